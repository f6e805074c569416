//! `z29c-bench`: z29c measured against the durable-execution engines (Restate, DBOS) and the
//! Postgres queues (graphile-worker, pg-boss) people would use instead, on one machine in one
//! run, so every figure has its baseline beside it (docs/performance.md).
//!
//! ```text
//! cargo build --release -p z29c-cli -p z29c-bench
//! target/release/z29c-bench --steps 20000 --concurrency 32 --rounds 3 --parts drain
//! ```

use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use z29c_scenarios::{say, stop_signal};

#[tokio::main]
async fn main() -> Result<()> {
    let args = BenchArgs::parse();
    // A signal drops the run, and with it every process it started (all are `kill_on_drop`):
    // a stopped bench leaves no PostgreSQL or z29c service behind.
    tokio::select! {
        out = bench(args) => out,
        signal = stop_signal() => bail!("stopped by {signal}; the processes it started were killed"),
    }
}

#[derive(Parser)]
#[command(
    name = "z29c-bench",
    about = "z29c side by side with Restate, DBOS, graphile-worker and pg-boss, every step one POST to the benchmark's own HTTP sink: drain throughput and machine time per step (A B A B), open-loop schedule-to-start latency, re-claim after SIGKILL, growth and a steady run"
)]
struct BenchArgs {
    /// Steps (jobs) pre-loaded before each drain.
    #[arg(long, default_value_t = 20_000)]
    steps: usize,
    /// Concurrencies (attempts, invocations or jobs at once), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [32usize])]
    concurrency: Vec<usize>,
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Workflow shapes drained, comma-separated: steps per workflow, run one after another,
    /// each step one POST to the sink. The queues' jobs are one step each.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 5])]
    shapes: Vec<usize>,
    /// Systems to run, comma-separated: z29c, z29c-eager (every write its own commit, permit
    /// releases included), restate, dbos, graphile-worker, pg-boss. A queue runs twice: with
    /// no-op jobs, and with jobs that make the sink's POST.
    #[arg(long, value_delimiter = ',', default_values_t = ["z29c".to_owned(), "restate".to_owned(), "dbos".to_owned(), "graphile-worker".to_owned(), "pg-boss".to_owned()])]
    systems: Vec<String>,
    /// Parts to run, comma-separated: drain, latency, reclaim, growth, steady, and
    /// steady-retention (the steady run again, with `--retention-keep` and
    /// `--retention-period`).
    #[arg(long, value_delimiter = ',', default_values_t = ["drain".to_owned(), "latency".to_owned(), "reclaim".to_owned(), "growth".to_owned(), "steady".to_owned()])]
    parts: Vec<String>,
    /// Steps waiting in the growth runs, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [10_000usize, 100_000, 1_000_000])]
    growth: Vec<usize>,
    /// Length of the steady run.
    #[arg(long, default_value = "20m", value_parser = humantime::parse_duration)]
    steady: Duration,
    /// Retention of the steady-retention run: how long a finished workflow is kept.
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    retention_keep: Duration,
    /// Retention period of the steady-retention run.
    #[arg(long, default_value = "1m", value_parser = humantime::parse_duration)]
    retention_period: Duration,
    /// A drain stops here; its rate is what finished by then.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    cap: Duration,
    /// Open-loop loads, as fractions of each system's drain rate.
    #[arg(long, value_delimiter = ',', default_values_t = [0.5f64, 0.8])]
    loads: Vec<f64>,
    /// Offer every system this many jobs per second in the open-loop part, instead of
    /// `--loads` times its own drain rate (no drain is run to scale by): for comparing two
    /// builds at one load, when their drains differ by the machine's noise.
    #[arg(long, value_name = "JOBS_PER_SECOND")]
    rate: Option<f64>,
    /// Open-loop run length, seconds, counted after the warm-up.
    #[arg(long, default_value_t = 20)]
    latency_seconds: u64,
    /// Open-loop warm-up, seconds: offered like the rest of the load, not counted in the
    /// percentiles (its p99 and max are printed beside them), for every system alike.
    #[arg(long, default_value_t = 2)]
    latency_warmup: u64,
    /// Run every system on a PostgreSQL of the benchmark's own (initdb; durable, autovacuum
    /// on) instead of DATABASE_URL's server.
    #[arg(long)]
    private_postgres: bool,
    /// A setting of the benchmark's own PostgreSQL (`name=value`, as `postgres -c` takes it;
    /// repeatable; implies --private-postgres), e.g. `shared_buffers=1GB`. Every system runs
    /// on the same server, so every system gets it.
    #[arg(long = "pg-setting", value_name = "NAME=VALUE")]
    pg_settings: Vec<String>,
    /// Profile the statements (implies --private-postgres, with pg_stat_statements loaded):
    /// prints, at the end, the statements that took the most server time, with their calls,
    /// mean time and rows, over every system the run measured.
    #[arg(long)]
    profile_statements: bool,
    /// Read each drain's WAL by record type (`pg_walinspect`) and print the largest kinds
    /// per step, full-page images apart.
    #[arg(long)]
    profile_wal: bool,
    /// Where the JSON report goes; the plot goes beside it (`.svg`).
    #[arg(long, default_value = "target/bench/bench.json")]
    out: std::path::PathBuf,
}

