//! Only an attempt's own request reaches the outside world: a gateway sends what PostgreSQL
//! holds for the attempt its caller names, refuses (`FAILED_PRECONDITION`, audited) a call that
//! names no attempt or a request that is not the attempt's, answers a call for an attempt
//! that does not exist as not begun (audited), and caps every call's deadline. Nothing refused
//! reaches the destination, as its own records show.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::json;
use sqlx::PgPool;
use tonic::Code;
use z29c_core::{AttemptId, OwnerId};
use z29c_proto::v1::adapter_gateway_client::AdapterGatewayClient;
use z29c_proto::v1::{self as pb};
use z29c_scenarios::cluster::{Cluster, Topology, chain};
use z29c_store::Store;
use z29c_store::leases::ClaimedStep;

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

/// Submits a one-step workflow on `route` and claims its step as `executor-test`.
async fn claimed(cluster: &Cluster, pool: &PgPool, key: &str, route: &str) -> Result<ClaimedStep> {
    let token = cluster.token("olga", &[z29c_core::Role::Operator])?;
    let mut client = cluster
        .client_with(&cluster.operator_tls(), Some(&token))
        .await?;
    let mut req = chain(key, route, 1);
    // a policy whose calls fit any gateway's cap in these tests
    req.steps[0].policy = Some(z29c_scenarios::matrix::policy());
    client.submit(req).await?;
    let store = Store::from_pool(pool.clone());
    let start = Instant::now();
    loop {
        if let Some(c) = store
            .claim(&OwnerId::parse("executor-test")?, 1)
            .await?
            .pop()
        {
            return Ok(c);
        }
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(30),
            "nothing to claim"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The call an executor makes for `c`.
fn call_for(c: &ClaimedStep) -> pb::InvokeRequest {
    pb::InvokeRequest {
        adapter: c.adapter.clone(),
        operation: c.operation.clone(),
        request_identity: c.request_identity.as_str().to_owned(),
        input_json: c.input.to_string(),
        input_digest: c.input_digest.as_str().to_owned(),
        workflow_id: c.workflow.to_string(),
        step_id: c.lease.step.to_string(),
        attempt_id: c.lease.attempt.to_string(),
        lease_version: c.lease.version.get(),
        lease_owner: c.lease.owner.as_str().to_owned(),
    }
}

async fn effects(cluster: &Cluster) -> Result<i64> {
    let ledger = cluster.ledger_pool().await?;
    let n = z29c_scenarios::count_rows(&ledger, "destination.requests").await?;
    ledger.close().await;
    Ok(n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_sends_only_an_attempts_own_request_and_audits_every_other() -> Result<()> {
    let (cluster, pool) = cluster(&[]).await?;
    let services = cluster
        .security
        .as_ref()
        .context("secure")?
        .pki
        .tls("services");
    let mut gw =
        AdapterGatewayClient::new(cluster.channel(&cluster.gateway_urls[0], &services).await?);
    let c = claimed(&cluster, &pool, "own-1", "ok").await?;
    let own = call_for(&c);
    let before = effects(&cluster).await?;

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
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_log WHERE action = 'invoke' AND outcome = 'refused'",
    )
    .fetch_one(&pool)
    .await?;
    assert_eq!(audited, 5, "every refusal audited");
    assert_eq!(effects(&cluster).await?, before, "nothing refused was sent");

    // the attempt's own request goes through, once
    let answer = gw.invoke(own).await?.into_inner();
    assert!(
        matches!(
            answer.outcome,
            Some(pb::invoke_response::Outcome::Succeeded(_))
        ),
        "{answer:?}"
    );
    assert_eq!(effects(&cluster).await?, before + 1);
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
    let services = cluster
        .security
        .as_ref()
        .context("secure")?
        .pki
        .tls("services");
    let mut gw =
        AdapterGatewayClient::new(cluster.channel(&cluster.gateway_urls[0], &services).await?);
    for (i, deadline) in [Some(Duration::from_secs(3600)), None]
        .into_iter()
        .enumerate()
    {
        let c = claimed(&cluster, &pool, &format!("cap-{i}"), "slow").await?;
        let mut req = tonic::Request::new(call_for(&c));
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
