//! Scale-out: 3 executors, 2 gateways, 2 recovery instances and a scheduler as
//! separate processes, 2,000 workflows; one executor, one gateway and one recovery instance
//! are killed and restarted during the run, and a third gateway joins. Everything completes
//! or lands in review, docs/design.md §1's invariants hold over the recorded history, and the
//! permit table shows the joining gateway raised usable capacity without exceeding the
//! adapter's limit.

#![allow(clippy::print_stdout)] // the capacity figures go in the test log

use std::time::Duration;

use anyhow::Result;
use chrono::{DateTime, Utc};
use serde_json::json;
use sqlx::PgPool;
use z29c_core::AdapterCapability;
use z29c_proto::v1::{self as pb};
use z29c_scenarios::cluster::{Cluster, Topology, chain};
use z29c_scenarios::history::{Expect, History};

const WORKFLOWS: usize = 2_000;
/// The adapter's permit limit, over every gateway.
const LIMIT: i64 = 6;
/// What one gateway instance runs at once.
const PER_GATEWAY: usize = 2;

/// The most calls in flight at once among those that began in `[from, to)`: permits their
/// gateway released at the call's end (a killed gateway's permits only expire; they count
/// against the limit, which the history check covers, but no call ran under them).
async fn calls_in_flight(pool: &PgPool, from: DateTime<Utc>, to: DateTime<Utc>) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "WITH ran AS (
             SELECT acquired_at, released_at FROM adapter_permits
             WHERE released_at IS NOT NULL
               AND release_reason NOT IN ('hold expired', 'safety window passed'))
         SELECT coalesce(max((SELECT count(*) FROM ran q
                              WHERE q.acquired_at <= p.acquired_at
                                AND q.released_at > p.acquired_at)), 0)
         FROM ran p WHERE p.acquired_at >= $1 AND p.acquired_at < $2",
    )
    .bind(from)
    .bind(to)
    .fetch_one(pool)
    .await?)
}

async fn db_now(pool: &PgPool) -> Result<DateTime<Utc>> {
    Ok(sqlx::query_scalar("SELECT now()").fetch_one(pool).await?)
}

/// Waits until `n` steps have completed: faults are placed by progress, not by the clock, so
/// a slow machine moves them along with the work.
async fn completed_at_least(pool: &PgPool, n: i64) -> Result<()> {
    let start = std::time::Instant::now();
    loop {
        let done: i64 = sqlx::query_scalar("SELECT count(*) FROM steps WHERE state = 'completed'")
            .fetch_one(pool)
            .await?;
        if done >= n {
            return Ok(());
        }
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(300),
            "only {done} of {n} steps completed after 300 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_workflows_survive_kills_and_a_new_gateway_adds_capacity() -> Result<()> {
    let per_gateway = PER_GATEWAY.to_string();
    let mut cluster = Cluster::start_with(Topology {
        gateways: 0,
        executors: 0,
        recoveries: 2,
        permit_limit: LIMIT as u32,
        ..Topology::default()
    })
    .await?;
    let gateway = [("Z29C_MAX_CALLS", per_gateway.as_str())];
    cluster.add_gateway_with(LIMIT as u32, &gateway).await?;
    cluster.add_gateway_with(LIMIT as u32, &gateway).await?;
    // each call takes a while at the destination, so the gateways' capacity is what limits
    cluster
        .set_faults("scale", json!({ "delay_ms": 100 }))
        .await?;
    let pool = cluster.db.pool(2).await?;

    // the whole load waits in PostgreSQL before the executors start
    let mut client = cluster.client().await?;
    let mut ids = Vec::with_capacity(WORKFLOWS);
    for i in 0..WORKFLOWS {
        let w = client
            .submit(chain(&format!("scale-{i}"), "scale", 1))
            .await?
            .into_inner()
            .workflow
            .expect("workflow");
        ids.push(w.id);
    }
    for _ in 0..3 {
        cluster.add_executor().await?;
    }
    let two_from = db_now(&pool).await?;
    // an executor and a recovery instance die mid-run and come back
    for (done, victim) in [(300, "executor-1"), (500, "recovery-1")] {
        completed_at_least(&pool, done).await?;
        cluster.process(victim).expect("started").kill().await?;
        cluster.restart(victim, &[]).await?;
    }
    // two gateways at their capacity so far; then a third joins
    completed_at_least(&pool, 700).await?;
    let joined = db_now(&pool).await?;
    cluster.add_gateway_with(LIMIT as u32, &gateway).await?;
    // then, with three serving, a gateway dies mid-call and comes back
    completed_at_least(&pool, 1_100).await?;
    let killed = db_now(&pool).await?;
    cluster
        .process("gateway-1")
        .expect("started")
        .kill()
        .await?;
    cluster.restart("gateway-1", &[]).await?;
    cluster
        .wait_all_ended(&ids, Duration::from_secs(600))
        .await?;

    let history = History::load(&pool, &cluster.ledger_pool().await?).await?;
    let tally = history.tally();
    assert_eq!(tally.steps, WORKFLOWS);
    assert_eq!(
        tally.completed + tally.in_review,
        WORKFLOWS,
        "every step completed or is in review: {tally:?}"
    );
    let violations = history.check(&Expect {
        capabilities: [("http".to_owned(), AdapterCapability::Idempotent)].into(),
        permit_limit: LIMIT,
        // idempotent calls never need review: all of them must complete
        min_completed: WORKFLOWS,
    });
    assert!(violations.is_empty(), "invariants violated: {violations:?}");
    let workflows: Vec<(String, i64)> =
        sqlx::query_as("SELECT state::text, count(*) FROM workflows GROUP BY 1")
            .fetch_all(&pool)
            .await?;
    assert_eq!(workflows, vec![("completed".to_owned(), WORKFLOWS as i64)]);

    // the permit table: two gateways ran at most their capacity at once; with the third,
    // more calls ran at once; the adapter's limit held throughout (checked above: permit-limit-held)
    let two = calls_in_flight(&pool, two_from, joined).await?;
    let three = calls_in_flight(&pool, joined, killed).await?;
    println!("calls in flight at most: {two} on 2 gateways, {three} on 3 (limit {LIMIT})");
    assert!(
        (1..=2 * PER_GATEWAY as i64).contains(&two),
        "two gateways of {PER_GATEWAY} calls ran {two} at once"
    );
    assert!(
        two < three && three <= LIMIT,
        "a third gateway raised calls in flight from {two} to {three} (limit {LIMIT})"
    );
    let gateways: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT gateway) FROM adapter_permits WHERE acquired_at > $1",
    )
    .bind(joined)
    .fetch_one(&pool)
    .await?;
    assert_eq!(
        gateways, 3,
        "all three gateways served calls after the join"
    );
    let wf = client
        .get(pb::GetRequest {
            workflow_id: ids[0].clone(),
        })
        .await?
        .into_inner();
    assert_eq!(wf.state(), pb::ProductState::Completed);
    pool.close().await;
    cluster.stop().await
}
