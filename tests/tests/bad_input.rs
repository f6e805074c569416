//! Bad input at every surface of a secure cluster, as real processes: each gets the answer
//! docs/operations.md ("Security") states, and changes no state. Malformed protobuf and invalid
//! UTF-8 are sent as raw bytes, as a hostile client would.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use bytes::{Buf, BufMut};
use prost::Message;
use sqlx::PgPool;
use tonic::Code;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use z29c_core::Role;
use z29c_core::identity::ServiceRole;
use z29c_proto::v1::adapter_gateway_client::AdapterGatewayClient;
use z29c_proto::v1::{self as pb};
use z29c_scenarios::cluster::{Cluster, chain};
use z29c_scenarios::matrix;

/// Sends bytes as they are and returns the answer's bytes: a client that does not speak
/// protobuf correctly.
#[derive(Debug, Default, Clone)]
struct Raw;

impl Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl Encoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        Ok(Some(src.copy_to_bytes(src.remaining()).to_vec()))
    }
}

async fn raw_call(
    cluster: &Cluster,
    url: &str,
    tls: &z29c_security::TlsConfig,
    path: &'static str,
    body: Vec<u8>,
    token: &str,
) -> Result<tonic::Status> {
    let channel = cluster.channel(url, tls).await?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await?;
    let mut req = tonic::Request::new(body);
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse()?);
    match grpc
        .unary(
            req,
            tonic::codegen::http::uri::PathAndQuery::from_static(path),
            Raw,
        )
        .await
    {
        Ok(_) => bail!("{path} accepted bytes it should have refused"),
        Err(s) => Ok(s),
    }
}

async fn count(pool: &PgPool, table: &str) -> Result<i64> {
    z29c_scenarios::count_rows(pool, table).await
}

/// Rows in every table a submission, an attempt or a resolution writes.
async fn state(pool: &PgPool) -> Result<Vec<i64>> {
    let mut out = Vec::new();
    for t in [
        "workflows",
        "steps",
        "attempts",
        "step_receipts",
        "review_items",
        "review_resolutions",
        "adapter_permits",
    ] {
        out.push(count(pool, t).await?);
    }
    Ok(out)
}

