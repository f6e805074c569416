//! The `z29c` command line against a running deployment: `--output json` is parseable, a
//! followed workflow prints a JSON line per change, and the exit codes say how it ended —
//! 0 completed, 3 waiting for a person, 2 bad input, 4 unreachable.

use std::process::Output;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use serde_json::Value;
use z29c_scenarios::cluster::{Cluster, Topology, z29c_binary};

fn workflow_file(dir: &std::path::Path, name: &str) -> Result<std::path::PathBuf> {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(
        &path,
        format!(
            "name: {name}\nsteps:\n  - name: a\n    adapter: http\n    operation: cli\n    input: {{ n: 1 }}\n    policy: {{ lease_ms: 1500, renew_every_ms: 500, final_grace_ms: 500, attempt_deadline_ms: 8000, adapter_timeout_ms: 800 }}\n  - name: b\n    adapter: http\n    operation: cli\n    input: {{ n: 2 }}\n    depends_on: [a]\n"
        ),
    )?;
    Ok(path)
}

async fn z29c(args: &[&str], server: &str) -> Result<Output> {
    Ok(tokio::process::Command::new(z29c_binary()?)
        .args(args)
        .env("Z29C_SERVER", server)
        .env("RUST_LOG", "warn")
        .output()
        .await?)
}

fn json_lines(out: &Output) -> Result<Vec<Value>> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| Ok(serde_json::from_str(l)?))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_watch_and_status_speak_json_and_exit_codes() -> Result<()> {
    let cluster = Cluster::start(1, 1, 8).await?;
    let dir = tempdir()?;
    let server = cluster.scheduler_url.clone();

    let file = workflow_file(&dir, "cli-ok")?;
    let out = z29c(
        &[
            "submit",
            file.to_str().unwrap_or_default(),
            "--watch",
            "--output",
            "json",
        ],
        &server,
    )
    .await?;
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let lines = json_lines(&out)?;
    assert_eq!(lines[0]["event"], "submitted");
    assert!(
        lines
            .iter()
            .any(|l| l["event"] == "changed" && l["step"] == "b"),
        "a line per change: {lines:?}"
    );
    let end = lines.last().expect("lines");
    assert_eq!(end["event"], "ended");
    assert_eq!(end["workflow"]["state"], "Completed");
    let steps = end["workflow"]["steps"].as_array().expect("steps");
    assert!(
        steps.iter().all(|s| s["receipt"]["external_reference"]
            .as_str()
            .is_some_and(|r| !r.is_empty())),
        "{steps:?}"
    );

    let id = lines[0]["workflow_id"].as_str().expect("id").to_owned();
    let out = z29c(&["status", &id, "--output", "json"], &server).await?;
    assert_eq!(out.status.code(), Some(0));
    let doc: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(doc["id"], id.as_str());
    assert_eq!(doc["steps"][1]["technical"]["attempts"], 1);

    // bad input: a missing file, an unknown workflow id
    let out = z29c(&["submit", "/nonexistent.yaml"], &server).await?;
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let out = z29c(&["status", "not-a-uuid"], &server).await?;
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    // nothing listening
    let out = z29c(&["status", &id], "http://127.0.0.1:9").await?;
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    let _ = std::fs::remove_dir_all(&dir);
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workflow_waiting_for_a_person_exits_3() -> Result<()> {
    let mut cluster = Cluster::start_with(Topology {
        gateways: 0,
        recoveries: 1,
        capability: "opaque",
        ..Topology::default()
    })
    .await?;
    // the gateway dies right after it committed *invocation began*: nobody knows whether the
    // request left, and an opaque adapter cannot be asked
    cluster
        .add_gateway_with(16, &[("Z29C_FAULT_CRASH", "after_invocation_began")])
        .await?;
    let dir = tempdir()?;
    let server = cluster.scheduler_url.clone();
    let file = workflow_file(&dir, "cli-review")?;
    let out = z29c(
        &[
            "submit",
            file.to_str().unwrap_or_default(),
            "--output",
            "json",
        ],
        &server,
    )
    .await?;
    assert_eq!(out.status.code(), Some(0), "accepted: {out:?}");
    let doc: Value = serde_json::from_slice(&out.stdout)?;
    let id = doc["id"].as_str().expect("id").to_owned();
    cluster
        .wait_exited("gateway-1", Duration::from_secs(20))
        .await?;
    cluster.restart("gateway-1", &["Z29C_FAULT_CRASH"]).await?;
    let start = Instant::now();
    loop {
        let out = z29c(&["status", &id, "--output", "json"], &server).await?;
        let doc: Value = serde_json::from_slice(&out.stdout)?;
        if doc["state"] == "Delivery status needs review" {
            break;
        }
        if start.elapsed() > Duration::from_secs(30) {
            bail!("never needed review: {doc}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let out = z29c(&["status", &id, "--watch"], &server).await?;
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let out = tokio::process::Command::new(z29c_binary()?)
        .args(["review", "list", "--output", "json"])
        .env("Z29C_REVIEW_SERVER", &cluster.review_url)
        .env("Z29C_SERVER", &server)
        .output()
        .await?;
    let items: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(items.as_array().map(Vec::len), Some(1), "{items}");
    assert_eq!(items[0]["step_name"], "a");
    assert_eq!(items[0]["workflow_label"], "Delivery status needs review");
    assert_eq!(items[0]["attempts_made"], 1);
    let evidence = items[0]["evidence"].as_array().cloned().unwrap_or_default();
    assert!(
        evidence.iter().any(|e| e["kind"] == "recovery_decision"),
        "the recovery decision is shown: {items}"
    );
    assert!(
        evidence
            .iter()
            .any(|e| e["kind"] == "attempt" && e["may_have_sent"] == true),
        "the attempt that may have sent is shown: {items}"
    );
    // the same, for a person: the item, its workflow's state, the decision behind it
    let out = tokio::process::Command::new(z29c_binary()?)
        .args(["review", "list"])
        .env("Z29C_REVIEW_SERVER", &cluster.review_url)
        .env("Z29C_SERVER", &server)
        .output()
        .await?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    for want in [
        "Delivery status needs review",
        "recovery (recovery-1): human_review",
        "attempt 1 by executor-1",
        "may have been sent",
        "attempts 1",
    ] {
        assert!(text.contains(want), "review list lacks {want:?}:\n{text}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    cluster.stop().await
}

fn tempdir() -> Result<std::path::PathBuf> {
    let d = std::env::temp_dir().join(format!("z29c-cli-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}
