//! The outbox relay and the workflow-deadline sweep.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use z29c_bus::wire::{self, envelope::Body};
use z29c_bus::{Bus, Topic};
use z29c_core::OwnerId;
use z29c_store::Store;
use z29c_store::outbox::OutboxMessage;

/// Publishes committed outbox messages with `Nats-Msg-Id`, then marks them sent. A relay that
/// dies between the two leaves its claim to expire; the next publish is a JetStream duplicate.
///
/// After a batch short of the limit it polls every 50 ms (other processes' transactions write
/// the outbox too); `wake` ends the wait at once, for this scheduler's own submissions.
pub async fn relay(
    store: Store,
    bus: Bus,
    id: String,
    wake: Arc<Notify>,
    shutdown: CancellationToken,
) {
    let Ok(owner) = OwnerId::parse(format!("{id}-relay")) else {
        tracing::error!(%id, "relay id is not a valid owner name");
        return;
    };
    // published, not yet marked: marked in the transaction that claims the next batch
    let mut sent: Vec<i64> = Vec::new();
    while !shutdown.is_cancelled() {
        let claimed = if sent.is_empty() {
            store.claim_outbox(&owner, BATCH, CLAIM_HOLD).await
        } else {
            store
                .mark_outbox_sent_and_claim(&sent, &owner, BATCH, CLAIM_HOLD)
                .await
                .map(|(_, next)| next)
        };
        // a failed mark republishes later under the same msg ids: duplicates JetStream drops
        sent.clear();
        let batch = match claimed {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "outbox claim failed; duplicates will be dropped by msg-id");
                pause(&shutdown, Duration::from_secs(1)).await;
                continue;
            }
        };
        // the batch is sent back to back, then its acknowledgements are awaited in order: one
        // round trip per batch instead of one per message. Only what the stream acknowledged is
        // marked; the rest is republished under the same msg ids once the claim expires
        let mut in_flight = Vec::with_capacity(batch.len());
        for msg in &batch {
            let Some(envelope) = envelope(msg) else {
                tracing::error!(kind = %msg.kind, id = msg.id, "outbox message of unknown kind; marking sent");
                sent.push(msg.id);
                continue;
            };
            // one span per message, in the workflow's trace; the consumer continues it
            let span = tracing::info_span!("outbox.publish", kind = %msg.kind, workflow = %msg.workflow_id, trace_id = tracing::field::Empty);
            z29c_telemetry::trace::set_parent(&span, msg.trace_context.as_deref());
            let traceparent = z29c_telemetry::trace::traceparent_of(&span);
            match bus
                .send_traced(&envelope, traceparent.as_deref())
                .instrument(span.clone())
                .await
            {
                Ok(pending) => in_flight.push((msg.id, pending, span)),
                Err(e) => {
                    tracing::warn!(error = %e, "publish failed; the claim will expire and be retried");
                    break;
                }
            }
        }
        for (id, pending, span) in in_flight {
            match pending.acked().instrument(span).await {
                Ok(_) => sent.push(id),
                Err(e) => {
                    tracing::warn!(error = %e, "publish not acknowledged; the claim will expire and be retried");
                }
            }
        }
        // a batch short of the limit took every message there was: wait for the next one
        // (a submission's wake is kept if it came during the publish) instead of asking again
        // at once, which found nothing almost every time at moderate load, a transaction each.
        // What was just published is marked with the next claim.
        if batch.len() < BATCH as usize {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = wake.notified() => {}
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
    }
    if !sent.is_empty()
        && let Err(e) = store.mark_outbox_sent(&sent).await
    {
        tracing::warn!(error = %e, "marking outbox sent failed; duplicates will be dropped by msg-id");
    }
}

/// Most messages claimed at once, and how long a claim holds them from other relays.
const BATCH: i64 = 200;
const CLAIM_HOLD: Duration = Duration::from_secs(30);

async fn pause(shutdown: &CancellationToken, d: Duration) {
    tokio::select! {
        _ = shutdown.cancelled() => {}
        _ = tokio::time::sleep(d) => {}
    }
}

