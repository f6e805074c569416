//! The `AdapterGateway` gRPC service and the permit discipline around each call.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument;
use z29c_core::{
    Checkpoint, ExternalReference, FenceReason, InputDigest, LeaseClaim, Outcome, RequestIdentity,
};
use z29c_proto::v1::adapter_gateway_server::AdapterGateway;
use z29c_proto::v1::{
    self as pb, DescribeRequest, DescribeResponse, InvokeRequest, InvokeResponse, QueryRequest,
    QueryResponse, invoke_response, query_response,
};
use z29c_runtime::status_from_store;
use z29c_store::faults::{CrashPoint, crash_if_armed};
use z29c_store::invocations::InvocationPath;
use z29c_store::leases::{Observation, Observed};
use z29c_store::permits::{EndedPermit, Permit, PermitRequest};
use z29c_store::{Store, StoreError};

use crate::adapter::{Adapters, Inquiry, Invocation};
use crate::config::{AdapterConfig, GatewayConfig};
use crate::http::{CallOutcome, QueryOutcome};

/// What a caller without a deadline gets (at most `grpc.max_deadline_ms`).
const DEFAULT_CALL: Duration = Duration::from_secs(10);
/// A call with less time than this left is not sent at all (nothing sent, retry later).
const MIN_CALL: Duration = Duration::from_millis(20);
use z29c_core::capability::STATUS_QUERY_CLASS as STATUS_CLASS;
/// When the permits are all taken, come back after this.
const PERMIT_RETRY: Duration = Duration::from_millis(200);

#[derive(Debug, Clone)]
pub struct Gateway {
    config: GatewayConfig,
    store: Store,
    /// How *invocation began* commits with its permit: each alone, or batched.
    invocations: InvocationPath,
    /// This instance's own capacity: calls it runs at once (`max_calls`). The adapter's
    /// permit limit bounds all instances together; this bounds one, so another instance adds
    /// usable capacity up to that limit.
    calls: Arc<Semaphore>,
    /// Calls that have ended, their permits not yet released: the next permit statement
    /// releases them, or [`Gateway::release_ended`] does after `release_linger_ms`.
    ended: Arc<std::sync::Mutex<Ended>>,
    ended_added: Arc<Notify>,
    /// Operation classes this instance gave their adapter's default limit. Held across the
    /// write, so calls that find a class without a limit together wait for one write.
    defaults_set: Arc<tokio::sync::Mutex<HashSet<(String, String)>>>,
    /// The adapters that make the calls, by name.
    adapters: Made,
}

/// The adapters a gateway made, shown by name.
#[derive(Clone)]
struct Made(Arc<Adapters>);

impl std::fmt::Debug for Made {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

impl Gateway {
    /// The gateway's service, its calls made by `adapters` ([`crate::adapter::build`]).
    pub fn new(
        config: GatewayConfig,
        store: Store,
        invocations: InvocationPath,
        adapters: Adapters,
    ) -> Self {
        let calls = Arc::new(Semaphore::new(config.max_calls));
        Self {
            adapters: Made(Arc::new(adapters)),
            config,
            store,
            invocations,
            calls,
            ended: Arc::default(),
            ended_added: Arc::default(),
            defaults_set: Arc::default(),
        }
    }

    /// Gives an operation class without a limit its adapter's default, once per class in this
    /// instance. On a fresh database the first calls all find the class missing: each writing
    /// the limit queued them on its row, one commit after another (32 writes of 13–16 ms each
    /// at the start of a benchmark run). Now the first writes it and the others wait for that
    /// write, then take their permits.
    async fn set_default_limit(&self, adapter: &AdapterConfig, class: &str) -> Result<(), Status> {
        let mut set = self.defaults_set.lock().await;
        let key = (adapter.name.clone(), class.to_owned());
        if set.contains(&key) {
            return Ok(());
        }
        self.store
            .set_permit_limit(
                &adapter.name,
                class,
                i32::try_from(adapter.default_limit).unwrap_or(i32::MAX),
            )
            .await
            .map_err(status_from_store)?;
        set.insert(key);
        Ok(())
    }

    fn take_ended(&self) -> Ended {
        std::mem::take(&mut *self.ended.lock().expect("ended permits lock"))
    }

