//! Retention, with real processes under the services' rows-only database role: recovery
//! makes two-second periods and keeps finished workflows eight seconds. A finished workflow
//! disappears with every row of its history once that has passed, exported first; a
//! workflow still running and a cancelled one waiting in review stay, each in its own period; the audit
//! log records every drop; the destination's own records are untouched.

use std::io::Read;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::json;
use sqlx::PgPool;
use z29c_proto::v1 as pb;
use z29c_scenarios::cluster::{Cluster, Topology, chain, flaky_workflow};

const PERIOD: Duration = Duration::from_secs(2);

async fn rows(pool: &PgPool, sql: &'static str, workflow: uuid::Uuid) -> Result<i64> {
    Ok(sqlx::query_scalar(sql)
        .bind(workflow)
        .fetch_one(pool)
        .await?)
}

/// Rows of each table of `workflow`'s history.
async fn history(pool: &PgPool, workflow: uuid::Uuid) -> Result<Vec<(&'static str, i64)>> {
    let mut out = Vec::new();
    for (table, sql) in [
        ("workflows", "SELECT count(*) FROM workflows WHERE id = $1"),
        ("steps", "SELECT count(*) FROM steps WHERE workflow_id = $1"),
        (
            "attempts",
            "SELECT count(*) FROM attempts WHERE workflow_id = $1",
        ),
        (
            "step_receipts",
            "SELECT count(*) FROM step_receipts WHERE workflow_id = $1",
        ),
        (
            "step_events",
            "SELECT count(*) FROM step_events WHERE workflow_id = $1",
        ),
        (
            "workflow_keys",
            "SELECT count(*) FROM workflow_keys WHERE workflow_id = $1",
        ),
    ] {
        out.push((table, rows(pool, sql, workflow).await?));
    }
    Ok(out)
}

