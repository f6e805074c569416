//! One attempt, checkpoint by checkpoint (docs/design.md §4). Every durable step is fenced by the
//! store; this module decides only *what to try next*, never whether the lease still holds.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use z29c_core::{
    AdapterCapability, AfterRefusal, AfterWait, Checkpoint, Deadlines, ExternalReference,
    FenceReason, Outcome,
};
use z29c_proto::v1::{InvokeRequest, invoke_response};
use z29c_store::faults::{CrashPoint, crash_if_armed};
use z29c_store::leases::{ClaimedStep, CommitOutcome, Observed};
use z29c_store::receipts::ReceiptPath;
use z29c_store::{Store, StoreError};
use z29c_telemetry::metrics::counter;

use z29c_bus::gateways::Gateways;

/// What the renewal beside a call does after one renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Renewal {
    /// The lease holds (or the gateway has not committed *invocation began* yet, so the
    /// lease itself is current): renew again at the next tick.
    Continue,
    /// The database could not be asked (a dropped connection, a timeout): nothing says the
    /// lease is lost, so try again at the next tick. Giving up here would let a long call
    /// lose its lease to one network blip and send an opaque step to review.
    Retry,
    /// The gateway recorded the answer (*response observed*): the call is over.
    Answered,
    /// The store refused the renewal: the lease is gone (superseded, expired, past the
    /// attempt deadline), or asking again cannot mend what went wrong. The call finishes; its
    /// answer becomes late evidence.
    Lost,
}

/// The rule the renewal loop follows; `version` is the checkpoint version the attempt holds
/// once the gateway has committed *invocation began*.
fn after_renewal<T>(result: &Result<T, StoreError>, version: i64) -> Renewal {
    match result {
        Ok(_) => Renewal::Continue,
        Err(StoreError::Fenced(FenceReason::StaleCheckpoint { durable, .. }))
            if *durable < version =>
        {
            Renewal::Continue
        }
        Err(StoreError::Fenced(FenceReason::StaleCheckpoint { durable, .. }))
            if *durable > version =>
        {
            Renewal::Answered
        }
        Err(StoreError::Transient(_) | StoreError::Database(_)) => Renewal::Retry,
        Err(_) => Renewal::Lost,
    }
}

/// What an attempt needs from its executor.
#[derive(Debug, Clone)]
pub struct Context {
    pub store: Store,
    /// How receipts commit: each alone, or batched.
    pub receipts: ReceiptPath,
    pub gateways: Gateways,
    /// Cancelled at shutdown: attempts that have not begun their invocation give the step back.
    pub stop: CancellationToken,
    #[cfg(feature = "faults")]
    pub stall_after_response: Duration,
    #[cfg(feature = "faults")]
    pub stall_after_claim: Duration,
}

/// A worker's hold on the step it runs: its worker slot (one call in flight per worker) and
/// the step's place among the leases the executor may hold.
#[derive(Debug)]
pub struct Worker {
    pub slot: OwnedSemaphorePermit,
    pub held: OwnedSemaphorePermit,
    /// Places for answered steps whose receipts are being recorded.
    pub recording: Arc<Semaphore>,
    /// The claim loop's wake-up, and whether steps may be waiting to be claimed.
    pub wake: Arc<Notify>,
    pub backlog: Arc<AtomicBool>,
}

impl Worker {
    /// Once the answer is in, the worker goes on to its next call while the receipt commits:
    /// the slot and the lease's place are exchanged for a place among the steps being
    /// recorded. The lease itself stays this attempt's until its receipt (or late evidence)
    /// is durable. When every place is taken, the worker waits for one, so receipts that
    /// cannot keep up hold the workers back instead of piling up.
    async fn answered(self) -> Option<OwnedSemaphorePermit> {
        let recording = self.recording.acquire_owned().await.ok();
        drop(self.slot);
        drop(self.held);
        if self.backlog.load(Ordering::Relaxed) {
            self.wake.notify_one();
        }
        recording
    }
}