    fn keep_ended(&self, ended: Ended) {
        if ended.permits.is_empty() && ended.slots.is_empty() {
            return;
        }
        let mut kept = self.ended.lock().expect("ended permits lock");
        kept.permits.extend(ended.permits);
        kept.slots.extend(ended.slots);
        drop(kept);
        self.ended_added.notify_one();
    }

    /// Releases the permits of ended calls that no permit transaction took along within
    /// `release_linger_ms`, until `shutdown`, then the last ones.
    pub async fn release_ended(self, shutdown: CancellationToken) {
        let linger = Duration::from_millis(self.config.release_linger_ms);
        loop {
            let stopping = tokio::select! {
                _ = self.ended_added.notified() => false,
                _ = shutdown.cancelled() => true,
            };
            if !stopping {
                tokio::time::sleep(linger).await;
            }
            let ended = self.take_ended();
            if !ended.permits.is_empty()
                && let Err(e) = self.store.release_permits(&ended.permits).await
            {
                // their holds run out by themselves; until then they count, which is safe
                tracing::warn!(error = %e, permits = ended.permits.len(), "permit release failed; retrying");
                if !stopping {
                    self.keep_ended(ended);
                    tokio::time::sleep(PERMIT_RETRY).await;
                }
            }
            if stopping {
                return;
            }
        }
    }

    fn max_call(&self) -> Duration {
        Duration::from_millis(self.config.grpc.max_deadline_ms)
    }

