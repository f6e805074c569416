//! The adapter gateway: the only place z29c calls external systems.
//!
//! It serves `AdapterGateway` over gRPC. Before each invocation it takes an adapter permit in
//! PostgreSQL (shared by all gateway instances), calls the adapter, and maps the answer to one
//! of four outcomes: succeeded, rejected, rate-limited (retry after), or **unknown**. A timeout
//! or a lost response is unknown, never a failure; its permit keeps counting for the adapter's
//! safety window. Gateways register themselves in a NATS key-value bucket so executors find
//! them, and adding an instance adds capacity.
//!
//! # Layout
//! - [`adapter`]: the `Adapter` trait a custom gateway binary implements, and the HTTP adapter.
//! - [`config`]: the gateway's configuration and adapters.
//! - [`contract`]: an adapter's declared HTTP contract (request, statuses, status query).
//! - [`http`]: the HTTP adapter, speaking that contract.
//! - [`service`]: the gRPC service and the permit discipline around each call.

pub mod adapter;
pub mod config;
pub mod contract;
pub mod http;
pub mod service;

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use z29c_bus::{AdapterRecord, GatewayRecord};
use z29c_core::identity::Server;
use z29c_proto::v1::adapter_gateway_server::AdapterGatewayServer;
use z29c_security::identity::RoleCheck;
use z29c_store::Store;
use z29c_store::invocations::InvocationPath;

pub use adapter::{Adapter, Adapters, Inquiry, Invocation};
pub use config::{AdapterConfig, AdapterKind, GatewayConfig};
pub use http::{CallOutcome, QueryOutcome};

/// A running gateway's address, once it listens.
#[derive(Debug, Clone)]
pub struct Started {
    pub addr: SocketAddr,
}

/// Runs the gateway until `shutdown` is cancelled. `ready` receives the listening address.
pub async fn run(
    config: GatewayConfig,
    shutdown: CancellationToken,
    ready: Option<tokio::sync::oneshot::Sender<Started>>,
) -> anyhow::Result<()> {
    run_with(config, Adapters::new(), shutdown, ready).await
}

/// [`run`], for a gateway binary built with its own adapters: `custom` holds the
/// implementations of the adapters its configuration marks `kind = "custom"`.
pub async fn run_with(
    config: GatewayConfig,
    custom: Adapters,
    shutdown: CancellationToken,
    ready: Option<tokio::sync::oneshot::Sender<Started>>,
) -> anyhow::Result<()> {
    // every adapter made (secrets read) before anything else starts
    let adapters = adapter::build(&config, custom)?;
    if let Some(addr) = config.shared.metrics_listen {
        z29c_telemetry::serve_prometheus(addr).context("serve /metrics")?;
        z29c_telemetry::zero_counters(&[z29c_telemetry::ATTEMPT_INVOCATIONS]);
    }
    #[cfg(feature = "faults")]
    if let Some(point) = config.fault_crash {
        tracing::warn!(%point, "fault: crash point armed");
        z29c_store::faults::arm(point);
    }
    let store = config.shared.store(config.max_connections).await?;
    for a in &config.adapters {
        for (class, limit) in &a.limits {
            store
                .set_permit_limit(&a.name, class, i32::try_from(*limit).unwrap_or(i32::MAX))
                .await?;
        }
    }
    // Before it registers (so no call of this process has a permit yet): a permit this
    // gateway's name still holds from before it started is a call that ended with the earlier
    // process. Its request may have reached the destination, so the permit counts on for the
    // safety window, as any unknown outcome's, but no call is in flight for recovery to wait
    // for. Gateway ids are unique per instance, as the registry requires.
    for a in &config.adapters {
        let orphaned = store
            .hold_earlier_permits_unknown(
                &config.id,
                &a.name,
                Duration::from_millis(a.safety_window_ms),
            )
            .await?;
        if orphaned > 0 {
            tracing::warn!(adapter = %a.name, permits = orphaned, "calls of an earlier run of this gateway ended with it; their outcome is unknown");
        }
    }
    let bus = config
        .shared
        .bus(z29c_core::identity::ServiceRole::Gateway)
        .await?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("bind {}", config.listen))?;
    let addr = listener.local_addr()?;
    let record = GatewayRecord {
        id: config.id.clone(),
        max_call_ms: Some(config.grpc.max_deadline_ms),
        // behind 0.0.0.0 (a container, a pod) executors need the address others reach it by
        endpoint: config.advertise.clone().unwrap_or_else(|| {
            let scheme = if config.tls.enabled().unwrap_or(false) {
                "https"
            } else {
                "http"
            };
            format!("{scheme}://{addr}")
        }),
        adapters: config
            .adapters
            .iter()
            .map(|a| AdapterRecord {
                name: a.name.clone(),
                version: a.version.clone(),
                capability: a.capability,
            })
            .collect(),
    };
    bus.register_gateway(&record).await?;
    let registration = {
        let (bus, record, shutdown, store) =
            (bus.clone(), record.clone(), shutdown.clone(), store.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(3));
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tick.tick() => {
                        if let Err(e) = bus.register_gateway(&record).await {
                            tracing::warn!(error = %e, "gateway registration refresh failed");
                        }
                        // permits whose hold or safety window ran out: record their end
                        match store.close_expired_permits().await {
                            Ok(0) => {}
                            Ok(n) => tracing::info!(permits = n, "expired permits closed"),
                            Err(e) => tracing::warn!(error = %e, "closing expired permits failed"),
                        }
                    }
                }
            }
        })
    };
    let health = z29c_runtime::health(
        "z29c.v1.AdapterGateway",
        config.health_listen,
        store.clone(),
        bus.clone(),
        shutdown.clone(),
    )
    .await?;
    // invocation batching, when on: calls arriving together begin in shared statements, on a
    // pool whose sessions never plan a sequential scan
    let invocations = if config.invocation_batch > 1 {
        InvocationPath::Batched(z29c_store::invocations::InvocationBatches::start(
            &Store::connect_committers(
                config.shared.database_url.expose(),
                config.invocation_committers,
            )
            .await
            .context("connect the invocation committers to PostgreSQL")?,
            &store,
            config.invocation_committers,
            config.invocation_batch,
        ))
    } else {
        InvocationPath::Direct(store.clone())
    };
    let service = service::Gateway::new(config.clone(), store, invocations, adapters);
    // stopped after the server, which lets calls in flight finish first: their permits are
    // released too
    let serving_done = CancellationToken::new();
    let releases = tokio::spawn(service.clone().release_ended(serving_done.clone()));
    tracing::info!(%addr, id = %config.id, adapters = config.adapters.len(), "gateway listening");
    if let Some(ready) = ready {
        let _ = ready.send(Started { addr });
    }
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    z29c_runtime::server::builder(&config.tls, &config.grpc)?
        .add_service(health)
        .add_service(InterceptedService::new(
            AdapterGatewayServer::new(service).max_decoding_message_size(config.max_request_bytes),
            RoleCheck::new(Server::Gateway, &config.tls)?,
        ))
        .serve_with_incoming_shutdown(incoming, shutdown.cancelled())
        .await?;
    registration.abort();
    // the permits of calls that ended are released before the process goes
    serving_done.cancel();
    if let Err(e) = releases.await {
        tracing::warn!(error = %e, "the permit release task failed");
    }
    let _ = bus.deregister_gateway(&config.id).await;
    Ok(())
}
