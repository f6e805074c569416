//! The executor: a bounded pool of workers that claim ready steps and run the attempt protocol
//! of docs/design.md §4 under fenced leases.
//!
//! Work is found by polling PostgreSQL; JetStream `step.ready` hints only wake the pool early,
//! so a lost message delays work and a duplicate changes nothing. The claim creates each
//! attempt with its request identity; the attempt calls a gateway with its lease and a
//! deadline that ends before the attempt does (the gateway commits *invocation began* under
//! that lease, with its permit, before it sends), renews the short lease beside the call for
//! as long as the call runs, and commits the receipt — or, when fenced, keeps what it saw as
//! late evidence. On shutdown it stops claiming, gives back
//! steps whose invocation has not begun, and lets calls in flight finish within a grace period.
//!
//! While every worker is busy it claims a few steps ahead (`claim_ahead`): they wait, leased
//! and unbegun, for the next worker that frees, so the claim's round trip is not between one
//! attempt's receipt and the next attempt's call. A step that waits longer than half its
//! renewal interval is given back unbegun, and claiming ahead stops until an attempt ends
//! within that time again: while calls run long, it would only claim and give back.
//!
//! # Layout
//! - [`config`]: executor configuration.
//! - [`attempt`]: one attempt, checkpoint by checkpoint.
//! - `claims`: the claim loop, and the rules for how many steps it claims and when.

pub mod attempt;
mod claims;
pub mod config;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;
use z29c_bus::{Bus, Topic};
use z29c_core::OwnerId;
use z29c_store::Store;
use z29c_store::audit::PoisonMessage;
use z29c_store::receipts::ReceiptPath;

pub use config::ExecutorConfig;

/// Runs the executor until `shutdown` is cancelled, then drains within the grace period.
pub async fn run(config: ExecutorConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let owner = OwnerId::parse(config.id.clone()).context("executor id")?;
    if let Some(addr) = config.shared.metrics_listen {
        z29c_telemetry::serve_prometheus(addr).context("serve /metrics")?;
        z29c_telemetry::zero_counters(&[
            z29c_telemetry::LEASE_ACQUISITIONS,
            z29c_telemetry::LEASE_RENEWAL_FAILURES,
            z29c_telemetry::ATTEMPT_FENCING_REJECTIONS,
            z29c_telemetry::ATTEMPT_LATE_OBSERVATIONS,
            z29c_telemetry::STEP_UNKNOWN_OUTCOMES,
        ]);
    }
    #[cfg(feature = "faults")]
    {
        if let Some(point) = config.fault_crash {
            tracing::warn!(%point, "fault: crash point armed");
            z29c_store::faults::arm(point);
        }
        if config.fault_break_receipt_fencing {
            z29c_store::faults::break_receipt_fencing();
        }
    }
    let store = config.shared.store(config.max_connections).await?;
    let bus = config
        .shared
        .bus(z29c_core::identity::ServiceRole::Executor)
        .await?;
    if let Some(addr) = config.health_listen {
        z29c_runtime::serve_plain_health(
            addr,
            "z29c.v1.Executor",
            store.clone(),
            bus.clone(),
            shutdown.clone(),
        )
        .await?;
    }
    let gateways = z29c_bus::gateways::Gateways::new(bus.clone(), config.tls.clone());
    // how receipts commit, chosen here once: receipts finishing together share statements
    // when batching is on
    let receipts = if config.receipt_batch > 1 {
        ReceiptPath::Batched(z29c_store::receipts::ReceiptBatches::start(
            &Store::connect_committers(
                config.shared.database_url.expose(),
                config.receipt_committers,
            )
            .await
            .context("connect the receipt committers to PostgreSQL")?,
            &store,
            config.receipt_committers,
            config.receipt_batch,
        ))
    } else {
        ReceiptPath::Direct(store.clone())
    };
    let wake = Arc::new(Notify::new());
    let hints = tokio::spawn(listen_for_hints(
        bus.clone(),
        store.clone(),
        wake.clone(),
        shutdown.clone(),
    ));
    let advisories = tokio::spawn(record_max_deliveries(
        bus.clone(),
        store.clone(),
        shutdown.clone(),
    ));

    let tracker = TaskTracker::new();
    let attempts_token = CancellationToken::new();
    tracing::info!(id = %owner, workers = config.workers, "executor started");
    claims::run(
        &config,
        &owner,
        attempt::Context {
            store: store.clone(),
            receipts,
            gateways,
            stop: attempts_token.clone(),
            #[cfg(feature = "faults")]
            stall_after_response: Duration::from_millis(config.fault_stall_after_response_ms),
            #[cfg(feature = "faults")]
            stall_after_claim: Duration::from_millis(config.fault_stall_after_claim_ms),
        },
        wake,
        &tracker,
        &shutdown,
    )
    .await?;
    tracing::info!(in_flight = tracker.len(), "executor draining");
    attempts_token.cancel();
    tracker.close();
    if tokio::time::timeout(
        Duration::from_millis(config.shutdown_grace_ms),
        tracker.wait(),
    )
    .await
    .is_err()
    {
        tracing::warn!(
            left = tracker.len(),
            "grace period over; leases left will expire into recovery"
        );
    }
    hints.abort();
    advisories.abort();
    Ok(())
}

