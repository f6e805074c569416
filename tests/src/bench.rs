//! The benchmark harness (issue 7, first part): z29c's drain throughput end to end, side by
//! side with the physical limit of the same PostgreSQL, in alternating rounds (A B A B) so
//! both see the same machine. Figures only; nothing here asserts a time.
//!
//! Measured per run: steps per second to drain `steps` pre-loaded steps (scheduler →
//! JetStream → executor → gateway over gRPC → destination over HTTP → receipt), PostgreSQL
//! commits and WAL bytes per completed step (`pg_stat_database`, `pg_current_wal_lsn()`),
//! and each process's peak RSS and CPU seconds (`/proc`). The floor is `pgbench` running a
//! one-row durable update at the same client count (TPS_floor); L = TPS_floor ÷
//! commits-per-step is what z29c could reach if commits were all it paid for.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use z29c_proto::v1 as pb;

use crate::TestDatabase;
use crate::cluster::{Cluster, Topology};

/// One drain run of one system.
#[derive(Debug, Clone, Serialize)]
pub struct Drain {
    pub system: String,
    pub round: usize,
    pub concurrency: usize,
    pub steps: usize,
    pub seconds: f64,
    pub steps_per_second: f64,
    pub commits_per_step: f64,
    pub wal_bytes_per_step: f64,
    /// (process, peak RSS MiB, CPU seconds)
    pub processes: Vec<(String, f64, f64)>,
}

/// One pgbench run: the one-row durable transaction rate.
#[derive(Debug, Clone, Serialize)]
pub struct Floor {
    pub round: usize,
    pub clients: usize,
    pub tps: f64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    pub drains: Vec<Drain>,
    pub floors: Vec<Floor>,
}

/// Steps per submitted workflow: independent, so all are ready at once.
const STEPS_PER_WORKFLOW: usize = 100;

fn workflow(i: usize, steps: usize) -> pb::SubmitRequest {
    pb::SubmitRequest {
        client_key: format!("bench-{i}"),
        name: format!("bench {i}"),
        steps: (0..steps)
            .map(|s| pb::StepDefinition {
                name: format!("s{s}"),
                adapter: "http".into(),
                operation: "bench".into(),
                input_json: "{}".into(),
                depends_on: vec![],
                policy: None,
            })
            .collect(),
        deadline: None,
    }
}

async fn pg_counters(pool: &sqlx::PgPool) -> Result<(i64, String)> {
    Ok(sqlx::query_as(
        "SELECT xact_commit, pg_current_wal_lsn()::text
         FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(pool)
    .await?)
}

/// Peak RSS (MiB) and CPU seconds of a live process, from `/proc`.
fn proc_usage(pid: i32) -> Option<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let hwm_kib: f64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // fields after the command name (which may hold spaces) start after the last ')'
    let rest: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = rest.get(11)?.parse::<f64>().ok()? + rest.get(12)?.parse::<f64>().ok()?;
    Some((hwm_kib / 1024.0, ticks / 100.0))
}

