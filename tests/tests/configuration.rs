//! What is configured is what runs, and what is shown is what happened: configuration files
//! refuse keys nothing reads, `--dump-config` shows no credential, a workflow file's deadline
//! is kept, recovery never decides from a capability it does not know, and a rate-limited
//! step reads as one state through its wait, with its attempts and waits counted apart.

use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::json;
use z29c_proto::v1 as pb;
use z29c_scenarios::apis::Apis;
use z29c_scenarios::cluster::{Cluster, Topology, chain, z29c_binary};

async fn z29c(args: &[&str]) -> Result<std::process::Output> {
    let run = tokio::process::Command::new(z29c_binary()?)
        .args(args)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .with_context(|| format!("z29c {args:?} did not end"))?
        .map_err(Into::into)
}

/// A directory of this test's own.
fn scratch() -> Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("z29c-config-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

#[tokio::test]
async fn a_configuration_file_with_a_key_nothing_reads_does_not_start() -> Result<()> {
    let dir = scratch()?;
    let gateway = dir.join("gateway.toml");
    std::fs::write(
        &gateway,
        "[[adapters]]\nname = \"payments\"\nbase_url = \"http://127.0.0.1:9/stripe\"\nreference_field = \"/id\"\n",
    )?;
    let scheduler = dir.join("scheduler.toml");
    std::fs::write(&scheduler, "prefx = \"prod\"\n")?;
    for (service, file, key) in [
        ("gateway", &gateway, "adapters[0].reference_field"),
        ("scheduler", &scheduler, "prefx"),
    ] {
        let file = file.to_string_lossy();
        // started for real, and asked to print its configuration: both refuse
        for extra in [&[][..], &["--dump-config"][..]] {
            let mut args = vec![service, "--config", &file];
            args.extend_from_slice(extra);
            let out = z29c(&args).await?;
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(
                !out.status.success(),
                "{service} {extra:?} started: {stderr}"
            );
            assert!(
                stderr.contains(&format!("unknown key `{key}`")) && stderr.contains(&*file),
                "{service}: {stderr}"
            );
        }
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[tokio::test]
async fn a_dumped_configuration_shows_no_credential_inside_a_url() -> Result<()> {
    let dir = scratch()?;
    let file = dir.join("gateway.toml");
    std::fs::write(
        &file,
        r#"
nats_url = "nats://svc:hunter2@127.0.0.1:4222"
database_url = "postgres://app:s3cret@db.internal/z29c?sslmode=require"
[[adapters]]
name = "payments"
base_url = "https://user:pw-in-url@api.example.com/v1?api_key=sk_live_9&region=eu"
"#,
    )?;
    let out = z29c(&[
        "gateway",
        "--config",
        &file.to_string_lossy(),
        "--dump-config",
    ])
    .await?;
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for secret in ["hunter2", "s3cret", "pw-in-url", "sk_live_9"] {
        assert!(!printed.contains(secret), "{secret} printed:\n{printed}");
    }
    for shown in [
        "nats://svc:REDACTED@127.0.0.1:4222",
        "postgres://app:REDACTED@db.internal/z29c",
        "api_key=REDACTED&region=eu",
    ] {
        assert!(printed.contains(shown), "{shown} missing:\n{printed}");
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// A deadline set in the workflow file is the workflow's: past it, a workflow nobody could
/// run is cancelled, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workflow_files_deadline_cancels_it_when_it_passes() -> Result<()> {
    let cluster = Cluster::start(1, 0, 4).await?;
    let deadline = (chrono::Utc::now() + chrono::Duration::seconds(3)).to_rfc3339();
    let file = format!(
        "name: late\nclient_key: late-1\ndeadline: {deadline}\nsteps:\n  - {{ name: a, adapter: http, operation: late }}\n"
    );
    let request = z29c_proto::workflow_file::parse(&file)?.into_request()?;
    assert!(request.deadline.is_some());
    let mut client = cluster.client().await?;
    let wf = client
        .submit(request)
        .await?
        .into_inner()
        .workflow
        .context("workflow")?;
    assert!(wf.deadline.is_some(), "the deadline was kept");
    cluster
        .wait_all_ended(std::slice::from_ref(&wf.id), Duration::from_secs(60))
        .await?;
    let ended = client
        .get(pb::GetRequest {
            workflow_id: wf.id.clone(),
        })
        .await?
        .into_inner();
    assert_eq!(ended.state(), pb::ProductState::Cancelled);
    assert_eq!(ended.reason, "cancelled: workflow deadline passed");
    cluster.stop().await
}

const STRIPE_KEY: &str = "sk_test_z29c_c4p4b1l1tyK3y000000000000";

/// The gateway of an idempotent payments adapter dies right after *invocation began*, and
/// comes back only later. Meanwhile no registered gateway can describe the adapter; recovery
/// waits and asks again instead of deciding as for an opaque adapter (which would send the
/// step to a person), then decides by the capability the gateway declares: the same request
/// again, one charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_decides_by_the_capability_a_gateway_declares_never_by_a_guess() -> Result<()> {
    let apis = Apis::start(STRIPE_KEY).await?;
    let mut cluster = Cluster::start_with(Topology {
        gateways: 0,
        recoveries: 1,
        env: vec![("Z29C_RECOVERY_LEASE_MS".into(), "1500".into())],
        ..Topology::default()
    })
    .await?;
    let adapter = format!(
        r#"
[[adapters]]
name = "payments"
version = "stripe/2026-01"
base_url = "{}/stripe"
capability = "idempotent"
default_limit = 4
safety_window_ms = 5000
[adapters.http]
path = "/v1/{{operation}}"
reference = "/id"
refusal_reason = "/error/message"
[adapters.http.headers]
Authorization = {{ env = "Z29C_TEST_KEY", prefix = "Bearer " }}
"#,
        apis.url
    );
    cluster
        .add_gateway_serving(
            &adapter,
            &[
                ("Z29C_TEST_KEY", STRIPE_KEY),
                ("Z29C_FAULT_CRASH", "after_invocation_began"),
            ],
        )
        .await?;
    let mut client = cluster.client().await?;
    let wf = client
        .submit(pb::SubmitRequest {
            client_key: "charge-1".into(),
            name: "charge".into(),
            steps: vec![pb::StepDefinition {
                name: "charge".into(),
                adapter: "payments".into(),
                operation: "charges".into(),
                input_json: json!({ "amount": 500 }).to_string(),
                depends_on: vec![],
                policy: Some(pb::LeasePolicy {
                    lease_ms: 1_500,
                    renew_every_ms: 500,
                    attempt_deadline_ms: 8_000,
                    final_grace_ms: 500,
                    adapter_timeout_ms: 2_000,
                    max_attempts: 3,
                    ..Default::default()
                }),
            }],
            deadline: None,
        })
        .await?
        .into_inner()
        .workflow
        .context("workflow")?;
    cluster
        .wait_exited("gateway-1", Duration::from_secs(30))
        .await?;
    // long past the lease and past recovery's patience with an unanswering gateway
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_ne!(
        cluster.product_state(&wf.id).await?,
        pb::ProductState::NeedsReview,
        "decided as for an opaque adapter while no gateway could say what it is"
    );
    cluster.restart("gateway-1", &["Z29C_FAULT_CRASH"]).await?;
    cluster
        .wait_all_ended(std::slice::from_ref(&wf.id), Duration::from_secs(60))
        .await?;
    assert_eq!(
        cluster.product_state(&wf.id).await?,
        pb::ProductState::Completed
    );
    let pool = cluster.db.pool(2).await?;
    let capabilities: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT capability::text FROM recovery_decisions WHERE workflow_id = $1",
    )
    .bind(uuid::Uuid::parse_str(&wf.id)?)
    .fetch_all(&pool)
    .await?;
    assert_eq!(
        capabilities,
        ["idempotent"],
        "every decision by the real capability"
    );
    assert_eq!(apis.effects("stripe").len(), 1, "one charge");
    pool.close().await;
    cluster.stop().await
}

/// A step the destination keeps rate-limiting is given back and claimed again at each turn:
/// through all of it, it reads as *Waiting on an external service*, with the reason and its
/// next turn; once it goes through, it shows one attempt and its waits counted apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_step_reads_as_one_state_and_counts_its_waits_apart() -> Result<()> {
    let cluster = Cluster::start(1, 1, 4).await?;
    cluster
        .set_faults("limited", json!({ "rate_limit_ms": 1000 }))
        .await?;
    let mut client = cluster.client().await?;
    let mut request = chain("limited-1", "limited", 1);
    request.steps[0].policy = Some(pb::LeasePolicy {
        initial_backoff_ms: 100,
        ..Default::default()
    });
    let wf = client
        .submit(request)
        .await?
        .into_inner()
        .workflow
        .context("workflow")?;
    let get = |client: &mut z29c_proto::v1::workflow_service_client::WorkflowServiceClient<_>| {
        let id = wf.id.clone();
        let mut client = client.clone();
        async move {
            anyhow::Ok(
                client
                    .get(pb::GetRequest { workflow_id: id })
                    .await?
                    .into_inner(),
            )
        }
    };
    // once it first waits, every look until the limit lifts says the same
    let start = tokio::time::Instant::now();
    loop {
        let w = get(&mut client).await?;
        if w.steps[0].reason.starts_with("waiting: ") {
            break;
        }
        anyhow::ensure!(start.elapsed() < Duration::from_secs(30), "it never waited");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut seen = std::collections::BTreeMap::new();
    let mut next_turn_shown = false;
    let watch = tokio::time::Instant::now();
    while watch.elapsed() < Duration::from_secs(6) {
        let w = get(&mut client).await?;
        let step = &w.steps[0];
        *seen.entry(step.state_label.clone()).or_insert(0) += 1;
        assert!(
            step.reason.starts_with("waiting: "),
            "a waiting step says why: {:?}",
            step.reason
        );
        next_turn_shown |= step.next_attempt_at.is_some();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        seen.keys().collect::<Vec<_>>(),
        ["Waiting on an external service"],
        "one state through the wait: {seen:?}"
    );
    assert!(next_turn_shown, "the next turn is shown while it waits");
    cluster.set_faults("limited", json!({})).await?;
    cluster
        .wait_all_ended(std::slice::from_ref(&wf.id), Duration::from_secs(60))
        .await?;
    let done = get(&mut client).await?;
    assert_eq!(done.state(), pb::ProductState::Completed);
    let technical = done.steps[0].technical.clone().context("technical")?;
    assert_eq!(
        technical.attempts, 1,
        "one attempt went through: {technical:?}"
    );
    assert!(technical.waits >= 3, "{technical:?}");
    assert!(technical.given_back >= technical.waits, "{technical:?}");
    cluster.stop().await
}