/// The wire envelope for an outbox row.
pub fn envelope(msg: &OutboxMessage) -> Option<wire::Envelope> {
    let workflow_id = msg.workflow_id.to_string();
    let step_id = msg.step_id.map(|s| s.to_string()).unwrap_or_default();
    let text = |k: &str| {
        msg.payload
            .get(k)
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let body = match Topic::from_outbox_kind(&msg.kind)? {
        Topic::StepReady => Body::StepReady(wire::StepReady {
            workflow_id,
            step_id,
        }),
        Topic::StepCompleted => Body::StepCompleted(wire::StepCompleted {
            workflow_id,
            step_id,
            outcome: text("outcome"),
            verification: text("verification"),
        }),
        Topic::LateEvidence => Body::LateEvidence(wire::LateEvidence {
            workflow_id,
            step_id,
            observation_id: text("observation"),
        }),
        Topic::WorkflowChanged => Body::WorkflowChanged(wire::WorkflowChanged {
            workflow_id,
            state: text("state"),
        }),
    };
    Some(wire::Envelope {
        msg_id: msg.msg_id.clone(),
        created_at: Some(prost_types::Timestamp {
            seconds: msg.created_at.timestamp(),
            nanos: msg.created_at.timestamp_subsec_nanos() as i32,
        }),
        body: Some(body),
    })
}

/// Cancels running workflows whose deadline passed (their outcome is no longer useful), and
/// fails steps that waited, ready, past their schedule-to-start deadline.
pub async fn deadline_sweep(store: Store, shutdown: CancellationToken) {
    while !shutdown.is_cancelled() {
        match store.overdue_workflows(100).await {
            Ok(ids) => {
                for id in ids {
                    match store.cancel_workflow(id, "workflow deadline passed").await {
                        Ok(_) => {
                            tracing::info!(workflow = %id, "workflow deadline passed; cancelled")
                        }
                        Err(e) => {
                            tracing::warn!(workflow = %id, error = %e, "deadline cancel failed")
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "deadline sweep failed"),
        }
        // steps that waited, ready, past their schedule-to-start deadline: nothing was sent
        match store.steps_past_start_by(100).await {
            Ok(steps) => {
                for step in steps {
                    match store.fail_unstarted(step).await {
                        Ok(true) => {
                            tracing::info!(%step, "step not started within its schedule-to-start deadline; failed")
                        }
                        Ok(false) => {}
                        Err(e) => {
                            tracing::warn!(%step, error = %e, "schedule-to-start failure not recorded")
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "schedule-to-start sweep failed"),
        }
        pause(&shutdown, Duration::from_millis(500)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(kind: &str, payload: serde_json::Value) -> OutboxMessage {
        OutboxMessage {
            id: 1,
            msg_id: format!("{kind}-1"),
            kind: kind.into(),
            workflow_id: uuid::Uuid::nil(),
            step_id: Some(uuid::Uuid::max()),
            payload,
            created_at: chrono::DateTime::from_timestamp(1_800_000_000, 5).unwrap(),
            trace_context: None,
        }
    }

    #[test]
    fn a_completed_step_carries_its_outcome_and_how_it_was_known() {
        let m = message(
            "step_completed",
            serde_json::json!({ "outcome": "succeeded", "verification": "direct" }),
        );
        let e = envelope(&m).unwrap();
        assert_eq!(e.msg_id, "step_completed-1");
        assert_eq!(e.created_at.unwrap().seconds, 1_800_000_000);
        let Some(Body::StepCompleted(c)) = e.body else {
            panic!("a step_completed body")
        };
        assert_eq!(
            (c.outcome.as_str(), c.verification.as_str()),
            ("succeeded", "direct")
        );
        assert_eq!(c.step_id, uuid::Uuid::max().to_string());
    }

    #[test]
    fn a_workflow_message_names_no_step_and_a_missing_field_reads_empty() {
        let mut m = message("workflow_changed", serde_json::json!({}));
        m.step_id = None;
        let Some(Body::WorkflowChanged(w)) = envelope(&m).unwrap().body else {
            panic!("a workflow_changed body")
        };
        assert_eq!(w.state, "");
        assert_eq!(w.workflow_id, uuid::Uuid::nil().to_string());
    }

    #[test]
    fn a_kind_no_topic_carries_is_not_published() {
        assert!(envelope(&message("no_such_kind", serde_json::json!({}))).is_none());
    }
}