async fn cluster(capability: &'static str, env: &[(&str, &str)]) -> Result<(Cluster, PgPool)> {
    Cluster::start_secure(capability, env).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_oversized_and_unknown_input_is_refused_and_changes_nothing() -> Result<()> {
    let (cluster, pool) = cluster("idempotent", &[]).await?;
    let token = cluster.token("olga", &[Role::Operator])?;
    let tls = cluster.operator_tls();
    let mut client = cluster.client_with(&tls, Some(&token)).await?;
    // one good workflow first, so refusals are measured against a system that works
    let first = client.submit(chain("k-1", "ok", 1)).await?.into_inner();
    cluster
        .wait_all_ended(&[first.workflow.unwrap().id], Duration::from_secs(60))
        .await?;
    let before = state(&pool).await?;
    let submit = "/z29c.v1.WorkflowService/Submit";
    let invoke = "/z29c.v1.AdapterGateway/Invoke";
    let gateway = cluster.gateway_urls[0].clone();
    let services = cluster.role_tls(ServiceRole::Executor);

    // malformed protobuf, and invalid UTF-8 in a string field (client_key; adapter)
    for (url, tls, path) in [
        (&cluster.scheduler_url, &tls, submit),
        (&gateway, &services, invoke),
    ] {
        for body in [vec![0xff, 0xff, 0xff], vec![0x0a, 0x02, 0xc3, 0x28]] {
            let s = raw_call(&cluster, url, tls, path, body, &token).await?;
            assert_eq!(s.code(), Code::InvalidArgument, "{path}: {}", s.message());
            assert!(
                s.message().starts_with("malformed message"),
                "{}",
                s.message()
            );
        }
    }
    // an oversized request: refused by its length, before it is decoded
    let mut huge = chain("k-huge", "ok", 1);
    huge.steps[0].input_json = format!("{{\"pad\":\"{}\"}}", "x".repeat(5 * 1024 * 1024));
    let s = client.submit(huge).await.unwrap_err();
    assert_eq!(s.code(), Code::OutOfRange, "{}", s.message());
    assert!(s.message().contains("too large"), "{}", s.message());
    // within the message limit but over the workflow's: the field is named
    let mut big = chain("k-big", "ok", 1);
    big.steps[0].input_json = format!("{{\"pad\":\"{}\"}}", "x".repeat(100 * 1024));
    let s = client.submit(big).await.unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument);
    assert!(s.message().contains("input"), "{}", s.message());
    let s = client
        .submit(chain("k-long", "ok", 1_001))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument);
    assert!(s.message().contains("steps"), "{}", s.message());
    // an unknown adapter, at the scheduler and at the gateway
    let mut unknown = chain("k-unknown", "ok", 1);
    unknown.steps[0].adapter = "smtp".into();
    let s = client.submit(unknown).await.unwrap_err();
    assert_eq!(s.code(), Code::FailedPrecondition, "not served yet");
    assert!(s.message().contains("steps[0].adapter"), "{}", s.message());
    let mut gw = AdapterGatewayClient::new(cluster.channel(&gateway, &services).await?);
    let s = gw
        .invoke(pb::InvokeRequest {
            adapter: "smtp".into(),
            operation: "ok".into(),
            request_identity: "z29c:x:y".into(),
            input_json: "{}".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::NotFound, "{}", s.message());
    // SQL-looking text in an operation, at the gateway: refused by its shape
    let s = gw
        .invoke(pb::InvokeRequest {
            adapter: "http".into(),
            operation: "ok'; DROP TABLE adapter_permits; --".into(),
            request_identity: "z29c:x:y".into(),
            input_json: "{}".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument);
    assert!(s.message().starts_with("operation"), "{}", s.message());
    assert_eq!(state(&pool).await?, before, "no refusal changed anything");

    // SQL-looking text in keys and names is data: stored and shown verbatim
    let sneaky_key = "k'); DELETE FROM workflows; --";
    let sneaky_name = "Robert'); DROP TABLE steps; -- \u{1F4E6}";
    let mut req = chain(sneaky_key, "ok", 1);
    req.name = sneaky_name.into();
    let wf = client
        .submit(req.clone())
        .await?
        .into_inner()
        .workflow
        .unwrap();
    let got = client
        .get(pb::GetRequest {
            workflow_id: wf.id.clone(),
        })
        .await?
        .into_inner();
    assert_eq!(got.name, sneaky_name);
    assert_eq!(got.client_key, sneaky_key);
    let stored: String =
        sqlx::query_scalar("SELECT client_key FROM workflows WHERE client_key = $1")
            .bind(sneaky_key)
            .fetch_one(&pool)
            .await?;
    assert_eq!(stored, sneaky_key);
    assert_eq!(count(&pool, "workflows").await?, before[0] + 1);
    // the same key with a different payload
    let mut changed = req;
    changed.steps[0].input_json = "{\"n\":42}".into();
    let s = client.submit(changed).await.unwrap_err();
    assert_eq!(s.code(), Code::FailedPrecondition, "{}", s.message());
    assert_eq!(count(&pool, "workflows").await?, before[0] + 1);
    cluster
        .wait_all_ended(&[wf.id], Duration::from_secs(60))
        .await?;
    pool.close().await;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_cap_is_named_at_submit_and_each_caller_has_its_own_rate() -> Result<()> {
    // one-step workflows whose calls fit the 2 s cap
    let fitting = |key: &str| {
        let mut req = chain(key, "ok", 1);
        req.steps[0].policy = Some(matrix::policy());
        req
    };
    let (cluster, pool) = cluster(
        "idempotent",
        &[
            ("Z29C_GRPC__MAX_DEADLINE_MS", "2000"),
            ("Z29C_SUBMISSIONS_PER_SECOND", "1"),
            ("Z29C_SUBMISSION_BURST", "3"),
        ],
    )
    .await?;
    let tls = cluster.operator_tls();
    // a caller over its rate is refused with the wait; another caller is not affected
    let randy = cluster.token("randy", &[Role::Operator])?;
    let mut r = cluster.client_with(&tls, Some(&randy)).await?;
    let mut refused = None;
    for i in 0..6 {
        match r.submit(fitting(&format!("r-{i}"))).await {
            Ok(_) => {}
            Err(s) => {
                refused = Some((i, s));
                break;
            }
        }
    }
    let (i, s) = refused.expect("six submissions in a burst of three are not all accepted");
    assert!(i >= 3, "the burst of three is allowed (refused at {i})");
    assert_eq!(s.code(), Code::ResourceExhausted);
    assert!(s.message().contains("retry in"), "{}", s.message());
    let olga = cluster.token("olga", &[Role::Operator])?;
    let mut o = cluster.client_with(&tls, Some(&olga)).await?;
    o.submit(fitting("o-1")).await?;
    let limited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_log WHERE outcome = 'rate_limited' AND subject = 'randy'",
    )
    .fetch_one(&pool)
    .await?;
    assert!(limited <= 1);

    // a step whose adapter timeout the gateways would cut is refused at submit, naming the
    // field and the bound, instead of being cut short and retried at the cut
    let mut long_call = fitting("o-long");
    long_call.steps[0].policy = Some(pb::LeasePolicy {
        adapter_timeout_ms: 5_000,
        ..matrix::policy()
    });
    let s = o
        .submit(long_call)
        .await
        .expect_err("a call longer than the cap");
    assert_eq!(s.code(), Code::InvalidArgument);
    assert!(
        s.message()
            .starts_with("steps[0].policy.adapter_timeout_ms:")
            && s.message().contains("5000 ms")
            && s.message().contains("2000 ms"),
        "{}",
        s.message()
    );

    // the gateway's own deadline cap is tests/tests/gateway_calls.rs's
    let _ = pool.close().await;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_garbage_is_terminated_and_recorded_and_a_replay_changes_nothing() -> Result<()> {
    let (cluster, pool) = cluster("idempotent", &[]).await?;
    let mut client = cluster.client().await?;
    let wf = client
        .submit(chain("n-1", "ok", 1))
        .await?
        .into_inner()
        .workflow
        .unwrap();
    cluster
        .wait_all_ended(std::slice::from_ref(&wf.id), Duration::from_secs(60))
        .await?;
    let before = state(&pool).await?;
    // hints come from the scheduler alone: garbage on its subject is what a scheduler gone
    // wrong (or holding a stolen key) could send
    let bus = cluster.bus_as(ServiceRole::Scheduler).await?;
    let subject = bus.names().subject(z29c_bus::Topic::StepReady);
    // a replay of the step's hint, under its old and a new msg_id: hints carry no truth
    let step = &wf.steps[0].id;
    for msg_id in ["replayed-1", "replayed-1", "replayed-2"] {
        bus.publish(&z29c_bus::step_ready(msg_id, &wf.id, step))
            .await?;
    }
    // garbage, invalid UTF-8, a body of another topic, an id that is not an id
    let wrong_topic = pb::Envelope {
        msg_id: "wrong-topic".into(),
        created_at: None,
        body: Some(pb::envelope::Body::WorkflowChanged(pb::WorkflowChanged {
            workflow_id: wf.id.clone(),
            state: "completed".into(),
        })),
    };
    let bad_id = z29c_bus::step_ready("bad-id", "'; DROP TABLE steps; --", step);
    let js = async_nats::jetstream::new(bus.client().clone());
    for (i, payload) in [
        vec![0xff, 0xfe, 0x00],
        vec![0x0a, 0x02, 0xc3, 0x28],
        wrong_topic.encode_to_vec(),
        bad_id.encode_to_vec(),
    ]
    .into_iter()
    .enumerate()
    {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("poison-{i}").as_str());
        js.publish_with_headers(subject.clone(), headers, payload.into())
            .await?
            .await?;
    }
    let start = Instant::now();
    while count(&pool, "poison_messages").await? < 4 {
        if start.elapsed() > Duration::from_secs(20) {
            bail!(
                "poison messages not recorded: {}",
                count(&pool, "poison_messages").await?
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reasons: Vec<String> =
        sqlx::query_scalar("SELECT reason FROM poison_messages ORDER BY stream_sequence")
            .fetch_all(&pool)
            .await?;
    assert!(
        reasons[0].starts_with("malformed") || reasons[0].contains("not an envelope"),
        "{reasons:?}"
    );
    assert!(reasons[1].contains("not an envelope"), "{reasons:?}");
    assert!(reasons[2].contains("WorkflowChanged"), "{reasons:?}");
    assert!(reasons[3].contains("workflow_id"), "{reasons:?}");
    // terminated, not redelivered: after the ack wait (5 s) there are still four
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert_eq!(count(&pool, "poison_messages").await?, 4);
    assert_eq!(
        state(&pool).await?,
        before,
        "neither garbage nor a replay changed anything"
    );
    let after = client
        .get(pb::GetRequest {
            workflow_id: wf.id.clone(),
        })
        .await?
        .into_inner();
    assert_eq!(after.state(), pb::ProductState::Completed);
    // the system still works
    let next = client
        .submit(chain("n-2", "ok", 1))
        .await?
        .into_inner()
        .workflow
        .unwrap();
    cluster
        .wait_all_ended(std::slice::from_ref(&next.id), Duration::from_secs(60))
        .await?;
    pool.close().await;
    cluster.stop().await
}