/// Runs one claimed step to a receipt, a release, or a hand-over to recovery. Errors are logged
/// here: the durable state is always left somewhere recovery can reason from.
pub async fn run(ctx: Context, step: ClaimedStep, claimed_at: Instant, worker: Worker) {
    let span = tracing::info_span!(
        "attempt",
        step = %step.lease.step,
        workflow = %step.workflow,
        lease_version = %step.lease.version,
        attempt = step.attempt_number,
        trace_id = tracing::field::Empty,
    );
    // the attempt joins the workflow's trace, begun at submission
    z29c_telemetry::trace::set_parent(&span, step.trace_context.as_deref());
    if let Err(e) = attempt(&ctx, &step, claimed_at, worker)
        .instrument(span)
        .await
    {
        match e {
            StoreError::Fenced(reason) => {
                counter!(z29c_telemetry::ATTEMPT_FENCING_REJECTIONS).increment(1);
                tracing::info!(step = %step.lease.step, %reason, "attempt stopped: lease no longer current");
            }
            e => tracing::warn!(step = %step.lease.step, error = %e, "attempt stopped"),
        }
    }
}

/// Gives back, unbegun, a step claimed ahead that no worker took in time (or at shutdown).
pub async fn give_back(ctx: &Context, step: &ClaimedStep) {
    tracing::debug!(step = %step.lease.step, "no worker free in time for a step claimed ahead; giving it back");
    if let Err(e) = ctx.store.release_unbegun(&step.lease).await {
        tracing::warn!(step = %step.lease.step, error = %e, "could not give back a step claimed ahead; its lease will expire into recovery");
    }
}

