//! The `z29c` command line against a running deployment: `--output json` is parseable and
//! has one shape for a workflow wherever it is printed, a followed workflow prints a JSON line
//! per change, and the exit codes say how it ended — 0 completed, 1 failed or cancelled, 3
//! waiting for a person, 2 bad input, 4 unreachable — the same from `status`, `status
//! --watch` and `submit --wait`, even when nobody reads the output.

use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use z29c_scenarios::apis::Apis;
use z29c_scenarios::cluster::{Cluster, Topology, z29c_binary};
use z29c_scenarios::order;

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

/// Longer than any of these commands needs on a loaded machine.
const PATIENCE: Duration = Duration::from_secs(120);

async fn z29c(args: &[&str], server: &str) -> Result<Output> {
    let run = tokio::process::Command::new(z29c_binary()?)
        .args(args)
        .env("Z29C_SERVER", server)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(PATIENCE, run)
        .await
        .with_context(|| format!("z29c {args:?} did not end"))?
        .map_err(Into::into)
}

/// Runs `z29c` with its standard output closed before it writes anything, as `z29c … | head
/// -c 1` does once `head` has its byte.
async fn z29c_unread(args: &[&str], server: &str) -> Result<Output> {
    let mut child = tokio::process::Command::new(z29c_binary()?)
        .args(args)
        .env("Z29C_SERVER", server)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    drop(child.stdout.take());
    tokio::time::timeout(PATIENCE, child.wait_with_output())
        .await
        .with_context(|| format!("z29c {args:?} did not end"))?
        .map_err(Into::into)
}

fn exit(out: &Output) -> Option<i32> {
    out.status.code()
}

