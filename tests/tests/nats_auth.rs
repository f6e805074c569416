//! NATS with a user per service role, as a secure cluster runs it: every service does its
//! work with only its own subjects (the server logs no violation for it), a client without a
//! key is not let in, and a service's key cannot purge the streams, forge a gateway
//! registration, publish a hint, forge JetStream's advisories, or make a consumer of its own. What counts is what NATS
//! holds afterwards: the stream's messages, the registry's gateways, the poison records.

use std::time::Duration;

use anyhow::{Context, Result};
use z29c_core::identity::ServiceRole;
use z29c_scenarios::cluster::{Cluster, chain};

/// Violations the cluster's NATS server logged.
fn violations(cluster: &Cluster) -> Vec<String> {
    cluster
        .nats_log()
        .lines()
        .filter(|l| l.contains("Violation") || l.contains("Authorization"))
        .map(str::to_owned)
        .collect()
}

/// Messages in the event stream, as a service sees them.
async fn hints(cluster: &Cluster) -> Result<u64> {
    let bus = cluster.bus_as(ServiceRole::Recovery).await?;
    let js = async_nats::jetstream::new(bus.client().clone());
    Ok(js
        .get_stream(bus.names().stream())
        .await?
        .info()
        .await?
        .state
        .messages)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_service_has_only_its_own_subjects_and_nobody_else_gets_in() -> Result<()> {
    let (cluster, pool) = Cluster::start_secure("idempotent", &[]).await?;
    let keys = cluster
        .security
        .as_ref()
        .and_then(|s| s.nats_keys.clone())
        .context("a secure cluster runs its own NATS with users")?;
    // the whole protocol runs on the services' own permissions
    let mut client = cluster.client().await?;
    let wf = client
        .submit(chain("nats-1", "ok", 3))
        .await?
        .into_inner()
        .workflow
        .context("workflow")?;
    cluster
        .wait_all_ended(std::slice::from_ref(&wf.id), Duration::from_secs(60))
        .await?;
    assert_eq!(
        cluster.product_state(&wf.id).await?,
        z29c_proto::v1::ProductState::Completed
    );
    assert!(
        violations(&cluster).is_empty(),
        "a service needed a subject it is not allowed: {:#?}",
        violations(&cluster)
    );
    let stored = hints(&cluster).await?;
    assert!(
        stored >= 3,
        "the scheduler's hints are in the stream: {stored}"
    );

    // no key, and a key the server does not know: not let in
    let refused = async_nats::connect(&cluster.nats_url).await;
    assert!(refused.is_err(), "connected without a key");
    let stranger = nkeys::KeyPair::new_user().seed()?;
    let refused = async_nats::ConnectOptions::with_nkey(stranger)
        .connect(&cluster.nats_url)
        .await;
    assert!(refused.is_err(), "connected with an unknown key");

    // an executor's key: no purge, no forged registration, no hint, no advisory
    let executor = cluster.bus_as(ServiceRole::Executor).await?;
    let purge = tokio::time::timeout(Duration::from_secs(10), executor.purge()).await;
    assert!(
        !matches!(purge, Ok(Ok(()))),
        "the executor purged the stream"
    );
    let forged = z29c_bus::GatewayRecord {
        id: "forged".into(),
        endpoint: "http://127.0.0.1:1".into(),
        adapters: Vec::new(),
        max_call_ms: None,
    };
    let registered =
        tokio::time::timeout(Duration::from_secs(10), executor.register_gateway(&forged)).await;
    assert!(
        !matches!(registered, Ok(Ok(()))),
        "the executor registered a gateway"
    );
    let hint = z29c_bus::step_ready("forged-hint", &wf.id, &wf.steps[0].id);
    let published = tokio::time::timeout(Duration::from_secs(10), executor.publish(&hint)).await;
    assert!(
        !matches!(published, Ok(Ok(_))),
        "the executor published a hint"
    );
    let advisory = format!(
        "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{}.{}",
        executor.names().stream(),
        z29c_bus::EXECUTOR_CONSUMER
    );
    let body = serde_json::json!({
        "stream": executor.names().stream(),
        "consumer": z29c_bus::EXECUTOR_CONSUMER,
        "stream_seq": 1,
        "deliveries": 3
    });
    executor
        .client()
        .publish(advisory.clone(), body.to_string().into())
        .await?;
    executor.client().flush().await?;
    // nor a consumer of its own whose deliveries would land on the gateway registry
    let js = async_nats::jetstream::new(executor.client().clone());
    let pushy = async {
        js.get_stream(executor.names().stream())
            .await?
            .create_consumer(async_nats::jetstream::consumer::push::Config {
                durable_name: Some("pushy".into()),
                deliver_subject: format!("{}.registry.gateway.victim", cluster.prefix),
                filter_subject: executor.names().subject(z29c_bus::Topic::StepReady),
                ..Default::default()
            })
            .await?;
        Ok::<_, anyhow::Error>(())
    };
    let pushy = tokio::time::timeout(Duration::from_secs(10), pushy).await;
    assert!(
        !matches!(pushy, Ok(Ok(()))),
        "the executor made a push consumer"
    );

    // what NATS holds: the stream's hints, no forged gateway; the server saw each attempt
    assert_eq!(hints(&cluster).await?, stored, "the stream changed");
    let gateways = cluster.registered_gateways().await?;
    assert!(!gateways.iter().any(|g| g == "forged"), "{gateways:?}");
    assert!(!gateways.is_empty(), "the real gateway is still registered");
    let seen = violations(&cluster).join("\n");
    for subject in [
        format!("$JS.API.STREAM.PURGE.{}", executor.names().stream()),
        format!(
            "$JS.API.CONSUMER.CREATE.{}.pushy",
            executor.names().stream()
        ),
        format!("{}.registry.gateway.forged", cluster.prefix),
        executor.names().subject(z29c_bus::Topic::StepReady),
        advisory,
    ] {
        assert!(
            seen.contains(&subject),
            "no violation logged for {subject}:\n{seen}"
        );
    }
    let poison: i64 = sqlx::query_scalar("SELECT count(*) FROM poison_messages")
        .fetch_one(&pool)
        .await?;
    assert_eq!(poison, 0, "a forged advisory was recorded");
    // every role's key is a file only its owner reads
    #[cfg(unix)]
    for role in z29c_bus::auth::NATS_ROLES {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(z29c_bus::auth::seed_path(&keys, role))?
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "{role}'s key is readable by others");
    }
    pool.close().await;
    cluster.stop().await
}
