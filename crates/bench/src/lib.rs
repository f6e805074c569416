//! The benchmark harness: z29c end to end, side by side with the durable-execution engines
//! people would pick instead (Restate, DBOS: [`engines`]) and the Postgres queues they use
//! today (graphile-worker, pg-boss: [`peers`]), in alternating rounds (A B A B) so all see the
//! same machine. Figures only; nothing here asserts a time.
//!
//! Every system runs the same workload: workflows of 1 or of 5 steps, each step one HTTP POST
//! to the benchmark's own [`sink`] (z29c through its gateway). Measured per run: steps per
//! second to drain pre-loaded steps, the POSTs the sink received per step (the outside world's
//! count), PostgreSQL commits and WAL bytes per step (`pg_stat_database`,
//! `pg_current_wal_lsn()`), and the machine's time per step: CPU (all processes, from
//! `/proc/stat`) and bytes written to disk (`/proc/diskstats`), beside each process's peak RSS
//! and CPU seconds (`/proc`).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use z29c_proto::v1 as pb;

use z29c_scenarios::cluster::{Cluster, Topology};

pub mod engines;
pub mod growth;
pub mod peers;
pub mod plot;
pub mod sink;

/// One drain run of one system.
#[derive(Debug, Clone, Serialize)]
pub struct Drain {
    pub system: String,
    pub round: usize,
    pub concurrency: usize,
    pub steps: usize,
    pub seconds: f64,
    pub steps_per_second: f64,
    /// The drain hit its time cap: `steps` is what finished by then.
    pub capped: bool,
    pub commits_per_step: f64,
    pub wal_bytes_per_step: f64,
    /// WAL syncs per step (`pg_stat_wal.wal_sync`; server-wide, so a quiet server matters).
    pub fsyncs_per_step: f64,
    /// The machine's CPU time per step, every process's (the system's, PostgreSQL's, the
    /// sink's), from `/proc/stat`: busy time over the run's wall time, in milliseconds.
    pub machine_cpu_ms_per_step: f64,
    /// Bytes the machine wrote to its disks per step (`/proc/diskstats`): PostgreSQL's WAL
    /// and data files, or an engine's own log.
    pub disk_bytes_per_step: f64,
    /// Requests the sink received per step; none for a bare queue whose jobs send nothing.
    pub posts_per_step: Option<f64>,
    /// With `--profile-wal`: the run's WAL by record type, largest first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub wal_records: Vec<WalRecord>,
    /// (process, peak RSS MiB, CPU seconds)
    pub processes: Vec<(String, f64, f64)>,
}

/// PostgreSQL's counters, and the machine's, before and after a run.
#[derive(Debug, Clone)]
pub struct Counters {
    commits: i64,
    lsn: String,
    wal_syncs: i64,
    machine: Machine,
}

impl Counters {
    pub async fn take(pool: &sqlx::PgPool) -> Result<Self> {
        let (commits, lsn, wal_syncs) = sqlx::query_as(
            "SELECT xact_commit, pg_current_wal_lsn()::text,
                    (SELECT wal_sync FROM pg_stat_wal)
             FROM pg_stat_database WHERE datname = current_database()",
        )
        .fetch_one(pool)
        .await?;
        Ok(Self {
            commits,
            lsn,
            wal_syncs,
            machine: Machine::take()?,
        })
    }

    fn wal_bytes_since(&self, before: &Self) -> f64 {
        fn lsn(v: &str) -> f64 {
            let (hi, lo) = v.split_once('/').unwrap_or(("0", "0"));
            (u64::from_str_radix(hi, 16).unwrap_or(0) * (1 << 32)
                + u64::from_str_radix(lo, 16).unwrap_or(0)) as f64
        }
        lsn(&self.lsn) - lsn(&before.lsn)
    }
}

/// One kind of WAL record of a run (`pg_walinspect`), per step.
#[derive(Debug, Clone, Serialize)]
pub struct WalRecord {
    /// Resource manager and record type, e.g. `Heap/HOT_UPDATE`, `Btree/INSERT_LEAF`.
    pub kind: String,
    pub records_per_step: f64,
    /// Bytes per step, full-page images included.
    pub bytes_per_step: f64,
    /// Of which full-page images.
    pub fpi_bytes_per_step: f64,
}

static PROFILE_WAL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Every drain from here on also reads its WAL by record type ([`WalRecord`]).
pub fn profile_wal() {
    PROFILE_WAL.store(true, std::sync::atomic::Ordering::Relaxed);
}

impl Counters {
    /// With `--profile-wal`, the WAL between `before` and `self` by record type, per step
    /// (the whole server's: a quiet server matters), largest first; none, said why, where it
    /// cannot be read (no superuser, the WAL already recycled).
    pub async fn wal_records(
        &self,
        pool: &sqlx::PgPool,
        before: &Self,
        steps: usize,
    ) -> Result<Vec<WalRecord>> {
        if !PROFILE_WAL.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(Vec::new());
        }
        match self.read_wal_records(pool, before, steps).await {
            Ok(records) => Ok(records),
            Err(e) => {
                z29c_scenarios::say(&format!("no WAL profile: {e:#}"));
                Ok(Vec::new())
            }
        }
    }

    async fn read_wal_records(
        &self,
        pool: &sqlx::PgPool,
        before: &Self,
        steps: usize,
    ) -> Result<Vec<WalRecord>> {
        sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            .execute(pool)
            .await
            .context("pg_walinspect (PostgreSQL 15's contrib; a superuser's connection)")?;
        let rows: Vec<(String, i64, i64, i64)> = sqlx::query_as(
            "SELECT \"resource_manager/record_type\", count, combined_size, fpi_size
             FROM pg_get_wal_stats($1::pg_lsn, $2::pg_lsn, true)
             WHERE count > 0 ORDER BY combined_size DESC",
        )
        .bind(&before.lsn)
        .bind(&self.lsn)
        .fetch_all(pool)
        .await?;
        let per = |v: i64| v as f64 / steps.max(1) as f64;
        Ok(rows
            .into_iter()
            .map(|(kind, count, bytes, fpi)| WalRecord {
                kind,
                records_per_step: per(count),
                bytes_per_step: per(bytes),
                fpi_bytes_per_step: per(fpi),
            })
            .collect())
    }
}

