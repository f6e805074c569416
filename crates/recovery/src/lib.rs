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
use tonic::service::interceptor::InterceptedService;
use z29c_core::OwnerId;
use z29c_core::identity::Server;
use z29c_security::identity::RoleCheck;

pub use config::RecoveryConfig;

/// How often recovery reads the tables' sizes for the storage gauges.
const STORAGE_EVERY: Duration = Duration::from_secs(30);

/// How often recovery makes the next retention periods and drops expired ones, at most: a
/// quarter of a period, so a new period exists well before the first id that needs it.
const RETENTION_EVERY: Duration = Duration::from_secs(60);

/// Makes the next periods, and, with a retention, exports (when asked) and drops each
/// period that may go. Every failure is logged and tried again next round; a period whose
/// export failed is not dropped.
async fn retention_round(store: &z29c_store::Store, config: &config::RetentionConfig) {
    if let Err(e) = store.cover_ahead(config.period).await {
        tracing::warn!(error = %e, "making the next retention period failed");
    }
    let Some(keep) = config.keep else {
        return;
    };
    let expired = match store.expired_periods(keep).await {
        Ok(expired) => expired,
        Err(e) => {
            tracing::warn!(error = %e, "listing expired retention periods failed");
            return;
        }
    };
    for period in expired {
        let exported_to = match &config.export_dir {
            Some(dir) => match store.export_period(&period, dir).await {
                Ok(files) => {
                    let bytes: u64 = files.iter().map(|f| f.bytes).sum();
                    tracing::info!(period = %period.suffix, files = files.len(), bytes,
                                   dir = %dir.display(), "period exported");
                    Some(dir.display().to_string())
                }
                Err(e) => {
                    tracing::warn!(period = %period.suffix, error = %e,
                                   "export failed; the period is kept");
                    continue;
                }
            },
            None => None,
        };
        match store
            .drop_period(&period.suffix, keep, exported_to.as_deref())
            .await
        {
            Ok(Some(removed)) => {
                tracing::info!(period = %period.suffix, %removed, "retention period dropped");
            }
            Ok(None) => {
                tracing::debug!(period = %period.suffix, "period not droppable after all");
            }
            Err(e) => tracing::warn!(period = %period.suffix, error = %e,
                                     "dropping a retention period failed"),
        }
    }
}

/// Runs recovery and its `ReviewService` until `shutdown` is cancelled. `ready` receives the
/// review service's address.
pub async fn run(
    config: RecoveryConfig,
    shutdown: CancellationToken,
    ready: Option<tokio::sync::oneshot::Sender<std::net::SocketAddr>>,
) -> anyhow::Result<()> {
    let owner = OwnerId::parse(config.id.clone()).context("recovery id")?;
    let store = config.shared.store(config.max_connections).await?;
    let bus = config
        .shared
        .bus(z29c_core::identity::ServiceRole::Recovery)
        .await?;
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
            .add_service(InterceptedService::new(
                z29c_proto::v1::review_service_server::ReviewServiceServer::new(
                    review::Reviews::new(store.clone(), guard),
                )
                .max_decoding_message_size(config.max_request_bytes),
                RoleCheck::new(Server::Reviews, &config.tls)?,
            ))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                shutdown.clone().cancelled_owned(),
            ),
    );
    tracing::info!(id = %config.id, %addr, "recovery started; ReviewService listening");
    if let Some(ready) = ready {
        let _ = ready.send(addr);
    }
    let mut storage_read: Option<std::time::Instant> = None;
    // on a task of its own: an export of a large period must not hold up recovery
    let retention = {
        let (store, retention, shutdown) =
            (store.clone(), config.retention.clone(), shutdown.clone());
        tokio::spawn(async move {
            let every = RETENTION_EVERY.min(retention.period / 4);
            while !shutdown.is_cancelled() {
                retention_round(&store, &retention).await;
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = tokio::time::sleep(every) => {}
                }
            }
        })
    };
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
        if storage_read.is_none_or(|t| t.elapsed() >= STORAGE_EVERY) {
            storage_read = Some(std::time::Instant::now());
            match store.storage().await {
                Ok(storage) => {
                    use z29c_telemetry::metrics::gauge;
                    for (table, bytes) in storage.tables {
                        gauge!(z29c_telemetry::STORAGE_TABLE_BYTES, "table" => table)
                            .set(bytes as f64);
                    }
                    gauge!(z29c_telemetry::STORAGE_OLDEST_WORKFLOW_AGE).set(
                        storage
                            .oldest_workflow_age
                            .map_or(0.0, |age| age.as_secs_f64()),
                    );
                }
                Err(e) => tracing::warn!(error = %e, "reading table sizes failed"),
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = tokio::time::sleep(Duration::from_millis(config.scan_ms)) => {}
        }
    }
    retention.await?;
    server.await??;
    Ok(())
}
