//! Only an attempt's own request reaches the outside world: a gateway sends what PostgreSQL
//! holds for the attempt its caller names, refuses (`FAILED_PRECONDITION`, audited) a call that
//! names no attempt or a request that is not the attempt's (its input, identity, operation or
//! adapter), answers a call for an attempt that does not exist, or under a stale lease, as not
//! begun (audited), audits a call for an adapter it does not serve and one that does not parse,
//! and caps every call's deadline. Nothing refused reaches the destination, as its own records
//! show.

use std::time::{Duration, Instant};

use anyhow::Result;
use serde_json::json;
use sqlx::PgPool;
use tonic::Code;
use z29c_core::AttemptId;
use z29c_core::identity::ServiceRole;
use z29c_proto::v1::adapter_gateway_client::AdapterGatewayClient;
use z29c_proto::v1::{self as pb};
use z29c_scenarios::cluster::{Cluster, Topology, invoke_request};

/// A secure cluster with no executor: the test claims steps itself, as an executor would.
async fn cluster(env: &[(&str, &str)]) -> Result<(Cluster, PgPool)> {
    let cluster = Cluster::start_with(Topology {
        executors: 0,
        secure: true,
        env: env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ..Topology::default()
    })
    .await?;
    let pool = cluster.db.pool(2).await?;
    Ok((cluster, pool))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_sends_only_an_attempts_own_request_and_audits_every_other() -> Result<()> {
    let (cluster, pool) = cluster(&[]).await?;
    let executor = cluster.role_tls(ServiceRole::Executor);
    let mut gw =
        AdapterGatewayClient::new(cluster.channel(&cluster.gateway_urls[0], &executor).await?);
    let c = cluster.claimed_by_test(&pool, "own-1", "ok").await?;
    let own = invoke_request(&c);
    let before = cluster.requests_received().await?;

    let mut refused = Vec::new();
    // no attempt at all: what an operator's certificate could once send
    refused.push((
        pb::InvokeRequest {
            attempt_id: String::new(),
            step_id: String::new(),
            lease_owner: String::new(),
            lease_version: 0,
            ..own.clone()
        },
        "attempt_id",
    ));
    // the attempt's lease, someone else's request
    refused.push((
        pb::InvokeRequest {
            input_json: json!({ "amount": 1_000_000 }).to_string(),
            ..own.clone()
        },
        "input_json",
    ));
    refused.push((
        pb::InvokeRequest {
            request_identity: "z29c:someone:else".into(),
            ..own.clone()
        },
        "request_identity",
    ));
    refused.push((
        pb::InvokeRequest {
            operation: "refunds".into(),
            ..own.clone()
        },
        "operation",
    ));
    // another adapter this gateway serves, not the one the attempt was claimed for
    refused.push((
        pb::InvokeRequest {
            adapter: "http-opaque".into(),
            ..own.clone()
        },
        "adapter",
    ));
    for (req, field) in refused {
        let s = gw.invoke(req).await.expect_err("refused");
        assert_eq!(s.code(), Code::FailedPrecondition, "{field}: {s:?}");
        assert!(s.message().starts_with(field), "{field}: {}", s.message());
    }
    // an attempt that does not exist (a claim lost in a crash, say): its lease is not
    // current, so the caller stops, as the fence would have it stop
    let unknown = gw
        .invoke(pb::InvokeRequest {
            attempt_id: AttemptId::new().to_string(),
            ..own.clone()
        })
        .await?
        .into_inner();
    assert!(
        matches!(
            &unknown.outcome,
            Some(pb::invoke_response::Outcome::NotBegun(n))
                if n.reason == "attempt is not the step's current attempt"
        ),
        "{unknown:?}"
    );
    // a stale lease: the step was given back unbegun and claimed again since, so the first
    // claim's call is turned away as the fence says, and audited
    let first = cluster.claimed_by_test(&pool, "own-2", "ok").await?;
    let store = z29c_store::Store::from_pool(pool.clone());
    store.release_unbegun(&first.lease).await?;
    let owner = z29c_core::OwnerId::parse("executor-test-2")?;
    let start = Instant::now();
    let again = loop {
        if let Some(c) = store.claim(&owner, 1).await?.pop() {
            break c;
        }
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(30),
            "not claimed again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(again.lease.step, first.lease.step);
    assert!(again.lease.version > first.lease.version);
    let stale = gw.invoke(invoke_request(&first)).await?.into_inner();
    assert!(
        matches!(
            &stale.outcome,
            Some(pb::invoke_response::Outcome::NotBegun(n))
                if n.reason.starts_with("lease superseded") && !n.workflow_ended
        ),
        "{stale:?}"
    );
    let audited: Vec<String> = sqlx::query_scalar(
        "SELECT detail FROM audit_log WHERE action = 'invoke' AND outcome = 'refused'
         ORDER BY id",
    )
    .fetch_all(&pool)
    .await?;
    assert_eq!(audited.len(), 7, "every refusal audited: {audited:#?}");
    assert!(
        audited[6].starts_with("lease_version: ") && audited[6].contains("lease superseded"),
        "{}",
        audited[6]
    );
    // an adapter this gateway does not serve, and a request that does not parse: refused as
    // before (NOT_FOUND, INVALID_ARGUMENT), and audited too
    let unserved = gw
        .invoke(pb::InvokeRequest {
            adapter: "payments".into(),
            ..own.clone()
        })
        .await
        .expect_err("not served here");
    assert_eq!(unserved.code(), Code::NotFound, "{unserved:?}");
    let garbled = gw
        .invoke(pb::InvokeRequest {
            input_json: "{not json".into(),
            ..own.clone()
        })
        .await
        .expect_err("does not parse");
    assert_eq!(garbled.code(), Code::InvalidArgument, "{garbled:?}");
    let audited: Vec<String> = sqlx::query_scalar(
        "SELECT detail FROM audit_log WHERE action = 'invoke' AND outcome = 'refused'
         ORDER BY id",
    )
    .fetch_all(&pool)
    .await?;
    assert_eq!(audited.len(), 9, "every refusal audited: {audited:#?}");
    assert!(audited[7].starts_with("adapter: "), "{}", audited[7]);
    assert!(audited[8].contains("input_json"), "{}", audited[8]);
    assert_eq!(
        cluster.requests_received().await?,
        before,
        "nothing refused was sent"
    );

    // the attempt's own request goes through, once
    let answer = gw.invoke(own).await?.into_inner();
    assert!(
        matches!(
            answer.outcome,
            Some(pb::invoke_response::Outcome::Succeeded(_))
        ),
        "{answer:?}"
    );
    assert_eq!(cluster.requests_received().await?, before + 1);
    pool.close().await;
    cluster.stop().await
}

/// A call with an hour's deadline, and one with none, end within the server's cap: the
/// gateway answers "unknown" itself before the cap would cut the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_ends_within_the_gateways_deadline_cap() -> Result<()> {
    let (cluster, pool) = cluster(&[("Z29C_GRPC__MAX_DEADLINE_MS", "2000")]).await?;
    cluster
        .set_faults("slow", json!({ "delay_ms": 10_000 }))
        .await?;
    let executor = cluster.role_tls(ServiceRole::Executor);
    let mut gw =
        AdapterGatewayClient::new(cluster.channel(&cluster.gateway_urls[0], &executor).await?);
    for (i, deadline) in [Some(Duration::from_secs(3600)), None]
        .into_iter()
        .enumerate()
    {
        let c = cluster
            .claimed_by_test(&pool, &format!("cap-{i}"), "slow")
            .await?;
        let mut req = tonic::Request::new(invoke_request(&c));
        if let Some(d) = deadline {
            req.set_timeout(d);
        }
        let start = Instant::now();
        let answer = gw.invoke(req).await;
        let took = start.elapsed();
        match answer {
            // the gateway's own answer, kept back from the capped deadline
            Ok(a) => assert!(
                matches!(
                    a.get_ref().outcome,
                    Some(pb::invoke_response::Outcome::Unknown(_))
                ),
                "{a:?}"
            ),
            // on a loaded machine the server's cap may cut the call first: capped all the same
            Err(s) => assert!(
                s.code() == Code::Cancelled && s.message().contains("Timeout"),
                "{deadline:?}: {s:?}"
            ),
        }
        assert!(took < Duration::from_secs(5), "{deadline:?}: took {took:?}");
        assert!(
            took >= Duration::from_millis(1_500),
            "{deadline:?}: the call ended before the cap: {took:?}"
        );
    }
    pool.close().await;
    cluster.stop().await
}
