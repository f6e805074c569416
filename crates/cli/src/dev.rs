//! `z29c dev`: the whole system in one process on loopback — destination, adapter gateway,
//! scheduler, executor, recovery — with the demo workflow submitted and followed to its end.

#![allow(clippy::print_stdout)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use z29c_adapter_gateway::{AdapterConfig, GatewayConfig};
use z29c_core::identity::ServiceRole;
use z29c_executor::ExecutorConfig;
use z29c_proto::v1::{self as pb, ProductState};
use z29c_scheduler::SchedulerConfig;

use crate::client;
use crate::infra::Infra;

#[derive(Debug, clap::Args)]
pub(crate) struct DevArgs {
    /// Workflow to run instead of the built-in demo.
    #[arg(long)]
    workflow: Option<PathBuf>,
    /// Stop once the demo workflow has ended (exit 0 if it completed).
    #[arg(long)]
    exit_after_demo: bool,
    /// Use this PostgreSQL instead of a throwaway one.
    #[arg(long, env = "Z29C_DATABASE_URL")]
    database_url: Option<String>,
    /// Use this NATS instead of a throwaway one.
    #[arg(long, env = "Z29C_NATS_URL")]
    nats_url: Option<String>,
    /// Executors to run.
    #[arg(long, default_value_t = 1)]
    executors: usize,
    /// Where the operator console is served (another free port if this one is taken).
    #[arg(long, default_value = "127.0.0.1:8088")]
    console: std::net::SocketAddr,
    /// Plaintext gRPC and no operator tokens (by default dev makes a throwaway CA, requires
    /// client certificates between services, and signs operator tokens, as production does).
    #[arg(long)]
    insecure: bool,
}

/// What `z29c dev` secures its services with: a throwaway CA with one certificate per role,
/// a token secret, and the tokens it hands out.
struct DevSecurity {
    pki: Option<z29c_security::pki::DevPki>,
    auth: z29c_security::AuthConfig,
    /// All three roles, for the demo and the person at the console.
    token: Option<String>,
    dir: Option<PathBuf>,
}

impl DevSecurity {
    fn new(insecure: bool) -> anyhow::Result<Self> {
        if insecure {
            return Ok(Self {
                pki: None,
                auth: Default::default(),
                token: None,
                dir: None,
            });
        }
        let dir =
            std::env::temp_dir().join(format!("z29c-dev-pki-{}", uuid::Uuid::new_v4().simple()));
        let roles: Vec<&str> = ServiceRole::ALL.iter().map(|r| r.as_str()).collect();
        let pki = z29c_security::pki::DevPki::generate(&dir, &roles)?;
        let secret = z29c_security::token::random_secret();
        let auth = z29c_security::AuthConfig {
            enabled: true,
            hs256_secrets: vec![secret.clone().into()],
            ..Default::default()
        };
        let token = z29c_security::token::mint(
            &secret,
            &auth.audience,
            "dev-operator",
            z29c_core::Role::ALL,
            Duration::from_secs(24 * 3600),
        )?;
        Ok(Self {
            pki: Some(pki),
            auth,
            token: Some(token),
            dir: Some(dir),
        })
    }
}

impl DevSecurity {
    /// The certificate files of `role` (none with `--insecure`).
    fn tls(&self, role: ServiceRole) -> z29c_security::TlsConfig {
        self.pki
            .as_ref()
            .map(|p| p.tls(role.as_str()))
            .unwrap_or_default()
    }
}

