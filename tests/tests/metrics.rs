//! `/metrics` after fault scenarios: each level of docs/design.md §7 counts what happened, and
//! only that — worker churn is not a result, a stale result is evidence, and a lease expiry
//! before anything was sent is no unknown outcome.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use z29c_proto::v1::{self as pb};
use z29c_scenarios::cluster::{Cluster, Topology, chain, free_port};

fn one_step(key: &str, route: &str, policy: pb::LeasePolicy) -> pb::SubmitRequest {
    let mut req = chain(key, route, 1);
    req.steps[0].policy = Some(policy);
    req
}

/// A step whose lease runs out quickly, so a stalled worker is stale within seconds.
fn short(key: &str, route: &str) -> pb::SubmitRequest {
    one_step(
        key,
        route,
        pb::LeasePolicy {
            lease_ms: 1_500,
            renew_every_ms: 500,
            attempt_deadline_ms: 10_000,
            final_grace_ms: 500,
            adapter_timeout_ms: 800,
            ..Default::default()
        },
    )
}

/// A step whose lease outlives a slow machine: the retry's call must not be cut by its own
/// lease running out (an opaque step would go to review), so only the crash expires a lease.
fn patient(key: &str, route: &str) -> pb::SubmitRequest {
    one_step(
        key,
        route,
        pb::LeasePolicy {
            lease_ms: 6_000,
            renew_every_ms: 1_000,
            attempt_deadline_ms: 30_000,
            final_grace_ms: 1_000,
            adapter_timeout_ms: 5_000,
            ..Default::default()
        },
    )
}

/// Scrapes `url` until every line in `want` is on it.
async fn scrape_until(url: &str, want: &[&str]) -> Result<String> {
    let start = Instant::now();
    loop {
        let text = match reqwest::get(url).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        if want.iter().all(|w| text.lines().any(|l| l == *w)) {
            return Ok(text);
        }
        if start.elapsed() > Duration::from_secs(30) {
            let missing: Vec<_> = want
                .iter()
                .filter(|w| !text.lines().any(|l| l == **w))
                .collect();
            bail!("{url} lacks {missing:?}:\n{text}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_worker_shows_one_fencing_rejection_and_one_late_observation() -> Result<()> {
    let mut cluster = Cluster::start_with(Topology {
        executors: 0,
        recoveries: 1,
        capability: "queryable",
        executor_stall_ms: 4_000,
        ..Topology::default()
    })
    .await?;
    let port = free_port()?;
    cluster
        .add_executor_with(&[("Z29C_METRICS_LISTEN", &format!("127.0.0.1:{port}"))])
        .await?;
    cluster.client().await?.submit(short("stale", "m")).await?;
    let executor = format!("http://127.0.0.1:{port}/metrics");
    let text = scrape_until(
        &executor,
        &[
            "z29c_attempt_fencing_rejections_total 1",
            "z29c_attempt_late_observations_total 1",
            "z29c_lease_acquisitions_total 1",
        ],
    )
    .await?;
    assert!(
        text.contains("z29c_step_unknown_outcomes_total 0"),
        "the worker knew its outcome; it was only late:\n{text}"
    );
    let text = scrape_until(
        &cluster.recovery_metrics_url,
        &[
            "z29c_lease_recoveries_total 1",
            // the gateway recorded the answer before it replied: recovery reconciles from
            // that record, with no status query
            "z29c_step_recovery_decisions_total{category=\"result_observed\",decision=\"reconcile\",capability=\"queryable\"} 1",
        ],
    )
    .await?;
    // what the database keeps, for people to watch grow (read when recovery starts, then
    // every 30 s: the receipts table's indexes have pages from the start)
    let gauge = |name: &str| -> Result<f64> {
        Ok(text
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .with_context(|| format!("{name}missing:\n{text}"))?
            .trim()
            .parse()?)
    };
    assert!(gauge("z29c_storage_table_bytes{table=\"step_receipts\"} ")? > 0.0);
    assert!(gauge("z29c_storage_oldest_workflow_age_seconds ")? >= 0.0);
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pure_retry_is_a_lease_expiry_without_an_unknown_outcome() -> Result<()> {
    let mut cluster = Cluster::start_with(Topology {
        gateways: 0,
        executors: 0,
        recoveries: 1,
        capability: "opaque",
        ..Topology::default()
    })
    .await?;
    let gateway_metrics = format!("127.0.0.1:{}", free_port()?);
    cluster
        .add_gateway_with(16, &[("Z29C_METRICS_LISTEN", &gateway_metrics)])
        .await?;
    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    // the first worker dies right after its claim (which persisted the identity): nothing
    // was sent
    cluster
        .add_executor_with(&[
            ("Z29C_FAULT_CRASH", "after_attempt_created"),
            ("Z29C_METRICS_LISTEN", &listen),
        ])
        .await?;
    let wf = cluster
        .client()
        .await?
        .submit(patient("retry", "m"))
        .await?
        .into_inner()
        .workflow
        .expect("workflow");
    cluster
        .wait_exited("executor-1", Duration::from_secs(20))
        .await?;
    cluster.restart("executor-1", &["Z29C_FAULT_CRASH"]).await?;
    cluster
        .wait_all_ended(std::slice::from_ref(&wf.id), Duration::from_secs(60))
        .await?;
    scrape_until(
        &cluster.recovery_metrics_url,
        &[
            "z29c_lease_recoveries_total 1",
            "z29c_step_recovery_decisions_total{category=\"identity_not_invoked\",decision=\"retry\",capability=\"opaque\"} 1",
        ],
    )
    .await?;
    scrape_until(
        &format!("http://{listen}/metrics"),
        &[
            "z29c_step_unknown_outcomes_total 0",
            "z29c_attempt_fencing_rejections_total 0",
            "z29c_step_receipts_total{verification=\"direct\",outcome=\"succeeded\"} 1",
            "z29c_step_time_to_receipt_seconds_count{verification=\"direct\"} 1",
        ],
    )
    .await?;
    // one call reached the destination: the retry's, not the dead worker's
    scrape_until(
        &format!("http://{gateway_metrics}/metrics"),
        &["z29c_attempt_invocations_total{adapter=\"http\",result=\"succeeded\"} 1"],
    )
    .await?;
    // outcomes and knowledge, from PostgreSQL: one workflow completed, no duplicate effect
    scrape_until(
        &cluster.recovery_metrics_url,
        &[
            "z29c_workflows{state=\"completed\"} 1",
            "z29c_workflows{state=\"running\"} 0",
            "z29c_step_duplicate_external_references 0",
            "z29c_step_review_items_open 0",
        ],
    )
    .await?;
    cluster.stop().await
}