async fn bench(a: BenchArgs) -> Result<()> {
    use z29c_scenarios::infra::{DURABLE_SETTINGS, PrivatePostgres};
    if let Some(bad) = a.pg_settings.iter().find(|s| {
        s.split_once('=')
            .is_none_or(|(name, value)| name.trim().is_empty() || value.trim().is_empty())
    }) {
        bail!("--pg-setting: {bad:?} is not NAME=VALUE");
    }
    if !a.private_postgres && !a.profile_statements && a.pg_settings.is_empty() {
        return bench_on(a).await;
    }
    say("starting a PostgreSQL of the benchmark's own (initdb; durable, autovacuum on)…");
    let mut settings = DURABLE_SETTINGS.to_vec();
    settings.extend(a.pg_settings.iter().map(String::as_str));
    if a.profile_statements {
        settings.extend([
            "shared_preload_libraries=pg_stat_statements",
            "pg_stat_statements.track=all",
        ]);
    }
    let pg = PrivatePostgres::start_with(&settings).await?;
    z29c_scenarios::use_server(pg.admin_url());
    let profile = a.profile_statements;
    let mut result = bench_on(a).await;
    if profile && result.is_ok() {
        result = z29c_bench::statement_profile(&pg.admin_url(), 30)
            .await
            .map(|table| say(&table));
    }
    pg.stop().await;
    result
}

/// One-step workflows drained to scale z29c's open-loop load by.
const ONE_STEP_DRAIN: usize = 3_000;