/// The machine's busy CPU time and disk writes so far.
#[derive(Debug, Clone, Copy, Default)]
pub struct Machine {
    /// Clock ticks (USER_HZ, 100 per second on Linux) spent in user, nice, system, irq,
    /// softirq and steal, over all CPUs.
    busy_ticks: u64,
    /// Sectors (512 bytes) written to the machine's disks (not loop, RAM or zram devices).
    sectors_written: u64,
}

impl Machine {
    pub fn take() -> Result<Self> {
        let stat = std::fs::read_to_string("/proc/stat").context("/proc/stat")?;
        let cpu: Vec<u64> = stat
            .lines()
            .find(|l| l.starts_with("cpu "))
            .context("/proc/stat has no cpu line")?
            .split_whitespace()
            .skip(1)
            .map(|v| v.parse().unwrap_or(0))
            .collect();
        // user nice system idle iowait irq softirq steal
        let busy_ticks = [0, 1, 2, 5, 6, 7]
            .iter()
            .map(|&i| cpu.get(i).copied().unwrap_or(0))
            .sum();
        let disks: Vec<String> = std::fs::read_dir("/sys/block")
            .map(|d| {
                d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .filter(|n| !["loop", "ram", "zram"].iter().any(|p| n.starts_with(p)))
                    .collect()
            })
            .unwrap_or_default();
        let sectors_written = std::fs::read_to_string("/proc/diskstats")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (disks.iter().any(|d| Some(&d.as_str()) == f.get(2)))
                    .then(|| f.get(9)?.parse::<u64>().ok())
                    .flatten()
            })
            .sum();
        Ok(Self {
            busy_ticks,
            sectors_written,
        })
    }

    /// CPU seconds and bytes written since `before`.
    pub fn since(&self, before: &Self) -> (f64, f64) {
        (
            self.busy_ticks.saturating_sub(before.busy_ticks) as f64 / 100.0,
            self.sectors_written.saturating_sub(before.sectors_written) as f64 * 512.0,
        )
    }
}

impl Drain {
    /// A run of a system that keeps nothing in PostgreSQL: no commits or WAL of its own to
    /// count (`NaN`, shown as "-"), the machine's time as for every system.
    #[allow(clippy::too_many_arguments)]
    pub fn without_postgres(
        system: &str,
        round: usize,
        concurrency: usize,
        steps: usize,
        seconds: f64,
        capped: bool,
        before: &Machine,
        after: &Machine,
        processes: Vec<(String, f64, f64)>,
    ) -> Self {
        let per = |v: f64| v / steps.max(1) as f64;
        let (cpu, disk) = after.since(before);
        Self {
            system: system.into(),
            round,
            concurrency,
            steps,
            seconds,
            steps_per_second: steps as f64 / seconds,
            capped,
            commits_per_step: f64::NAN,
            wal_bytes_per_step: f64::NAN,
            fsyncs_per_step: f64::NAN,
            machine_cpu_ms_per_step: per(cpu * 1_000.0),
            disk_bytes_per_step: per(disk),
            posts_per_step: None,
            wal_records: Vec::new(),
            processes,
        }
    }

    /// `harness_queries`: the harness's own autocommit reads in the window, not counted.
    #[allow(clippy::too_many_arguments)]
    pub fn from_counters(
        system: &str,
        round: usize,
        concurrency: usize,
        steps: usize,
        seconds: f64,
        capped: bool,
        before: &Counters,
        after: &Counters,
        harness_queries: usize,
        processes: Vec<(String, f64, f64)>,
    ) -> Self {
        let per = |v: f64| v / steps.max(1) as f64;
        Self {
            commits_per_step: per((after.commits - before.commits - harness_queries as i64) as f64),
            wal_bytes_per_step: per(after.wal_bytes_since(before)),
            fsyncs_per_step: per((after.wal_syncs - before.wal_syncs) as f64),
            ..Self::without_postgres(
                system,
                round,
                concurrency,
                steps,
                seconds,
                capped,
                &before.machine,
                &after.machine,
                processes,
            )
        }
    }
}

/// Schedule-to-start latency of one system under an open-loop load.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    pub system: String,
    /// Fraction of the system's drain rate offered; 0 for a fixed rate (`bench --rate`).
    pub load: f64,
    pub rate: f64,
    pub sent: usize,
    pub started: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    /// Where the time went (z29c): each leg's p50 and p99 in ms, from PostgreSQL's
    /// transaction start times of the submission, the claim and *invocation began*.
    pub legs: Vec<Leg>,
    /// The slowest jobs (z29c), slowest first: when each was meant to be sent, in seconds
    /// from the first send, and its latency. Shows whether the tail is a moment (a warm-up, a
    /// stall) or spread over the run.
    pub slowest: Vec<Slow>,
    /// The load's first seconds, run but not counted above.
    pub warmup: Warmup,
}

