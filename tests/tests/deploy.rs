//! What a deployment relies on: `z29c probe` as the container health check, and
//! `--dump-config` naming every setting a gateway reads (and never a password), and a
//! configuration no service can run with refused at start.

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

/// `z29c <service> --dump-config` with `env` set: its exit status, what it printed, and what
/// it said on standard error.
fn dump(service: &str, env: &[(&str, &str)]) -> Result<(bool, String, String)> {
    let out = Command::new(z29c_binary()?)
        .args([service, "--dump-config"])
        .envs(env.iter().copied())
        .output()?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

#[test]
fn the_dumped_configuration_never_shows_the_database_password() -> Result<()> {
    for service in ["scheduler", "executor", "gateway", "recovery"] {
        let (ok, text, err) = dump(
            service,
            &[(
                "Z29C_DATABASE_URL",
                "postgres://app:s3cret@db.internal:5432/z29c?sslmode=require",
            )],
        )?;
        assert!(ok, "{service}: {err}");
        assert!(
            !text.contains("s3cret"),
            "{service} showed the password:\n{text}"
        );
        let line =
            "database_url = \"postgres://app:REDACTED@db.internal:5432/z29c?sslmode=require\"";
        assert!(
            text.lines().any(|l| l.trim() == line),
            "{service}: {line} in:\n{text}"
        );
    }
    Ok(())
}

#[test]
fn a_value_no_service_can_run_with_is_refused_at_start_naming_its_field() -> Result<()> {
    for (service, var, value, field) in [
        ("executor", "Z29C_WORKERS", "0", "workers"),
        ("gateway", "Z29C_MAX_CALLS", "0", "max_calls"),
        ("recovery", "Z29C_BATCH", "0", "batch"),
        ("scheduler", "Z29C_PREFIX", "z29c.prod", "prefix"),
        (
            "executor",
            "Z29C_DATABASE_URL",
            "mysql://u:pw@db/z29c",
            "database_url",
        ),
        (
            "gateway",
            "Z29C_DATABASE_URL",
            "db.internal:5432",
            "database_url",
        ),
    ] {
        let (ok, _, err) = dump(service, &[(var, value)])?;
        assert!(!ok, "{service} started with {var}={value}");
        assert!(
            err.contains(field),
            "{service}: the refusal of {var}={value} names {field}: {err}"
        );
        assert!(!err.contains("pw@"), "{service} showed a password: {err}");
    }
    Ok(())
}
