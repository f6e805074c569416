//! Against the real NATS server: duplicates are dropped by msg-id, consumers get each hint once,
//! and a test's stream is its own and is removed afterwards.

use std::time::Duration;

use futures::StreamExt;
use z29c_bus::{Bus, Topic, decode, step_ready};

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A workflow and a step id as the outbox would send them.
fn ids() -> (String, String) {
    (
        z29c_core::WorkflowId::new().to_string(),
        z29c_core::StepId::new().to_string(),
    )
}

fn prefix() -> String {
    format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

#[tokio::test]
async fn a_republished_outbox_message_is_dropped_as_a_duplicate() {
    let bus = Bus::connect(&nats_url(), &prefix()).await.unwrap();
    let (wf, st) = ids();
    let e = step_ready("step_ready-1", &wf, &st);
    let first = bus.publish(&e).await.unwrap();
    let again = bus.publish(&e).await.unwrap();
    assert!(!first.duplicate);
    assert!(again.duplicate, "same Nats-Msg-Id inside the window");
    assert_eq!(again.sequence, first.sequence);
    let other = bus
        .publish(&step_ready("step_ready-2", &wf, &ids().1))
        .await
        .unwrap();
    assert!(!other.duplicate);

    let consumer = bus
        .pull_consumer("executor", Topic::StepReady, Duration::from_secs(5), 5)
        .await
        .unwrap();
    let mut batch = consumer
        .fetch()
        .max_messages(10)
        .expires(Duration::from_millis(500))
        .messages()
        .await
        .unwrap();
    let mut got = Vec::new();
    while let Some(msg) = batch.next().await {
        let msg = msg.unwrap();
        got.push(decode(&msg.payload).unwrap().msg_id);
        msg.ack().await.unwrap();
    }
    assert_eq!(got, ["step_ready-1", "step_ready-2"]);
    bus.delete_stream().await.unwrap();
}

#[tokio::test]
async fn prefixes_isolate_deployments_on_one_server() {
    let (a, b) = (prefix(), prefix());
    let bus_a = Bus::connect(&nats_url(), &a).await.unwrap();
    let bus_b = Bus::connect(&nats_url(), &b).await.unwrap();
    let (wf, st) = ids();
    bus_a.publish(&step_ready("m-a", &wf, &st)).await.unwrap();
    let consumer = bus_b
        .pull_consumer("executor", Topic::StepReady, Duration::from_secs(5), 5)
        .await
        .unwrap();
    let mut batch = consumer
        .fetch()
        .max_messages(10)
        .expires(Duration::from_millis(300))
        .messages()
        .await
        .unwrap();
    assert!(batch.next().await.is_none(), "b sees nothing of a");
    bus_a.delete_stream().await.unwrap();
    bus_b.delete_stream().await.unwrap();
}

#[tokio::test]
async fn gateways_register_and_are_listed() {
    let bus = Bus::connect(&nats_url(), &prefix()).await.unwrap();
    let record = z29c_bus::GatewayRecord {
        id: "gw-1".into(),
        endpoint: "http://127.0.0.1:1".into(),
        max_call_ms: Some(60_000),
        adapters: vec![z29c_bus::AdapterRecord {
            name: "http".into(),
            version: "http/1".into(),
            capability: z29c_core::AdapterCapability::Idempotent,
        }],
    };
    bus.register_gateway(&record).await.unwrap();
    assert_eq!(bus.gateways().await.unwrap(), vec![record]);
    bus.deregister_gateway("gw-1").await.unwrap();
    assert!(bus.gateways().await.unwrap().is_empty());
    bus.delete_stream().await.unwrap();
}

fn gateway(id: &str) -> z29c_bus::GatewayRecord {
    z29c_bus::GatewayRecord {
        id: id.into(),
        endpoint: format!("http://127.0.0.1:1/{id}"),
        max_call_ms: None,
        adapters: vec![z29c_bus::AdapterRecord {
            name: "http".into(),
            version: "http/1".into(),
            capability: z29c_core::AdapterCapability::Idempotent,
        }],
    }
}

/// A gateway list older than its refresh interval answers the next call at once, while the
/// registry is read again behind it: calls used to wait for that read, each attempt starting
/// meanwhile with them. The new list shows on a later call.
#[tokio::test]
async fn a_stale_gateway_list_answers_at_once_and_is_read_again_behind() {
    use z29c_bus::gateways::{Gateways, REFRESH};
    let bus = Bus::connect(&nats_url(), &prefix()).await.unwrap();
    bus.register_gateway(&gateway("gw-1")).await.unwrap();
    let gateways = Gateways::new(bus.clone(), z29c_security::TlsConfig::default());
    assert_eq!(gateways.for_adapter("http").await.unwrap().gateway, "gw-1");
    bus.deregister_gateway("gw-1").await.unwrap();
    bus.register_gateway(&gateway("gw-2")).await.unwrap();
    tokio::time::sleep(REFRESH + Duration::from_millis(200)).await;
    assert_eq!(
        gateways.for_adapter("http").await.unwrap().gateway,
        "gw-1",
        "the stale list answers without waiting for the registry"
    );
    let mut seen = Vec::new();
    for _ in 0..50 {
        let chosen = gateways.for_adapter("http").await.unwrap().gateway;
        if chosen == "gw-2" {
            break;
        }
        seen.push(chosen);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        gateways.for_adapter("http").await.unwrap().gateway,
        "gw-2",
        "the registry read behind the calls replaced the list (answers until then: {seen:?})"
    );
    bus.delete_stream().await.unwrap();
}

/// A list asked for no older than an age is read again, and waited for, once it is that old;
/// younger, it answers as it is.
#[tokio::test]
async fn a_gateway_list_past_the_age_asked_for_is_read_again_first() {
    use z29c_bus::gateways::{Gateways, REFRESH};
    let ids = |records: Vec<z29c_bus::GatewayRecord>| -> Vec<String> {
        records.into_iter().map(|g| g.id).collect()
    };
    let bus = Bus::connect(&nats_url(), &prefix()).await.unwrap();
    bus.register_gateway(&gateway("gw-1")).await.unwrap();
    let gateways = Gateways::new(bus.clone(), z29c_security::TlsConfig::default());
    assert_eq!(ids(gateways.records(REFRESH).await.unwrap()), ["gw-1"]);
    bus.deregister_gateway("gw-1").await.unwrap();
    bus.register_gateway(&gateway("gw-2")).await.unwrap();
    assert_eq!(
        ids(gateways.records(Duration::from_secs(60)).await.unwrap()),
        ["gw-1"],
        "a young list answers as it is"
    );
    tokio::time::sleep(REFRESH).await;
    assert_eq!(
        ids(gateways.records(REFRESH).await.unwrap()),
        ["gw-2"],
        "a list as old as asked for is read again before answering"
    );
    assert_eq!(
        ids(gateways.records(Duration::ZERO).await.unwrap()),
        ["gw-2"]
    );
    bus.delete_stream().await.unwrap();
}

#[tokio::test]
async fn a_message_out_of_deliveries_raises_an_advisory_z29c_can_read() {
    let bus = Bus::connect(&nats_url(), &prefix()).await.unwrap();
    let mut advisories = bus.max_delivery_advisories("stubborn").await.unwrap();
    bus.client().flush().await.unwrap();
    let (wf, st) = ids();
    let published = bus.publish(&step_ready("m-1", &wf, &st)).await.unwrap();
    let consumer = bus
        .pull_consumer("stubborn", Topic::StepReady, Duration::from_millis(300), 2)
        .await
        .unwrap();
    // fetched and never acknowledged: delivered twice (max_deliver 2), then the server gives
    // up on it and says so; pulls keep going so the server has somewhere to redeliver to
    let mut deliveries = 0;
    let mut advisory = None;
    let start = std::time::Instant::now();
    while advisory.is_none() && start.elapsed() < Duration::from_secs(15) {
        let mut batch = consumer
            .fetch()
            .max_messages(1)
            .expires(Duration::from_millis(400))
            .messages()
            .await
            .unwrap();
        while let Some(m) = batch.next().await {
            if m.is_ok() {
                deliveries += 1;
            }
        }
        if let Ok(Some(a)) =
            tokio::time::timeout(Duration::from_millis(10), advisories.next()).await
        {
            advisory = Some(a);
        }
    }
    let advisory = advisory.expect("a max-deliveries advisory within 15 s");
    assert_eq!(deliveries, 2, "delivered max_deliver times, never more");
    let a: z29c_bus::MaxDeliveries = serde_json::from_slice(&advisory.payload).unwrap();
    assert_eq!(a.consumer, "stubborn");
    assert_eq!(a.stream_seq, published.sequence);
    assert_eq!(a.deliveries, 2);
    bus.delete_stream().await.unwrap();
}

/// A service started before its NATS server waits for it (as it does for PostgreSQL) instead
/// of exiting: the server here comes up a second and a half after the connect began.
#[tokio::test]
async fn a_server_that_comes_up_after_the_service_is_waited_for() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("nats://127.0.0.1:{port}");
    let started = std::time::Instant::now();
    let connecting = tokio::spawn({
        let (url, prefix) = (url.clone(), prefix());
        async move { Bus::connect(&url, &prefix).await }
    });
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(
        !connecting.is_finished(),
        "the connect gave up while no server was up"
    );
    let store =
        std::env::temp_dir().join(format!("z29c-bus-late-{}", uuid::Uuid::new_v4().simple()));
    let mut server = tokio::process::Command::new("nats-server")
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(&store)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("nats-server on PATH");
    let bus = tokio::time::timeout(z29c_bus::CONNECT_PATIENCE, connecting)
        .await
        .expect("connected within the patience")
        .unwrap()
        .expect("connected once the server came up");
    assert!(started.elapsed() >= Duration::from_millis(1_500));
    // the stream was made on the late server: a hint goes through it
    let (w, s) = ids();
    bus.publish(&step_ready("late-1", &w, &s))
        .await
        .expect("published on the late server");
    let _ = server.kill().await;
    let _ = std::fs::remove_dir_all(&store);
}

/// A URL that can never work fails at once, without the patience for an unreachable server.
#[tokio::test]
async fn a_malformed_url_fails_at_once() {
    let started = std::time::Instant::now();
    let err = Bus::connect("nats://127.0.0.1:not-a-port", &prefix())
        .await
        .expect_err("a malformed URL connected");
    assert!(
        started.elapsed() < z29c_bus::CONNECT_PATIENCE / 2,
        "a malformed URL was retried: {err}"
    );
}