impl Latency {
    /// The load as the report names it: a percentage of the drain, or `fixed` for a rate
    /// given on the command line.
    pub fn load_label(&self) -> String {
        if self.load > 0.0 {
            format!("{:.0}%", self.load * 100.0)
        } else {
            "fixed".to_owned()
        }
    }
}

/// The first seconds of an open-loop run: offered like the rest, not counted in its
/// percentiles, for every system alike. A fresh process opens its connections and prepares its
/// statements on its first jobs (z29c's gateway also creates an operation class's permit slots
/// on its first call), once in its life; a steady figure must not be a cold start's. What the
/// warm-up cost is reported beside the figures, not hidden.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Warmup {
    pub seconds: f64,
    /// Jobs meant to be sent in the warm-up, and started.
    pub jobs: usize,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Warmup {
    /// Splits `(seconds from the first send, latency ms)` at `seconds`: the latencies counted,
    /// and the warm-up's summary.
    pub fn split(samples: &[(f64, f64)], seconds: f64) -> Result<(Vec<f64>, Self)> {
        let ms = |cold: bool| -> Vec<f64> {
            samples
                .iter()
                .filter(|(at, _)| (*at < seconds) == cold)
                .map(|&(_, ms)| ms)
                .collect()
        };
        let (cold, warm) = (ms(true), ms(false));
        let summary = if cold.is_empty() {
            Self {
                seconds,
                ..Self::default()
            }
        } else {
            let l = latency_from("warm-up", 0.0, 0.0, cold.len(), &cold)?;
            Self {
                seconds,
                jobs: cold.len(),
                p99_ms: l.p99_ms,
                max_ms: l.max_ms,
            }
        };
        Ok((warm, summary))
    }

    /// Of `total` jobs sent open-loop at `rate` (job i due i/rate s after the first), how many
    /// are due after `seconds` of warm-up: the jobs counted.
    pub fn counted(total: usize, rate: f64, seconds: f64) -> usize {
        total.saturating_sub((seconds * rate).ceil() as usize)
    }

    /// `warm-up 2 s (96 jobs, not counted): p99 127.9 ms, max 212.9 ms`
    pub fn describe(&self) -> String {
        format!(
            "warm-up {:.0} s ({} jobs, not counted): p99 {:.1} ms, max {:.1} ms",
            self.seconds, self.jobs, self.p99_ms, self.max_ms
        )
    }
}

/// One slow job: intended send time (seconds from the first) and its latency.
#[derive(Debug, Clone, Serialize)]
pub struct Slow {
    pub at_s: f64,
    pub ms: f64,
}

impl Slow {
    /// The `n` slowest of `(at_s, ms)`, slowest first.
    pub fn slowest(mut all: Vec<Slow>, n: usize) -> Vec<Slow> {
        all.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        all.truncate(n);
        all
    }