    fn adapter(&self, name: &str) -> Result<&AdapterConfig, Status> {
        self.config
            .adapters
            .iter()
            .find(|a| a.name == name)
            .ok_or_else(|| Status::not_found(format!("adapter {name:?} is not served here")))
    }
}

/// The caller's deadline from `grpc-timeout`, capped at `max` (the server's deadline cap, so
/// the gateway answers "unknown" itself before the transport would cut the call); a little is
/// kept back for the answer.
fn call_timeout<T>(req: &Request<T>, max: Duration) -> Duration {
    let parsed = req
        .metadata()
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(grpc_timeout);
    let d = parsed.unwrap_or(DEFAULT_CALL).min(max);
    d.saturating_sub(ANSWER_RESERVE.min(d / 10))
}

/// A `grpc-timeout` value (digits and a unit: `H`, `M`, `S`, `m`, `u`, `n`); `None` for
/// anything else, and a saturated duration rather than an overflow for absurd hours.
fn grpc_timeout(v: &str) -> Option<Duration> {
    let unit = v.chars().last()?;
    let n: u64 = v.strip_suffix(unit)?.parse().ok()?;
    Some(match unit {
        'H' => Duration::from_secs(n.saturating_mul(3600)),
        'M' => Duration::from_secs(n.saturating_mul(60)),
        'S' => Duration::from_secs(n),
        'm' => Duration::from_millis(n),
        'u' => Duration::from_micros(n),
        'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Kept back from a call's deadline for what follows the adapter's answer (the permit's
/// release or hold in PostgreSQL, the reply), so the gateway answers before the deadline.
const ANSWER_RESERVE: Duration = Duration::from_millis(200);

/// What a definite answer established, as the attempt records it; `None` for an answer that
/// establishes nothing (unknown, rate limited, not sent).
fn observation(
    outcome: &CallOutcome,
    identity: &RequestIdentity,
    input_digest: &str,
    adapter: &AdapterConfig,
) -> Option<Observed> {
    let (outcome, external_reference, result) = match outcome {
        CallOutcome::Succeeded { reference, result } => (
            Outcome::Succeeded,
            Some(ExternalReference::parse(reference.clone()).ok()?),
            result.clone(),
        ),
        CallOutcome::Rejected { status, reason } => (
            Outcome::Failed,
            None,
            serde_json::json!({ "status": status, "reason": reason }),
        ),
        _ => return None,
    };
    Some(Observed {
        request_identity: identity.clone(),
        input_digest: InputDigest::parse(input_digest.to_owned()).ok()?,
        adapter_version: if adapter.version.is_empty() {
            "unknown".into()
        } else {
            adapter.version.clone()
        },
        outcome,
        external_reference,
        result,
        seen: None,
    })
}

/// The answer to a call turned away before it took a permit (this instance full, or the
/// adapter's limit reached): "rate limited, retry shortly", counted under `result`.
fn turned_away(adapter: &AdapterConfig, result: &'static str) -> Response<InvokeResponse> {
    z29c_telemetry::metrics::counter!(
        z29c_telemetry::ATTEMPT_INVOCATIONS,
        "adapter" => adapter.name.clone(),
        "result" => result
    )
    .increment(1);
    Response::new(InvokeResponse {
        outcome: Some(invoke_response::Outcome::RateLimited(pb::RateLimited {
            retry_after_ms: PERMIT_RETRY.as_millis() as u64,
            reason: result.into(),
        })),
        adapter_version: adapter.version.clone(),
    })
}

impl Gateway {
    /// Refuses a call that is not an attempt's own request (`FAILED_PRECONDITION`, saying
    /// why) and records the refusal in the audit log.
    async fn refuse(&self, peer: Option<String>, why: &str) -> Status {
        self.audit_refusal(peer, why).await;
        Status::failed_precondition(why)
    }

    /// Records a call the gateway did not send, and why, in the audit log (and the log).
    async fn audit_refusal(&self, peer: Option<String>, why: &str) {
        tracing::warn!(
            peer = peer.as_deref().unwrap_or(""),
            reason = why,
            "call refused"
        );
        let entry = z29c_store::audit::AuditEntry {
            service: "z29c.v1.AdapterGateway".into(),
            method: "Invoke".into(),
            subject: None,
            action: "invoke".into(),
            outcome: "refused".into(),
            detail: why.to_owned(),
            peer,
        };
        if let Err(e) = self.store.audit(&entry).await {
            tracing::error!(error = %e, "the refusal's audit record was not written");
        }
    }

    /// One invocation: permit (with *invocation began*, under a lease), the adapter's call, the
    /// permit's release (or its hand-over to the next permit's transaction), the answer.
    async fn call(
        &self,
        request: Request<InvokeRequest>,
    ) -> Result<Response<InvokeResponse>, Status> {
        // the budget runs from the request's arrival: taking the permit spends it too
        let deadline = tokio::time::Instant::now() + call_timeout(&request, self.max_call());
        let peer = request.remote_addr().map(|a| a.to_string());
        let req = request.into_inner();
        // a call this gateway cannot make is refused as it always was, and audited as every
        // other refusal
        let adapter = match self.adapter(&req.adapter) {
            Ok(adapter) => adapter,
            Err(status) => {
                self.audit_refusal(peer, &format!("adapter: {}", status.message()))
                    .await;
                return Err(status);
            }
        };
        let z29c_proto::validate::ValidInvoke {
            identity,
            input,
            attempt,
            lease,
            ..
        } = match z29c_proto::validate::invoke(&req) {
            Ok(valid) => valid,
            Err(invalid) => {
                let status = Status::from(invalid);
                self.audit_refusal(peer, status.message()).await;
                return Err(status);
            }
        };
        // Only an attempt's own request reaches the outside world: the caller names the
        // attempt, and what is sent is what PostgreSQL holds for it.
        let Some(claim) = &lease else {
            return Err(self
                .refuse(
                    peer,
                    "attempt_id: a call is sent only under an attempt's lease, and this one names no attempt",
                )
                .await);
        };
        let input = match self
            .store
            .attempt_request(claim.step, claim.attempt)
            .await
            .map_err(status_from_store)?
        {
            None => {
                // a claim PostgreSQL never kept (lost in a crash) or made up: the lease is
                // not current, which the caller is told as the fence would tell it, so an
                // executor stops; the refusal is audited all the same
                let why = format!(
                    "attempt_id: step {} has no attempt {}",
                    claim.step, claim.attempt
                );
                self.audit_refusal(peer, &why).await;
                return Ok(not_begun(adapter, FenceReason::NotCurrentAttempt));
            }
            Some(persisted) => {
                if let Some(field) = persisted.differs_from(
                    identity.as_str(),
                    &input,
                    &req.input_digest,
                    &req.adapter,
                    &req.operation,
                ) {
                    return Err(self
                        .refuse(
                            peer,
                            &format!(
                                "{field}: not the one attempt {} of step {} was claimed with",
                                claim.attempt, claim.step
                            ),
                        )
                        .await);
                }
                persisted.input
            }
        };
        // The ended calls' permits go with this call's permit statement, and the capacity
        // they held here with them: it comes back once their releases are durable, so no call
        // of this instance begins before the releases of the calls whose places it takes (the
        // permit history never shows more calls at once than `max_calls`).
        let mut carried = self.take_ended();
        let slot = match carried.slots.pop() {
            Some(slot) => slot,
            None => match self.calls.clone().try_acquire_owned() {
                Ok(slot) => slot,
                Err(_) => {
                    // a full instance turns the call away before it takes a permit another
                    // could use
                    self.keep_ended(carried);
                    return Ok(turned_away(adapter, "instance_busy"));
                }
            },
        };
        let permit_req = PermitRequest {
            adapter: &adapter.name,
            operation_class: &req.operation,
            attempt,
            request_identity: &identity,
            gateway: &self.config.id,
            // a call may outlive its lease: its permit holds until the call's own deadline
            hold: Duration::from_millis(adapter.permit_hold_ms).max(
                deadline.saturating_duration_since(tokio::time::Instant::now()) + ANSWER_RESERVE,
            ),
        };
        let permit = match self
            .take_permit(adapter, lease.as_ref(), &permit_req, carried)
            .await?
        {
            Taken::Permit(p) => p,
            Taken::Exhausted => return Ok(turned_away(adapter, "no_permit")),
            Taken::NotBegun(reason) => {
                // a stale lease, or a workflow that ended: the fence turned the call away,
                // and the caller is told so in the protocol's words, so an executor stops
                let field = match reason {
                    FenceReason::WorkflowForbids { .. } => "step_id",
                    _ => "lease_version",
                };
                self.audit_refusal(
                    peer,
                    &format!(
                        "{field}: the call of step {} under lease v{} did not begin: {reason}",
                        claim.step, claim.version
                    ),
                )
                .await;
                return Ok(not_begun(adapter, reason));
            }
        };
        if lease.is_some() {
            // *invocation began* is durable, nothing is sent yet
            crash_if_armed(CrashPoint::after(Checkpoint::InvocationBegan));
        }

        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let outcome = if left < MIN_CALL {
            CallOutcome::NotSent {
                reason: format!("{} ms left of the caller's deadline", left.as_millis()),
            }
        } else {
            // the adapter answers within the call's time, or it is unknown
            let call = self.adapters.0[&adapter.name].invoke(Invocation {
                operation: &req.operation,
                identity: identity.as_str(),
                input: &input,
                timeout: left,
            });
            tokio::time::timeout(left, call)
                .await
                .unwrap_or_else(|_| CallOutcome::Unknown {
                    reason: format!("no answer within {} ms", left.as_millis()),
                })
        };
        #[cfg(feature = "faults")]
        if self.config.fault_crash_after_destination
            && matches!(outcome, CallOutcome::Succeeded { .. })
        {
            tracing::error!(request_identity = %identity, "fault: crashing after the destination committed");
            std::process::abort();
        }
        // the answer becomes durable here, before it travels on: a worker that pauses, dies
        // or stops waiting after this loses nothing (recovery reconciles from it)
        if let Some(lease) = &lease
            && let Some(observed) = observation(&outcome, &identity, &req.input_digest, adapter)
        {
            match self.store.observe_response(lease, &observed).await {
                Ok(Observation::Recorded) => {}
                Ok(Observation::Late(id)) => {
                    tracing::warn!(observation = %id, request_identity = %identity, "the attempt's lease moved on during the call: its answer is kept as a late observation");
                }
                Err(e) => {
                    tracing::warn!(error = %e, request_identity = %identity, "recording the answer failed; its worker records it with the receipt");
                }
            }
        }
        let (release, answer) = match outcome {
            CallOutcome::Succeeded { reference, result } => (
                Some("succeeded"),
                invoke_response::Outcome::Succeeded(pb::Succeeded {
                    external_reference: reference,
                    result_json: result.to_string(),
                }),
            ),
            CallOutcome::Rejected { status, reason } => (
                Some("rejected"),
                invoke_response::Outcome::Rejected(pb::Rejected {
                    reason,
                    status: u32::from(status),
                }),
            ),
            CallOutcome::RateLimited { retry_after } => (
                Some("rate_limited"),
                invoke_response::Outcome::RateLimited(pb::RateLimited {
                    retry_after_ms: retry_after.as_millis() as u64,
                    reason: "rate_limited".into(),
                }),
            ),
            CallOutcome::NotSent { reason } => {
                tracing::warn!(adapter = %adapter.name, %reason, "request not sent");
                (
                    Some("not_sent"),
                    invoke_response::Outcome::RateLimited(pb::RateLimited {
                        retry_after_ms: 1_000,
                        reason: "not_sent".into(),
                    }),
                )
            }
            CallOutcome::Unknown { reason } => {
                tracing::warn!(adapter = %adapter.name, request_identity = %identity, %reason, "outcome unknown");
                (
                    None,
                    invoke_response::Outcome::Unknown(pb::Unknown { reason }),
                )
            }
        };
        z29c_telemetry::metrics::counter!(
            z29c_telemetry::ATTEMPT_INVOCATIONS,
            "adapter" => adapter.name.clone(),
            "result" => release.unwrap_or("unknown")
        )
        .increment(1);
        let permit_result = match release {
            Some(reason) if self.config.release_linger_ms > 0 => {
                self.keep_ended(Ended {
                    permits: vec![EndedPermit::now(permit.id, reason)],
                    slots: vec![slot],
                });
                Ok(())
            }
            Some(reason) => self.store.release_permit(permit.id, reason).await,
            None => {
                self.store
                    .hold_permit_unknown(permit.id, Duration::from_millis(adapter.safety_window_ms))
                    .await
            }
        };
        if let Err(e) = permit_result {
            // the answer matters more than the permit's bookkeeping, which expires by itself
            tracing::warn!(error = %e, permit = %permit.id, "permit update failed");
        }
        Ok(Response::new(InvokeResponse {
            outcome: Some(answer),
            adapter_version: adapter.version.clone(),
        }))
    }

    /// A permit for this call; under a lease, with *invocation began* committed in the same
    /// transaction. An operation class without a configured limit gets the adapter's default
    /// on first use.
    async fn take_permit(
        &self,
        adapter: &AdapterConfig,
        lease: Option<&LeaseClaim>,
        req: &PermitRequest<'_>,
        mut carried: Ended,
    ) -> Result<Taken, Status> {
        // the ended calls' permits are released with this call's permit (their capacity then
        // comes back), or kept for the next one
        let _released = CarriedBack(self, &mut carried);
        let carried = &mut *_released.1;
        for _ in 0..2 {
            let taken = match lease {
                Some(l) => {
                    let ended = &carried.permits;
                    let taken = self
                        .invocations
                        .begin_invocation_with_permit(l, req, ended)
                        .await;
                    if taken.is_ok() {
                        // released: their capacity comes back as this returns
                        carried.permits.clear();
                    }
                    taken.map(|t| t.0)
                }
                None => self.store.acquire_permit(req).await,
            };
            match taken {
                Ok(p) => return Ok(Taken::Permit(p)),
                Err(StoreError::PermitsExhausted { .. }) => return Ok(Taken::Exhausted),
                Err(StoreError::Fenced(reason)) => return Ok(Taken::NotBegun(reason)),
                Err(StoreError::NotFound { what: "step" }) => {
                    return Err(Status::not_found(
                        "the lease names a step that does not exist",
                    ));
                }
                Err(StoreError::NotFound { .. }) => {
                    self.set_default_limit(adapter, req.operation_class).await?;
                }
                Err(e) => return Err(status_from_store(e)),
            }
        }
        Err(Status::internal("adapter limit could not be set"))
    }
}

/// Calls that have ended: their permits, to be released, and the capacity of this instance
/// they held, given back once those releases are durable.
#[derive(Debug, Default)]
struct Ended {
    permits: Vec<EndedPermit>,
    slots: Vec<OwnedSemaphorePermit>,
}

/// On drop: ended calls whose permits are still to be released go back to the gateway's list
/// with their capacity; the capacity of those released comes back.
struct CarriedBack<'a>(&'a Gateway, &'a mut Ended);

impl Drop for CarriedBack<'_> {
    fn drop(&mut self) {
        let ended = std::mem::take(self.1);
        if ended.permits.is_empty() {
            drop(ended.slots);
        } else {
            self.0.keep_ended(ended);
        }
    }
}

/// What [`Gateway::take_permit`] got.
enum Taken {
    Permit(Permit),
    /// The class is at its limit: nothing began.
    Exhausted,
    /// The lease's fence refused *invocation began*: nothing began, nothing may be sent.
    NotBegun(FenceReason),
}

/// The answer to a call whose *invocation began* was refused by the lease's fence.
fn not_begun(adapter: &AdapterConfig, reason: FenceReason) -> Response<InvokeResponse> {
    z29c_telemetry::metrics::counter!(
        z29c_telemetry::ATTEMPT_INVOCATIONS,
        "adapter" => adapter.name.clone(),
        "result" => "not_begun"
    )
    .increment(1);
    Response::new(InvokeResponse {
        outcome: Some(invoke_response::Outcome::NotBegun(pb::NotBegun {
            workflow_ended: matches!(reason, FenceReason::WorkflowForbids { .. }),
            reason: reason.to_string(),
        })),
        adapter_version: adapter.version.clone(),
    })
}

#[tonic::async_trait]
impl AdapterGateway for Gateway {
    async fn invoke(
        &self,
        request: Request<InvokeRequest>,
    ) -> Result<Response<InvokeResponse>, Status> {
        let span = tracing::info_span!("gateway.invoke", adapter = %request.get_ref().adapter, trace_id = tracing::field::Empty);
        z29c_telemetry::trace::set_parent(
            &span,
            z29c_telemetry::trace::grpc_traceparent(&request).as_deref(),
        );
        // The call runs to its end even if the caller goes away (an executor killed mid-call):
        // an external call cut off halfway would turn a known outcome into an unknown one and
        // leave its permit counting until it expires.
        let this = self.clone();
        tokio::spawn(async move { this.call(request).await }.instrument(span))
            .await
            .map_err(|e| Status::internal(format!("the call's task failed: {e}")))?
    }

    async fn query(
        &self,
        request: Request<QueryRequest>,
    ) -> Result<Response<QueryResponse>, Status> {
        let span = tracing::info_span!("gateway.query", adapter = %request.get_ref().adapter, trace_id = tracing::field::Empty);
        z29c_telemetry::trace::set_parent(
            &span,
            z29c_telemetry::trace::grpc_traceparent(&request).as_deref(),
        );
        async move {
            let timeout = call_timeout(&request, self.max_call());
            let req = request.into_inner();
            let adapter = self.adapter(&req.adapter)?;
            if adapter.capability == z29c_core::AdapterCapability::Opaque {
                return Err(Status::failed_precondition(format!(
                    "adapter {:?} is opaque: it cannot be queried",
                    adapter.name
                )));
            }
            let identity = RequestIdentity::parse(req.request_identity)
                .map_err(|e| Status::invalid_argument(format!("request_identity: {}", e.reason)))?;
            // a status query loads the destination as a call does: it takes a permit, of its
            // own operation class, so queries are bounded and never take a call's place
            let permit_req = PermitRequest {
                adapter: &adapter.name,
                operation_class: STATUS_CLASS,
                attempt: None,
                request_identity: &identity,
                gateway: &self.config.id,
                hold: timeout + ANSWER_RESERVE,
            };
            // a full class is waited on, within the query's own time: an answer of "no
            // permit" would count as a query unanswered, and enough of those ask a person
            let until = tokio::time::Instant::now() + timeout;
            let permit = loop {
                match self
                    .take_permit(adapter, None, &permit_req, Ended::default())
                    .await?
                {
                    Taken::Permit(p) => break p,
                    Taken::Exhausted | Taken::NotBegun(_)
                        if tokio::time::Instant::now() + PERMIT_RETRY < until =>
                    {
                        tokio::time::sleep(PERMIT_RETRY).await;
                    }
                    Taken::Exhausted | Taken::NotBegun(_) => {
                        let reason = format!(
                            "no permit free for a status query within {} ms (operation class {STATUS_CLASS:?} of adapter {:?} at its limit)",
                            timeout.as_millis(),
                            adapter.name
                        );
                        return Ok(Response::new(QueryResponse {
                            status: Some(query_response::Status::Unknown(pb::Unknown { reason })),
                        }));
                    }
                }
            };
            let timeout = until.saturating_duration_since(tokio::time::Instant::now());
            let asked = self.adapters.0[&adapter.name].query(Inquiry {
                identity: identity.as_str(),
                timeout,
            });
            let answer = tokio::time::timeout(timeout, asked)
                .await
                .unwrap_or_else(|_| QueryOutcome::Unknown {
                    reason: format!("no answer within {} ms", timeout.as_millis()),
                });
            if let Err(e) = self.store.release_permit(permit.id, "queried").await {
                // it stops counting when its hold runs out
                tracing::warn!(error = %e, permit = %permit.id, "status query permit release failed");
            }
            let status = match answer {
                QueryOutcome::Found { reference, result } => {
                    query_response::Status::Found(pb::Succeeded {
                        external_reference: reference,
                        result_json: result.to_string(),
                    })
                }
                QueryOutcome::NotFound => query_response::Status::NotFound(pb::NotFound {}),
                QueryOutcome::Unknown { reason } => {
                    query_response::Status::Unknown(pb::Unknown { reason })
                }
            };
            Ok(Response::new(QueryResponse {
                status: Some(status),
            }))
        }
        .instrument(span)
        .await
    }

    async fn describe(
        &self,
        _request: Request<DescribeRequest>,
    ) -> Result<Response<DescribeResponse>, Status> {
        let adapters = self
            .config
            .adapters
            .iter()
            .map(|a| pb::AdapterDescription {
                name: a.name.clone(),
                version: a.version.clone(),
                capability: capability_to_wire(a.capability) as i32,
                limits: a
                    .limits
                    .iter()
                    .map(|(class, max)| pb::OperationLimit {
                        operation_class: class.clone(),
                        max_in_flight: *max,
                    })
                    .collect(),
            })
            .collect();
        Ok(Response::new(DescribeResponse {
            gateway_id: self.config.id.clone(),
            adapters,
        }))
    }
}

pub fn capability_to_wire(c: z29c_core::AdapterCapability) -> pb::AdapterCapability {
    match c {
        z29c_core::AdapterCapability::Idempotent => pb::AdapterCapability::Idempotent,
        z29c_core::AdapterCapability::Queryable => pb::AdapterCapability::Queryable,
        z29c_core::AdapterCapability::Opaque => pb::AdapterCapability::Opaque,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grpc_timeout_is_read_in_its_unit_or_not_at_all() {
        let cases = [
            ("100m", Some(Duration::from_millis(100))),
            ("5S", Some(Duration::from_secs(5))),
            ("2M", Some(Duration::from_secs(120))),
            ("1H", Some(Duration::from_secs(3600))),
            ("250u", Some(Duration::from_micros(250))),
            ("7n", Some(Duration::from_nanos(7))),
            (
                "99999999999999999999H",
                None, // not a u64: ignored, the default applies
            ),
            (
                "9999999999999999H",
                Some(Duration::from_secs(
                    9_999_999_999_999_999u64.saturating_mul(3600),
                )),
            ),
            ("", None),
            ("m", None),
            ("12", None),
            ("12x", None),
            ("-5S", None),
            ("5 S", None),
            ("5é", None),
        ];
        for (v, want) in cases {
            assert_eq!(grpc_timeout(v), want, "{v:?}");
        }
    }

    #[test]
    fn a_call_keeps_time_back_for_its_answer_and_never_exceeds_the_cap() {
        let req = |t: Option<&str>| {
            let mut r = Request::new(());
            if let Some(t) = t {
                r.metadata_mut().insert("grpc-timeout", t.parse().unwrap());
            }
            r
        };
        let max = Duration::from_secs(60);
        // a tenth of a short call, at most 200 ms of a long one
        assert_eq!(
            call_timeout(&req(Some("1S")), max),
            Duration::from_millis(900)
        );
        assert_eq!(
            call_timeout(&req(Some("30S")), max),
            Duration::from_millis(29_800)
        );
        // capped by the server's own limit, and the default when the caller gives none
        assert_eq!(
            call_timeout(&req(Some("1H")), max),
            Duration::from_millis(59_800)
        );
        assert_eq!(call_timeout(&req(None), max), DEFAULT_CALL - ANSWER_RESERVE);
        assert_eq!(
            call_timeout(&req(Some("soon")), max),
            DEFAULT_CALL - ANSWER_RESERVE
        );
    }
}
