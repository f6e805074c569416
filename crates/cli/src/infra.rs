//! Throwaway PostgreSQL and NATS for `z29c dev`: started as children on free loopback ports,
//! in a temporary directory, and removed on exit. PostgreSQL refuses to run as root, so as root
//! it runs as the unprivileged `nobody` user.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::process::{Child, Command};

/// The running throwaway services. Dropping it stops them and removes their files.
#[derive(Debug)]
pub(crate) struct Infra {
    pub(crate) database_url: String,
    pub(crate) nats_url: String,
    children: Vec<Child>,
    dir: Option<PathBuf>,
}

impl Drop for Infra {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.start_kill();
        }
        if let Some(dir) = &self.dir {
            // give the children a moment to let go of their files
            std::thread::sleep(Duration::from_millis(200));
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

async fn wait_for_port(port: u16, what: &str, child: &mut Child) -> anyhow::Result<()> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
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
    bail!("{what} did not listen on 127.0.0.1:{port} within 20 s")
}

fn find_pg_bin(name: &str) -> anyhow::Result<PathBuf> {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    versions.sort_by_key(|p| {
        p.file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.parse::<u32>().ok())
            .unwrap_or(0)
    });
    if let Some(v) = versions.last() {
        let p = v.join("bin").join(name);
        if p.exists() {
            return Ok(p);
        }
    }
    which(name).with_context(|| {
        format!("PostgreSQL's {name} was not found: install it (apt-get install postgresql) or set Z29C_DATABASE_URL")
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

fn is_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
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

impl Infra {
    /// Uses `database_url`/`nats_url` when given; starts throwaway servers for what is not.
    pub(crate) async fn start(
        database_url: Option<String>,
        nats_url: Option<String>,
    ) -> anyhow::Result<Self> {
        let need_dir = database_url.is_none() || nats_url.is_none();
        let dir = need_dir.then(|| {
            std::env::temp_dir().join(format!("z29c-dev-{}", uuid::Uuid::new_v4().simple()))
        });
        let mut infra = Self {
            database_url: database_url.clone().unwrap_or_default(),
            nats_url: nats_url.clone().unwrap_or_default(),
            children: Vec::new(),
            dir: dir.clone(),
        };
        if let Some(dir) = &dir {
            std::fs::create_dir_all(dir)?;
        }
        if database_url.is_none() {
            let dir = dir.as_ref().context("temporary directory")?;
            infra.database_url = infra.start_postgres(dir).await?;
        }
        if nats_url.is_none() {
            let dir = dir.as_ref().context("temporary directory")?;
            infra.nats_url = infra.start_nats(dir).await?;
        }
        Ok(infra)
    }

    async fn start_postgres(&mut self, dir: &Path) -> anyhow::Result<String> {
        let data = dir.join("pg");
        std::fs::create_dir_all(&data)?;
        if is_root() {
            let status = std::process::Command::new("chown")
                .args(["-R", "nobody:nogroup"])
                .arg(dir)
                .status()?;
            if !status.success() {
                bail!("could not hand {} to the nobody user", dir.display());
            }
        }
        let initdb = find_pg_bin("initdb")?;
        let out = unprivileged(&initdb)
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"])
            .stdout(Stdio::null())
            .output()
            .await
            .context("run initdb")?;
        if !out.status.success() {
            bail!("initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let port = free_port()?;
        let postgres = find_pg_bin("postgres")?;
        let mut child = unprivileged(&postgres)
            .arg("-D")
            .arg(&data)
            .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-k"])
            .arg(&data)
            .args([
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("start postgres")?;
        wait_for_port(port, "postgres", &mut child).await?;
        self.children.push(child);
        // the server accepts connections a moment after it listens
        let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
        let start = Instant::now();
        loop {
            match sqlx::PgPool::connect(&url).await {
                Ok(pool) => {
                    sqlx::query("CREATE DATABASE z29c").execute(&pool).await?;
                    break;
                }
                Err(_) if start.elapsed() < Duration::from_secs(10) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(e).context("connect to the throwaway PostgreSQL"),
            }
        }
        tracing::info!(port, "throwaway PostgreSQL started");
        Ok(format!("postgres://postgres@127.0.0.1:{port}/z29c"))
    }

    async fn start_nats(&mut self, dir: &Path) -> anyhow::Result<String> {
        let bin = which("nats-server").context(
            "nats-server was not found: install it (apt-get install nats-server) or set Z29C_NATS_URL",
        )?;
        let port = free_port()?;
        let store = dir.join("nats");
        std::fs::create_dir_all(&store)?;
        let mut child = Command::new(bin)
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(&store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("start nats-server")?;
        wait_for_port(port, "nats-server", &mut child).await?;
        self.children.push(child);
        tracing::info!(port, "throwaway NATS started");
        Ok(format!("nats://127.0.0.1:{port}"))
    }
}