    /// `120.0 ms at 0.1 s, 98.3 ms at 0.2 s, …`
    pub fn describe(slow: &[Slow]) -> String {
        slow.iter()
            .map(|s| format!("{:.1} ms at {:.1} s", s.ms, s.at_s))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// One leg of schedule-to-start.
#[derive(Debug, Clone, Serialize)]
pub struct Leg {
    pub leg: String,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

impl Leg {
    fn from(leg: &str, ms: &[f64]) -> Result<Self> {
        let l = latency_from(leg, 0.0, 0.0, ms.len(), ms)?;
        Ok(Self {
            leg: leg.into(),
            p50_ms: l.p50_ms,
            p99_ms: l.p99_ms,
        })
    }
}

/// Builds a [`Latency`] from milliseconds per started job (HDR histogram, µs resolution).
pub fn latency_from(
    system: &str,
    load: f64,
    rate: f64,
    sent: usize,
    ms: &[f64],
) -> Result<Latency> {
    let mut h = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
    for v in ms {
        h.saturating_record((v.max(0.0) * 1_000.0).round() as u64);
    }
    let q = |q: f64| h.value_at_quantile(q) as f64 / 1_000.0;
    Ok(Latency {
        system: system.into(),
        load,
        rate,
        sent,
        started: ms.len(),
        p50_ms: q(0.5),
        p99_ms: q(0.99),
        p999_ms: q(0.999),
        max_ms: h.max() as f64 / 1_000.0,
        legs: Vec::new(),
        slowest: Vec::new(),
        warmup: Warmup::default(),
    })
}

/// Time from SIGKILL of a worker holding steps to their re-claim and their completion.
#[derive(Debug, Clone, Serialize)]
pub struct Reclaim {
    pub system: String,
    pub held: usize,
    pub lease_seconds: f64,
    /// The last of the held steps taken again, seconds after the kill.
    pub reclaimed_after: Option<f64>,
    /// The last of them completed, seconds after the kill.
    pub completed_after: Option<f64>,
    pub note: String,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// The PostgreSQL every system ran on: version and the settings that decide its speed.
    pub server: String,
    pub drains: Vec<Drain>,
    pub latencies: Vec<Latency>,
    pub reclaims: Vec<Reclaim>,
    pub growth: Vec<growth::Growth>,
    pub steady: Option<growth::Steady>,
    /// The steady run again, with retention.
    pub steady_retention: Option<growth::Steady>,
}

/// Steps per submitted workflow of the growth and steady runs: independent, so all are ready
/// at once.
pub const STEPS_PER_WORKFLOW: usize = 100;

/// A workflow of `steps` steps, each after the one before (as an engine's handler runs its
/// steps one after another), each one POST through the `http` adapter.
pub(crate) fn chained(key: &str, steps: usize) -> pb::SubmitRequest {
    let mut w = workflow_named(key, steps);
    for (i, step) in w.steps.iter_mut().enumerate().skip(1) {
        step.depends_on = vec![format!("s{}", i - 1)];
    }
    w
}

pub(crate) fn workflow_named(key: &str, steps: usize) -> pb::SubmitRequest {
    pb::SubmitRequest {
        client_key: key.to_owned(),
        name: key.to_owned(),
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

/// Peak RSS (MiB) and CPU seconds of a live process, from `/proc`.
pub(crate) fn proc_usage(pid: i32) -> Option<(f64, f64)> {
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

/// Drains `steps` pre-loaded steps, in workflows of `shape` chained steps, through one
/// executor running `concurrency` attempts; every step POSTs to `sink` through the gateway,
/// whose `http` adapter declares it opaque (the sink de-duplicates nothing). The drain ends at
/// the last receipt; the sink's count says how many requests reached it per step.
///
/// `mode`: how the services commit (see [`Mode`]); the system is reported by its name and
/// shape (`z29c 5-step`).
pub async fn z29c_drain(
    round: usize,
    steps: usize,
    shape: usize,
    concurrency: usize,
    cap: Duration,
    mode: Mode,
    sink: &sink::Sink,
) -> Result<Drain> {
    let shape = shape.max(1);
    let system = format!("{} {shape}-step", mode.name());
    let mut cluster = Cluster::start_with(Topology {
        gateways: 0,
        ..topology(0, mode)?
    })
    .await?;
    let result = async {
        cluster
            .add_gateway_serving(
                &format!(
                    "[[adapters]]\nname = \"http\"\nversion = \"sink/1\"\nbase_url = \"{}\"\n\
                     capability = \"opaque\"\ndefault_limit = 4096\nsafety_window_ms = 5000\n",
                    sink.url()
                ),
                &[],
            )
            .await?;
        let pool = cluster.db.pool(2).await?;
        let mut client = cluster.client().await?;
        let workflows = steps.div_ceil(shape);
        for i in 0..workflows {
            let n = shape.min(steps - i * shape);
            client
                .submit(chained(&format!("bench-{i}"), n))
                .await
                .with_context(|| format!("preload workflow {i}"))?;
        }
        // let the stats of the preload settle before counting
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let before = Counters::take(&pool).await?;
        let posts_before = sink.received();
        let start = Instant::now();
        cluster
            .add_executor_with(&[
                ("Z29C_WORKERS", &concurrency.to_string()),
                ("Z29C_CLAIM_BATCH", &concurrency.min(64).to_string()),
            ])
            .await?;
        let mut polls = 0;
        let mut done;
        loop {
            done = receipts(&pool).await?;
            polls += 1;
            if done >= steps || start.elapsed() > cap {
                break;
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
        let machine_after = Machine::take()?;
        let posts = sink.received() - posts_before;
        // backends flush their statistics within a second of going idle
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let mut after = Counters::take(&pool).await?;
        after.machine = machine_after;
        let mut d = Drain::from_counters(
            &system,
            round,
            concurrency,
            done,
            seconds,
            done < steps,
            &before,
            &after,
            polls + 1,
            processes,
        );
        d.posts_per_step = Some(posts as f64 / done.max(1) as f64);
        d.wal_records = after.wal_records(&pool, &before, done).await?;
        pool.close().await;
        anyhow::Ok(d)
    }
    .await;
    cluster.stop().await?;
    result
}

/// Receipts committed so far: those kept, and those retention dropped (each drop's audit row
/// counts what it removed).
pub(crate) async fn receipts(pool: &sqlx::PgPool) -> Result<usize> {
    let n: i64 = sqlx::query_scalar(
        "SELECT ((SELECT count(*) FROM step_receipts)
                 + (SELECT coalesce(sum((detail::jsonb -> 'removed' ->> 'step_receipts')::bigint), 0)
                    FROM audit_log WHERE action = 'drop'))::bigint",
    )
    .fetch_one(pool)
    .await?;
    Ok(n as usize)
}

/// A cluster whose destination does no-op work, with one executor of `concurrency` workers.
/// How z29c's services commit in a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The defaults: every write its own transaction, except that a gateway's permit releases
    /// ride on its next permit's transaction (`release_linger_ms`, 5 ms).
    Plain,
    /// Every write its own `COMMIT`, permit releases included (`Z29C_RELEASE_LINGER_MS=0`).
    Eager,
}

impl Mode {
    pub const ALL: [Mode; 2] = [Mode::Plain, Mode::Eager];

    /// The system's name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Plain => "z29c",
            Mode::Eager => "z29c-eager",
        }
    }

    pub fn parse(system: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| m.name() == system)
    }

    fn env(self) -> Vec<(String, String)> {
        vec![(
            "Z29C_RELEASE_LINGER_MS".into(),
            if self == Mode::Eager { "0" } else { "5" }.into(),
        )]
    }
}

pub(crate) fn topology(recoveries: usize, mode: Mode) -> Result<Topology> {
    Ok(Topology {
        gateways: 1,
        executors: 0,
        recoveries,
        // far above any concurrency measured: the limit never binds, and its slots are few
        permit_limit: 4_096,
        env: mode.env(),
        // the services' database URL says `sslmode` as the harness's pools have it
        postgres_admin_url: Some(z29c_scenarios::with_sslmode(
            &z29c_scenarios::database_url(),
            CLIENT_TLS.1,
        )?),
        ..Topology::default()
    })
}

pub(crate) async fn z29c_cluster(
    concurrency: usize,
    recoveries: usize,
    mode: Mode,
) -> Result<Cluster> {
    z29c_cluster_of(concurrency, topology(recoveries, mode)?).await
}

/// [`z29c_cluster`] of the processes `t` names.
pub(crate) async fn z29c_cluster_of(concurrency: usize, t: Topology) -> Result<Cluster> {
    let mut cluster = Cluster::start_with(t).await?;
    cluster
        .set_faults("bench", serde_json::json!({ "ledger_off": true }))
        .await?;
    cluster
        .add_executor_with(&[
            ("Z29C_WORKERS", &concurrency.to_string()),
            ("Z29C_CLAIM_BATCH", &concurrency.min(64).to_string()),
        ])
        .await?;
    Ok(cluster)
}

fn epoch_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
        * 1_000.0
}

/// z29c's schedule-to-start latency: one-step workflows submitted open-loop at `rate` per
/// second for `warmup` + `seconds`; latency is from each submission's intended time to its
/// *invocation began*, counted for the jobs meant to be sent after the [`Warmup`].
pub async fn z29c_latency(
    mode: Mode,
    concurrency: usize,
    load: f64,
    rate: f64,
    warmup: u64,
    seconds: u64,
) -> Result<Latency> {
    let cluster = z29c_cluster(concurrency, 0, mode).await?;
    let result = async {
        let pool = cluster.db.pool(2).await?;
        let client = cluster.client().await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let total = (rate * (warmup + seconds) as f64).round() as usize;
        let (t0, e0) = (
            tokio::time::Instant::now() + Duration::from_millis(200),
            epoch_ms() + 200.0,
        );
        let mut intended = Vec::with_capacity(total);
        let mut sends = tokio::task::JoinSet::new();
        for i in 0..total {
            let offset = i as f64 / rate;
            tokio::time::sleep_until(t0 + Duration::from_secs_f64(offset)).await;
            intended.push(e0 + offset * 1_000.0);
            let mut client = client.clone();
            sends.spawn(async move { client.submit(workflow_named(&format!("lat-{i}"), 1)).await });
        }
        let mut failed = 0;
        while let Some(r) = sends.join_next().await {
            if !matches!(r, Ok(Ok(_))) {
                failed += 1;
            }
        }
        let until = Instant::now() + Duration::from_secs(60);
        while receipts(&pool).await? + failed < total && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let began: Vec<(String, f64, f64, f64)> = sqlx::query_as(
            "SELECT w.client_key, extract(epoch FROM w.created_at)::float8 * 1000,
                    extract(epoch FROM a.created_at)::float8 * 1000,
                    extract(epoch FROM a.invocation_began_at)::float8 * 1000
             FROM attempts a JOIN workflows w ON w.id = a.workflow_id
             WHERE a.number = 1 AND a.invocation_began_at IS NOT NULL",
        )
        .fetch_all(&pool)
        .await?;
        pool.close().await;
        let (mut submit, mut claim, mut invoke) = (vec![], vec![], vec![]);
        let mut all = Vec::with_capacity(began.len());
        for (key, submitted, claimed, at) in began {
            let Some(sent) = key
                .strip_prefix("lat-")
                .and_then(|i| i.parse::<usize>().ok())
                .and_then(|i| intended.get(i))
            else {
                continue;
            };
            let at_s = (sent - e0) / 1_000.0;
            all.push((at_s, at - sent));
            if at_s >= warmup as f64 {
                submit.push(submitted - sent);
                claim.push(claimed - submitted);
                invoke.push(at - claimed);
            }
        }
        let (ms, warm) = Warmup::split(&all, warmup as f64)?;
        let counted = Warmup::counted(total, rate, warmup as f64);
        let mut l = latency_from(mode.name(), load, rate, counted, &ms)?;
        l.warmup = warm;
        l.legs = vec![
            Leg::from("intended send → submission's transaction", &submit)?,
            Leg::from("submission → claim's transaction", &claim)?,
            Leg::from("claim → invocation began (gateway)", &invoke)?,
        ];
        let after: Vec<Slow> = all
            .into_iter()
            .filter(|(at_s, _)| *at_s >= warmup as f64)
            .map(|(at_s, ms)| Slow { at_s, ms })
            .collect();
        l.slowest = Slow::slowest(after, 8);
        Ok(l)
    }
    .await;
    cluster.stop().await?;
    result
}

/// z29c at a 5 s lease: an executor holding `held` steps (their destination call hangs) is
/// SIGKILLed while a second executor runs; how long until recovery re-claims them, and until
/// their receipts.
pub async fn z29c_reclaim(held: usize) -> Result<Reclaim> {
    let mut cluster = z29c_cluster(held, 1, Mode::Plain).await?;
    let result = async {
        let pool = cluster.db.pool(2).await?;
        cluster
            .set_faults(
                "bench",
                serde_json::json!({ "ledger_off": true, "delay_ms": 600_000 }),
            )
            .await?;
        let mut request = workflow_named("reclaim", held);
        for s in &mut request.steps {
            s.policy = Some(pb::LeasePolicy {
                lease_ms: 5_000,
                renew_every_ms: 1_000,
                attempt_deadline_ms: 120_000,
                final_grace_ms: 1_000,
                adapter_timeout_ms: 60_000,
                max_attempts: 3,
                ..Default::default()
            });
        }
        cluster.client().await?.submit(request).await?;
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let began: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM attempts WHERE invocation_began_at IS NOT NULL",
            )
            .fetch_one(&pool)
            .await?;
            if began as usize >= held {
                break;
            }
            if Instant::now() > until {
                bail!("only {began} of {held} steps began");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        cluster
            .add_executor_with(&[("Z29C_WORKERS", &held.to_string())])
            .await?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        cluster
            .set_faults("bench", serde_json::json!({ "ledger_off": true }))
            .await?;
        let killed_at = chrono::Utc::now();
        cluster
            .process("executor-1")
            .context("executor-1")?
            .kill()
            .await?;
        let start = Instant::now();
        while receipts(&pool).await? < held && start.elapsed() < Duration::from_secs(120) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let (reclaimed, completed): (Option<f64>, Option<f64>) = sqlx::query_as(
            "SELECT (SELECT extract(epoch FROM max(first) - $1)::float8 FROM (
                        SELECT min(at) AS first FROM step_events
                        WHERE at > $1 AND kind IN ('recovery_lease_acquired', 'lease_acquired')
                        GROUP BY step_id) f),
                    (SELECT extract(epoch FROM max(committed_at) - $1)::float8
                     FROM step_receipts)",
        )
        .bind(killed_at)
        .fetch_one(&pool)
        .await?;
        pool.close().await;
        Ok(Reclaim {
            system: "z29c".into(),
            held,
            lease_seconds: 5.0,
            reclaimed_after: reclaimed,
            completed_after: completed,
            note: "re-claim = recovery's lease on the step (it fences the dead worker, then \
                   retries with the same request identity: the adapter is idempotent)"
                .into(),
        })
    }
    .await;
    cluster.stop().await?;
    result
}

