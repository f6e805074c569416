//! The Postgres queues z29c is compared with, driven through `crates/bench/peers/peer.mjs`: each
//! through its own documented API, with no-op jobs or jobs that make the sink's one POST,
//! installed by the harness with `npm ci` from the committed lock file (which holds Restate's
//! server and SDK too, for [`super::engines`]). Every run gets a database of its own.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use serde_json::json;

use super::sink::Sink;
use super::{Counters, Drain, Latency, Machine, Reclaim, Warmup, latency_from, proc_usage};
use z29c_scenarios::TestDatabase;

/// A peer system.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    GraphileWorker,
    PgBoss,
}

impl Peer {
    pub const ALL: [Peer; 2] = [Peer::GraphileWorker, Peer::PgBoss];

    pub fn name(self) -> &'static str {
        match self {
            Peer::GraphileWorker => "graphile-worker",
            Peer::PgBoss => "pg-boss",
        }
    }

    /// Jobs of the run's queue not yet finished (graphile-worker deletes a finished job;
    /// pg-boss marks it completed).
    async fn unfinished(self, pool: &sqlx::PgPool, jobs: usize) -> Result<i64> {
        Ok(match self {
            Peer::GraphileWorker => {
                sqlx::query_scalar("SELECT count(*) FROM graphile_worker._private_jobs")
                    .fetch_one(pool)
                    .await?
            }
            Peer::PgBoss => {
                let done: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pgboss.job WHERE name = 'bench' AND state = 'completed'",
                )
                .fetch_one(pool)
                .await?;
                jobs as i64 - done
            }
        })
    }
}

/// The installed peers: `node_modules` under `target/bench/peers`.
#[derive(Debug, Clone)]
pub struct Peers {
    dir: PathBuf,
    logs: PathBuf,
}

impl Peers {
    /// Copies `crates/bench/peers` to `under/peers` and runs `npm ci` there (once per lock file).
    pub async fn install(under: &Path) -> Result<Self> {
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("peers");
        std::fs::create_dir_all(under)?;
        // node runs in `dir`: every path handed to it must be absolute
        let under = &std::fs::canonicalize(under)?;
        let dir = under.join("peers");
        std::fs::create_dir_all(&dir)?;
        let lock = std::fs::read(source.join("package-lock.json"))?;
        // the lock file npm ci installed from is recorded once it has
        let marker = dir.join("node_modules/.installed-lock.json");
        let fresh = std::fs::read(&marker).ok().as_ref() != Some(&lock);
        for f in ["package.json", "package-lock.json", "peer.mjs"] {
            std::fs::copy(source.join(f), dir.join(f)).with_context(|| format!("copy {f}"))?;
        }
        if fresh {
            let out = tokio::process::Command::new("npm")
                .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
                .current_dir(&dir)
                .output()
                .await
                .context("npm (Node.js 20 or later; Debian's nodejs and npm)")?;
            if !out.status.success() {
                bail!("npm ci: {}", String::from_utf8_lossy(&out.stderr));
            }
            std::fs::write(&marker, &lock)?;
        }
        let logs = under.join("logs");
        std::fs::create_dir_all(&logs)?;
        Ok(Self { dir, logs })
    }

    /// The installed Restate server's binary: the platform package's own, not npm's Node
    /// wrapper, so what is measured and stopped is the server itself.
    pub(crate) fn restate_server(&self) -> Result<PathBuf> {
        let arch = match std::env::consts::ARCH {
            "x86_64" => "x64",
            "aarch64" => "arm64",
            other => bail!("Restate's npm package has no server for {other}"),
        };
        let bin = self.dir.join(format!(
            "node_modules/@restatedev/restate-server-{}-{arch}/bin/restate-server",
            std::env::consts::OS
        ));
        anyhow::ensure!(bin.exists(), "{} is missing", bin.display());
        Ok(bin)
    }

    /// Where runs write their logs.
    pub(crate) fn logs(&self) -> &Path {
        &self.logs
    }

    /// A log file of this run's, appended to.
    pub(crate) fn log(&self, name: &str) -> Result<std::fs::File> {
        append_log(&self.logs, name)
    }