/// `claimed_at`: when the claim answered, on this process's monotonic clock (a step claimed
/// ahead may wait for a worker: its deadlines run from the claim).
async fn attempt(
    ctx: &Context,
    step: &ClaimedStep,
    claimed_at: Instant,
    worker: Worker,
) -> Result<(), StoreError> {
    let store = &ctx.store;
    let lease = &step.lease;
    // the claim created the attempt with its request identity, in one transaction
    crash_if_armed(CrashPoint::after(Checkpoint::AttemptCreated));
    crash_if_armed(CrashPoint::after(Checkpoint::RequestIdentityPersisted));
    #[cfg(feature = "faults")]
    if !ctx.stall_after_claim.is_zero() {
        tracing::warn!(
            attempt = %lease.attempt,
            ms = ctx.stall_after_claim.as_millis() as u64,
            "fault: stalling after the claim"
        );
        tokio::time::sleep(ctx.stall_after_claim).await;
    }

    // safe boundary: nothing has been sent yet
    if ctx.stop.is_cancelled() {
        return store.release_unbegun(lease).await;
    }
    let Some(gateway) = ctx.gateways.for_adapter(&step.adapter).await else {
        tracing::warn!(adapter = %step.adapter, "no gateway serves this adapter; giving the step back");
        return store
            .release_rate_limited(
                lease,
                Duration::from_secs(2),
                "no gateway serves the adapter",
            )
            .await
            .map(waited);
    };
    let Some(budget) = deadlines(step, claimed_at).call_budget() else {
        tracing::warn!(
            "no time left for a call before the attempt's deadline; giving the step back"
        );
        return store.release_unbegun(lease).await;
    };
    // The gateway commits *invocation began* under this lease, with its permit, right before
    // it sends (docs/design.md §4 step 3): from then on the attempt's checkpoint version is one
    // past the claim's.
    let version = step.checkpoint_version + 1;

    // renewal beside the call keeps a short lease alive through a long call; it stops when
    // fenced, and the commit below is fenced anyway, so a lost lease turns the answer into
    // late evidence
    let renewal = {
        let (store, lease, every) = (store.clone(), lease.clone(), step.policy.renew_every);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let result = store.renew(&lease, version).await;
                match after_renewal(&result, version) {
                    Renewal::Continue => {}
                    Renewal::Retry => {
                        counter!(z29c_telemetry::LEASE_RENEWAL_FAILURES).increment(1);
                        if let Err(e) = &result {
                            tracing::warn!(step = %lease.step, error = %e, "renewal failed; trying again at the next tick");
                        }
                    }
                    Renewal::Answered => return,
                    Renewal::Lost => {
                        counter!(z29c_telemetry::LEASE_RENEWAL_FAILURES).increment(1);
                        if let Err(e) = &result {
                            tracing::info!(step = %lease.step, error = %e, "renewal refused; finishing the call, then stopping");
                        }
                        return;
                    }
                }
            }
        })
    };

    let mut request = tonic::Request::new(InvokeRequest {
        adapter: step.adapter.clone(),
        operation: step.operation.clone(),
        request_identity: step.request_identity.to_string(),
        input_json: step.input.to_string(),
        input_digest: step.input_digest.to_string(),
        workflow_id: step.workflow.to_string(),
        step_id: lease.step.to_string(),
        attempt_id: lease.attempt.to_string(),
        lease_version: lease.version.get(),
        lease_owner: lease.owner.to_string(),
    });
    request.set_timeout(budget);
    let mut client = gateway.client;
    let call = tracing::info_span!("gateway.invoke", gateway = %gateway.gateway, budget_ms = budget.as_millis() as u64);
    let answer = async {
        z29c_telemetry::trace::inject_grpc(&mut request);
        client.invoke(request).await
    }
    .instrument(call)
    .await;
    // when the answer came, on PostgreSQL's clock as this worker reckons it
    let seen = step.db_now + chrono::TimeDelta::from_std(claimed_at.elapsed()).unwrap_or_default();
    renewal.abort();

    #[cfg(feature = "faults")]
    if !ctx.stall_after_response.is_zero() {
        tracing::warn!(
            ms = ctx.stall_after_response.as_millis() as u64,
            "fault: stalling after the response"
        );
        tokio::time::sleep(ctx.stall_after_response).await;
    }
    // the call is over: the worker takes its next step while this one's outcome is recorded
    let _recording = worker.answered().await;
    // the gateway recorded a definite answer before replying; here it is in this worker's
    // memory, and the receipt makes it the step's
    crash_if_armed(CrashPoint::before(Checkpoint::ResponseObserved));
    let response = match answer {
        Ok(r) => r.into_inner(),
        Err(status) => {
            // a gateway that never began the invocation sent nothing (it commits *invocation
            // began* before it sends, and the fenced release below means it never will under
            // this lease): the step waits, within its budget, for a gateway to answer
            let why = format!("gateway unreachable: {}", status.message());
            match store.release_unsent(lease, GATEWAY_RETRY, &why).await {
                Ok(after) => {
                    tracing::warn!(gateway = %gateway.gateway, %status, "gateway call failed before the invocation began; the step waits");
                    waited(after);
                    return Ok(());
                }
                Err(StoreError::Conflict(_)) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "could not give the step back; handing it to recovery");
                }
            }
            // the gateway may have called out before failing: unknown, recovery decides
            counter!(z29c_telemetry::STEP_UNKNOWN_OUTCOMES).increment(1);
            tracing::warn!(gateway = %gateway.gateway, %status, "gateway call failed; handing to recovery");
            return store.surrender(lease, &format!("gateway: {status}")).await;
        }
    };
    let observed = |outcome: Outcome, reference: Option<String>, result: Value| Observed {
        request_identity: step.request_identity.clone(),
        input_digest: step.input_digest.clone(),
        adapter_version: if response.adapter_version.is_empty() {
            "unknown".into()
        } else {
            response.adapter_version.clone()
        },
        outcome,
        external_reference: reference.and_then(|r| ExternalReference::parse(r).ok()),
        result,
        seen: Some(seen),
    };
    match response.outcome.clone() {
        Some(invoke_response::Outcome::Succeeded(s)) => {
            let result = serde_json::from_str(&s.result_json).unwrap_or(Value::Null);
            let o = observed(Outcome::Succeeded, Some(s.external_reference), result);
            report(ctx.receipts.commit_or_keep_late(&step.lease, &o).await?);
        }
        Some(invoke_response::Outcome::Rejected(r)) => {
            let status = u16::try_from(r.status).unwrap_or(0);
            // a refusal is sent again only where the destination de-duplicates by request
            // identity: a status taken for a refusal may still hide an effect
            if gateway.capability == AdapterCapability::Idempotent
                && step.policy.retry.retryable_statuses.contains(status)
            {
                match store.retry_refused(lease, status, &r.reason).await {
                    Ok(AfterRefusal::Retry { after }) => {
                        tracing::info!(step = %lease.step, status, after_ms = after.as_millis() as u64, "refused with a status the policy retries; trying again under the same request identity");
                        return Ok(());
                    }
                    Ok(AfterRefusal::Final) => {}
                    // the refusal is committed below, or kept as late evidence
                    Err(e) => {
                        tracing::warn!(step = %lease.step, error = %e, "could not schedule the retry of a refusal; recording the refusal")
                    }
                }
            }
            let result = serde_json::json!({ "status": r.status, "reason": r.reason });
            let o = observed(Outcome::Failed, None, result);
            report(ctx.receipts.commit_or_keep_late(&step.lease, &o).await?);
        }
        Some(invoke_response::Outcome::RateLimited(r)) => {
            store
                .release_rate_limited(
                    lease,
                    Duration::from_millis(r.retry_after_ms),
                    if r.reason.is_empty() {
                        "rate_limited"
                    } else {
                        &r.reason
                    },
                )
                .await
                .map(waited)?;
        }
        Some(invoke_response::Outcome::NotBegun(n)) => {
            // the gateway's fence refused *invocation began*: nothing was sent
            if n.workflow_ended {
                // cancelled before anything was sent: stop here
                return store.release_unbegun(lease).await;
            }
            counter!(z29c_telemetry::ATTEMPT_FENCING_REJECTIONS).increment(1);
            tracing::info!(step = %lease.step, reason = %n.reason, "invocation not begun: lease no longer current");
        }
        Some(invoke_response::Outcome::Unknown(u)) => {
            counter!(z29c_telemetry::STEP_UNKNOWN_OUTCOMES).increment(1);
            store
                .surrender(lease, &format!("outcome unknown: {}", u.reason))
                .await?;
        }
        None => {
            counter!(z29c_telemetry::STEP_UNKNOWN_OUTCOMES).increment(1);
            store.surrender(lease, "gateway answered nothing").await?;
        }
    }
    Ok(())
}

