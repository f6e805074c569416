//! Real z29c processes for scenario tests: the destination, gateways, executors and the
//! scheduler, each its own `z29c` process on loopback, on a database and a NATS prefix of the
//! test's own. Processes can be killed (SIGKILL) or stopped (SIGTERM) like in production.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use backon::Retryable;
use tokio::process::{Child, Command};
use z29c_core::identity::ServiceRole;
use z29c_proto::v1::review_service_client::ReviewServiceClient;
use z29c_proto::v1::workflow_service_client::WorkflowServiceClient;
use z29c_proto::v1::{self as pb};
use z29c_security::pki::DevPki;
use z29c_security::{Authed, Bearer, TlsConfig};

use crate::TestDatabase;
use crate::infra::PrivateNats;

/// The `z29c` binary built alongside the tests (`target/<profile>/z29c`).
pub fn z29c_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .and_then(|d| {
            if d.ends_with("deps") {
                d.parent()
            } else {
                Some(d)
            }
        })
        .context("test binary location")?;
    let bin = dir.join("z29c");
    if !bin.exists() {
        bail!(
            "{} is missing: build it with `cargo build -p z29c-cli`",
            bin.display()
        );
    }
    Ok(bin)
}

pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A loopback port nobody listens on now, for a process about to bind it. Drawn at random
/// below the kernel's ephemeral range (32768 and up), which `bind(…:0)` elsewhere (the
/// throwaway servers, other tests' listeners) hands out in order: a port taken from there
/// could be handed to another listener before this process binds it.
pub fn free_port() -> Result<u16> {
    use rand::Rng;
    let mut rng = rand::rng();
    for _ in 0..200 {
        let port = rng.random_range(20_000..32_000);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// One running service process.
#[derive(Debug)]
pub struct Process {
    pub name: String,
    child: Child,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl Process {
    pub fn pid(&self) -> Option<i32> {
        self.child.id().map(|p| p as i32)
    }

    fn signal(&self, sig: &str) -> Result<()> {
        let pid = self.pid().context("process already gone")?;
        let status = std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()?;
        if !status.success() {
            bail!("kill {sig} {pid} failed");
        }
        Ok(())
    }

    /// SIGSTOP: the process freezes, its sockets stay open, its leases run out.
    pub fn pause(&self) -> Result<()> {
        self.signal("-STOP")
    }

    /// SIGCONT after [`Process::pause`].
    pub fn resume(&self) -> Result<()> {
        self.signal("-CONT")
    }

    /// Whether the process has exited (crashed at a fault point, say).
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// SIGKILL: no goodbye.
    pub async fn kill(&mut self) -> Result<()> {
        self.signal("-KILL")?;
        self.child.wait().await?;
        Ok(())
    }

    /// SIGTERM, then wait up to `within` for a clean exit.
    pub async fn terminate(&mut self, within: Duration) -> Result<std::process::ExitStatus> {
        self.signal("-TERM")?;
        tokio::time::timeout(within, self.child.wait())
            .await
            .with_context(|| format!("{} did not exit within {within:?}", self.name))?
            .map_err(Into::into)
    }
}

/// A z29c deployment of separate processes for one test.
#[derive(Debug)]
pub struct Cluster {
    pub db: TestDatabase,
    /// The destination's own database on the machine's PostgreSQL: its records never roll
    /// back with z29c's, and survive a crash of a scenario's own PostgreSQL.
    pub destination_db: TestDatabase,
    pub prefix: String,
    pub scheduler_url: String,
    /// The first scheduler's HTTP/JSON API (`https://` in a secure cluster).
    pub http_url: String,
    /// Every scheduler's URL, the first's first.
    pub scheduler_urls: Vec<String>,
    pub destination_url: String,
    /// `ReviewService` of the first recovery instance.
    pub review_url: String,
    /// `ReviewService` of every recovery instance started, in order.
    pub review_urls: Vec<String>,
    /// `/metrics` of the first recovery instance.
    pub recovery_metrics_url: String,
    /// `AdapterGateway` of each gateway started, in order.
    pub gateway_urls: Vec<String>,
    pub processes: Vec<Process>,
    dir: PathBuf,
    bin: PathBuf,
    gateways: usize,
    executors: usize,
    recoveries: usize,
    capability: &'static str,
    executor_stall_ms: u64,
    /// NATS this cluster talks to.
    pub nats_url: String,
    env: Vec<(String, String)>,
    /// The throwaway CA and token secret of a secure cluster.
    pub security: Option<ClusterSecurity>,
    /// A secure cluster's own NATS server, with a user per service role.
    nats: Option<PrivateNats>,
    /// The database URL services use when they connect with least privilege.
    service_db_url: Option<String>,
}

/// What a secure cluster's processes trust: one CA with a certificate per role (each
/// process presents its own role's), a second, foreign CA (members `impostor`, and `executor`
/// claiming that role) for certificates nobody trusts, and the secret operator tokens are
/// signed with.
#[derive(Debug, Clone)]
pub struct ClusterSecurity {
    pub pki: DevPki,
    pub foreign: DevPki,
    pub secret: String,
    /// Where each service role's NATS key is (`<role>.nk`), when the cluster runs its own
    /// NATS with users.
    pub nats_keys: Option<PathBuf>,
}

/// Which processes a cluster runs.
#[derive(Debug, Clone)]
pub struct Topology {
    pub gateways: usize,
    pub executors: usize,
    pub recoveries: usize,
    pub permit_limit: u32,
    /// The `http` adapter's declared capability: idempotent, queryable or opaque.
    pub capability: &'static str,
    /// Executors stall this long after a gateway answer, before committing (fault point).
    pub executor_stall_ms: u64,
    /// NATS to use instead of the machine's (a scenario's own server, to restart).
    pub nats_url: Option<String>,
    /// PostgreSQL server to create the test database on instead of `DATABASE_URL`'s.
    pub postgres_admin_url: Option<String>,
    /// Environment every process of the cluster gets (an OTLP endpoint, say).
    pub env: Vec<(String, String)>,
    /// Mutual TLS between every process and operator tokens required, as in production.
    pub secure: bool,
    /// Services connect as a login role in `z29c_service` (rows only), as in production,
    /// and do not migrate.
    pub least_privilege: bool,
    /// Length of the retention periods made before anything starts, as a recovery that had
    /// run already would have made them (a day, recovery's default).
    pub retention_period: Duration,
}

impl Default for Topology {
    fn default() -> Self {
        Self {
            gateways: 1,
            executors: 1,
            recoveries: 0,
            permit_limit: 16,
            capability: "idempotent",
            executor_stall_ms: 0,
            nats_url: None,
            postgres_admin_url: None,
            env: Vec::new(),
            secure: false,
            least_privilege: false,
            retention_period: Duration::from_secs(24 * 60 * 60),
        }
    }
}

/// The main pool of each process of a cluster on the machine's shared PostgreSQL (committer
/// pools keep their own sizes).
const SHARED_SERVER_POOL: u32 = 3;

impl Cluster {
    /// Starts the destination, `gateways` gateways, `executors` executors and one scheduler.
    pub async fn start(gateways: usize, executors: usize, permit_limit: u32) -> Result<Self> {
        Self::start_with(Topology {
            gateways,
            executors,
            permit_limit,
            ..Topology::default()
        })
        .await
    }

    /// Starts the processes `t` describes.
    /// A secure cluster (mutual TLS between every process, operator tokens required) with
    /// one recovery instance, adapters of `capability`, `env` for every process, and a pool
    /// of two connections on its database.
    pub async fn start_secure(
        capability: &'static str,
        env: &[(&str, &str)],
    ) -> Result<(Self, sqlx::PgPool)> {
        let cluster = Self::start_with(Topology {
            recoveries: 1,
            capability,
            secure: true,
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..Topology::default()
        })
        .await?;
        let pool = cluster.db.pool(2).await?;
        Ok((cluster, pool))
    }

    pub async fn start_with(t: Topology) -> Result<Self> {
        let Topology {
            gateways,
            executors,
            recoveries,
            permit_limit,
            capability,
            executor_stall_ms,
            nats_url: nats,
            postgres_admin_url,
            mut env,
            secure,
            least_privilege,
            retention_period,
        } = t;
        let bin = z29c_binary()?;
        let mut db = match &postgres_admin_url {
            Some(url) => TestDatabase::create_on(url).await?,
            None => TestDatabase::create().await?,
        };
        let prefix = format!("s{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let dir = std::env::temp_dir().join(format!("z29c-{prefix}"));
        std::fs::create_dir_all(&dir)?;
        // load generators submit faster than one operator would: no per-caller rate unless a
        // test sets one (its own entry comes later and wins)
        env.insert(0, ("Z29C_SUBMISSIONS_PER_SECOND".into(), "0".into()));
        // on the machine's shared server (100 connections as PostgreSQL ships) two clusters
        // run side by side with the suite's other tests: each process keeps a small pool
        if postgres_admin_url.is_none() {
            env.insert(
                0,
                (
                    "Z29C_MAX_CONNECTIONS".into(),
                    SHARED_SERVER_POOL.to_string(),
                ),
            );
        }
        let (mut private_nats, mut nats_keys) = (None, None);
        let security = if secure {
            let roles: Vec<&str> = ServiceRole::ALL.iter().map(|r| r.as_str()).collect();
            let pki = DevPki::generate(&dir.join("pki"), &roles)?;
            let foreign = DevPki::generate(&dir.join("foreign"), &["impostor", "executor"])?;
            let secret = z29c_security::token::random_secret();
            // a NATS of its own, with a user per role, unless the scenario brings one
            if nats.is_none() {
                let keys = dir.join("nats-keys");
                let names = z29c_bus::Names::new(&prefix)?;
                let conf =
                    z29c_bus::auth::write_keys(&keys, &names, &z29c_bus::auth::NATS_ROLES, false)?;
                private_nats = Some(
                    PrivateNats::start_with_config(Some(&std::fs::read_to_string(conf)?)).await?,
                );
                nats_keys = Some(keys);
            }
            env.push(("Z29C_AUTH__ENABLED".into(), "true".into()));
            env.push(("Z29C_AUTH__HS256_SECRETS".into(), format!("[{secret}]")));
            Some(ClusterSecurity {
                pki,
                foreign,
                secret,
                nats_keys: nats_keys.clone(),
            })
        } else {
            None
        };
        let scheme = if secure { "https" } else { "http" };
        // migrate once before anything starts, and make the first periods
        db.store().await?.cover_ahead(retention_period).await?;
        let service_db_url = if least_privilege {
            env.push(("Z29C_MIGRATE".into(), "false".into()));
            Some(db.service_url().await?)
        } else {
            None
        };
        let destination_db = TestDatabase::create().await?;
        let destination_port = free_port()?;
        let mut cluster = Self {
            db,
            destination_db,
            prefix,
            scheduler_url: String::new(),
            http_url: String::new(),
            scheduler_urls: Vec::new(),
            destination_url: format!("http://127.0.0.1:{destination_port}"),
            review_url: String::new(),
            review_urls: Vec::new(),
            recovery_metrics_url: String::new(),
            gateway_urls: Vec::new(),
            processes: Vec::new(),
            dir,
            bin,
            gateways: 0,
            executors: 0,
            recoveries: 0,
            capability,
            executor_stall_ms,
            nats_url: nats
                .or_else(|| private_nats.as_ref().map(PrivateNats::url))
                .unwrap_or_else(nats_url),
            env,
            security,
            nats: private_nats,
            service_db_url,
        };
        let dest = cluster.spawn(
            "destination",
            &["destination"],
            &[
                ("Z29C_LISTEN", format!("127.0.0.1:{destination_port}")),
                ("Z29C_DATABASE_URL", cluster.destination_db.url().to_owned()),
            ],
        )?;
        cluster.processes.push(dest);
        cluster.wait_listening(destination_port).await?;
        for _ in 0..gateways {
            cluster.add_gateway(permit_limit).await?;
        }
        let port = free_port()?;
        let http_port = free_port()?;
        let sched = cluster.spawn(
            "scheduler",
            &["scheduler"],
            &[
                ("Z29C_LISTEN", format!("127.0.0.1:{port}")),
                ("Z29C_HTTP_LISTEN", format!("127.0.0.1:{http_port}")),
            ],
        )?;
        cluster.processes.push(sched);
        cluster.wait_listening(port).await?;
        cluster.wait_listening(http_port).await?;
        cluster.http_url = format!("{scheme}://127.0.0.1:{http_port}");
        cluster.scheduler_url = format!("{scheme}://127.0.0.1:{port}");
        cluster.scheduler_urls.push(cluster.scheduler_url.clone());
        for _ in 0..executors {
            cluster.add_executor().await?;
        }
        for _ in 0..recoveries {
            cluster.add_recovery().await?;
        }
        Ok(cluster)
    }

    fn spawn(&self, name: &str, args: &[&str], env: &[(&str, String)]) -> Result<Process> {
        let log = std::fs::File::create(self.dir.join(format!("{name}.log")))?;
        let mut cmd = Command::new(&self.bin);
        cmd.args(args)
            .env(
                "Z29C_DATABASE_URL",
                self.service_db_url.as_deref().unwrap_or(self.db.url()),
            )
            .env("Z29C_NATS_URL", &self.nats_url)
            .env("Z29C_PREFIX", &self.prefix)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        // in a secure cluster each service presents the certificate of its own role, and
        // its role's key to NATS
        let role = args.first().and_then(|a| a.parse::<ServiceRole>().ok());
        if let (Some(security), Some(role)) = (&self.security, role) {
            if let Some(keys) = &security.nats_keys
                && z29c_bus::auth::NATS_ROLES.contains(&role)
            {
                cmd.env(
                    "Z29C_NATS_AUTH__NKEY_FILE",
                    z29c_bus::auth::seed_path(keys, role),
                );
            }
            let tls = security.pki.tls(role.as_str());
            for (k, v) in [
                ("Z29C_TLS__CA_FILE", tls.ca_file),
                ("Z29C_TLS__CERT_FILE", tls.cert_file),
                ("Z29C_TLS__KEY_FILE", tls.key_file),
            ] {
                cmd.env(k, v.context("pki file")?);
            }
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        Ok(Process {
            name: name.to_owned(),
            child: cmd.spawn().with_context(|| format!("start {name}"))?,
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.clone()))
                .collect(),
        })
    }

    /// Starts a process that was killed again, with the same arguments and environment but
    /// `drop_env` removed (a fault switch, say), and waits for its port if it listens.
    pub async fn restart(&mut self, name: &str, drop_env: &[&str]) -> Result<()> {
        let i = self
            .processes
            .iter()
            .position(|p| p.name == name)
            .with_context(|| format!("no process {name}"))?;
        let old = &mut self.processes[i];
        if !old.exited() {
            old.kill().await?;
        }
        let args: Vec<String> = old.args.clone();
        let env: Vec<(String, String)> = old
            .env
            .iter()
            .filter(|(k, _)| !drop_env.contains(&k.as_str()))
            .cloned()
            .collect();
        // every address it listens on: the service's, and its metrics' if it has one
        let listen: Vec<u16> = env
            .iter()
            .filter(|(k, _)| k.ends_with("LISTEN"))
            .filter_map(|(_, v)| v.rsplit(':').next()?.parse::<u16>().ok())
            .collect();
        let args_ref: Vec<&str> = args.iter().map(String::as_str).collect();
        let env_ref: Vec<(&str, String)> =
            env.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        let log_name = format!("{name}.{}", uuid::Uuid::new_v4().simple());
        let mut p = self.spawn(&log_name, &args_ref, &env_ref)?;
        p.name = name.to_owned();
        self.processes[i] = p;
        for port in listen {
            let start = Instant::now();
            while tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_err()
            {
                // a restart that could not bind its port must say so, not leave a test waiting
                if self.processes[i].exited() || start.elapsed() > Duration::from_secs(45) {
                    bail!(
                        "{name} restarted but does not listen on {port}\n{}",
                        self.log_warnings()
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        if name.starts_with("gateway-") {
            self.wait_registered(name).await?;
        }
        Ok(())
    }

    /// Where this cluster's logs and configuration live.
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Starts one more gateway; it registers itself and adds capacity.
    pub async fn add_gateway(&mut self, permit_limit: u32) -> Result<()> {
        self.add_gateway_with(permit_limit, &[]).await
    }

    /// A pool on the destination's own database, to count what the outside world recorded.
    pub async fn ledger_pool(&self) -> Result<sqlx::PgPool> {
        self.destination_db.pool(2).await
    }

    /// Requests the destination received, by its own records.
    pub async fn requests_received(&self) -> Result<i64> {
        let ledger = self.ledger_pool().await?;
        let n = crate::count_rows(&ledger, "destination.requests").await?;
        ledger.close().await;
        Ok(n)
    }

    /// Submits a one-step workflow on `route` as an operator and claims its step as
    /// `executor-test` on `pool`, as an executor would: for tests that make the executor's
    /// call to a gateway themselves ([`invoke_request`]).
    pub async fn claimed_by_test(
        &self,
        pool: &sqlx::PgPool,
        key: &str,
        route: &str,
    ) -> Result<z29c_store::leases::ClaimedStep> {
        let token = self.token("olga", &[z29c_core::Role::Operator])?;
        let mut client = self.client_with(&self.operator_tls(), Some(&token)).await?;
        let mut req = chain(key, route, 1);
        // a policy whose calls fit any gateway's cap in these tests
        req.steps[0].policy = Some(crate::matrix::policy());
        client.submit(req).await?;
        let store = z29c_store::Store::from_pool(pool.clone());
        let owner = z29c_core::OwnerId::parse("executor-test")?;
        let start = Instant::now();
        loop {
            if let Some(c) = store.claim(&owner, 1).await?.pop() {
                return Ok(c);
            }
            anyhow::ensure!(
                start.elapsed() < Duration::from_secs(30),
                "nothing to claim"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts one more gateway with extra environment. It serves the adapter `http` with the
    /// topology's capability, and `http-idempotent`, `http-queryable` and `http-opaque`, for
    /// runs that mix capabilities; each adapter calls the destination's routes of its own
    /// capability, which behave as it declares (an opaque route never de-duplicates).
    pub async fn add_gateway_with(
        &mut self,
        permit_limit: u32,
        extra: &[(&str, &str)],
    ) -> Result<()> {
        let adapter = |name: &str, capability: &str| {
            format!(
                "[[adapters]]\nname = \"{name}\"\nversion = \"http/1\"\nbase_url = \"{}/{capability}\"\n\
                 capability = \"{capability}\"\ndefault_limit = {permit_limit}\nsafety_window_ms = 5000\n",
                self.destination_url
            )
        };
        let mut toml = adapter("http", self.capability);
        for c in ["idempotent", "queryable", "opaque"] {
            toml.push_str(&adapter(&format!("http-{c}"), c));
        }
        self.add_gateway_serving(&toml, extra).await
    }

    /// Starts one more gateway serving the adapters of `adapters_toml` (its `[[adapters]]`
    /// tables), with `extra` in its environment; it is registered once it listens.
    pub async fn add_gateway_serving(
        &mut self,
        adapters_toml: &str,
        extra: &[(&str, &str)],
    ) -> Result<()> {
        self.gateways += 1;
        let port = free_port()?;
        let config = self.dir.join(format!("gateway-{}.toml", self.gateways));
        std::fs::write(&config, adapters_toml)?;
        let name = format!("gateway-{}", self.gateways);
        let p = self.spawn(
            &name,
            &["gateway", "--config", &config.to_string_lossy()],
            &[
                ("Z29C_ID", name.clone()),
                ("Z29C_LISTEN", format!("127.0.0.1:{port}")),
            ]
            .into_iter()
            .chain(extra.iter().map(|(k, v)| (*k, (*v).to_owned())))
            .collect::<Vec<_>>(),
        )?;
        self.processes.push(p);
        self.gateway_urls
            .push(format!("{}://127.0.0.1:{port}", self.scheme()));
        self.wait_listening(port).await?;
        self.wait_registered(&name).await
    }

    /// The ids of the gateways in the registry now.
    pub async fn registered_gateways(&self) -> Result<Vec<String>> {
        let bus = self.bus_as(ServiceRole::Recovery).await?;
        Ok(bus.gateways().await?.into_iter().map(|g| g.id).collect())
    }

    /// A connection to this cluster's NATS as the service `role` would make it (with its key
    /// when the cluster's NATS has users).
    pub async fn bus_as(&self, role: ServiceRole) -> Result<z29c_bus::Bus> {
        let auth = z29c_bus::auth::NatsAuth {
            nkey_file: self
                .security
                .as_ref()
                .and_then(|s| s.nats_keys.as_ref())
                .map(|keys| z29c_bus::auth::seed_path(keys, role)),
        };
        Ok(z29c_bus::Bus::connect_as(
            &self.nats_url,
            &self.prefix,
            &TlsConfig::default(),
            Some(role),
            &auth,
        )
        .await?)
    }

    /// What the cluster's own NATS server logged (empty when it uses a shared one).
    pub fn nats_log(&self) -> String {
        self.nats.as_ref().map(PrivateNats::log).unwrap_or_default()
    }

    /// Waits until gateway `id` is in the registry, from when work for its adapters is
    /// accepted and sent to it.
    async fn wait_registered(&mut self, id: &str) -> Result<()> {
        let start = Instant::now();
        loop {
            if self.registered_gateways().await?.iter().any(|g| g == id) {
                return Ok(());
            }
            if self.process(id).is_none_or(Process::exited)
                || start.elapsed() > Duration::from_secs(45)
            {
                bail!("{id} did not register\n{}", self.log_warnings());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts one more recovery worker.
    pub async fn add_recovery(&mut self) -> Result<()> {
        self.add_recovery_with(&[]).await
    }

    /// Starts one more recovery worker with extra environment.
    pub async fn add_recovery_with(&mut self, extra: &[(&str, &str)]) -> Result<()> {
        self.recoveries += 1;
        let name = format!("recovery-{}", self.recoveries);
        let port = free_port()?;
        let metrics_port = free_port()?;
        let p = self.spawn(
            &name,
            &["recovery"],
            &[
                ("Z29C_ID", name.clone()),
                ("Z29C_SCAN_MS", "200".into()),
                ("Z29C_LISTEN", format!("127.0.0.1:{port}")),
                ("Z29C_METRICS_LISTEN", format!("127.0.0.1:{metrics_port}")),
            ]
            .into_iter()
            .chain(extra.iter().map(|(k, v)| (*k, (*v).to_owned())))
            .collect::<Vec<_>>(),
        )?;
        self.processes.push(p);
        self.wait_listening(port).await?;
        self.review_urls
            .push(format!("{}://127.0.0.1:{port}", self.scheme()));
        if self.review_url.is_empty() {
            self.review_url = format!("{}://127.0.0.1:{port}", self.scheme());
            self.recovery_metrics_url = format!("http://127.0.0.1:{metrics_port}/metrics");
        }
        Ok(())
    }

    /// Starts one more scheduler, `scheduler-N` (the first is `scheduler`), on the same
    /// database and prefix: submissions may go to either.
    pub async fn add_scheduler(&mut self) -> Result<()> {
        let n = self.scheduler_urls.len() + 1;
        let name = format!("scheduler-{n}");
        let port = free_port()?;
        let p = self.spawn(
            &name,
            &["scheduler"],
            &[
                ("Z29C_ID", name.clone()),
                ("Z29C_LISTEN", format!("127.0.0.1:{port}")),
            ],
        )?;
        self.processes.push(p);
        self.wait_listening(port).await?;
        self.scheduler_urls
            .push(format!("{}://127.0.0.1:{port}", self.scheme()));
        Ok(())
    }

    /// `WorkflowService` of the scheduler at `url`, as the operator.
    pub async fn client_at(&self, url: &str) -> Result<WorkflowServiceClient<Authed>> {
        let token = match &self.security {
            Some(_) => Some(self.token("test-operator", z29c_core::Role::ALL)?),
            None => None,
        };
        let channel = self.channel(url, &self.operator_tls()).await?;
        Ok(WorkflowServiceClient::with_interceptor(
            channel,
            Bearer::new(token.as_deref())?,
        ))
    }

    /// Starts the operator console on this cluster's scheduler and first recovery instance,
    /// summing `metrics` (URLs of `/metrics`); returns its base URL.
    pub async fn add_console(&mut self, metrics: &[String]) -> Result<String> {
        self.add_console_with(metrics, false).await
    }

    /// [`Self::add_console`]; with `https`, serving HTTPS with the cluster's `console`
    /// certificate (a secure cluster's only), no client certificate asked of browsers.
    pub async fn add_console_with(&mut self, metrics: &[String], https: bool) -> Result<String> {
        let port = free_port()?;
        let name = if https { "console-https" } else { "console" };
        let config = self.dir.join(format!("{name}.toml"));
        let mut toml = format!(
            "listen = \"127.0.0.1:{port}\"\nworkflow_server = \"{}\"\nreview_server = \"{}\"\nmetrics = [",
            self.scheduler_url, self.review_url
        );
        toml.push_str(
            &metrics
                .iter()
                .map(|m| format!("\"{m}\""))
                .collect::<Vec<_>>()
                .join(", "),
        );
        toml.push_str("]\n");
        if https {
            let tls = self
                .security
                .as_ref()
                .context("https needs a secure cluster")?
                .pki
                .tls(ServiceRole::Console.as_str());
            let (cert, key) = (tls.cert_file.context("cert")?, tls.key_file.context("key")?);
            toml.push_str(&format!(
                "[https]\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
                cert.display(),
                key.display()
            ));
        }
        std::fs::write(&config, toml)?;
        let p = self.spawn(
            name,
            &["console", "--config", &config.to_string_lossy()],
            &[],
        )?;
        self.processes.push(p);
        self.wait_listening(port).await?;
        let scheme = if https { "https" } else { "http" };
        Ok(format!("{scheme}://127.0.0.1:{port}"))
    }

    /// Starts one more executor.
    pub async fn add_executor(&mut self) -> Result<()> {
        self.add_executor_with(&[]).await
    }

    /// Starts one more executor with extra environment (fault switches, say).
    pub async fn add_executor_with(&mut self, extra: &[(&str, &str)]) -> Result<()> {
        self.executors += 1;
        let name = format!("executor-{}", self.executors);
        let p = self.spawn(
            &name,
            &["executor"],
            &[
                ("Z29C_ID", name.clone()),
                ("Z29C_POLL_MS", "200".into()),
                ("Z29C_SHUTDOWN_GRACE_MS", "5000".into()),
                (
                    "Z29C_FAULT_STALL_AFTER_RESPONSE_MS",
                    self.executor_stall_ms.to_string(),
                ),
            ]
            .into_iter()
            .chain(extra.iter().map(|(k, v)| (*k, (*v).to_owned())))
            .collect::<Vec<_>>(),
        )?;
        self.processes.push(p);
        Ok(())
    }

    /// Waits until process `name` has exited (crashed at a fault point, say).
    pub async fn wait_exited(&mut self, name: &str, within: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            if self.process(name).context("no such process")?.exited() {
                return Ok(());
            }
            if start.elapsed() > within {
                bail!("{name} did not crash within {within:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Every process of the cluster, live or not.
    pub fn processes(&self) -> impl Iterator<Item = &Process> {
        self.processes.iter()
    }

    /// Waits until process `name`'s log has a line containing `text`.
    pub async fn wait_for_log(&self, name: &str, text: &str, within: Duration) -> Result<()> {
        let path = self.dir().join(format!("{name}.log"));
        let start = Instant::now();
        loop {
            if std::fs::read_to_string(&path).is_ok_and(|log| log.contains(text)) {
                return Ok(());
            }
            if start.elapsed() > within {
                bail!("waited {within:?} for {name} to log {text:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn process(&mut self, name: &str) -> Option<&mut Process> {
        self.processes.iter_mut().find(|p| p.name == name)
    }

    fn scheme(&self) -> &'static str {
        if self.security.is_some() {
            "https"
        } else {
            "http"
        }
    }

    /// A token signed with the cluster's secret (a secure cluster's only).
    pub fn token(&self, subject: &str, roles: &[z29c_core::Role]) -> Result<String> {
        let s = self.security.as_ref().context("not a secure cluster")?;
        z29c_security::token::mint(&s.secret, "z29c", subject, roles, Duration::from_secs(600))
    }

    /// The operator's certificate in a secure cluster (none otherwise).
    pub fn operator_tls(&self) -> TlsConfig {
        self.role_tls(ServiceRole::Operator)
    }

    /// The certificate of `role` in a secure cluster (none otherwise).
    pub fn role_tls(&self, role: ServiceRole) -> TlsConfig {
        self.security
            .as_ref()
            .map(|s| s.pki.tls(role.as_str()))
            .unwrap_or_default()
    }

    /// A connected channel to `url` with `tls`.
    pub async fn channel(&self, url: &str, tls: &TlsConfig) -> Result<tonic::transport::Channel> {
        Ok(tls
            .endpoint(url)?
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await?)
    }

    /// What a person is told about workflow `id` (its product state), as `Get` answers. A
    /// scheduler that answers `UNAVAILABLE` (its database busy or away for a moment) is asked
    /// again, with backoff, as `z29c-client` does.
    pub async fn product_state(&self, id: &str) -> Result<pb::ProductState> {
        let client = self.client().await?;
        let ask = || {
            let mut client = client.clone();
            async move {
                client
                    .get(pb::GetRequest {
                        workflow_id: id.to_owned(),
                    })
                    .await
            }
        };
        let answer = ask
            .retry(
                backon::ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(200))
                    .with_max_delay(Duration::from_secs(2))
                    .with_total_delay(Some(Duration::from_secs(60)))
                    .without_max_times(),
            )
            .when(|s| s.code() == tonic::Code::Unavailable)
            .await?;
        Ok(answer.into_inner().state())
    }

    /// `WorkflowService` as the operator: with every role's token in a secure cluster.
    pub async fn client(&self) -> Result<WorkflowServiceClient<Authed>> {
        let token = match &self.security {
            Some(_) => Some(self.token("test-operator", z29c_core::Role::ALL)?),
            None => None,
        };
        self.client_with(&self.operator_tls(), token.as_deref())
            .await
    }

    /// `WorkflowService` with this certificate and token.
    pub async fn client_with(
        &self,
        tls: &TlsConfig,
        token: Option<&str>,
    ) -> Result<WorkflowServiceClient<Authed>> {
        let channel = self.channel(&self.scheduler_url, tls).await?;
        Ok(WorkflowServiceClient::with_interceptor(
            channel,
            Bearer::new(token)?,
        ))
    }

    /// `ReviewService` of the first recovery instance, with the operator's certificate and
    /// this token.
    pub async fn reviews(&self, token: Option<&str>) -> Result<ReviewServiceClient<Authed>> {
        let channel = self.channel(&self.review_url, &self.operator_tls()).await?;
        Ok(ReviewServiceClient::with_interceptor(
            channel,
            Bearer::new(token)?,
        ))
    }

    /// Resolves every open review item the way a person would: by looking in the destination
    /// for the step's effect (the request whose body names the step). Found: "succeeded" with
    /// its reference; none: "failed". Returns how many items were resolved. Only once the
    /// faults have healed: a request still on its way would make "none" a wrong answer.
    pub async fn resolve_reviews_from_ledger(&self) -> Result<usize> {
        use pb::resolve_request::Resolution;
        let token = match &self.security {
            Some(_) => Some(self.token("test-operator", z29c_core::Role::ALL)?),
            None => None,
        };
        // any recovery instance that answers: a scenario may have killed the first
        let mut answered = None;
        for url in &self.review_urls {
            let Ok(channel) = self.channel(url, &self.operator_tls()).await else {
                continue;
            };
            let mut reviews =
                ReviewServiceClient::with_interceptor(channel, Bearer::new(token.as_deref())?);
            if let Ok(list) = reviews.list(pb::ListReviewsRequest::default()).await {
                answered = Some((reviews, list.into_inner().items));
                break;
            }
        }
        let (mut reviews, items) = answered.context("no recovery instance answers")?;
        let pool = self.db.pool(1).await?;
        let ledger = self.ledger_pool().await?;
        let mut resolved = 0;
        for item in items.iter().filter(|i| i.state == "open") {
            let step: Option<(String, String)> = sqlx::query_as(
                "SELECT w.client_key, s.name FROM steps s JOIN workflows w ON w.id = s.workflow_id
                 WHERE s.id = $1::uuid",
            )
            .bind(&item.step_id)
            .fetch_optional(&pool)
            .await?;
            let Some((client_key, name)) = step else {
                continue;
            };
            let found: Option<String> = sqlx::query_scalar(
                "SELECT reference FROM destination.ledger WHERE body->>'step' = $1
                 ORDER BY request_id LIMIT 1",
            )
            .bind(crate::history::step_token(&client_key, &name))
            .fetch_optional(&ledger)
            .await?;
            let (resolution, reason) = match found {
                Some(reference) => (
                    Resolution::SucceededExternalReference(reference),
                    "found the effect in the destination",
                ),
                None => (
                    Resolution::Failed(true),
                    "the destination has no such effect",
                ),
            };
            let mut req = tonic::Request::new(pb::ResolveRequest {
                item_id: item.id.clone(),
                expected_version: item.version,
                reason: reason.into(),
                resolution: Some(resolution),
                result_json: String::new(),
            });
            req.metadata_mut()
                .insert("x-z29c-operator", "harness".parse()?);
            reviews.resolve(req).await?;
            resolved += 1;
        }
        pool.close().await;
        ledger.close().await;
        Ok(resolved)
    }

    /// Switches faults on a destination route.
    pub async fn set_faults(&self, route: &str, faults: serde_json::Value) -> Result<()> {
        let r = reqwest::Client::new()
            .put(format!("{}/admin/faults/{route}", self.destination_url))
            .json(&faults)
            .send()
            .await?;
        if !r.status().is_success() {
            bail!("setting faults failed: {}", r.status());
        }
        Ok(())
    }

    /// Waits until every listed workflow has ended, or fails after `within`.
    pub async fn wait_all_ended(&self, ids: &[String], within: Duration) -> Result<()> {
        let mut client = self.client().await?;
        let start = Instant::now();
        let mut pending: Vec<String> = ids.to_vec();
        // what the last look at an unfinished workflow saw, for the error
        let mut seen = String::new();
        while !pending.is_empty() {
            if start.elapsed() > within {
                bail!(
                    "{} workflows still running after {within:?}; last seen:\n{seen}{}",
                    pending.len(),
                    self.log_warnings()
                );
            }
            seen.clear();
            let mut still = Vec::new();
            for id in pending {
                // a scheduler that lost its database for a moment answers again shortly
                let Ok(w) = client
                    .get(pb::GetRequest {
                        workflow_id: id.clone(),
                    })
                    .await
                else {
                    still.push(id);
                    continue;
                };
                let w = w.into_inner();
                if seen.len() < 4_000 {
                    for step in &w.steps {
                        let t = step.technical.clone().unwrap_or_default();
                        seen.push_str(&format!(
                            "  {id} {}: {} (lease v{} by {:?}, checkpoint {:?}, {} attempts)\n",
                            step.name,
                            t.step_state,
                            t.lease_version,
                            t.lease_owner,
                            t.checkpoint,
                            t.attempts
                        ));
                    }
                }
                let ended = matches!(
                    w.state(),
                    pb::ProductState::Completed
                        | pb::ProductState::Failed
                        | pb::ProductState::Cancelled
                        | pb::ProductState::NeedsReview
                );
                if !ended {
                    still.push(id);
                }
            }
            pending = still;
            if !pending.is_empty() {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        Ok(())
    }

    /// Every line of every process's log, each after its file's name.
    pub fn log_lines(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut files: Vec<_> = entries.flatten().map(|e| e.path()).collect();
        files.sort();
        files
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "log"))
            .flat_map(|path| {
                let name = path
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned();
                std::fs::read_to_string(path)
                    .unwrap_or_default()
                    .lines()
                    .map(|l| format!("{name}: {l}"))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// The last warnings and errors of every process's log, for a failure message.
    pub fn log_warnings(&self) -> String {
        let mut out = format!("logs in {}:\n", self.dir.display());
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return out;
        };
        let mut files: Vec<_> = entries.flatten().map(|e| e.path()).collect();
        files.sort();
        for path in files
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "log"))
        {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            let bad: Vec<&str> = text
                .lines()
                .filter(|l| l.contains("WARN") || l.contains("ERROR") || l.contains("panicked"))
                .collect();
            for line in &bad[bad.len().saturating_sub(3)..] {
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                let line: String = line.chars().take(400).collect();
                out.push_str(&format!("  {name}: {line}\n"));
            }
        }
        out
    }

    /// Kills every process, drops the database and the NATS streams.
    pub async fn stop(self) -> Result<()> {
        let Cluster {
            db,
            destination_db,
            prefix,
            mut processes,
            dir,
            nats_url,
            nats,
            ..
        } = self;
        for p in &mut processes {
            let _ = p.signal("-KILL");
            let _ = p.child.wait().await;
        }
        match nats {
            // its own server goes, streams and all
            Some(server) => server.stop().await,
            None => {
                if let Ok(bus) = z29c_bus::Bus::connect(&nats_url, &prefix).await {
                    let _ = bus.delete_stream().await;
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        let dropped = destination_db.drop_now().await;
        db.drop_now().await.and(dropped)
    }
}

impl Cluster {
    /// Waits until the process started last listens on `port`. If it exits first (a port taken
    /// between `free_port` and its bind, a bad configuration), fails at once with the logs
    /// instead of waiting out the 45 s.
    async fn wait_listening(&mut self, port: u16) -> Result<()> {
        let start = Instant::now();
        // a service waits up to 30 s for PostgreSQL before it listens (Store::connect)
        while start.elapsed() < Duration::from_secs(45) {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return Ok(());
            }
            if let Some(p) = self.processes.last_mut()
                && p.exited()
            {
                let name = p.name.clone();
                bail!(
                    "{name} exited before it listened on 127.0.0.1:{port}\n{}",
                    self.log_warnings()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!(
            "nothing listened on 127.0.0.1:{port} within 45 s\n{}",
            self.log_warnings()
        )
    }
}

/// One step whose calls time out quickly, so an unknown outcome comes fast.
pub fn flaky_workflow(key: &str) -> pb::SubmitRequest {
    let mut req = chain(key, "flaky", 1);
    req.steps[0].policy = Some(pb::LeasePolicy {
        lease_ms: 2_000,
        renew_every_ms: 500,
        attempt_deadline_ms: 4_000,
        final_grace_ms: 500,
        adapter_timeout_ms: 800,
        ..Default::default()
    });
    req
}

/// The call an executor makes to a gateway for the claimed step `c`.
pub fn invoke_request(c: &z29c_store::leases::ClaimedStep) -> pb::InvokeRequest {
    pb::InvokeRequest {
        adapter: c.adapter.clone(),
        operation: c.operation.clone(),
        request_identity: c.request_identity.as_str().to_owned(),
        input_json: c.input.to_string(),
        input_digest: c.input_digest.as_str().to_owned(),
        workflow_id: c.workflow.to_string(),
        step_id: c.lease.step.to_string(),
        attempt_id: c.lease.attempt.to_string(),
        lease_version: c.lease.version.get(),
        lease_owner: c.lease.owner.as_str().to_owned(),
    }
}

/// A workflow of `steps` chained steps on `route`. Each step's input names it
/// ([`crate::history::step_token`]), so the destination's records say which step a request
/// was for.
pub fn chain(key: &str, route: &str, steps: usize) -> pb::SubmitRequest {
    pb::SubmitRequest {
        client_key: key.to_owned(),
        name: format!("scenario {key}"),
        steps: (0..steps)
            .map(|i| pb::StepDefinition {
                name: format!("s{i}"),
                adapter: "http".into(),
                operation: route.into(),
                input_json: serde_json::json!({
                    "n": i,
                    "step": crate::history::step_token(key, &format!("s{i}")),
                })
                .to_string(),
                depends_on: if i == 0 {
                    vec![]
                } else {
                    vec![format!("s{}", i - 1)]
                },
                policy: None,
            })
            .collect(),
        deadline: None,
    }
}