async fn bench_on(a: BenchArgs) -> Result<()> {
    use z29c_bench::{self as bench, peers::Peer};
    if a.profile_wal {
        bench::profile_wal();
    }
    if a.steps == 0 || a.concurrency.contains(&0) || a.rounds == 0 || a.shapes.contains(&0) {
        bail!("--steps, --concurrency, --rounds and --shapes must be positive");
    }
    let mut peers_wanted = Vec::new();
    for s in &a.systems {
        match s.as_str() {
            s if bench::Mode::parse(s).is_some() => {}
            "restate" | "dbos" => {}
            "graphile-worker" => peers_wanted.push(Peer::GraphileWorker),
            "pg-boss" => peers_wanted.push(Peer::PgBoss),
            other => bail!(
                "--systems: unknown system {other:?} (z29c, z29c-eager, restate, dbos, graphile-worker, pg-boss)"
            ),
        }
    }
    let wants = |system: &str| a.systems.iter().any(|s| s == system);
    for p in &a.parts {
        if ![
            "drain",
            "latency",
            "reclaim",
            "growth",
            "steady",
            "steady-retention",
        ]
        .contains(&p.as_str())
        {
            bail!(
                "--parts: unknown part {p:?} (drain, latency, reclaim, growth, steady, \
                 steady-retention)"
            );
        }
    }
    if let Some(l) = a.loads.iter().find(|l| !(**l > 0.0 && **l <= 1.0)) {
        bail!("--loads: {l} is not a fraction in (0, 1]");
    }
    if let Some(r) = a.rate.filter(|r| !(r.is_finite() && *r >= 1.0)) {
        bail!("--rate: {r} is not a number of jobs per second of at least 1");
    }
    let dir = a
        .out
        .parent()
        .unwrap_or(std::path::Path::new("."))
        .to_owned();
    std::fs::create_dir_all(&dir)?;
    let z29c = a.systems.iter().any(|s| s == "z29c");
    let peers = if peers_wanted.is_empty() && !wants("restate") {
        None
    } else {
        say("installing Restate, graphile-worker and pg-boss (npm ci)…");
        Some(bench::peers::Peers::install(&dir).await?)
    };
    let dbos = if wants("dbos") {
        say("installing DBOS (a venv of its own, pip)…");
        Some(bench::engines::Dbos::install(&dir).await?)
    } else {
        None
    };
    let sink = bench::sink::Sink::start().await?;
    let part = |p: &str| a.parts.iter().any(|x| x == p);
    let mut report = bench::Report {
        server: bench::server_settings().await?,
        ..bench::Report::default()
    };
    say(&format!("PostgreSQL {}", report.server));
    let save = |report: &bench::Report| -> Result<()> {
        std::fs::write(&a.out, serde_json::to_string_pretty(report)?)?;
        Ok(())
    };
    let line = |d: &bench::Drain| {
        say(&format!(
            "round {} · {} concurrency {}: {} steps in {:.1} s = {:.0} steps/s{}, {} POSTs/step, {} commits/step, {} WAL B/step, {:.2} machine CPU ms/step, {:.0} disk B/step",
            d.round,
            d.system,
            d.concurrency,
            d.steps,
            d.seconds,
            d.steps_per_second,
            if d.capped { " (time cap)" } else { "" },
            d.posts_per_step
                .map_or("no".to_owned(), |p| format!("{p:.3}")),
            bench::or_dash(d.commits_per_step, 2),
            bench::or_dash(d.wal_bytes_per_step, 0),
            d.machine_cpu_ms_per_step,
            d.disk_bytes_per_step,
        ))
    };
    if part("drain") {
        for round in 1..=a.rounds {
            for &c in &a.concurrency {
                for &shape in &a.shapes {
                    for mode in bench::Mode::ALL {
                        if !wants(mode.name()) {
                            continue;
                        }
                        let d =
                            bench::z29c_drain(round, a.steps, shape, c, a.cap, mode, &sink).await?;
                        line(&d);
                        report.drains.push(d);
                    }
                    if wants("restate") {
                        let peers = peers.as_ref().context("Restate installed")?;
                        let d = bench::engines::restate_drain(
                            peers, round, a.steps, shape, c, a.cap, &sink,
                        )
                        .await?;
                        line(&d);
                        report.drains.push(d);
                    }
                    if let Some(dbos) = &dbos {
                        let d = bench::engines::dbos_drain(
                            dbos, round, a.steps, shape, c, a.cap, &sink,
                        )
                        .await?;
                        line(&d);
                        report.drains.push(d);
                    }
                    save(&report)?;
                }
                for &p in &peers_wanted {
                    let peers = peers.as_ref().context("peers installed")?;
                    for posting in [None, Some(&sink)] {
                        let d = bench::peers::drain(peers, p, round, a.steps, c, a.cap, posting)
                            .await?;
                        line(&d);
                        report.drains.push(d);
                    }
                }
                save(&report)?;
            }
        }
    }
    if part("latency") {
        let c = a.concurrency.iter().copied().max().unwrap_or(8);
        // a fixed rate is one load for every system; its fraction of a drain is not known (0)
        let loads = match a.rate {
            Some(_) => vec![0.0],
            None => a.loads.clone(),
        };
        for &load in &loads {
            for system in &a.systems {
                if system == "restate" || system == "dbos" {
                    // drains only: no open-loop producer drives them here
                    continue;
                }
                let rate = match a.rate {
                    Some(rate) => rate,
                    None => {
                        // the offered rate is a fraction of the system's own drain rate in
                        // this run, of the same shape as the load: one job per enqueue. For
                        // z29c that is a drain of one-step workflows (each step pays for its
                        // workflow's submission and completion too), measured once per system
                        let mut scale_by = system.clone();
                        if let Some(mode) = bench::Mode::parse(system) {
                            scale_by = format!("{system} 1-step");
                            if report.drain_median(&scale_by, c).is_none() {
                                let n = a.steps.min(ONE_STEP_DRAIN);
                                let d = bench::z29c_drain(1, n, 1, c, a.cap, mode, &sink).await?;
                                line(&d);
                                report.drains.push(d);
                                save(&report)?;
                            }
                        }
                        let Some(drain) = report.drain_median(&scale_by, c) else {
                            say(&format!(
                                "latency: no {system} drain at concurrency {c} to scale the load by; skipped"
                            ));
                            continue;
                        };
                        (drain.steps_per_second * load).max(1.0)
                    }
                };
                let l = match bench::Mode::parse(system) {
                    Some(mode) => {
                        bench::z29c_latency(
                            mode,
                            c,
                            load,
                            rate,
                            a.latency_warmup,
                            a.latency_seconds,
                        )
                        .await?
                    }
                    None => {
                        let other = system.as_str();
                        let p = if other == "pg-boss" {
                            Peer::PgBoss
                        } else {
                            Peer::GraphileWorker
                        };
                        let peers = peers.as_ref().context("peers installed")?;
                        bench::peers::latency(
                            peers,
                            p,
                            c,
                            load,
                            rate,
                            a.latency_warmup,
                            a.latency_seconds,
                        )
                        .await?
                    }
                };
                say(&format!(
                    "latency · {system} at {} ({rate:.0}/s): p50 {:.1} ms, p99 {:.1} ms, p99.9 {:.1} ms ({} of {} started)",
                    l.load_label(),
                    l.p50_ms,
                    l.p99_ms,
                    l.p999_ms,
                    l.started,
                    l.sent
                ));
                for leg in &l.legs {
                    say(&format!(
                        "  {}: p50 {:.1} ms, p99 {:.1} ms",
                        leg.leg, leg.p50_ms, leg.p99_ms
                    ));
                }
                if !l.slowest.is_empty() {
                    say(&format!("  slowest: {}", bench::Slow::describe(&l.slowest)));
                }
                if l.warmup.seconds > 0.0 {
                    say(&format!("  {}", l.warmup.describe()));
                }
                report.latencies.push(l);
                save(&report)?;
            }
        }
    }
    if part("reclaim") {
        let held = 8;
        if z29c {
            let r = bench::z29c_reclaim(held).await?;
            say(&format!(
                "re-claim · z29c: {:?} s, completed {:?} s after SIGKILL",
                r.reclaimed_after, r.completed_after
            ));
            report.reclaims.push(r);
        }
        if peers_wanted.contains(&Peer::PgBoss) {
            let peers = peers.as_ref().context("peers installed")?;
            let r = bench::peers::reclaim(peers, held).await?;
            say(&format!(
                "re-claim · pg-boss: {:?} s, completed {:?} s after SIGKILL",
                r.reclaimed_after, r.completed_after
            ));
            report.reclaims.push(r);
        }
        save(&report)?;
    }
    let c = a.concurrency.iter().copied().max().unwrap_or(8);
    if part("growth") && z29c {
        for &waiting in &a.growth {
            let g = bench::growth::z29c_growth(waiting, c, 5_000, &say).await?;
            say(&format!(
                "growth · {} waiting: claim p50 {:.2} ms, p99 {:.2} ms; {:.0} steps/s",
                g.waiting, g.claim_p50_ms, g.claim_p99_ms, g.steps_per_second
            ));
            report.growth.push(g);
            save(&report)?;
        }
    }
    if part("steady") && z29c {
        report.steady = Some(bench::growth::z29c_steady(a.steady, c, 3_000, None, &say).await?);
        save(&report)?;
    }
    if part("steady-retention") && z29c {
        let retention = bench::growth::Retention {
            period: a.retention_period,
            keep: a.retention_keep,
        };
        report.steady_retention =
            Some(bench::growth::z29c_steady(a.steady, c, 3_000, Some(retention), &say).await?);
        save(&report)?;
    }
    say(&report.table());
    save(&report)?;
    say(&format!("report: {}", a.out.display()));
    let svg = a.out.with_extension("svg");
    match bench::plot::write(&report, &svg) {
        Ok(()) => say(&format!("plot: {}", svg.display())),
        Err(e) => say(&format!("no plot: {e:#}")),
    }
    Ok(())
}
