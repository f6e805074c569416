//! Recovery (docs/design.md §5): lease expiry starts reasoning, never repetition.
//!
//! A recovery worker scans leases that expired by PostgreSQL's clock, takes a recovery lease
//! (bumping the version, which fences the old worker out), reads the evidence — checkpoint,
//! request identity, receipt, late observations — and the adapter's capability from the
//! gateway registry, and asks `z29c_core::classify` what to do. Every decision is recorded
//! before it is acted on. Several instances may run: each step's recovery lease is taken once.
//!
//! # Layout
//! - [`config`]: recovery configuration.
//! - [`worker`]: one step's recovery, decision by decision.
//! - [`review`]: `ReviewService`, the review queue over gRPC.

pub mod config;
pub mod review;
pub mod worker;

use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use z29c_core::OwnerId;

pub use config::RecoveryConfig;

/// Runs recovery and its `ReviewService` until `shutdown` is cancelled. `ready` receives the
/// review service's address.
pub async fn run(
    config: RecoveryConfig,
    shutdown: CancellationToken,
    ready: Option<tokio::sync::oneshot::Sender<std::net::SocketAddr>>,
) -> anyhow::Result<()> {
    let owner = OwnerId::parse(config.id.clone()).context("recovery id")?;
    let store = config.shared.store(config.max_connections).await?;
    let bus = config.shared.bus().await?;
    let health = z29c_runtime::health(
        "z29c.v1.ReviewService",
        config.health_listen,
        store.clone(),
        bus.clone(),
        shutdown.clone(),
    )
    .await?;
    let ctx = worker::Context {
        store: store.clone(),
        gateways: z29c_bus::gateways::Gateways::new(bus, config.tls.clone()),
        owner,
        hold: Duration::from_millis(config.recovery_lease_ms),
        capability_patience: Duration::from_millis(config.capability_patience_ms),
        capability_unknown: Default::default(),
    };
    if let Some(addr) = config.shared.metrics_listen {
        z29c_telemetry::serve_prometheus(addr).context("serve /metrics")?;
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("bind {}", config.listen))?;
    let addr = listener.local_addr()?;
    let guard =
        z29c_runtime::Guard::new("z29c.v1.ReviewService", &config.auth, store.clone(), (0, 0))?;
    let server = tokio::spawn(
        z29c_runtime::server::builder(&config.tls, &config.grpc)?
            .add_service(health)
            .add_service(
                z29c_proto::v1::review_service_server::ReviewServiceServer::new(
                    review::Reviews::new(store.clone(), guard),
                )
                .max_decoding_message_size(config.max_request_bytes),
            )
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                shutdown.clone().cancelled_owned(),
            ),
    );
    tracing::info!(id = %config.id, %addr, "recovery started; ReviewService listening");
    if let Some(ready) = ready {
        let _ = ready.send(addr);
    }
    while !shutdown.is_cancelled() {
        match store.scan_expired(config.batch).await {
            Ok(expired) => {
                for lease in expired {
                    if shutdown.is_cancelled() {
                        break;
                    }
                    if let Err(e) = worker::recover(&ctx, &lease).await {
                        tracing::warn!(step = %lease.step, error = %e, "recovery stopped; the step stays leased to recovery until its lease expires");
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "expired-lease scan failed"),
        }
        if let Ok(k) = store.knowledge().await {
            use z29c_telemetry::metrics::gauge;
            gauge!(z29c_telemetry::REVIEW_ITEMS_OPEN).set(k.open_reviews as f64);
            gauge!(z29c_telemetry::INTEGRITY_CONFLICTS).set(k.integrity_conflicts as f64);
            gauge!(z29c_telemetry::STEP_DUPLICATE_REFERENCES).set(k.duplicate_references as f64);
            for state in ["running", "completed", "failed", "cancelled"] {
                let n = k
                    .workflows_by_state
                    .iter()
                    .find(|(s, _)| s == state)
                    .map_or(0, |(_, n)| *n);
                gauge!(z29c_telemetry::WORKFLOWS, "state" => state).set(n as f64);
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = tokio::time::sleep(Duration::from_millis(config.scan_ms)) => {}
        }
    }
    server.await??;
    Ok(())
}