/// How every system of a run reaches PostgreSQL: without TLS, whatever the server offers. The
/// peers' Node driver connects in plain text unless told otherwise, while libpq (psycopg, for
/// DBOS) and sqlx (z29c) encrypt whenever the server has TLS on, as Debian's does: one side
/// paid for TLS (8 % of PostgreSQL's CPU in a z29c latency run) and the other did not. The
/// peers and DBOS get this variable; z29c's services get it as their URL's `sslmode`
/// ([`topology`]: the database URLs the harness makes name their `sslmode`, which wins over
/// the variable).
pub(crate) const CLIENT_TLS: (&str, &str) = ("PGSSLMODE", "disable");

/// The server's version and the settings that decide its speed, as one line, with how the
/// systems connect ([`CLIENT_TLS`]).
pub async fn server_settings() -> Result<String> {
    let pool = sqlx::PgPool::connect(&z29c_scenarios::database_url()).await?;
    let line: String = sqlx::query_scalar(
        "SELECT current_setting('server_version') || ': ' || string_agg(name || '=' || setting, ', ' ORDER BY name)
         FROM pg_settings
         WHERE name IN ('autovacuum', 'fsync', 'synchronous_commit', 'shared_buffers',
                        'max_connections', 'wal_level', 'checkpoint_timeout', 'max_wal_size',
                        'ssl')",
    )
    .fetch_one(&pool)
    .await?;
    pool.close().await;
    Ok(format!(
        "{line}; every system connects without TLS ({}={})",
        CLIENT_TLS.0, CLIENT_TLS.1
    ))
}

