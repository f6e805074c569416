//! What z29c commits without waiting for the disk (`synchronous_commit = off`: claims, permit
//! releases, outbox marks) is safe to lose. The scenario makes PostgreSQL lose such commits
//! for real: its WAL writer is stopped, so they live only in the server's memory until a
//! commit that waits writes them out, and the server then crashes. The test first shows that
//! they were lost, then that nothing was sent twice, no step was lost, and the destination's
//! records agree with the end state.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use sqlx::PgPool;
use z29c_core::AdapterCapability;
use z29c_proto::v1::{self as pb};
use z29c_scenarios::cluster::{Cluster, Topology, chain};
use z29c_scenarios::history::{Expect, History};
use z29c_scenarios::infra::PrivatePostgres;

async fn count(pool: &PgPool, sql: &str) -> Result<i64> {
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await?)
}

/// Waits until `sql` counts at least one row.
async fn wait_for(pool: &PgPool, sql: &str, what: &str) -> Result<()> {
    let start = Instant::now();
    while count(pool, sql).await.unwrap_or(0) == 0 {
        if start.elapsed() > Duration::from_secs(30) {
            bail!("waited 30 s for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

async fn submit(cluster: &Cluster, key: &str) -> Result<String> {
    let mut req = chain(key, "charge", 1);
    // long enough that a claim's stall (below) never outlasts its lease
    req.steps[0].policy = Some(pb::LeasePolicy {
        lease_ms: 10_000,
        renew_every_ms: 2_000,
        attempt_deadline_ms: 30_000,
        final_grace_ms: 1_000,
        adapter_timeout_ms: 5_000,
        max_attempts: 3,
        ..Default::default()
    });
    Ok(cluster
        .client()
        .await?
        .submit(req)
        .await?
        .into_inner()
        .workflow
        .context("submit answered no workflow")?
        .id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_that_do_not_wait_for_the_disk_are_safe_to_lose() -> Result<()> {
    let pg = PrivatePostgres::start_with(&[
        "fsync=on",
        "synchronous_commit=on",
        "autovacuum=off",
        "max_connections=200",
    ])
    .await?;
    let mut cluster = Cluster::start_with(Topology {
        gateways: 0,
        executors: 0,
        recoveries: 1,
        capability: "opaque",
        postgres_admin_url: Some(pg.admin_url()),
        ..Topology::default()
    })
    .await?;
    // the gateway releases an ended call's permit a second after the call, so the release
    // is the last commit of the step's story
    cluster
        .add_gateway_with(16, &[("Z29C_RELEASE_LINGER_MS", "1000")])
        .await?;
    cluster.add_executor_with(&[]).await?;
    let pool = cluster.db.pool(2).await?;

    // 1. A permit release lost: the step completes (its receipt waits for the disk), then
    //    the gateway releases the call's permit, and the server crashes.
    let writer = pg.stop_wal_writer().await?;
    let first = submit(&cluster, "first").await?;
    cluster
        .wait_all_ended(std::slice::from_ref(&first), Duration::from_secs(30))
        .await?;
    wait_for(
        &pool,
        "SELECT count(*) FROM adapter_permits WHERE state = 'released'",
        "the permit's release",
    )
    .await?;
    pg.crash_losing_unwritten_wal(writer).await?;
    let released = count(
        &pool,
        "SELECT count(*) FROM adapter_permits WHERE state = 'released'",
    )
    .await?;
    assert_eq!(released, 0, "the permit's release was lost in the crash");
    let completed = count(
        &pool,
        "SELECT count(*) FROM step_receipts r JOIN steps s ON s.id = r.step_id
         WHERE s.state = 'completed'",
    )
    .await?;
    assert_eq!(
        completed, 1,
        "the receipt, which waited for the disk, survived"
    );
    // a workflow a client may have seen completed stays completed
    let state: String =
        sqlx::query_scalar("SELECT state::text FROM workflows WHERE client_key = 'first'")
            .fetch_one(&pool)
            .await?;
    assert_eq!(state, "completed");

    // 2. A claim and an outbox mark lost: the step's hint is published and marked, the
    //    executor claims the step and stalls, and the server crashes. The executor, unaware,
    //    then calls with a lease PostgreSQL never kept.
    cluster
        .process("executor-1")
        .context("executor-1")?
        .kill()
        .await?;
    cluster
        .add_executor_with(&[("Z29C_FAULT_STALL_AFTER_CLAIM_MS", "3000")])
        .await?;
    let writer = pg.stop_wal_writer().await?;
    let second = submit(&cluster, "second").await?;
    cluster
        .wait_for_log(
            "executor-2",
            "fault: stalling after the claim",
            Duration::from_secs(30),
        )
        .await?;
    let claimed: Vec<uuid::Uuid> = sqlx::query_scalar(
        "SELECT a.id FROM attempts a JOIN steps s ON s.id = a.step_id
         JOIN workflows w ON w.id = s.workflow_id WHERE w.client_key = 'second'",
    )
    .fetch_all(&pool)
    .await?;
    assert_eq!(claimed.len(), 1, "claimed, in memory");
    let hint = "SELECT count(*) FROM outbox o JOIN workflows w ON w.id = o.workflow_id
                WHERE w.client_key = 'second' AND o.kind = 'step_ready'";
    // the relay may publish after the executor's poll found the step
    wait_for(
        &pool,
        &format!("SELECT (({hint}) = 0)::int::bigint"),
        "the hint's mark",
    )
    .await?;
    // the scheduler's relay would publish the hint again at once: it waits until it was seen
    cluster.process("scheduler").context("scheduler")?.pause()?;
    pg.crash_losing_unwritten_wal(writer).await?;
    // the executor may have claimed the step again since: that is another attempt
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM attempts WHERE id = $1")
        .bind(claimed[0])
        .fetch_one(&pool)
        .await?;
    assert_eq!(kept, 0, "the claim was lost in the crash");
    assert_eq!(
        count(&pool, hint).await?,
        1,
        "the hint's mark was lost in the crash"
    );
    cluster
        .process("scheduler")
        .context("scheduler")?
        .resume()?;

    let ids = [first, second];
    cluster
        .wait_all_ended(&ids, Duration::from_secs(60))
        .await?;
    // the stalled worker woke with a lease PostgreSQL never kept: the gateway's fence
    // refused its invocation, so nothing was sent under it
    let log = std::fs::read_to_string(cluster.dir().join("executor-2.log"))?;
    assert!(
        log.lines().any(|l| l.contains("invocation not begun")
            && l.contains("attempt is not the step's current attempt")),
        "the lost claim's call was refused before it was sent:\n{log}"
    );
    let ledger = cluster.ledger_pool().await?;
    let history = History::load(&pool, &ledger).await?;
    let violations = history.check(&Expect {
        capabilities: [("http".to_owned(), AdapterCapability::Opaque)].into(),
        permit_limit: 16,
        min_completed: 2,
    });
    assert!(violations.is_empty(), "{violations:#?}");
    // opaque: one request per step reached the destination, nothing more
    assert_eq!(
        count(&ledger, "SELECT count(*) FROM destination.requests").await?,
        2
    );
    pool.close().await;
    ledger.close().await;
    cluster.stop().await?;
    pg.stop().await;
    Ok(())
}