impl Drop for DevSecurity {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

const DEMO: &str = include_str!("../../../examples/demo.yaml");

pub(crate) async fn run(args: DevArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let shutdown = z29c_runtime::shutdown_token();
    let security = DevSecurity::new(args.insecure)?;
    let prefix = format!("dev{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    // a throwaway NATS of a secured run has a user per service role, each with its subjects
    let nats_keys = match (&security.dir, &args.nats_url) {
        (Some(dir), None) => {
            let dir = dir.join("nats");
            let names = z29c_bus::Names::new(&prefix)?;
            let conf =
                z29c_bus::auth::write_keys(&dir, &names, &z29c_bus::auth::NATS_ROLES, false)?;
            Some((dir, std::fs::read_to_string(conf)?))
        }
        _ => None,
    };
    let infra = Infra::start(
        args.database_url.clone(),
        args.nats_url.clone(),
        nats_keys.as_ref().map(|(_, conf)| conf.as_str()),
    )
    .await?;

    let store = z29c_store::Store::connect(&infra.database_url, 4).await?;
    store.migrate().await.context("apply migrations")?;

    // the destination: the outside world of the demo
    let destination = z29c_destination::Destination::install(store.pool().clone()).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let destination_url = format!("http://{}", listener.local_addr()?);
    {
        let router = destination.router();
        let token = shutdown.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, router)
                .with_graceful_shutdown(token.cancelled_owned())
                .await;
        });
    }

    // what every service is given alike: this run's database, NATS and prefix
    let shared = z29c_runtime::SharedConfig {
        database_url: z29c_security::DatabaseUrl::parse(&infra.database_url)
            .map_err(|e| anyhow::anyhow!("database URL: {e}"))?,
        nats_url: infra.nats_url.clone(),
        prefix: prefix.clone(),
        ..z29c_runtime::SharedConfig::default()
    };
    // each service's own NATS key, when NATS has users
    let shared_as = |role: ServiceRole| z29c_runtime::SharedConfig {
        nats_auth: z29c_bus::auth::NatsAuth {
            nkey_file: nats_keys
                .as_ref()
                .map(|(dir, _)| z29c_bus::auth::seed_path(dir, role)),
        },
        ..shared.clone()
    };
    let mut tasks = Vec::new();
    let (gw_ready, gw_addr) = tokio::sync::oneshot::channel();
    let gateway = GatewayConfig {
        id: "gateway-1".into(),
        listen: "127.0.0.1:0".parse()?,
        shared: shared_as(ServiceRole::Gateway),
        adapters: vec![AdapterConfig {
            base_url: destination_url.clone(),
            ..AdapterConfig::default()
        }],
        tls: security.tls(ServiceRole::Gateway),
        ..GatewayConfig::default()
    };
    tasks.push(tokio::spawn(z29c_adapter_gateway::run(
        gateway,
        shutdown.clone(),
        Some(gw_ready),
    )));
    if gw_addr.await.is_err() {
        return Err(failure(tasks.pop())
            .await
            .context("the gateway did not start"));
    }

    let (sched_ready, sched_addr) = tokio::sync::oneshot::channel();
    let scheduler = SchedulerConfig {
        listen: "127.0.0.1:0".parse()?,
        shared: shared_as(ServiceRole::Scheduler),
        tls: security.tls(ServiceRole::Scheduler),
        auth: security.auth.clone(),
        ..SchedulerConfig::default()
    };
    tasks.push(tokio::spawn(z29c_scheduler::run(
        scheduler,
        shutdown.clone(),
        Some(sched_ready),
    )));
    let Ok(sched_addr) = sched_addr.await else {
        return Err(failure(tasks.pop())
            .await
            .context("the scheduler did not start"));
    };

    for i in 0..args.executors.max(1) {
        let executor = ExecutorConfig {
            id: format!("executor-{}", i + 1),
            shared: shared_as(ServiceRole::Executor),
            tls: security.tls(ServiceRole::Executor),
            ..ExecutorConfig::default()
        };
        tasks.push(tokio::spawn(z29c_executor::run(executor, shutdown.clone())));
    }
    let recovery = z29c_recovery::RecoveryConfig {
        listen: "127.0.0.1:0".parse()?,
        shared: shared_as(ServiceRole::Recovery),
        tls: security.tls(ServiceRole::Recovery),
        auth: security.auth.clone(),
        ..z29c_recovery::RecoveryConfig::default()
    };
    let (rec_ready, rec_addr) = tokio::sync::oneshot::channel();
    tasks.push(tokio::spawn(z29c_recovery::run(
        recovery,
        shutdown.clone(),
        Some(rec_ready),
    )));
    let Ok(rec_addr) = rec_addr.await else {
        return Err(failure(tasks.pop()).await.context("recovery did not start"));
    };
    let scheme = if security.dir.is_some() {
        "https"
    } else {
        "http"
    };
    let server = format!("{scheme}://{sched_addr}");
    let review_server = format!("{scheme}://{rec_addr}");

    // one process, one metrics registry: every service's metrics on one /metrics
    let metrics_addr = free_local_addr()?;
    z29c_telemetry::serve_prometheus(metrics_addr).context("serve /metrics")?;
    let console_listen = if std::net::TcpListener::bind(args.console).is_ok() {
        args.console
    } else {
        tracing::warn!(taken = %args.console, "console port taken; using another");
        "127.0.0.1:0".parse()?
    };
    // secured like the services: HTTPS with the throwaway CA's certificate, `Secure` cookies
    let console_tls = security.tls(ServiceRole::Console);
    let console_https = z29c_runtime::https::HttpsConfig {
        cert_file: console_tls.cert_file.clone(),
        key_file: console_tls.key_file.clone(),
        client_ca_file: None,
    };
    let (console_ready, console_addr) = tokio::sync::oneshot::channel();
    tasks.push(tokio::spawn(z29c_console::run(
        z29c_console::ConsoleConfig {
            listen: console_listen,
            https: console_https,
            workflow_server: server.clone(),
            review_server: review_server.clone(),
            metrics: vec![format!("http://{metrics_addr}/metrics")],
            tls: console_tls,
            auth: security.auth.clone(),
        },
        shutdown.clone(),
        Some(console_ready),
    )));
    let Ok(console_addr) = console_addr.await else {
        return Err(failure(tasks.pop())
            .await
            .context("the console did not start"));
    };

    println!("z29c dev is up in {:.1} s", started.elapsed().as_secs_f64());
    println!("  console: {scheme}://{console_addr}/");
    println!("  metrics (all services): http://{metrics_addr}/metrics");
    println!("  scheduler (WorkflowService): {server}");
    println!("  recovery (ReviewService): {review_server}");
    println!("  destination (synthetic external system): {destination_url}");
    println!("  PostgreSQL: {}", shared.database_url);
    println!("  NATS: {} (prefix {prefix})", infra.nats_url);
    if let Some((dir, _)) = &nats_keys {
        println!(
            "  NATS users: one NKey per service role, each allowed only its own subjects (keys in {})",
            dir.display()
        );
    }
    if let (Some(dir), Some(token)) = (&security.dir, &security.token) {
        println!(
            "  mutual TLS between services, one certificate per role (throwaway CA in {}), operator tokens required",
            dir.display()
        );
        println!(
            "  the console's certificate is the throwaway CA's: trust {}/ca.pem or accept the browser's warning",
            dir.display()
        );
        println!("  to use the CLI or sign in to the console (token with every role, valid 24 h):");
        println!(
            "    export Z29C_TLS__CA_FILE={0}/ca.pem Z29C_TLS__CERT_FILE={0}/operator.pem Z29C_TLS__KEY_FILE={0}/operator.key",
            dir.display()
        );
        println!("    export Z29C_SERVER={server} Z29C_REVIEW_SERVER={review_server}");
        println!("    export Z29C_TOKEN={token}");
    } else {
        println!("  --insecure: plaintext gRPC, no operator tokens");
    }

    let file = match &args.workflow {
        Some(path) => client::read_workflow(path)?,
        None => z29c_proto::workflow_file::parse(DEMO)?,
    };
    let access = client::Access::new(security.token.clone(), &security.tls(ServiceRole::Operator));
    let client = client::connect(&server, &access).await?;
    let wf = client
        .submit_file(file)
        .await
        .context("demo submit refused")?
        .workflow;
    println!("demo workflow {} submitted", wf.id);
    let mut out = client::Stdout::default();
    let end = client::watch_until_done(
        &client,
        &wf.id,
        client::Output::Text,
        wf.steps.len(),
        &mut out,
    )
    .await?;
    let detail = client.get(&wf.id).await?;
    client::print_workflow(&mut out, &detail)?;
    check_against_ledger(&detail, &destination).await?;
    println!(
        "demo finished: {} after {:.1} s",
        detail.state_label,
        started.elapsed().as_secs_f64()
    );

    if !args.exit_after_demo {
        println!("running; Ctrl-C to stop");
        shutdown.cancelled().await;
    }
    shutdown.cancel();
    for t in tasks {
        match tokio::time::timeout(Duration::from_secs(15), t).await {
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "service ended with an error"),
            Ok(_) => {}
            Err(_) => tracing::warn!("a service did not stop within 15 s"),
        }
    }
    drop(infra);
    if end != ProductState::Completed {
        bail!("the demo workflow ended {}", detail.state_label);
    }
    Ok(())
}