/// `v` with `digits` decimals, or `-` for a figure a system has not (`NaN`).
pub fn or_dash(v: f64, digits: usize) -> String {
    if v.is_nan() {
        "-".to_owned()
    } else {
        format!("{v:.digits$}")
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

impl Report {
    /// Medians over rounds of one system at one concurrency.
    pub fn drain_median(&self, system: &str, concurrency: usize) -> Option<Drain> {
        let ds: Vec<&Drain> = self
            .drains
            .iter()
            .filter(|d| d.system == system && d.concurrency == concurrency)
            .collect();
        let first = (*ds.first()?).clone();
        let m = |f: fn(&Drain) -> f64| median(ds.iter().map(|d| f(d)).collect());
        Some(Drain {
            steps_per_second: m(|d| d.steps_per_second),
            commits_per_step: m(|d| d.commits_per_step),
            wal_bytes_per_step: m(|d| d.wal_bytes_per_step),
            fsyncs_per_step: m(|d| d.fsyncs_per_step),
            machine_cpu_ms_per_step: m(|d| d.machine_cpu_ms_per_step),
            disk_bytes_per_step: m(|d| d.disk_bytes_per_step),
            // the most any round saw: one round's duplicate shows
            posts_per_step: ds
                .iter()
                .filter_map(|d| d.posts_per_step)
                .fold(None, |m: Option<f64>, p| Some(m.map_or(p, |m| m.max(p)))),
            capped: ds.iter().any(|d| d.capped),
            processes: ds.iter().flat_map(|d| d.processes.iter().cloned()).fold(
                Vec::<(String, f64, f64)>::new(),
                |mut acc, (name, rss, cpu)| {
                    match acc.iter_mut().find(|p| p.0 == name) {
                        Some(p) => {
                            p.1 = p.1.max(rss);
                            p.2 = p.2.max(cpu);
                        }
                        None => acc.push((name, rss, cpu)),
                    }
                    acc
                },
            ),
            ..first
        })
    }

    /// z29c's ratios at concurrency `c` against the engines and the queue making the same
    /// POST, as the targets in docs/performance.md name them.
    pub fn targets(&self, c: usize) -> String {
        let mut out = String::new();
        let rate = |s: &str| self.drain_median(s, c).map(|d| d.steps_per_second);
        for shape in [1, 5] {
            let Some(z) = rate(&format!("z29c {shape}-step")) else {
                continue;
            };
            for other in ["restate", "dbos"] {
                if let Some(o) = rate(&format!("{other} {shape}-step")).filter(|o| *o > 0.0) {
                    out.push_str(&format!(
                        "{c:>11} | z29c ÷ {other}, {shape}-step workflows: {:.2}\n",
                        z / o
                    ));
                }
            }
        }
        if let (Some(z), Some(g)) = (
            self.drain_median("z29c 1-step", c),
            self.drain_median("graphile-worker POST", c),
        ) {
            out.push_str(&format!(
                "{c:>11} | z29c 1-step ÷ graphile-worker POST: {:.2} × its steps/s, {:.2} × its machine CPU per step; z29c WAL {:.0} B/step\n",
                z.steps_per_second / g.steps_per_second,
                z.machine_cpu_ms_per_step / g.machine_cpu_ms_per_step,
                z.wal_bytes_per_step,
            ));
        }
        out
    }

    pub fn systems(&self) -> Vec<String> {
        let mut v: Vec<String> = Vec::new();
        for d in &self.drains {
            if !v.contains(&d.system) {
                v.push(d.system.clone());
            }
        }
        v
    }

    pub fn concurrencies(&self) -> Vec<usize> {
        let mut cs: Vec<usize> = self.drains.iter().map(|d| d.concurrency).collect();
        cs.sort_unstable();
        cs.dedup();
        cs
    }

    /// The tables: drains per concurrency and system (medians over rounds) with the machine's
    /// time per step, z29c's ratios against the others, then latency and re-claim.
    pub fn table(&self) -> String {
        let mut out = format!("PostgreSQL: {}\n", self.server);
        out.push_str(
            "concurrency | system                | steps/s | POSTs/step | commits/step | WAL B/step | machine CPU ms/step | disk B/step | peak RSS MiB (max process)\n\
             ------------|-----------------------|---------|------------|--------------|------------|---------------------|-------------|---------------------------\n",
        );
        for c in self.concurrencies() {
            for system in self.systems() {
                let Some(d) = self.drain_median(&system, c) else {
                    continue;
                };
                let rss = d.processes.iter().map(|p| p.1).fold(0.0, f64::max);
                out.push_str(&format!(
                    "{c:>11} | {system:<21} | {:>7.0}{} | {:>10} | {:>12} | {:>10} | {:>19.3} | {:>11.0} | {rss:>26.1}\n",
                    d.steps_per_second,
                    if d.capped { "*" } else { "" },
                    d.posts_per_step.map_or("-".to_owned(), |p| format!("{p:.3}")),
                    or_dash(d.commits_per_step, 2),
                    or_dash(d.wal_bytes_per_step, 0),
                    d.machine_cpu_ms_per_step,
                    d.disk_bytes_per_step,
                ));
            }
            out.push_str(&self.targets(c));
            for system in self.systems() {
                let Some(d) = self.drains.iter().find(|d| {
                    d.system == system && d.concurrency == c && !d.wal_records.is_empty()
                }) else {
                    continue;
                };
                out.push_str(&format!(
                    "{c:>11} | {system}, WAL by record type (round {}): records/step, B/step (of which full-page images)\n",
                    d.round
                ));
                for r in d.wal_records.iter().take(12) {
                    out.push_str(&format!(
                        "            |   {:<32} {:>6.2} {:>7.0} ({:.0})\n",
                        r.kind, r.records_per_step, r.bytes_per_step, r.fpi_bytes_per_step
                    ));
                }
            }
        }
        out.push_str(&format!(
            "medians over {} rounds (A B A B: each system in turn, per concurrency); * = stopped at the time cap\n",
            self.drains.iter().map(|d| d.round).max().unwrap_or(0)
        ));
        if !self.latencies.is_empty() {
            out.push_str(
                "\nschedule-to-start, open loop | load  | jobs/s | sent | started | p50 ms | p99 ms | p99.9 ms | max ms\n\
                 -----------------------------|-------|--------|------|---------|--------|--------|----------|-------\n",
            );
            for l in &self.latencies {
                out.push_str(&format!(
                    "{:<28} | {:>5} | {:>6.0} | {:>4} | {:>7} | {:>6.1} | {:>6.1} | {:>8.1} | {:>6.1}\n",
                    l.system, l.load_label(), l.rate, l.sent, l.started, l.p50_ms, l.p99_ms, l.p999_ms, l.max_ms
                ));
                for leg in &l.legs {
                    out.push_str(&format!(
                        "  {:<44} p50 {:>6.1} ms · p99 {:>6.1} ms\n",
                        leg.leg, leg.p50_ms, leg.p99_ms
                    ));
                }
                if !l.slowest.is_empty() {
                    out.push_str(&format!("  slowest: {}\n", Slow::describe(&l.slowest)));
                }
                if l.warmup.seconds > 0.0 {
                    out.push_str(&format!("  {}\n", l.warmup.describe()));
                }
            }
        }
        if !self.reclaims.is_empty() {
            out.push_str(
                "\nworker SIGKILLed holding steps | held | lease/expiry s | re-claimed after s | completed after s\n\
                 -------------------------------|------|----------------|--------------------|------------------\n",
            );
            let s = |v: Option<f64>| v.map_or("never".to_owned(), |v| format!("{v:.2}"));
            for r in &self.reclaims {
                out.push_str(&format!(
                    "{:<30} | {:>4} | {:>14.1} | {:>18} | {:>17}\n",
                    r.system,
                    r.held,
                    r.lease_seconds,
                    s(r.reclaimed_after),
                    s(r.completed_after)
                ));
            }
            out.push_str("graphile-worker: no expiry to measure (a crashed worker's locked jobs are freed after 4 hours)\n");
        }
        if !self.growth.is_empty() {
            out.push_str(
                "\nz29c, steps waiting | claim p50 ms | claim p99 ms | drain steps/s (after the claims)\n\
                 --------------------|--------------|--------------|--------------------------------\n",
            );
            for g in &self.growth {
                out.push_str(&format!(
                    "{:>19} | {:>12.2} | {:>12.2} | {:>6.0} ({} steps)\n",
                    g.waiting, g.claim_p50_ms, g.claim_p99_ms, g.steps_per_second, g.drained
                ));
            }
        }
        for st in self.steady.iter().chain(&self.steady_retention) {
            let per_minute = |f: &dyn Fn(&growth::SteadyMinute) -> String| {
                st.minutes.iter().map(f).collect::<Vec<_>>().join(" ")
            };
            out.push_str(&format!(
                "\nz29c steady run, concurrency {}, {}: {} minutes; steps/s per minute: {}; last 3 ÷ minutes 2–4 = {:.2}\n  database MiB at each minute's end: {}\n  workflows kept: {}\n",
                st.concurrency,
                st.retention.as_ref().map_or("no retention".to_owned(), |r| format!(
                    "retention {} in periods of {}",
                    humantime::format_duration(r.keep),
                    humantime::format_duration(r.period)
                )),
                st.minutes.len(),
                per_minute(&|m| format!("{:.0}", m.steps_per_second)),
                st.last_over_first,
                per_minute(&|m| format!("{:.0}", m.tables_mib)),
                per_minute(&|m| m.workflows_kept.to_string()),
            ));
        }
        out
    }
}

/// The `top` statements by total server time since the server started (pg_stat_statements),
/// as a table: share of all statement time, calls, mean ms, rows per call, shared buffers hit
/// per call (a statement that walks past dead or locked rows shows here before it shows in
/// time), and the statement.
pub async fn statement_profile(admin_url: &str, top: i64) -> Result<String> {
    let pool = sqlx::PgPool::connect(admin_url).await?;
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&pool)
        .await?;
    let rows: Vec<(f64, i64, f64, f64, f64, String)> = sqlx::query_as(
        "SELECT 100 * total_exec_time / sum(total_exec_time) OVER (), calls, mean_exec_time,
                rows::float8 / greatest(calls, 1),
                shared_blks_hit::float8 / greatest(calls, 1),
                regexp_replace(query, '\\s+', ' ', 'g')
         FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT $1",
    )
    .bind(top)
    .fetch_all(&pool)
    .await?;
    pool.close().await;
    let mut out = String::from(
        "\nstatements by server time (pg_stat_statements, every system of this run)\n\
         share % |    calls |  mean ms | rows/call | hits/call | statement\n",
    );
    for (share, calls, mean, per_call, hits, query) in rows {
        let query: String = query.chars().take(150).collect();
        out.push_str(&format!(
            "{share:7.1} | {calls:8} | {mean:8.3} | {per_call:9.1} | {hits:9.1} | {query}\n"
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_warm_up_is_split_off_by_intended_send_time_and_summarised() {
        // 10 jobs/s for 3 s: the first 2 s are the warm-up, and the slow ones sit there
        let rate = 10.0;
        let samples: Vec<(f64, f64)> = (0..30)
            .map(|i| {
                let at = f64::from(i) / rate;
                (at, if i < 3 { 200.0 + f64::from(i) } else { 5.0 })
            })
            .collect();
        let (counted, warm) = Warmup::split(&samples, 2.0).unwrap();
        assert_eq!(counted.len(), 10);
        assert!(counted.iter().all(|&ms| ms == 5.0));
        assert_eq!(warm.jobs, 20);
        assert!((warm.max_ms - 202.0).abs() < 0.5, "{}", warm.max_ms);
        assert_eq!(Warmup::counted(30, rate, 2.0), 10);
        // a rate whose warm-up ends between two jobs: job 7 (at 2.1875 s) is the first counted
        assert_eq!(Warmup::counted(32, 3.2, 2.0), 25);
        let (none, cold) = Warmup::split(&samples, 0.0).unwrap();
        assert_eq!((none.len(), cold.jobs), (30, 0));
    }

    #[test]
    fn the_slowest_jobs_come_slowest_first_with_when_they_were_sent() {
        let all = [(0.1, 3.0), (4.0, 90.0), (2.5, 40.0), (7.0, 1.0)]
            .map(|(at_s, ms)| Slow { at_s, ms })
            .to_vec();
        let slow = Slow::slowest(all, 2);
        assert_eq!(Slow::describe(&slow), "90.0 ms at 4.0 s, 40.0 ms at 2.5 s");
    }

    #[test]
    fn a_fixed_rate_is_reported_as_fixed_not_as_zero_percent() {
        let scaled = latency_from("z29c", 0.5, 300.0, 3, &[1.0, 2.0, 3.0]).unwrap();
        let fixed = latency_from("z29c", 0.0, 200.0, 3, &[1.0, 2.0, 3.0]).unwrap();
        assert_eq!(scaled.load_label(), "50%");
        assert_eq!(fixed.load_label(), "fixed");
        let report = Report {
            latencies: vec![scaled, fixed],
            ..Report::default()
        };
        let table = report.table();
        assert!(table.contains("|   50% |    300 |"), "{table}");
        assert!(table.contains("| fixed |    200 |"), "{table}");
        let fixed_row = table.lines().find(|l| l.contains("|    200 |")).unwrap();
        assert!(!fixed_row.contains('%'), "{table}");
    }
}