async fn wait_for(
    what: &str,
    within: Duration,
    mut done: impl AsyncFnMut() -> Result<bool>,
) -> Result<()> {
    let start = Instant::now();
    while !done().await? {
        if start.elapsed() > within {
            bail!("{what}: not after {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_workflows_go_with_their_history_and_the_rest_stays() -> Result<()> {
    let mut cluster = Cluster::start_with(Topology {
        capability: "opaque",
        least_privilege: true,
        retention_period: PERIOD,
        ..Topology::default()
    })
    .await?;
    let export = cluster.dir().join("export");
    let export_dir = export.display().to_string();
    cluster
        .add_recovery_with(&[
            ("Z29C_RETENTION__PERIOD", "2s"),
            ("Z29C_RETENTION__KEEP", "8s"),
            ("Z29C_RETENTION__EXPORT_DIR", export_dir.as_str()),
        ])
        .await?;
    let owner = cluster.db.pool(2).await?;
    let mut client = cluster.client().await?;
    let mut submit = async |req| -> Result<uuid::Uuid> {
        let id = client
            .submit(req)
            .await?
            .into_inner()
            .workflow
            .context("workflow")?
            .id;
        Ok(id.parse()?)
    };
    let done = submit(chain("retention-done", "ok", 2)).await?;
    cluster
        .wait_all_ended(&[done.to_string()], Duration::from_secs(60))
        .await?;
    let done_before = history(&owner, done).await?;
    let done_requests = async |ledger: &PgPool| -> Result<i64> {
        Ok(sqlx::query_scalar(
            "SELECT count(*) FROM destination.requests WHERE body::text LIKE '%retention-done/%'",
        )
        .fetch_one(ledger)
        .await?)
    };
    assert_eq!(done_before[3], ("step_receipts", 2), "{done_before:?}");
    let ledger = cluster.ledger_pool().await?;
    let effects_before = done_requests(&ledger).await?;
    assert!(
        effects_before >= 2,
        "{effects_before} requests for two steps"
    );
    // the others in periods of their own
    tokio::time::sleep(PERIOD + Duration::from_millis(300)).await;
    cluster.set_faults("held", json!({ "hold": true })).await?;
    let running = submit(chain("retention-running", "held", 1)).await?;
    tokio::time::sleep(PERIOD + Duration::from_millis(300)).await;
    cluster
        .set_faults("flaky", json!({ "drop_response": true }))
        .await?;
    let reviewed = submit(flaky_workflow("retention-review")).await?;
    wait_for("a review item", Duration::from_secs(60), async || {
        Ok(rows(
            &owner,
            "SELECT count(*) FROM review_items WHERE workflow_id = $1 AND state = 'open'",
            reviewed,
        )
        .await?
            == 1)
    })
    .await?;
    // cancelled, so it is not running: what keeps it is the question still open
    cluster
        .client()
        .await?
        .cancel(pb::CancelRequest {
            workflow_id: reviewed.to_string(),
            reason: "the customer withdrew".into(),
        })
        .await?;

    // the finished workflow goes once its period is past the retention
    wait_for(
        "the finished workflow dropped",
        Duration::from_secs(60),
        // the period goes a table at a time; its client key is freed with the last one
        async || {
            Ok(rows(
                &owner,
                "SELECT count(*) FROM workflow_keys WHERE workflow_id = $1",
                done,
            )
            .await?
                == 0)
        },
    )
    .await?;
    for (table, n) in history(&owner, done).await? {
        assert_eq!(n, 0, "{table} still holds rows of the dropped workflow");
    }
    // the running one and the one in review stay, with their history, well past it
    tokio::time::sleep(Duration::from_secs(5)).await;
    for id in [running, reviewed] {
        let kept = history(&owner, id).await?;
        assert_eq!(kept[0], ("workflows", 1), "{kept:?}");
        assert_eq!(kept[1], ("steps", 1), "{kept:?}");
        assert!(kept[2].1 >= 1, "{kept:?}");
    }
    let open = rows(
        &owner,
        "SELECT count(*) FROM review_items WHERE workflow_id = $1 AND state = 'open'",
        reviewed,
    )
    .await?;
    assert_eq!(open, 1, "the review item waits for a person");

    // the audit log records the drop of the finished workflow's period, and its export
    let drops: Vec<String> = sqlx::query_scalar(
        "SELECT detail FROM audit_log WHERE action = 'drop' AND service = 'recovery' ORDER BY id",
    )
    .fetch_all(&owner)
    .await?;
    let details: Vec<serde_json::Value> = drops
        .iter()
        .map(|d| serde_json::from_str(d))
        .collect::<Result<_, _>>()?;
    let its = details
        .iter()
        .find(|d| d["removed"]["step_receipts"] == 2)
        .with_context(|| format!("no drop removed its two receipts: {details:#?}"))?;
    assert_eq!(its["removed"]["workflows"], 1, "{its}");
    assert_eq!(its["exported_to"], export_dir.as_str(), "{its}");
    // and the export holds its receipts
    let mut found = 0;
    for entry in std::fs::read_dir(&export)? {
        let path = entry?.path();
        let name = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        if name.starts_with("step_receipts_") && name.ends_with(".csv.gz") {
            let mut text = String::new();
            flate2::read::GzDecoder::new(std::fs::File::open(&path)?).read_to_string(&mut text)?;
            found += text
                .lines()
                .filter(|l| l.contains(&done.to_string()))
                .count();
        }
    }
    assert_eq!(
        found, 2,
        "the export holds the dropped workflow's two receipts"
    );

    // the outside world's records are its own: nothing there was removed
    assert_eq!(done_requests(&ledger).await?, effects_before);
    ledger.close().await;
    let refusals: Vec<String> = cluster
        .log_lines()
        .into_iter()
        .filter(|l| l.contains("permission denied") || l.contains("must be owner"))
        .collect();
    assert!(refusals.is_empty(), "{refusals:#?}");
    owner.close().await;
    cluster.stop().await
}
