//! The durable-execution engines z29c is compared with, run on this machine beside it:
//!
//! - **Restate** (`@restatedev/restate-server` and the TypeScript SDK from npm, pinned in
//!   `crates/bench/peers/package-lock.json`): its own server, which keeps its journal in its
//!   own log (RocksDB), and a service endpoint whose handler runs the workflow's steps as
//!   durable `ctx.run`s, each one POST to the sink.
//! - **DBOS** (`dbos` from PyPI, every package pinned in
//!   `crates/bench/peers/dbos-requirements.txt`, in a venv of the benchmark's own): workflows
//!   of `@DBOS.step`s, each one POST to the sink, enqueued on a DBOS queue in a database of
//!   the same PostgreSQL z29c uses.
//!
//! Both are drained as z29c is: the work is loaded first, and the drain's clock starts when it
//! may begin. Restate's steps count as done when the sink has received their POSTs (its last
//! journal entry follows each by a moment; the POSTs per step are counted again once the work
//! has settled, so a step sent twice shows); DBOS's when DBOS marks the workflow a success.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use serde_json::json;

use super::peers::{Peers, stop};
use super::sink::Sink;
use super::{Counters, Drain, Machine, proc_usage};
use z29c_scenarios::TestDatabase;

/// A free TCP port of 127.0.0.1 (bound, then let go).
fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn epoch_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
        * 1_000.0
}