    /// `node peer.mjs <system> <mode> <args>`, its output to the system's log.
    pub(crate) fn node(
        &self,
        system: &str,
        mode: &str,
        args: serde_json::Value,
    ) -> Result<tokio::process::Command> {
        let log = self.log(system)?;
        let mut cmd = tokio::process::Command::new("node");
        cmd.arg(self.dir.join("peer.mjs"))
            .args([system, mode, &args.to_string()])
            .current_dir(&self.dir)
            .env(super::CLIENT_TLS.0, super::CLIENT_TLS.1)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true);
        Ok(cmd)
    }

    fn command(
        &self,
        peer: Peer,
        mode: &str,
        args: serde_json::Value,
    ) -> Result<tokio::process::Command> {
        self.node(peer.name(), mode, args)
    }

    async fn run(&self, peer: Peer, mode: &str, args: serde_json::Value) -> Result<()> {
        let status = self.command(peer, mode, args)?.status().await?;
        if !status.success() {
            bail!(
                "{} {mode} failed ({status}); see {}",
                peer.name(),
                self.logs.join(format!("{}.log", peer.name())).display()
            );
        }
        Ok(())
    }

    fn spawn(
        &self,
        peer: Peer,
        mode: &str,
        args: serde_json::Value,
    ) -> Result<tokio::process::Child> {
        Ok(self.command(peer, mode, args)?.spawn()?)
    }
}

/// `<dir>/<name>.log`, opened for appending.
pub(crate) fn append_log(dir: &Path, name: &str) -> Result<std::fs::File> {
    Ok(std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("{name}.log")))?)
}

/// libpq's form of a test database's URL (no sqlx parameters).
pub(super) fn libpq_url(db: &TestDatabase) -> String {
    db.url().split('?').next().unwrap_or_default().to_owned()
}

/// Stops `child` with SIGTERM, and SIGKILL after 10 s.
pub(crate) async fn stop(mut child: tokio::process::Child) {
    if let Some(pid) = child.id() {
        // SIGTERM: each driver stops its worker the documented way
        let _ = std::process::Command::new("kill")
            .arg(pid.to_string())
            .status();
    }
    if tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
}

/// Drains `jobs` pre-loaded jobs at `concurrency`, stopping at `cap`: no-op jobs, or, with
/// `sink`, jobs that each make one POST there (reported as `<peer> POST`).
pub async fn drain(
    peers: &Peers,
    peer: Peer,
    round: usize,
    jobs: usize,
    concurrency: usize,
    cap: Duration,
    sink: Option<&Sink>,
) -> Result<Drain> {
    let db = TestDatabase::create().await?;
    let result = async {
        let url = libpq_url(&db);
        peers
            .run(peer, "load", json!({ "url": url, "jobs": jobs }))
            .await?;
        let pool = db.pool(2).await?;
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let before = Counters::take(&pool).await?;
        let posts_before = sink.map(Sink::received);
        let start = Instant::now();
        let worker = peers.spawn(
            peer,
            "work",
            json!({ "url": url, "concurrency": concurrency, "sink": sink.map(Sink::url) }),
        )?;
        let pid = worker.id().map(|p| p as i32);
        let mut polls = 0;
        let mut left;
        loop {
            left = peer.unfinished(&pool, jobs).await?;
            polls += 1;
            if left <= 0 || start.elapsed() > cap {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let seconds = start.elapsed().as_secs_f64();
        let usage = pid.and_then(proc_usage);
        let machine = Machine::take()?;
        let posts = sink.map(Sink::received);
        stop(worker).await;
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let mut after = Counters::take(&pool).await?;
        after.machine = machine;
        let done = jobs - left.max(0) as usize;
        let wal_records = after.wal_records(&pool, &before, done).await?;
        pool.close().await;
        let system = match sink {
            Some(_) => format!("{} POST", peer.name()),
            None => peer.name().to_owned(),
        };
        let mut d = Drain::from_counters(
            &system,
            round,
            concurrency,
            done,
            seconds,
            left > 0,
            &before,
            &after,
            polls + 1,
            usage
                .map(|(rss, cpu)| vec![("node worker".to_owned(), rss, cpu)])
                .unwrap_or_default(),
        );
        d.wal_records = wal_records;
        if let (Some(b), Some(a)) = (posts_before, posts) {
            d.posts_per_step = Some((a - b) as f64 / done.max(1) as f64);
        }
        Ok(d)
    }
    .await;
    db.drop_now().await?;
    result
}

fn epoch_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
        * 1_000.0
}

/// Lines `job start intended` written by `peer.mjs work`.
fn samples(path: &Path) -> Vec<(String, f64, f64)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            Some((
                it.next()?.to_owned(),
                it.next()?.parse().ok()?,
                it.next()?.parse().ok()?,
            ))
        })
        .collect()
}