/// The durable consumer of `step.ready` hints shared by executors.
const HINT_CONSUMER: &str = z29c_bus::EXECUTOR_CONSUMER;

/// Wakes the pool on `step.ready` hints. Hints are acknowledged at once: they carry no truth.
/// A message that is not a valid `step.ready` envelope is terminated (never redelivered) and
/// recorded with its reason; nothing is lost, since polling finds every claimable step anyway.
async fn listen_for_hints(bus: Bus, store: Store, wake: Arc<Notify>, shutdown: CancellationToken) {
    let consumer = match bus
        .pull_consumer(HINT_CONSUMER, Topic::StepReady, Duration::from_secs(5), 3)
        .await
    {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "no step.ready consumer; polling only");
            return;
        }
    };
    loop {
        let mut messages = match consumer.messages().await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "step.ready stream failed; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                next = messages.next() => match next {
                    Some(Ok(msg)) => {
                        if let Err(e) = z29c_bus::decode_on(&msg.payload, Topic::StepReady) {
                            let info = msg.info().ok();
                            poison(&store, PoisonMessage {
                                consumer: HINT_CONSUMER.into(),
                                subject: msg.subject.to_string(),
                                stream_sequence: info.as_ref().and_then(|i| i64::try_from(i.stream_sequence).ok()),
                                deliveries: info.as_ref().map(|i| i.delivered),
                                reason: e.to_string(),
                                payload: msg.payload.to_vec(),
                            }).await;
                            let _ = msg.ack_with(async_nats::jetstream::AckKind::Term).await;
                            continue;
                        }
                        // a hint continues the publisher's trace; it carries no truth
                        let span = tracing::info_span!("step.ready.hint", trace_id = tracing::field::Empty);
                        let traceparent = msg
                            .headers
                            .as_ref()
                            .and_then(|h| h.get(z29c_bus::TRACEPARENT_HEADER))
                            .map(|v| v.as_str().to_owned());
                        z29c_telemetry::trace::set_parent(&span, traceparent.as_deref());
                        let _ = msg.ack().instrument(span).await;
                        wake.notify_one();
                    }
                    Some(Err(e)) => {
                        tracing::debug!(error = %e, "hint error");
                    }
                    None => break,
                }
            }
        }
    }
}

/// Records a refused message (and counts it); a recording that fails is logged, the message is
/// terminated anyway: a hint is worth less than a stuck consumer.
async fn poison(store: &Store, m: PoisonMessage) {
    tracing::warn!(consumer = %m.consumer, subject = %m.subject, reason = %m.reason, "poison message terminated");
    z29c_telemetry::metrics::counter!(
        z29c_telemetry::POISON_MESSAGES,
        "consumer" => m.consumer.clone()
    )
    .increment(1);
    if let Err(e) = store.record_poison(&m).await {
        tracing::error!(error = %e, "poison message not recorded");
    }
}

/// Records JetStream's advisories that a hint ran out of deliveries (an executor that kept
/// dying before acking it, say). The step it hinted at is still found by polling.
async fn record_max_deliveries(bus: Bus, store: Store, shutdown: CancellationToken) {
    let mut advisories = match bus.max_delivery_advisories(HINT_CONSUMER).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "max-delivery advisories unavailable");
            return;
        }
    };
    loop {
        let advisory = tokio::select! {
            _ = shutdown.cancelled() => return,
            a = advisories.next() => match a {
                Some(a) => a,
                None => return,
            },
        };
        let parsed: Result<z29c_bus::MaxDeliveries, _> = serde_json::from_slice(&advisory.payload);
        let (sequence, deliveries, reason) = match parsed {
            Ok(a) => (
                i64::try_from(a.stream_seq).ok(),
                i64::try_from(a.deliveries).ok(),
                format!(
                    "delivered {} times without acknowledgement (max_deliver)",
                    a.deliveries
                ),
            ),
            Err(e) => (None, None, format!("max-deliveries advisory: {e}")),
        };
        poison(
            &store,
            PoisonMessage {
                consumer: HINT_CONSUMER.into(),
                subject: advisory.subject.to_string(),
                stream_sequence: sequence,
                deliveries,
                reason,
                payload: advisory.payload.to_vec(),
            },
        )
        .await;
    }
}