/// How long a step waits when no gateway serves its adapter, or none could be reached.
const GATEWAY_RETRY: Duration = Duration::from_secs(2);

/// Logs a wait that ended its step (its budget spent); the history says why.
fn waited(after: AfterWait) {
    match after {
        AfterWait::Wait { .. } => {}
        AfterWait::Fail(reason) => {
            tracing::warn!(%reason, "the step waited past its budget and failed")
        }
        AfterWait::Review(reason) => {
            tracing::warn!(%reason, "the step waited past its budget and goes to review")
        }
    }
}

fn report(outcome: CommitOutcome) {
    match outcome {
        CommitOutcome::Committed(r) => {
            z29c_telemetry::receipt_committed(
                "direct",
                r.outcome.as_str(),
                (r.committed_at - r.step_created_at)
                    .to_std()
                    .unwrap_or_default(),
            );
            crash_if_armed(CrashPoint::after(Checkpoint::ReceiptCommitted));
            tracing::info!(step = %r.step, reference = ?r.external_reference, outcome = %r.outcome, "receipt committed");
        }
        CommitOutcome::Late {
            observation,
            reason,
        } => {
            // the commit was refused by the fence; what was seen is kept, never lost
            counter!(z29c_telemetry::ATTEMPT_FENCING_REJECTIONS).increment(1);
            counter!(z29c_telemetry::ATTEMPT_LATE_OBSERVATIONS).increment(1);
            tracing::warn!(%observation, %reason, "lease lost before the answer: kept as late evidence");
        }
    }
}

