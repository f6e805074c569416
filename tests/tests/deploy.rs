//! What a deployment relies on: `z29c probe` as the container health check, and
//! `--dump-config` naming every setting a gateway reads.

use std::process::Command;

use anyhow::Result;
use z29c_scenarios::cluster::{Cluster, z29c_binary};

fn probe(addr: &str) -> Result<std::process::Output> {
    Ok(Command::new(z29c_binary()?)
        .args(["probe", addr])
        .output()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_answers_for_live_services_and_fails_naming_a_dead_address() -> Result<()> {
    let cluster = Cluster::start(1, 0, 4).await?;
    for addr in [&cluster.scheduler_url, &cluster.gateway_urls[0]] {
        let out = probe(addr)?;
        assert!(
            out.status.success(),
            "{addr}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let closed = format!(
        "http://127.0.0.1:{}",
        std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port()
    );
    let out = probe(&closed)?;
    assert!(!out.status.success(), "nothing listens on {closed}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.trim().is_empty(), "a failed probe says why");
    cluster.stop().await
}

#[test]
fn a_gateway_dumps_its_configuration_with_environment_applied() -> Result<()> {
    let out = Command::new(z29c_binary()?)
        .args(["gateway", "--dump-config"])
        .env("Z29C_ADVERTISE", "http://gateway-7:50052")
        .env("Z29C_MAX_CALLS", "12")
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for line in [
        "advertise = \"http://gateway-7:50052\"",
        "max_calls = 12",
        "[[adapters]]",
    ] {
        assert!(text.lines().any(|l| l.trim() == line), "{line} in:\n{text}");
    }
    Ok(())
}
