//! TLS to NATS against a real `nats-server` started with `--tlsverify`: with the deployment's
//! CA and a client certificate z29c connects and publishes; without a certificate, or with one
//! from another CA, it cannot connect at all.

use std::time::Duration;

use z29c_bus::{Bus, step_ready};
use z29c_security::TlsConfig;
use z29c_security::pki::DevPki;

fn nats_server() -> String {
    for p in [
        "/usr/sbin/nats-server",
        "/usr/bin/nats-server",
        "/usr/local/bin/nats-server",
    ] {
        if std::path::Path::new(p).exists() {
            return p.into();
        }
    }
    "nats-server".into()
}

#[tokio::test]
async fn only_a_client_with_a_certificate_from_the_ca_reaches_a_verifying_nats() {
    let dir = std::env::temp_dir().join(format!("z29c-nats-tls-{}", uuid::Uuid::new_v4().simple()));
    let pki = DevPki::generate(&dir.join("pki"), &["nats", "client"]).unwrap();
    let foreign = DevPki::generate(&dir.join("foreign"), &["client"]).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let server = pki.tls("nats");
    let path = |p: Option<std::path::PathBuf>| p.unwrap().to_string_lossy().into_owned();
    let mut child = tokio::process::Command::new(nats_server())
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(dir.join("js"))
        .args(["--tls", "--tlsverify", "--tlscert"])
        .arg(path(server.cert_file))
        .arg("--tlskey")
        .arg(path(server.key_file))
        .arg("--tlscacert")
        .arg(path(server.ca_file))
        .kill_on_drop(true)
        .spawn()
        .expect("nats-server (scripts/services installs it)");
    let url = format!("tls://127.0.0.1:{port}");
    let prefix = format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let mut bus = None;
    for _ in 0..100 {
        if let Ok(b) = Bus::connect_with(&url, &prefix, &pki.tls("client")).await {
            bus = Some(b);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let bus = bus.expect("a client with the CA's certificate connects");
    let (wf, st) = (
        z29c_core::WorkflowId::new().to_string(),
        z29c_core::StepId::new().to_string(),
    );
    assert!(
        !bus.publish(&step_ready("m-1", &wf, &st))
            .await
            .unwrap()
            .duplicate
    );

    let impostor = TlsConfig {
        ca_file: pki.tls("client").ca_file,
        ..foreign.tls("client")
    };
    let no_tls = tokio::time::timeout(
        Duration::from_secs(10),
        Bus::connect(&format!("nats://127.0.0.1:{port}"), &prefix),
    )
    .await;
    // refused at once, not retried as if the server were not up yet
    assert!(
        matches!(no_tls, Ok(Err(_))),
        "no certificate, no connection"
    );
    let other_ca = tokio::time::timeout(
        Duration::from_secs(10),
        Bus::connect_with(&url, &prefix, &impostor),
    )
    .await;
    assert!(
        matches!(other_ca, Ok(Err(_))),
        "another CA's certificate, no connection"
    );
    child.kill().await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}
