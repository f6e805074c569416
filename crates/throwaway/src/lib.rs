//! Throwaway servers: a PostgreSQL cluster (initdb, run as `nobody` when we are root, as
//! PostgreSQL requires) and a `nats-server` with JetStream on its own store directory, each
//! started as a child on a free loopback port in a temporary directory. `z29c dev` runs on
//! them when no server is configured; the scenario harness kills and restarts them without
//! touching the machine's shared servers (both restart on the same port and data). Dropping
//! one stops it and removes its files.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::process::{Child, Command};

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn is_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// A PostgreSQL server binary: `pg_config`'s, Debian's newest (kept per version, outside
/// `PATH`), or one on `PATH`.
fn pg_bin(name: &str) -> Result<PathBuf> {
    let from_config = std::process::Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()).join(name));
    let mut debian: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    debian.sort_by_key(|p| {
        p.file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.parse::<u32>().ok())
            .unwrap_or(0)
    });
    from_config
        .into_iter()
        .chain(debian.iter().rev().map(|v| v.join("bin").join(name)))
        .find(|p| p.exists())
        .or_else(|| which(name))
        .with_context(|| {
            format!(
                "PostgreSQL's {name} was not found: install it (apt-get install postgresql) \
                 or set Z29C_DATABASE_URL"
            )
        })
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(name))
        .chain([Path::new("/usr/sbin").join(name)])
        .find(|p| p.exists())
}

/// Runs `program` as `nobody` when we are root (PostgreSQL refuses root), else as ourselves.
fn unprivileged(program: &Path) -> Command {
    let mut c = Command::new(program);
    // the server itself runs as `nobody` (not under `runuser`, which would stay its parent):
    // killing this child kills the postmaster, and its backends follow
    if is_root() {
        c.uid(nobody_id("-u")).gid(nobody_id("-g"));
    }
    c
}

