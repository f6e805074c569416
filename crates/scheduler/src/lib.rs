//! The scheduler: the public `WorkflowService` (submit, get, list, cancel, watch), workflow
//! deadlines, and the outbox relay that publishes what PostgreSQL committed to JetStream.
//!
//! Dependents are released inside the receipt's own transaction (`z29c-store`), and
//! rate-limited steps become claimable at `next_eligible_at` by the claim query itself, so no
//! scheduler tick stands between a receipt and the next step.
//!
//! # Layout
//! - [`config`]: scheduler configuration.
//! - [`service`]: the gRPC service and its mapping to and from the wire.
//! - [`http`]: the HTTP/JSON API, a second door to the same service.
//! - [`relay`]: the outbox relay and the deadline sweep.
//! - [`maintenance`]: vacuuming z29c's tables where the server's autovacuum will not.

pub mod config;
pub mod http;
pub mod maintenance;
pub mod relay;
pub mod service;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use z29c_core::identity::Server;
use z29c_proto::v1::workflow_service_server::WorkflowServiceServer;
use z29c_security::identity::RoleCheck;
use z29c_store::Store;

pub use config::SchedulerConfig;

/// Runs the scheduler until `shutdown` is cancelled. `ready` receives the listening address.
pub async fn run(
    config: SchedulerConfig,
    shutdown: CancellationToken,
    ready: Option<tokio::sync::oneshot::Sender<SocketAddr>>,
) -> anyhow::Result<()> {
    if let Some(addr) = config.shared.metrics_listen {
        z29c_telemetry::serve_prometheus(addr).context("serve /metrics")?;
        z29c_telemetry::zero_counters(&[z29c_telemetry::WORKFLOW_SUBMISSIONS]);
    }
    let store = config.shared.store(config.max_connections).await?;
    if config.migrate {
        store.migrate().await.context(
            "apply migrations (only the tables' owner may: a scheduler that connects as a \
             role in z29c_service runs with migrate = false, after `z29c migrate` as the owner)",
        )?;
    }
    let bus = config
        .shared
        .bus(z29c_core::identity::ServiceRole::Scheduler)
        .await?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("bind {}", config.listen))?;
    let addr = listener.local_addr()?;
    // a submission wakes the relay at once instead of at its next poll
    let relay_wake = Arc::new(tokio::sync::Notify::new());
    let relay = tokio::spawn(relay::relay(
        store.clone(),
        bus.clone(),
        config.id.clone(),
        relay_wake.clone(),
        shutdown.clone(),
    ));
    let sweep = tokio::spawn(relay::deadline_sweep(store.clone(), shutdown.clone()));
    let vacuum = (config.vacuum_every_ms > 0).then(|| {
        tokio::spawn(maintenance::vacuum_neglected(
            store.clone(),
            std::time::Duration::from_millis(config.vacuum_every_ms),
            shutdown.clone(),
        ))
    });
    let health = z29c_runtime::health(
        "z29c.v1.WorkflowService",
        config.health_listen,
        store.clone(),
        bus.clone(),
        shutdown.clone(),
    )
    .await?;
    let guard = z29c_runtime::Guard::new(
        "z29c.v1.WorkflowService",
        &config.auth,
        store.clone(),
        (config.submissions_per_second, config.submission_burst),
    )?;
    // submission batching, when on: submissions arriving together share one statement, on
    // connections of their own
    let submissions = match config.submission_batch > 1 {
        true => Some(z29c_store::submissions::SubmissionBatches::start(
            &Store::connect_committers(
                config.shared.database_url.expose(),
                config.submission_committers,
            )
            .await
            .context("connect the submission committers to PostgreSQL")?,
            &store,
            config.submission_committers,
            config.submission_batch,
        )),
        false => None,
    };
    let service = Arc::new(
        service::Workflows::new(store, bus, config.limits(), guard, relay_wake, submissions)
            .adapter_grace(std::time::Duration::from_millis(config.adapter_grace_ms)),
    );
    let http = match config.http_listen {
        Some(http_addr) => Some(
            http::serve(
                http_addr,
                &config.tls,
                config.max_request_bytes,
                service.clone(),
                shutdown.clone(),
            )
            .await?
            .1,
        ),
        None => None,
    };
    tracing::info!(%addr, "scheduler listening");
    if let Some(ready) = ready {
        let _ = ready.send(addr);
    }
    z29c_runtime::server::builder(&config.tls, &config.grpc)?
        .add_service(health)
        .add_service(InterceptedService::new(
            WorkflowServiceServer::from_arc(service)
                .max_decoding_message_size(config.max_request_bytes),
            RoleCheck::new(Server::Workflows, &config.tls)?,
        ))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown.cancelled(),
        )
        .await?;
    if let Some(http) = http {
        let _ = http.await;
    }
    let _ = relay.await;
    let _ = sweep.await;
    if let Some(vacuum) = vacuum {
        let _ = vacuum.await;
    }
    Ok(())
}
