//! Plumbing every z29c service shares, so each `main` stays short: configuration ([`config`]:
//! layering, the shared fields, checks at load), signal handling (first signal
//! drains, second exits at once), tracing set-up (`z29c_telemetry::trace`), and the one mapping from store errors to
//! `tonic::Status`; the door of the public services ([`guard`]), how every gRPC server is
//! built ([`server`]) and how every HTTP listener serves HTTPS ([`https`]).

pub mod config;
pub mod guard;
pub mod https;
pub mod server;

pub use config::{SharedConfig, Validate, load_config};
pub use guard::Guard;
pub use server::ServerLimits;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;
use z29c_store::StoreError;

/// A gRPC code's name as gRPC spells it (`INVALID_ARGUMENT`), so an answer reads the same
/// through the HTTP API, the console and gRPC.
pub fn grpc_code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// The whole `main` of a service binary: `--config FILE` and `--dump-config` from the command
/// line, configuration layered as [`load_config`] does, tracing, signals, then `run`.
pub fn service_main<C, F, Fut>(name: &str, run: F) -> anyhow::Result<()>
where
    C: Serialize + DeserializeOwned + Default + Validate,
    F: FnOnce(C, CancellationToken) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let mut config_file = None;
    let mut dump = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--config" => {
                config_file = Some(std::path::PathBuf::from(
                    args.next()
                        .ok_or_else(|| anyhow::anyhow!("--config needs a file"))?,
                ))
            }
            "--dump-config" => dump = true,
            other => anyhow::bail!(
                "{name}: unknown argument {other:?} (use --config FILE, --dump-config)"
            ),
        }
    }
    let config: C = load_config(config_file.as_deref())?;
    if dump {
        #[allow(clippy::print_stdout)]
        {
            println!("{}", config::dump(&config)?);
        }
        return Ok(());
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(async move {
            // inside the runtime: the trace exporter runs on it; dropping the guard flushes
            let _telemetry = z29c_telemetry::trace::init(name);
            run(config, shutdown_token()).await
        })
}

/// A token cancelled on the first SIGINT or SIGTERM; a second signal exits the process at once.
pub fn shutdown_token() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutdown requested, draining (signal again to exit now)");
        t.cancel();
        wait_for_signal().await;
        tracing::warn!("second signal, exiting now");
        std::process::exit(130);
    });
    token
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => return std::future::pending().await,
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Asks the gRPC health service at `addr` about `service` ("" for the whole server), within
/// 3 s, and returns its status by name (`SERVING`, `NOT_SERVING`, ...).
/// With TLS (`Z29C_TLS__CA_FILE`, `…CERT_FILE`, `…KEY_FILE`) it presents that certificate.
pub async fn probe(
    addr: &str,
    service: &str,
    tls: &z29c_security::TlsConfig,
) -> anyhow::Result<String> {
    use tonic_health::pb::health_client::HealthClient;
    let channel = tls
        .endpoint(addr)?
        .connect_timeout(std::time::Duration::from_secs(3))
        .timeout(std::time::Duration::from_secs(3))
        .connect()
        .await?;
    let answer = HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: service.to_owned(),
        })
        .await?
        .into_inner();
    Ok(answer.status().as_str_name().to_owned())
}

/// The gRPC health protocol (`grpc.health.v1.Health`) for a service: `""` and `service` are
/// `SERVING` while PostgreSQL answers and NATS is connected, `NOT_SERVING` otherwise
/// (readiness). Checked every second until `shutdown`, then `NOT_SERVING`.
pub fn health_service(
    service: &'static str,
    store: z29c_store::Store,
    bus: z29c_bus::Bus,
    shutdown: CancellationToken,
) -> tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health> {
    let (reporter, server) = tonic_health::server::health_reporter();
    tokio::spawn(async move {
        let mut last = None;
        loop {
            let ready = !shutdown.is_cancelled() && bus.is_connected() && store.ping().await;
            if last != Some(ready) {
                let status = if ready {
                    tonic_health::ServingStatus::Serving
                } else {
                    tonic_health::ServingStatus::NotServing
                };
                for name in ["", service] {
                    reporter.set_service_status(name, status).await;
                }
                if last.is_some() {
                    tracing::warn!(ready, "readiness changed");
                }
                last = Some(ready);
            }
            if shutdown.is_cancelled() {
                return;
            }
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
            }
        }
    });
    server
}

/// Serves the gRPC health protocol alone on `addr`, without TLS, until `shutdown`: for
/// kubelet's gRPC probes and load balancers, which cannot present a client certificate. It
/// tells only SERVING or NOT_SERVING; every other call needs the mutually authenticated port.
pub async fn serve_plain_health(
    addr: std::net::SocketAddr,
    service: &'static str,
    store: z29c_store::Store,
    bus: z29c_bus::Bus,
    shutdown: CancellationToken,
) -> anyhow::Result<std::net::SocketAddr> {
    use anyhow::Context;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("bind health_listen {addr}"))?;
    let bound = listener.local_addr()?;
    tracing::info!(addr = %bound, "gRPC health listening (plaintext, health only)");
    let health = health_service(service, store, bus, shutdown.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health)
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                shutdown.cancelled_owned(),
            ),
    );
    Ok(bound)
}

/// A serving service's health: the plaintext health-only port when `health_listen` is set
/// ([`serve_plain_health`]), and the [`health_service`] to add beside the service itself on
/// its mutually authenticated port.
pub async fn health(
    service: &'static str,
    health_listen: Option<std::net::SocketAddr>,
    store: z29c_store::Store,
    bus: z29c_bus::Bus,
    shutdown: CancellationToken,
) -> anyhow::Result<
    tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
> {
    if let Some(addr) = health_listen {
        serve_plain_health(addr, service, store.clone(), bus.clone(), shutdown.clone()).await?;
    }
    Ok(health_service(service, store, bus, shutdown))
}

/// The one mapping from store errors to gRPC statuses.
pub fn status_from_store(e: StoreError) -> tonic::Status {
    use tonic::Status;
    match e {
        StoreError::Invalid { field, reason } => {
            Status::invalid_argument(format!("{field}: {reason}"))
        }
        StoreError::NotFound { what } => Status::not_found(format!("{what} not found")),
        StoreError::Conflict(msg) => Status::failed_precondition(msg),
        StoreError::Fenced(reason) => Status::failed_precondition(format!("fenced: {reason}")),
        StoreError::PermitsExhausted { .. } => Status::resource_exhausted(e.to_string()),
        StoreError::Transient(_) => Status::unavailable(e.to_string()),
        other => {
            tracing::error!(error = %other, "store error");
            Status::internal("internal error")
        }
    }
}