/// `nobody`'s user (`-u`) or group (`-g`) id; 65534 where `id` cannot say.
fn nobody_id(which: &str) -> u32 {
    std::process::Command::new("id")
        .args([which, "nobody"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(65_534)
}

/// Waits until `what` listens on `port`; fails at once if it exited, or after 30 s.
async fn wait_for_port(port: u16, what: &str, child: &mut Child) -> Result<()> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            bail!("{what} exited early with {status}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("{what} did not listen on 127.0.0.1:{port} within 30 s")
}

/// Stops `child` (SIGKILL) and removes `dir`, without waiting on a runtime: for `Drop`.
fn discard(child: Option<Child>, dir: &Path) {
    if let Some(mut c) = child {
        let _ = c.start_kill();
        // give it a moment to let go of its files
        let start = Instant::now();
        while !matches!(c.try_wait(), Ok(Some(_))) && start.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A throwaway PostgreSQL cluster.
#[derive(Debug)]
pub struct PrivatePostgres {
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
    settings: Vec<String>,
}

/// Settings of a scenario's server: nothing there needs to survive a power cut.
pub const SCENARIO_SETTINGS: &[&str] = &["fsync=off", "max_connections=200"];

/// Settings of a benchmark's server: durable (fsync and synchronous commit as PostgreSQL
/// ships them), autovacuum on, room for every system's connections.
pub const DURABLE_SETTINGS: &[&str] = &[
    "fsync=on",
    "synchronous_commit=on",
    "autovacuum=on",
    "max_connections=300",
];

impl PrivatePostgres {
    pub async fn start() -> Result<Self> {
        Self::start_with(SCENARIO_SETTINGS).await
    }

    /// A cluster started with `settings` (`name=value`, as `postgres -c` takes them).
    pub async fn start_with(settings: &[&str]) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("z29c-pg-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(dir.join("data"))?;
        if is_root() {
            let ok = std::process::Command::new("chown")
                .args(["-R", "nobody:nogroup"])
                .arg(&dir)
                .status()?
                .success();
            if !ok {
                bail!("could not hand {} to nobody", dir.display());
            }
        }
        let out = unprivileged(&pg_bin("initdb")?)
            .arg("-D")
            .arg(dir.join("data"))
            .args(["-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"])
            .stdout(Stdio::null())
            .output()
            .await
            .context("initdb")?;
        if !out.status.success() {
            bail!("initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let mut pg = Self {
            port: free_port()?,
            dir,
            child: None,
            settings: settings.iter().map(|s| (*s).to_owned()).collect(),
        };
        pg.spawn().await?;
        Ok(pg)
    }

    /// `postgres://…/postgres` on this cluster.
    pub fn admin_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    async fn spawn(&mut self) -> Result<()> {
        let data = self.dir.join("data");
        let mut child = unprivileged(&pg_bin("postgres")?)
            .arg("-D")
            .arg(&data)
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-k"])
            .arg(&data)
            .args(self.settings.iter().flat_map(|s| ["-c", s.as_str()]))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("start postgres")?;
        let listening = wait_for_port(self.port, "postgres", &mut child).await;
        self.child = Some(child);
        listening?;
        let start = Instant::now();
        while sqlx::PgPool::connect(&self.admin_url()).await.is_err() {
            if start.elapsed() > Duration::from_secs(30) {
                bail!("PostgreSQL on {} does not accept connections", self.port);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    /// SIGKILLs the postmaster (its backends follow), then starts it again on the same data:
    /// crash recovery, every connection lost, exactly a PostgreSQL crash and restart.
    /// Fails unless the server that answers afterwards is a new one.
    pub async fn crash_and_restart(&mut self, down_for: Duration) -> Result<()> {
        let before = self.started_at().await?;
        if let Some(mut c) = self.child.take() {
            c.start_kill()?;
            c.wait().await?;
        }
        // the backends notice the postmaster's death and exit; wait until the port is free
        let start = Instant::now();
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_ok()
        {
            if start.elapsed() > Duration::from_secs(10) {
                bail!(
                    "PostgreSQL on {} still answers 10 s after SIGKILL",
                    self.port
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = std::fs::remove_file(self.dir.join("data/postmaster.pid"));
        tokio::time::sleep(down_for).await;
        self.spawn().await?;
        let after = self.started_at().await?;
        if after <= before {
            bail!(
                "PostgreSQL on {} was not restarted (started at {before})",
                self.port
            );
        }
        Ok(())
    }

    /// The WAL writer's process id.
    pub async fn wal_writer(&self) -> Result<i32> {
        let pool = sqlx::PgPool::connect(&self.admin_url()).await?;
        let pid =
            sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'")
                .fetch_one(&pool)
                .await
                .context("no WAL writer")?;
        pool.close().await;
        Ok(pid)
    }

    /// Stops the WAL writer (SIGSTOP) and returns its process id. From then on a commit that
    /// does not wait for the disk (`synchronous_commit = off`) stays in PostgreSQL's memory
    /// until a commit that waits writes it out with its own, so a crash loses it.
    pub async fn stop_wal_writer(&self) -> Result<i32> {
        let pid = self.wal_writer().await?;
        signal(pid, "-STOP")?;
        Ok(pid)
    }

    /// Kills the stopped WAL writer `pid` (SIGKILL). The postmaster takes a child's death for
    /// a crash: every backend stops at once, writing nothing, and the server restarts from
    /// what is on disk, so what only its memory held is lost, as in a power cut. Returns once
    /// the server answers again with a new WAL writer.
    pub async fn crash_losing_unwritten_wal(&self, pid: i32) -> Result<()> {
        signal(pid, "-KILL")?;
        let start = Instant::now();
        loop {
            if let Ok(now) = self.wal_writer().await
                && now != pid
            {
                return Ok(());
            }
            if start.elapsed() > Duration::from_secs(30) {
                bail!(
                    "PostgreSQL on {} did not restart after its WAL writer died",
                    self.port
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// When the running postmaster started.
    async fn started_at(&self) -> Result<chrono::DateTime<chrono::Utc>> {
        let pool = sqlx::PgPool::connect(&self.admin_url()).await?;
        let at = sqlx::query_scalar("SELECT pg_postmaster_start_time()")
            .fetch_one(&pool)
            .await?;
        pool.close().await;
        Ok(at)
    }

    pub async fn stop(mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.start_kill();
            let _ = c.wait().await;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A throwaway `nats-server -js`.
#[derive(Debug)]
pub struct PrivateNats {
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
    /// A configuration file the server reads (users and their permissions, say).
    config: Option<PathBuf>,
}

impl PrivateNats {
    pub async fn start() -> Result<Self> {
        Self::start_with_config(None).await
    }

    /// A server that reads `config` (the text of a `nats-server` configuration file, such as
    /// an `authorization` block) as well.
    pub async fn start_with_config(config: Option<&str>) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("z29c-nats-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir)?;
        let config = match config {
            Some(text) => {
                let path = dir.join("nats.conf");
                std::fs::write(&path, text)?;
                Some(path)
            }
            None => None,
        };
        let mut n = Self {
            port: free_port()?,
            dir,
            child: None,
            config,
        };
        n.spawn().await?;
        Ok(n)
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// What the server logged so far (refused connections and permission violations among
    /// it).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    async fn spawn(&mut self) -> Result<()> {
        let bin = which("nats-server").context(
            "nats-server was not found: install it (apt-get install nats-server) or set Z29C_NATS_URL",
        )?;
        let mut command = Command::new(bin);
        if let Some(config) = &self.config {
            command.arg("-c").arg(config);
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.log"))?;
        let mut child = command
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.dir.join("store"))
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("start nats-server")?;
        let listening = wait_for_port(self.port, "nats-server", &mut child).await;
        self.child = Some(child);
        listening
    }

    /// SIGKILL, a pause, and a start on the same store directory.
    pub async fn crash_and_restart(&mut self, down_for: Duration) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            c.start_kill()?;
            c.wait().await?;
        }
        tokio::time::sleep(down_for).await;
        self.spawn().await
    }

    /// SIGKILL, then `while_down` (it observes the outage), then a start on the same store.
    pub async fn crash_and_restart_after<F, Fut>(&mut self, while_down: F) -> Result<()>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<()>>,
    {
        if let Some(mut c) = self.child.take() {
            c.start_kill()?;
            c.wait().await?;
        }
        let observed = while_down().await;
        self.spawn().await?;
        observed
    }

    pub async fn stop(mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.start_kill();
            let _ = c.wait().await;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Sends `sig` (`-STOP`, `-KILL`, …) to process `pid`.
fn signal(pid: i32, sig: &str) -> Result<()> {
    let ok = std::process::Command::new("kill")
        .arg(sig)
        .arg(pid.to_string())
        .status()?
        .success();
    if !ok {
        bail!("kill {sig} {pid} failed");
    }
    Ok(())
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        discard(self.child.take(), &self.dir);
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        discard(self.child.take(), &self.dir);
    }
}