/// Drains `steps` pre-loaded steps through one executor running `concurrency` attempts.
pub async fn z29c_drain(round: usize, steps: usize, concurrency: usize) -> Result<Drain> {
    let mut cluster = Cluster::start_with(Topology {
        gateways: 1,
        executors: 0,
        permit_limit: 100_000,
        ..Topology::default()
    })
    .await?;
    let result = async {
        let pool = cluster.db.pool(2).await?;
        let mut client = cluster.client().await?;
        let workflows = steps.div_ceil(STEPS_PER_WORKFLOW);
        for i in 0..workflows {
            let n = STEPS_PER_WORKFLOW.min(steps - i * STEPS_PER_WORKFLOW);
            client
                .submit(workflow(i, n))
                .await
                .with_context(|| format!("preload workflow {i}"))?;
        }
        // let the stats of the preload settle before counting
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let (commits0, lsn0) = pg_counters(&pool).await?;
        let start = Instant::now();
        cluster
            .add_executor_with(&[
                ("Z29C_WORKERS", &concurrency.to_string()),
                ("Z29C_CLAIM_BATCH", &concurrency.min(64).to_string()),
            ])
            .await?;
        loop {
            let done: i64 = sqlx::query_scalar("SELECT count(*) FROM step_receipts")
                .fetch_one(&pool)
                .await?;
            if done as usize >= steps {
                break;
            }
            if start.elapsed() > Duration::from_secs(1_800) {
                bail!("{done} of {steps} steps drained after 30 min");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let seconds = start.elapsed().as_secs_f64();
        let processes = cluster
            .processes()
            .filter_map(|p| {
                let (rss, cpu) = proc_usage(p.pid()?)?;
                Some((p.name.clone(), rss, cpu))
            })
            .collect();
        // backends flush their statistics within a second of going idle
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let (commits1, lsn1) = pg_counters(&pool).await?;
        let wal: f64 = sqlx::query_scalar("SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::float8")
            .bind(&lsn1)
            .bind(&lsn0)
            .fetch_one(&pool)
            .await?;
        pool.close().await;
        anyhow::Ok(Drain {
            system: "z29c".into(),
            round,
            concurrency,
            steps,
            seconds,
            steps_per_second: steps as f64 / seconds,
            commits_per_step: (commits1 - commits0) as f64 / steps as f64,
            wal_bytes_per_step: wal / steps as f64,
            processes,
        })
    }
    .await;
    cluster.stop().await?;
    result
}

/// `pgbench` at `clients` running a one-row durable update for `seconds`.
pub async fn pgbench_floor(round: usize, clients: usize, seconds: u64) -> Result<Floor> {
    let db = TestDatabase::create().await?;
    let result = async {
        // libpq's URI, without sqlx's own query parameters
        let url = db.url().split('?').next().unwrap_or_default().to_owned();
        let init = tokio::process::Command::new("pgbench")
            .args(["-i", "-q", "-s", "1", &url])
            .output()
            .await
            .context("pgbench (Debian's postgresql-contrib or postgresql client)")?;
        if !init.status.success() {
            bail!("pgbench -i: {}", String::from_utf8_lossy(&init.stderr));
        }
        let script = std::env::temp_dir().join(format!("z29c-floor-{}.sql", uuid::Uuid::new_v4()));
        std::fs::write(
            &script,
            "\\set aid random(1, 100000)\nUPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;\n",
        )?;
        let out = tokio::process::Command::new("pgbench")
            .args([
                "-n",
                "-c",
                &clients.to_string(),
                "-j",
                &clients.min(2).to_string(),
                "-T",
                &seconds.to_string(),
                "-f",
                &script.to_string_lossy(),
                &url,
            ])
            .output()
            .await?;
        let _ = std::fs::remove_file(&script);
        let text = String::from_utf8_lossy(&out.stdout);
        let tps = text
            .lines()
            .find_map(|l| l.strip_prefix("tps = "))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
            .with_context(|| format!("no tps in pgbench's output: {text}"))?;
        anyhow::Ok(Floor {
            round,
            clients,
            tps,
        })
    }
    .await;
    db.drop_now().await?;
    result
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

impl Report {
    /// The table: per concurrency, medians over rounds, and z29c against L.
    pub fn table(&self) -> String {
        let mut out = String::from(
            "concurrency | z29c steps/s | commits/step | WAL B/step | pgbench TPS_floor | L = floor÷commits | z29c ÷ L | peak RSS MiB (max)\n\
             ------------|--------------|--------------|------------|-------------------|-------------------|----------|-------------------\n",
        );
        let mut cs: Vec<usize> = self.drains.iter().map(|d| d.concurrency).collect();
        cs.sort_unstable();
        cs.dedup();
        for c in cs {
            let ds: Vec<&Drain> = self.drains.iter().filter(|d| d.concurrency == c).collect();
            let rate = median(ds.iter().map(|d| d.steps_per_second).collect());
            let commits = median(ds.iter().map(|d| d.commits_per_step).collect());
            let wal = median(ds.iter().map(|d| d.wal_bytes_per_step).collect());
            let floor = median(
                self.floors
                    .iter()
                    .filter(|f| f.clients == c)
                    .map(|f| f.tps)
                    .collect(),
            );
            let l = floor / commits;
            let rss = ds
                .iter()
                .flat_map(|d| d.processes.iter().map(|p| p.1))
                .fold(0.0, f64::max);
            out.push_str(&format!(
                "{c:>11} | {rate:>12.0} | {commits:>12.2} | {wal:>10.0} | {floor:>17.0} | {l:>17.0} | {:>8.2} | {rss:>6.1}\n",
                rate / l
            ));
        }
        out.push_str(&format!(
            "medians over {} rounds (A B A B: pgbench, then z29c, per concurrency)\n",
            self.floors.iter().map(|f| f.round).max().unwrap_or(0)
        ));
        out
    }
}