/// Waits until `url` answers 2xx, for up to `within`.
async fn answers(url: &str, within: Duration) -> Result<()> {
    let http = reqwest::Client::new();
    let until = Instant::now() + within;
    loop {
        if let Ok(r) = http.get(url).send().await
            && r.status().is_success()
        {
            return Ok(());
        }
        if Instant::now() > until {
            bail!("{url} did not answer within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until something listens on `port` of 127.0.0.1, for up to `within`.
async fn listening(port: u16, within: Duration) -> Result<()> {
    let until = Instant::now() + within;
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        if Instant::now() > until {
            bail!("nothing listens on port {port} after {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// How long loading `jobs` invocations may take before they fall due: Restate's ingress
/// takes a few thousand sends a second here, so this is generous, and a load that overruns it
/// fails the run rather than counting loading as draining.
fn restate_lead(jobs: usize) -> Duration {
    Duration::from_secs(5) + Duration::from_micros(1_500 * jobs as u64)
}

/// Drains `steps` steps of Restate, in invocations of `shape` steps, at `concurrency`
/// invocations at once (the invoker's `concurrent-invocations-limit`; everything else as the
/// server ships).
#[allow(clippy::too_many_arguments)]
pub async fn restate_drain(
    peers: &Peers,
    round: usize,
    steps: usize,
    shape: usize,
    concurrency: usize,
    cap: Duration,
    sink: &Sink,
) -> Result<Drain> {
    let shape = shape.max(1);
    let jobs = steps.div_ceil(shape);
    let base = peers
        .logs()
        .join(format!("restate-{}", uuid::Uuid::new_v4()));
    let (ingress, admin, node, endpoint) = (free_port()?, free_port()?, free_port()?, free_port()?);
    let log = peers.log("restate-server")?;
    let server = tokio::process::Command::new(peers.restate_server()?)
        .arg("--no-logo")
        .env("RESTATE_BASE_DIR", &base)
        .env(
            "RESTATE_INGRESS__BIND_ADDRESS",
            format!("127.0.0.1:{ingress}"),
        )
        .env("RESTATE_ADMIN__BIND_ADDRESS", format!("127.0.0.1:{admin}"))
        .env("RESTATE_BIND_ADDRESS", format!("127.0.0.1:{node}"))
        .env(
            "RESTATE_WORKER__INVOKER__CONCURRENT_INVOCATIONS_LIMIT",
            concurrency.to_string(),
        )
        .env("RESTATE_DISABLE_TELEMETRY", "true")
        .env("RESTATE_LOG_FILTER", "warn")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .context("restate-server (installed by npm ci)")?;
    let service = peers
        .node(
            "restate",
            "serve",
            json!({ "port": endpoint, "sink": format!("{}/restate", sink.url()) }),
        )?
        .spawn()?;
    let result = async {
        answers(
            &format!("http://127.0.0.1:{admin}/health"),
            Duration::from_secs(60),
        )
        .await?;
        listening(endpoint, Duration::from_secs(30)).await?;
        let due_at = epoch_ms() + restate_lead(jobs).as_millis() as f64;
        let status = peers
            .node(
                "restate",
                "load",
                json!({
                    "admin": format!("http://127.0.0.1:{admin}"),
                    "ingress": format!("http://127.0.0.1:{ingress}"),
                    "endpoint": format!("http://127.0.0.1:{endpoint}"),
                    "jobs": jobs,
                    "steps": shape,
                    "dueAt": due_at,
                }),
            )?
            .status()
            .await?;
        if !status.success() {
            bail!(
                "restate load failed ({status}); see {}",
                peers.logs().join("restate.log").display()
            );
        }
        let wait = due_at - epoch_ms();
        if wait > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(wait / 1_000.0)).await;
        }
        let before = Machine::take()?;
        let posts_before = sink.received();
        let start = Instant::now();
        let mut posted;
        loop {
            posted = (sink.received() - posts_before) as usize;
            if posted >= steps || start.elapsed() > cap {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let seconds = start.elapsed().as_secs_f64();
        let after = Machine::take()?;
        let processes = [
            ("restate-server", server.id()),
            ("node endpoint", service.id()),
        ]
        .into_iter()
        .filter_map(|(name, pid)| {
            let (rss, cpu) = proc_usage(pid? as i32)?;
            Some((name.to_owned(), rss, cpu))
        })
        .collect();
        let done = posted.min(steps);
        // a step whose POST was sent twice ends the count early by one; what arrives once
        // the work has settled says so (more than one POST per step)
        tokio::time::sleep(Duration::from_secs(2)).await;
        let posted = (sink.received() - posts_before) as usize;
        let mut d = Drain::without_postgres(
            &format!("restate {shape}-step"),
            round,
            concurrency,
            done,
            seconds,
            done < steps,
            &before,
            &after,
            processes,
        );
        d.posts_per_step = Some(posted as f64 / done.max(1) as f64);
        anyhow::Ok(d)
    }
    .await;
    stop(service).await;
    stop(server).await;
    let _ = std::fs::remove_dir_all(&base);
    result
}

/// DBOS installed in a venv of the benchmark's own, from the pinned requirements.
#[derive(Debug, Clone)]
pub struct Dbos {
    python: PathBuf,
    script: PathBuf,
    logs: PathBuf,
}

impl Dbos {
    /// Makes `under/dbos/venv` and installs `dbos-requirements.txt` there (once per
    /// requirements file).
    pub async fn install(under: &Path) -> Result<Self> {
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("peers");
        std::fs::create_dir_all(under)?;
        let under = &std::fs::canonicalize(under)?;
        let dir = under.join("dbos");
        std::fs::create_dir_all(&dir)?;
        let wanted = std::fs::read(source.join("dbos-requirements.txt"))?;
        let venv = dir.join("venv");
        let python = venv.join("bin/python");
        // the installed requirements are recorded once pip has installed them
        let marker = venv.join("installed-requirements.txt");
        let fresh = std::fs::read(&marker).ok().as_ref() != Some(&wanted) || !python.exists();
        for f in ["dbos-requirements.txt", "peer_dbos.py"] {
            std::fs::copy(source.join(f), dir.join(f)).with_context(|| format!("copy {f}"))?;
        }
        if fresh {
            let _ = std::fs::remove_dir_all(&venv);
            let out = tokio::process::Command::new("python3")
                .args(["-m", "venv"])
                .arg(&venv)
                .output()
                .await
                .context("python3 -m venv (Python 3.10 or later)")?;
            if !out.status.success() {
                bail!("python3 -m venv: {}", String::from_utf8_lossy(&out.stderr));
            }
            let out = tokio::process::Command::new(venv.join("bin/pip"))
                .args(["install", "--quiet", "--disable-pip-version-check", "-r"])
                .arg(dir.join("dbos-requirements.txt"))
                .output()
                .await?;
            if !out.status.success() {
                bail!("pip install dbos: {}", String::from_utf8_lossy(&out.stderr));
            }
            std::fs::write(&marker, &wanted)?;
        }
        let logs = under.join("logs");
        std::fs::create_dir_all(&logs)?;
        Ok(Self {
            python,
            script: dir.join("peer_dbos.py"),
            logs,
        })
    }

    fn command(&self, mode: &str, args: serde_json::Value) -> Result<tokio::process::Command> {
        let log = super::peers::append_log(&self.logs, "dbos")?;
        let mut cmd = tokio::process::Command::new(&self.python);
        cmd.arg(&self.script)
            .args([mode, &args.to_string()])
            // in plain text, as every system connects (psycopg reads libpq's variables)
            .env(super::CLIENT_TLS.0, super::CLIENT_TLS.1)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true);
        Ok(cmd)
    }
}

/// Drains `steps` steps of DBOS, in workflows of `shape` steps, enqueued on a queue whose
/// worker runs `concurrency` workflows at once.
#[allow(clippy::too_many_arguments)]
pub async fn dbos_drain(
    dbos: &Dbos,
    round: usize,
    steps: usize,
    shape: usize,
    concurrency: usize,
    cap: Duration,
    sink: &Sink,
) -> Result<Drain> {
    let shape = shape.max(1);
    let jobs = steps.div_ceil(shape);
    let db = TestDatabase::create().await?;
    let result = async {
        // SQLAlchemy's name for the driver's scheme
        let url = super::peers::libpq_url(&db).replacen("postgres://", "postgresql://", 1);
        let status = dbos
            .command(
                "load",
                json!({ "url": url, "jobs": jobs, "steps": shape, "concurrency": concurrency }),
            )?
            .status()
            .await?;
        if !status.success() {
            bail!(
                "dbos load failed ({status}); see {}",
                dbos.logs.join("dbos.log").display()
            );
        }
        let pool = db.pool(2).await?;
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let before = Counters::take(&pool).await?;
        let posts_before = sink.received();
        let start = Instant::now();
        let worker = dbos
            .command(
                "work",
                json!({ "url": url, "concurrency": concurrency,
                        "sink": format!("{}/dbos", sink.url()) }),
            )?
            .spawn()?;
        let pid = worker.id().map(|p| p as i32);
        let mut polls = 0;
        let mut left: i64;
        loop {
            left = sqlx::query_scalar(
                "SELECT count(*) FROM dbos.workflow_status WHERE status <> 'SUCCESS'",
            )
            .fetch_one(&pool)
            .await?;
            polls += 1;
            if left <= 0 || start.elapsed() > cap {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let seconds = start.elapsed().as_secs_f64();
        let usage = pid.and_then(proc_usage);
        let machine = Machine::take()?;
        let posted = sink.received() - posts_before;
        stop(worker).await;
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let mut after = Counters::take(&pool).await?;
        after.machine = machine;
        pool.close().await;
        let done = (jobs - left.max(0) as usize) * shape;
        let done = done.min(steps);
        let mut d = Drain::from_counters(
            &format!("dbos {shape}-step"),
            round,
            concurrency,
            done,
            seconds,
            left > 0,
            &before,
            &after,
            polls + 1,
            usage
                .map(|(rss, cpu)| vec![("python worker".to_owned(), rss, cpu)])
                .unwrap_or_default(),
        );
        d.posts_per_step = Some(posted as f64 / done.max(1) as f64);
        anyhow::Ok(d)
    }
    .await;
    db.drop_now().await?;
    result
}