/// A loopback address nobody listens on right now.
fn free_local_addr() -> anyhow::Result<std::net::SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// Why a service task ended before it was ready.
async fn failure(task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>) -> anyhow::Error {
    match task {
        Some(t) => match t.await {
            Ok(Err(e)) => e,
            Ok(Ok(())) => anyhow::anyhow!("it stopped without an error"),
            Err(e) => anyhow::anyhow!("it panicked: {e}"),
        },
        None => anyhow::anyhow!("no task"),
    }
}

/// Every receipt's external reference must be in the destination's own ledger, once.
async fn check_against_ledger(
    wf: &pb::Workflow,
    destination: &z29c_destination::Destination,
) -> anyhow::Result<()> {
    let ledger = destination.ledger().await?;
    for s in &wf.steps {
        let Some(r) = &s.receipt else { continue };
        let hits = ledger
            .iter()
            .filter(|e| e.idempotency_key.as_deref() == Some(r.request_identity.as_str()))
            .count();
        let matches = ledger.iter().any(|e| e.reference == r.external_reference);
        if hits != 1 || !matches {
            bail!(
                "step {}: receipt {} does not match the destination's ledger ({hits} entries for its identity)",
                s.name,
                r.external_reference
            );
        }
    }
    println!("receipts match the destination's ledger: one effect per request identity");
    Ok(())
}