/// The deadlines that bound a call, as this worker sees them: PostgreSQL's times at claim, minus the time
/// this process has measured since on its monotonic clock. Its wall clock plays no part.
fn deadlines(step: &ClaimedStep, claimed_at: Instant) -> Deadlines {
    let elapsed = claimed_at.elapsed();
    let left = |until: chrono::DateTime<chrono::Utc>| {
        (until - step.db_now)
            .to_std()
            .unwrap_or_default()
            .saturating_sub(elapsed)
    };
    Deadlines {
        adapter_timeout: step.policy.adapter_timeout,
        attempt_left: left(step.attempt_deadline),
        workflow_left: step.workflow_deadline.map(left),
        final_grace: step.policy.final_grace,
    }
}

#[cfg(test)]
mod tests {
    use z29c_core::{LeaseVersion, StepState};

    use super::*;

    const BEGUN: i64 = 4;

    fn fenced(reason: FenceReason) -> Result<(), StoreError> {
        Err(StoreError::Fenced(reason))
    }

    fn stale(durable: i64) -> Result<(), StoreError> {
        fenced(FenceReason::StaleCheckpoint {
            presented: BEGUN,
            durable,
        })
    }

    #[test]
    fn a_renewed_lease_keeps_renewing() {
        assert_eq!(after_renewal(&Ok(()), BEGUN), Renewal::Continue);
    }

    #[test]
    fn a_call_not_begun_yet_keeps_renewing() {
        assert_eq!(after_renewal(&stale(BEGUN - 1), BEGUN), Renewal::Continue);
    }

    #[test]
    fn an_answer_on_record_ends_the_renewal() {
        assert_eq!(after_renewal(&stale(BEGUN + 1), BEGUN), Renewal::Answered);
    }

    #[test]
    fn a_database_that_cannot_be_reached_is_asked_again() {
        let dropped = Err::<(), _>(StoreError::Transient(sqlx::Error::PoolTimedOut));
        assert_eq!(after_renewal(&dropped, BEGUN), Renewal::Retry);
        let other = Err::<(), _>(StoreError::Database(sqlx::Error::Protocol("eof".into())));
        assert_eq!(after_renewal(&other, BEGUN), Renewal::Retry);
    }

    #[test]
    fn every_other_refusal_of_the_fence_means_the_lease_is_lost() {
        let refusals = [
            FenceReason::Superseded {
                presented: LeaseVersion::new(1).unwrap(),
                current: LeaseVersion::new(2).unwrap(),
            },
            FenceReason::NotOwner,
            FenceReason::NotLeased {
                state: StepState::Ready,
            },
            FenceReason::Expired,
            FenceReason::NotCurrentAttempt,
            FenceReason::AttemptDeadlineReached,
            FenceReason::Changed,
            // a renewal that carries the checkpoint version the store holds is never refused
            // as stale; if it were, the lease is not this attempt's to keep
            FenceReason::StaleCheckpoint {
                presented: BEGUN,
                durable: BEGUN,
            },
        ];
        for reason in refusals {
            let shown = reason.to_string();
            assert_eq!(
                after_renewal(&fenced(reason), BEGUN),
                Renewal::Lost,
                "{shown}"
            );
        }
        // an error asking again cannot mend (the step gone, a stored value unreadable)
        for e in [
            StoreError::NotFound { what: "step" },
            StoreError::Corrupt("state".into()),
        ] {
            assert_eq!(after_renewal(&Err::<(), _>(e), BEGUN), Renewal::Lost);
        }
    }
}