fn stdout_json(out: &Output) -> Result<Value> {
    serde_json::from_slice(&out.stdout).with_context(|| format!("not one JSON document: {out:?}"))
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
    assert_eq!(end["workflow"]["state"], "completed");
    assert_eq!(end["workflow"]["label"], "Completed");
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

    // bad input: a missing file, an unknown workflow id, an unknown dependency, an unknown
    // state; each said in words, never in Rust's debug form
    let out = z29c(&["submit", "/nonexistent.yaml"], &server).await?;
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let out = z29c(&["status", "not-a-uuid"], &server).await?;
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        "name: bad\nsteps:\n  - { name: a, adapter: http, operation: cli }\n  - { name: b, adapter: http, operation: cli, depends_on: [zz] }\n",
    )?;
    let out = z29c(&["submit", bad.to_str().unwrap_or_default()], &server).await?;
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("steps[1].depends_on[0]"), "{err}");
    for debug in ["StepName(", "InvalidArgument", "Status {", "code:"] {
        assert!(!err.contains(debug), "{debug} in {err}");
    }
    let out = z29c(&["list", "--state", "done"], &server).await?;
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
        if doc["state"] == "needs_review" {
            break;
        }
        if start.elapsed() > Duration::from_secs(30) {
            bail!("never needed review: {doc}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let out = z29c(&["status", &id, "--watch"], &server).await?;
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let out = z29c(&["status", &id], &server).await?;
    assert_eq!(
        out.status.code(),
        Some(3),
        "status and status --watch agree: {out:?}"
    );
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

    // a person found the effect: resolved at the version seen, the workflow goes on to its end
    let item = items[0]["id"].as_str().context("item id")?.to_owned();
    let version = items[0]["version"].as_i64().context("version")?.to_string();
    let resolve = |extra: &'static [&'static str]| {
        let mut cmd = tokio::process::Command::new(z29c_binary()?);
        cmd.args(["review", "resolve", &item, "--version", &version])
            .args(["--reason", "found in the destination's books"])
            .args(extra)
            .args(["--output", "json"])
            .env("Z29C_REVIEW_SERVER", &cluster.review_url)
            .env("Z29C_SERVER", &server)
            .kill_on_drop(true);
        anyhow::Ok(cmd)
    };
    let out = resolve(&[
        "--succeeded",
        "manual-ref-1",
        "--result",
        r#"{"id": "manual-ref-1"}"#,
    ])?
    .output()
    .await?;
    assert_eq!(exit(&out), Some(0), "{out:?}");
    let resolved = stdout_json(&out)?;
    assert_ne!(resolved[0]["state"], "open", "{resolved}");
    let out = resolve(&["--failed"])?.output().await?;
    assert_eq!(exit(&out), Some(2), "a version no longer current: {out:?}");
    let out = z29c(&["status", &id, "--watch", "--output", "json"], &server).await?;
    assert_eq!(exit(&out), Some(0), "{out:?}");
    let lines = json_lines(&out)?;
    let end = lines.last().context("lines")?;
    assert_eq!(end["workflow"]["state"], "completed", "{end}");
    let a = &end["workflow"]["steps"][0];
    assert_eq!(a["receipt"]["verification"], "manual", "{a}");
    assert_eq!(a["receipt"]["external_reference"], "manual-ref-1", "{a}");
    assert_eq!(
        a["result"]["id"], "manual-ref-1",
        "the result the person found: {a}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    cluster.stop().await
}

/// A workflow file holding `doc` (YAML reads JSON).
fn document_file(dir: &std::path::Path, name: &str, doc: &Value) -> Result<String> {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, serde_json::to_string_pretty(doc)?)?;
    Ok(path.to_string_lossy().into_owned())
}

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// The ids of a `list --output json` answer, sorted.
fn listed(out: &Output) -> Result<Vec<String>> {
    let doc = stdout_json(out)?;
    let mut ids: Vec<String> = doc["workflows"]
        .as_array()
        .context("workflows")?
        .iter()
        .filter_map(|w| w["id"].as_str().map(str::to_owned))
        .collect();
    ids.sort();
    Ok(ids)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_cancel_list_and_exit_codes_through_the_command_line() -> Result<()> {
    let apis = Apis::start(order::KEY).await?;
    // no executor at first: what is submitted now cannot start, and is cancelled
    let mut cluster = Cluster::start_with(Topology {
        gateways: 0,
        executors: 0,
        ..Topology::default()
    })
    .await?;
    let refusing = format!(
        "[[adapters]]\nname = \"http\"\nversion = \"http/1\"\nbase_url = \"{}/idempotent\"\n\
         capability = \"idempotent\"\ndefault_limit = 4\nsafety_window_ms = 5000\n",
        cluster.destination_url
    );
    cluster
        .add_gateway_serving(
            &format!("{}\n{refusing}", order::gateway_toml(&apis.url)),
            &[(order::KEY_ENV, order::KEY)],
        )
        .await?;
    let dir = tempdir()?;
    let server = cluster.scheduler_url.clone();

    // cancel: the answer, then status and status --watch agree on 1
    let withdrawn_key = unique("withdrawn");
    let withdrawn = document_file(
        &dir,
        "withdrawn",
        &order::document(&withdrawn_key, &unique("sku")),
    )?;
    let out = z29c(&["submit", &withdrawn, "--output", "json"], &server).await?;
    assert_eq!(exit(&out), Some(0), "{out:?}");
    let withdrawn = stdout_json(&out)?["id"].as_str().context("id")?.to_owned();
    let out = z29c(
        &[
            "cancel",
            &withdrawn,
            "--reason",
            "the customer withdrew the order",
            "--output",
            "json",
        ],
        &server,
    )
    .await?;
    assert_eq!(exit(&out), Some(0), "{out:?}");
    let doc = stdout_json(&out)?;
    assert_eq!(doc["state"], "cancelled", "{doc}");
    let reason = doc["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("the customer withdrew the order"), "{doc}");
    for args in [
        vec!["status", &withdrawn],
        vec!["status", &withdrawn, "--watch"],
    ] {
        let out = z29c(&args, &server).await?;
        assert_eq!(exit(&out), Some(1), "{args:?}: {out:?}");
    }
    let out = z29c(&["cancel", &withdrawn], &server).await?;
    assert_eq!(exit(&out), Some(2), "a reason is required: {out:?}");

    cluster.add_executor().await?;

    // the order, waited for: every step's result, each request carrying what came before
    let (key, sku) = (unique("order"), unique("sku"));
    let file = document_file(&dir, "order", &order::document(&key, &sku))?;
    let out = z29c(&["submit", &file, "--wait", "--output", "json"], &server).await?;
    assert_eq!(exit(&out), Some(0), "{out:?}");
    let submitted = stdout_json(&out)?;
    assert_eq!(submitted["state"], "completed", "{submitted}");
    assert_eq!(submitted["created"], true);
    let id = submitted["id"].as_str().context("id")?.to_owned();
    let out = z29c(&["status", &id, "--output", "json"], &server).await?;
    assert_eq!(exit(&out), Some(0), "{out:?}");
    let status = stdout_json(&out)?;
    let keys = |v: &Value| {
        let mut k: Vec<String> = v
            .as_object()
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default();
        k.retain(|k| k != "created");
        k.sort();
        k
    };
    assert_eq!(
        keys(&submitted),
        keys(&status),
        "one shape: {submitted} {status}"
    );
    assert_eq!(status["created_at"], submitted["created_at"]);
    let created = status["created_at"].as_str().context("created_at")?;
    chrono::DateTime::parse_from_rfc3339(created)?;
    let steps = status["steps"].as_array().context("steps")?;
    assert_eq!(steps.len(), 3);
    for step in steps {
        assert_eq!(step["state"], "completed", "{step}");
        let reference = step["receipt"]["external_reference"]
            .as_str()
            .unwrap_or_default();
        assert!(!reference.is_empty(), "{step}");
        assert_eq!(step["result"]["id"], reference, "the step's result: {step}");
        assert_eq!(step["receipt"]["verification"], "direct", "{step}");
        let events = step["technical"]["events"].as_array().context("events")?;
        assert!(!events.is_empty(), "{step}");
        for e in events {
            let at = e["at"].as_str().context("an event's time")?;
            chrono::DateTime::parse_from_rfc3339(at)?;
            let fields = e.as_object().context("event")?;
            for field in ["kind", "owner", "detail", "lease_version"] {
                assert!(fields.contains_key(field), "{field} in {e}");
            }
        }
        assert!(
            events
                .iter()
                .any(|e| e["kind"] == "lease_acquired" && e["owner"] == "executor-1"),
            "{step}"
        );
    }
    assert_eq!(steps[2]["depends_on"], json!(["reserve", "charge"]));
    order::check_carried(&apis, &sku)?;
    let out = z29c(&["status", &id], &server).await?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(exit(&out), Some(0), "{out:?}");
    assert_eq!(text.matches("    result: {").count(), 3, "{text}");

    // a definite refusal fails the workflow: 1 from submit --wait, status and status --watch
    cluster
        .set_faults("refused", json!({ "refuse_status": 400 }))
        .await?;
    let failing = document_file(
        &dir,
        "failing",
        &json!({
            "name": "refused",
            "steps": [{ "name": "only", "adapter": "http", "operation": "refused", "input": {} }]
        }),
    )?;
    let out = z29c(&["submit", &failing, "--wait", "--output", "json"], &server).await?;
    assert_eq!(exit(&out), Some(1), "{out:?}");
    let failed = stdout_json(&out)?;
    assert_eq!(failed["state"], "failed", "{failed}");
    let failed = failed["id"].as_str().context("id")?.to_owned();
    for args in [vec!["status", &failed], vec!["status", &failed, "--watch"]] {
        let out = z29c(&args, &server).await?;
        assert_eq!(exit(&out), Some(1), "{args:?}: {out:?}");
    }
    let out = z29c(&["status", &failed], &server).await?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("    reason: "),
        "the step's reason is shown: {text}"
    );

    // list: by state, by key, page by page
    let out = z29c(
        &["list", "--state", "completed", "--output", "json"],
        &server,
    )
    .await?;
    assert_eq!(exit(&out), Some(0), "{out:?}");
    assert_eq!(listed(&out)?, [id.as_str()]);
    let out = z29c(
        &[
            "list",
            "--state",
            "failed",
            "--state",
            "cancelled",
            "--output",
            "json",
        ],
        &server,
    )
    .await?;
    let mut ended = vec![failed.clone(), withdrawn.clone()];
    ended.sort();
    assert_eq!(listed(&out)?, ended);
    let out = z29c(
        &["list", "--state", "needs-review", "--output", "json"],
        &server,
    )
    .await?;
    assert_eq!(listed(&out)?, Vec::<String>::new());
    let out = z29c(&["list", "--search", &key, "--output", "json"], &server).await?;
    assert_eq!(listed(&out)?, [id.as_str()]);
    let out = z29c(&["list", "--name", "refused", "--output", "json"], &server).await?;
    assert_eq!(listed(&out)?, [failed.as_str()]);
    let out = z29c(&["list", "--page-size", "2", "--output", "json"], &server).await?;
    let first = stdout_json(&out)?;
    assert_eq!(listed(&out)?.len(), 2, "{first}");
    let token = first["next_page_token"].as_str().context("a next page")?;
    let out = z29c(
        &[
            "list",
            "--page-size",
            "2",
            "--page-token",
            token,
            "--output",
            "json",
        ],
        &server,
    )
    .await?;
    assert_eq!(listed(&out)?.len(), 1);
    let out = z29c(&["list", "--all", "--output", "json"], &server).await?;
    let mut all = vec![id.clone(), failed.clone(), withdrawn.clone()];
    all.sort();
    assert_eq!(listed(&out)?, all);
    let out = z29c(&["list"], &server).await?;
    let text = String::from_utf8_lossy(&out.stdout);
    let row = text
        .lines()
        .find(|l| l.starts_with(&id))
        .with_context(|| format!("{id} in {text}"))?;
    assert!(row.contains("order") && row.contains("completed"), "{row}");

    // nobody reading: quiet, and the code of the workflow's state, never a panic (101)
    for (args, code) in [
        (vec!["status", &id], 0),
        (vec!["status", &id, "--watch"], 0),
        (vec!["status", &id, "--output", "json"], 0),
        (vec!["status", &failed], 1),
        (vec!["status", &failed, "--watch"], 1),
        (vec!["list", "--all"], 0),
    ] {
        let out = z29c_unread(&args, &server).await?;
        assert_eq!(exit(&out), Some(code), "{args:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(!err.contains("Broken pipe"), "{args:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    cluster.stop().await
}

fn tempdir() -> Result<std::path::PathBuf> {
    let d = std::env::temp_dir().join(format!("z29c-cli-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}