/// Schedule-to-start latency under an open-loop load of `rate` jobs/s for `seconds`.
pub async fn latency(
    peers: &Peers,
    peer: Peer,
    concurrency: usize,
    load: f64,
    rate: f64,
    warmup: u64,
    seconds: u64,
) -> Result<Latency> {
    let db = TestDatabase::create().await?;
    let file = peers.logs.join(format!(
        "{}-latency-{}.txt",
        peer.name(),
        uuid::Uuid::new_v4()
    ));
    let result = async {
        let url = libpq_url(&db);
        peers
            .run(peer, "load", json!({ "url": url, "jobs": 0 }))
            .await?;
        let worker = peers.spawn(
            peer,
            "work",
            json!({ "url": url, "concurrency": concurrency, "samples": file }),
        )?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        peers
            .run(
                peer,
                "produce",
                json!({ "url": url, "rate": rate, "seconds": warmup + seconds }),
            )
            .await?;
        let total = (rate * (warmup + seconds) as f64).round() as usize;
        let until = Instant::now() + Duration::from_secs(60);
        while samples(&file).len() < total && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        stop(worker).await;
        let timed: Vec<(f64, f64)> = samples(&file)
            .into_iter()
            .filter(|s| s.2 >= 0.0)
            .map(|(_, start, intended)| (intended, start - intended))
            .collect();
        // the producer's first job is due at its start
        let first = timed.iter().map(|s| s.0).fold(f64::INFINITY, f64::min);
        let timed: Vec<(f64, f64)> = timed
            .into_iter()
            .map(|(intended, ms)| ((intended - first) / 1_000.0, ms))
            .collect();
        let (lat, warm) = Warmup::split(&timed, warmup as f64)?;
        let counted = Warmup::counted(total, rate, warmup as f64);
        let mut l = latency_from(peer.name(), load, rate, counted, &lat)?;
        l.warmup = warm;
        Ok(l)
    }
    .await;
    let _ = std::fs::remove_file(&file);
    db.drop_now().await?;
    result
}

/// pg-boss with a 5 s expiry: a worker holding `jobs` jobs is SIGKILLed; how long until a
/// second worker starts them again, and until they are completed.
pub async fn reclaim(peers: &Peers, jobs: usize) -> Result<Reclaim> {
    let peer = Peer::PgBoss;
    let db = TestDatabase::create().await?;
    let id = uuid::Uuid::new_v4();
    let (a, b) = (
        peers.logs.join(format!("pg-boss-held-{id}.txt")),
        peers.logs.join(format!("pg-boss-taken-{id}.txt")),
    );
    let result = async {
        let url = libpq_url(&db);
        let pool = db.pool(2).await?;
        peers.run(peer, "load", json!({ "url": url, "jobs": jobs })).await?;
        let mut holder = peers.spawn(
            peer,
            "work",
            json!({ "url": url, "concurrency": jobs, "samples": a, "holdMs": 600_000 }),
        )?;
        let until = Instant::now() + Duration::from_secs(30);
        while samples(&a).len() < jobs {
            if Instant::now() > until {
                bail!("pg-boss started {} of {jobs} jobs", samples(&a).len());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let taker = peers.spawn(peer, "work", json!({ "url": url, "concurrency": jobs, "samples": b }))?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        holder.kill().await?;
        let killed = epoch_ms();
        let killed_at = Instant::now();
        let mut completed_after = None;
        while killed_at.elapsed() < Duration::from_secs(120) {
            if Peer::PgBoss.unfinished(&pool, jobs).await? <= 0 {
                completed_after = Some(killed_at.elapsed().as_secs_f64());
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stop(taker).await;
        pool.close().await;
        let restarts: Vec<f64> = samples(&b).iter().map(|s| (s.1 - killed) / 1_000.0).collect();
        Ok(Reclaim {
            system: peer.name().into(),
            held: jobs,
            lease_seconds: 5.0,
            reclaimed_after: restarts.iter().copied().fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v)))),
            completed_after,
            note: "expiry counts from the job's start (expireInSeconds 5); maintenance checks once a second".into(),
        })
    }
    .await;
    for f in [&a, &b] {
        let _ = std::fs::remove_file(f);
    }
    db.drop_now().await?;
    result
}
