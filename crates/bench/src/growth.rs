//! z29c as its tables grow: claim latency and drain throughput with 10k, 100k or 1M steps
//! waiting, and throughput minute by minute over a long steady run (dead tuples must not make
//! it decay; the autovacuum settings the schema needs are in `migrations/`).

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;
use z29c_core::OwnerId;

use super::{Mode, STEPS_PER_WORKFLOW, receipts, topology, workflow_named, z29c_cluster_of};
use z29c_scenarios::cluster::Cluster;

/// Steps per template workflow of the growth runs (the scheduler's `max_steps`).
const TEMPLATE_STEPS: usize = 1_000;

#[derive(Debug, Clone, Serialize)]
pub struct Growth {
    pub waiting: usize,
    pub load_seconds: f64,
    pub claims: usize,
    pub claim_p50_ms: f64,
    pub claim_p99_ms: f64,
    pub drained: usize,
    pub steps_per_second: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SteadyMinute {
    pub minute: usize,
    pub steps_per_second: f64,
    pub steps_dead_tuples: i64,
    pub tables_mib: f64,
    /// WAL written in the minute, and the share of it that was full-page images: the first
    /// change of a page after a checkpoint logs the whole page, so a minute after a checkpoint
    /// costs more than one before the first.
    pub wal_mib: f64,
    pub full_page_images: i64,
    /// Checkpoints (timed or requested) that began in the minute.
    pub checkpoints: i64,
    /// Workflows in the database at the minute's end (retention removes the old ones).
    pub workflows_kept: i64,
}

/// Retention for a steady run (recovery's `retention.period` and `retention.keep`).
#[derive(Debug, Clone, Serialize)]
pub struct Retention {
    #[serde(with = "humantime_serde")]
    pub period: Duration,
    #[serde(with = "humantime_serde")]
    pub keep: Duration,
}

/// The server's WAL and checkpoint counters, read at each minute's end.
#[derive(Clone, Copy, sqlx::FromRow)]
struct WalCounters {
    wal_bytes: f64,
    wal_fpi: i64,
    checkpoints: i64,
}

impl WalCounters {
    async fn read(pool: &sqlx::PgPool) -> Result<Self> {
        Ok(sqlx::query_as(
            "SELECT w.wal_bytes::float8 AS wal_bytes, w.wal_fpi,
                    b.checkpoints_timed + b.checkpoints_req AS checkpoints
             FROM pg_stat_wal w, pg_stat_bgwriter b",
        )
        .fetch_one(pool)
        .await?)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Steady {
    pub concurrency: usize,
    pub retention: Option<Retention>,
    pub minutes: Vec<SteadyMinute>,
    /// Mean of the last three minutes ÷ mean of minutes 2–4 (1.0 = no decay).
    pub last_over_first: f64,
}

fn ms(h: &hdrhistogram::Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1_000.0
}

/// Loads `waiting` ready steps (one template workflow submitted through the API, then copied
/// in SQL, `ANALYZE`d as a settled table would be), measures 200 single-step claims, then
/// drains `drain` of them with an executor of `concurrency` workers.
pub async fn z29c_growth(
    waiting: usize,
    concurrency: usize,
    drain: usize,
    say: &dyn Fn(&str),
) -> Result<Growth> {
    let mut cluster = Cluster::start_with(topology(0, Mode::Plain)?).await?;
    let result = async {
        cluster
            .set_faults("bench", serde_json::json!({ "ledger_off": true }))
            .await?;
        let pool = cluster.db.pool(2).await?;
        let start = Instant::now();
        cluster
            .client()
            .await?
            .submit(workflow_named("growth-0", TEMPLATE_STEPS))
            .await?;
        let copies = waiting.div_ceil(TEMPLATE_STEPS).saturating_sub(1) as i32;
        sqlx::query(
            "INSERT INTO workflows (id, client_key, submission_digest, name, state, deadline)
             SELECT z29c_uuid_v7(), 'growth-' || g, submission_digest, name, state, deadline
             FROM workflows, generate_series(1, $1) g WHERE client_key = 'growth-0'",
        )
        .bind(copies)
        .execute(&pool)
        .await?;
        sqlx::query(
            "INSERT INTO steps (id, workflow_id, name, position, adapter, operation, input,
                 input_digest, lease_ms, renew_every_ms, attempt_deadline_ms, final_grace_ms,
                 adapter_timeout_ms, max_attempts, state)
             SELECT gen_random_uuid(), w.id, t.name, t.position, t.adapter, t.operation, t.input,
                 t.input_digest, t.lease_ms, t.renew_every_ms, t.attempt_deadline_ms,
                 t.final_grace_ms, t.adapter_timeout_ms, t.max_attempts,
                 t.state
             FROM workflows w
             CROSS JOIN steps t
             WHERE w.client_key <> 'growth-0'
               AND t.workflow_id = (SELECT id FROM workflows WHERE client_key = 'growth-0')",
        )
        .execute(&pool)
        .await?;
        sqlx::query("ANALYZE workflows, steps")
            .execute(&pool)
            .await?;
        let load_seconds = start.elapsed().as_secs_f64();
        let ready: i64 = sqlx::query_scalar("SELECT count(*) FROM steps WHERE state = 'ready'")
            .fetch_one(&pool)
            .await?;
        say(&format!(
            "growth · {ready} steps waiting (loaded in {load_seconds:.0} s)"
        ));

        let store = cluster.db.store().await?;
        let probe = OwnerId::parse("bench-probe").context("owner")?;
        let mut h = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
        let claims = 200;
        for _ in 0..claims {
            let t = Instant::now();
            let got = store.claim(&probe, 1).await?;
            h.saturating_record(t.elapsed().as_micros() as u64);
            anyhow::ensure!(got.len() == 1, "a claim found no ready step");
        }
        let before = receipts(&pool).await?;
        let t = Instant::now();
        cluster
            .add_executor_with(&[
                ("Z29C_WORKERS", &concurrency.to_string()),
                ("Z29C_CLAIM_BATCH", &concurrency.min(64).to_string()),
            ])
            .await?;
        let mut done = 0;
        while done < drain && t.elapsed() < Duration::from_secs(300) {
            tokio::time::sleep(Duration::from_millis(50)).await;
            done = receipts(&pool).await? - before;
        }
        let steps_per_second = done as f64 / t.elapsed().as_secs_f64();
        pool.close().await;
        Ok(Growth {
            waiting: ready as usize,
            load_seconds,
            claims,
            claim_p50_ms: ms(&h, 0.5),
            claim_p99_ms: ms(&h, 0.99),
            drained: done,
            steps_per_second,
        })
    }
    .await;
    cluster.stop().await?;
    result
}

/// Keeps about `backlog` steps waiting (100-step workflows submitted as it drains) for
/// `duration`, and records throughput, dead tuples and table size each minute.
pub async fn z29c_steady(
    duration: Duration,
    concurrency: usize,
    backlog: usize,
    retention: Option<Retention>,
    say: &dyn Fn(&str),
) -> Result<Steady> {
    let mut t = topology(0, Mode::Plain)?;
    if let Some(r) = &retention {
        t.retention_period = r.period;
    }
    let mut cluster = z29c_cluster_of(concurrency, t).await?;
    if let Some(r) = &retention {
        let (period, keep) = (
            humantime::format_duration(r.period).to_string(),
            humantime::format_duration(r.keep).to_string(),
        );
        cluster
            .add_recovery_with(&[
                ("Z29C_RETENTION__PERIOD", period.as_str()),
                ("Z29C_RETENTION__KEEP", keep.as_str()),
            ])
            .await?;
    }
    let result = async {
        let pool = cluster.db.pool(2).await?;
        let mut client = cluster.client().await?;
        let start = Instant::now();
        let mut next_minute = start + Duration::from_secs(60);
        let mut last = receipts(&pool).await?;
        let mut last_wal = WalCounters::read(&pool).await?;
        let (mut minutes, mut submitted) = (Vec::new(), 0usize);
        // every minute of `duration` is recorded: a loop that stopped at `duration` itself
        // could miss the last one by the few milliseconds its own statements took
        let wanted = usize::try_from(duration.as_secs() / 60).unwrap_or(usize::MAX).max(1);
        while minutes.len() < wanted {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM steps WHERE state IN ('ready', 'leased')",
            )
            .fetch_one(&pool)
            .await?;
            let mut waiting = waiting as usize;
            while waiting < backlog {
                client
                    .submit(workflow_named(&format!("steady-{submitted}"), STEPS_PER_WORKFLOW))
                    .await?;
                submitted += 1;
                waiting += STEPS_PER_WORKFLOW;
            }
            if Instant::now() >= next_minute {
                let now = receipts(&pool).await?;
                let (dead, bytes, kept): (i64, i64, i64) = sqlx::query_as(
                    "SELECT (SELECT coalesce(sum(n_dead_tup), 0)::bigint FROM pg_stat_user_tables
                             WHERE relid IN (SELECT relid FROM pg_partition_tree('steps'))),
                            pg_database_size(current_database()),
                            (SELECT count(*) FROM workflows)",
                )
                .fetch_one(&pool)
                .await?;
                let wal = WalCounters::read(&pool).await?;
                let m = SteadyMinute {
                    minute: minutes.len() + 1,
                    steps_per_second: (now - last) as f64 / 60.0,
                    steps_dead_tuples: dead,
                    tables_mib: bytes as f64 / (1024.0 * 1024.0),
                    wal_mib: (wal.wal_bytes - last_wal.wal_bytes) / (1024.0 * 1024.0),
                    full_page_images: wal.wal_fpi - last_wal.wal_fpi,
                    checkpoints: wal.checkpoints - last_wal.checkpoints,
                    workflows_kept: kept,
                };
                say(&format!(
                    "steady · minute {}: {:.0} steps/s, {} dead tuples in steps, database {:.0} MiB, {} workflows kept, WAL {:.0} MiB ({} full-page images), {} checkpoint(s) began",
                    m.minute,
                    m.steps_per_second,
                    m.steps_dead_tuples,
                    m.tables_mib,
                    m.workflows_kept,
                    m.wal_mib,
                    m.full_page_images,
                    m.checkpoints
                ));
                minutes.push(m);
                last = now;
                last_wal = wal;
                next_minute += Duration::from_secs(60);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        pool.close().await;
        let mean = |ms: &[SteadyMinute]| {
            ms.iter().map(|m| m.steps_per_second).sum::<f64>() / ms.len().max(1) as f64
        };
        let first = &minutes[1.min(minutes.len())..4.min(minutes.len())];
        let last3 = &minutes[minutes.len().saturating_sub(3)..];
        Ok(Steady {
            concurrency,
            retention,
            // fewer than 4 minutes have no minutes 2–4 to compare with
            last_over_first: if minutes.len() < 4 {
                f64::NAN
            } else {
                mean(last3) / mean(first)
            },
            minutes,
        })
    }
    .await;
    cluster.stop().await?;
    result
}
