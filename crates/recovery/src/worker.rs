//! One step's recovery: take the recovery lease, classify the evidence, record the decision,
//! then act on it. Nothing here decides from a clock or a heartbeat; only durable evidence and
//! the adapter's declared capability count.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tracing::Instrument;
use z29c_bus::gateways::Gateways;
use z29c_core::recovery::{
    AfterQuery, AfterReconcile, QueryAnswer, RecordedAnswer, after_reconcile, after_status_query,
    waits_for_call,
};
use z29c_core::{
    AdapterCapability, ExternalReference, InputDigest, LeaseClaim, Outcome, OwnerId,
    RecoveryCategory, RecoveryDecision, RequestIdentity, StepId, Verification, classify,
};
use z29c_proto::v1::{QueryRequest, query_response};
use z29c_store::leases::Observed;
use z29c_store::recovery::{DecisionRecord, ExpiredLease, RecoverySnapshot};
use z29c_store::{Store, StoreError};

#[derive(Debug, Clone)]
pub struct Context {
    pub store: Store,
    /// The gateway registry and its channels (kept across recoveries).
    pub gateways: Gateways,
    pub owner: OwnerId,
    pub hold: Duration,
    /// How long a step waits for a gateway to describe its adapter before it is decided as
    /// for an opaque one.
    pub capability_patience: Duration,
    /// Steps whose adapter no registered gateway has described, since when (this worker's
    /// count: another instance taking the step counts its own).
    pub capability_unknown: Arc<Mutex<HashMap<StepId, Instant>>>,
}

const QUERY_TIMEOUT: Duration = Duration::from_secs(5);
/// How often recovery looks again at a step whose expired attempt's call is still in flight.
const CALL_RECHECK: Duration = Duration::from_secs(2);
/// How long a gateway that does not answer Describe is asked again before recovery counts the
/// adapter's capability as unknown for now.
const DESCRIBE_PATIENCE: Duration = Duration::from_secs(3);
/// How often recovery asks again for a capability no registered gateway described.
const CAPABILITY_RECHECK: Duration = Duration::from_secs(2);

/// Recovers one expired lease. Losing the race for the recovery lease to another instance is
/// not an error: that instance decides.
pub async fn recover(ctx: &Context, expired: &ExpiredLease) -> Result<(), StoreError> {
    let rec = match ctx
        .store
        .take_recovery_lease(expired.step, expired.version, &ctx.owner, ctx.hold)
        .await
    {
        Ok(r) => r,
        Err(StoreError::Fenced(reason)) => {
            tracing::debug!(step = %expired.step, %reason, "another worker took this step");
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    // the decision joins the workflow's trace, begun at submission
    let span = tracing::info_span!("recovery.decide", step = %expired.step, workflow = %rec.snapshot.workflow, trace_id = tracing::field::Empty);
    z29c_telemetry::trace::set_parent(&span, rec.snapshot.trace_context.as_deref());
    decide_on(ctx, expired, rec).instrument(span).await
}

async fn decide_on(
    ctx: &Context,
    expired: &ExpiredLease,
    rec: z29c_store::recovery::RecoveryLease,
) -> Result<(), StoreError> {
    z29c_telemetry::metrics::counter!(z29c_telemetry::LEASE_RECOVERIES).increment(1);
    z29c_telemetry::metrics::histogram!(z29c_telemetry::LEASE_EXPIRY_AGE)
        .record(expired.expired_for.num_milliseconds().max(0) as f64 / 1000.0);
    let chosen = ctx.gateways.for_adapter(&rec.snapshot.adapter).await;
    let described = match &chosen {
        Some(c) => described_capability(c, &rec.snapshot.adapter).await,
        None => None,
    };
    // `None`: no gateway has said yet, and recovery is still patient
    let known = {
        let mut unknown = ctx
            .capability_unknown
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match described {
            Some(c) => {
                unknown.remove(&expired.step);
                Some(c)
            }
            None => {
                // steps another instance decided meanwhile are forgotten in time
                let forget_after = ctx.capability_patience * 4;
                unknown.retain(|_, t| t.elapsed() < forget_after);
                let since = *unknown.entry(expired.step).or_insert_with(Instant::now);
                if since.elapsed() < ctx.capability_patience {
                    None
                } else {
                    unknown.remove(&expired.step);
                    tracing::warn!(step = %expired.step, adapter = %rec.snapshot.adapter, patience_ms = ctx.capability_patience.as_millis() as u64, "no gateway described the adapter in time; deciding as for an opaque adapter, which a person reviews");
                    Some(AdapterCapability::Opaque)
                }
            }
        }
    };
    // evidence that decides alike whatever the adapter promises needs no answer from a gateway
    let same_whatever = {
        let decide = |c| classify(&rec.snapshot.evidence(c));
        let opaque = decide(AdapterCapability::Opaque);
        [AdapterCapability::Idempotent, AdapterCapability::Queryable]
            .into_iter()
            .all(|c| decide(c) == opaque)
    };
    let known = known.or(same_whatever.then_some(AdapterCapability::Opaque));
    let Some(capability) = known else {
        // deciding as if for an opaque adapter could send an idempotent step to a person for
        // nothing; a gateway that serves it may be starting
        tracing::info!(step = %expired.step, adapter = %rec.snapshot.adapter, "no registered gateway describes the adapter; asking again before deciding");
        return ctx
            .store
            .wait_for_call(
                &rec.lease,
                chrono::Utc::now() + CAPABILITY_RECHECK,
                CAPABILITY_RECHECK,
            )
            .await;
    };
    // the broken build that sends an opaque request again, as if it were idempotent
    let judged_as = if capability == AdapterCapability::Opaque
        && z29c_store::faults::broken(z29c_store::faults::Break::OpaqueRetried)
    {
        AdapterCapability::Idempotent
    } else {
        capability
    };
    let evidence = rec.snapshot.evidence(judged_as);
    let (category, decision) = classify(&evidence);
    tracing::info!(
        step = %expired.step,
        expired_ms = expired.expired_for.num_milliseconds(),
        %category, %decision, %capability,
        "recovery decision"
    );
    let lease = &rec.lease;
    let snap = &rec.snapshot;
    if let Some(call) = &snap.call_in_flight
        && waits_for_call(decision, holds_call(ctx, &call.gateway).await)
    {
        // look again when the call has had time to answer, and no later than its deadline
        tracing::info!(step = %expired.step, %decision, gateway = %call.gateway, until = %call.until, "the expired attempt's call is still in flight; deciding once it has answered");
        return ctx
            .store
            .wait_for_call(lease, call.until, CALL_RECHECK)
            .await;
    }
    let record = |decision: RecoveryDecision, detail: Value| DecisionRecord {
        category,
        decision,
        capability,
        detail,
    };
    match decision {
        RecoveryDecision::StatusQuery => {
            decide(ctx, lease, &record(decision, json!({}))).await?;
            let answer = match chosen {
                Some(mut c) => {
                    let mut req = tonic::Request::new(QueryRequest {
                        adapter: snap.adapter.clone(),
                        request_identity: snap.request_identity.clone().unwrap_or_default(),
                    });
                    req.set_timeout(QUERY_TIMEOUT);
                    z29c_telemetry::trace::inject_grpc(&mut req);
                    c.client.query(req).await.map(|r| r.into_inner().status)
                }
                None => Err(tonic::Status::unavailable("no gateway serves the adapter")),
            };
            let (kind, found, reason) = match answer {
                Ok(Some(query_response::Status::Found(found))) => {
                    (QueryAnswer::Found, Some(found), String::new())
                }
                Ok(Some(query_response::Status::NotFound(_))) => (
                    QueryAnswer::NotFound,
                    None,
                    "status query found no such request".to_owned(),
                ),
                // still being processed, or no answer at all: a retry could send the request
                // twice
                other if answer_may_come(&other) => {
                    let reason = match other {
                        Ok(Some(query_response::Status::Unknown(u))) => u.reason,
                        Ok(_) => String::new(),
                        Err(status) => in_words(&status),
                    };
                    (QueryAnswer::NotYet, None, reason)
                }
                // an answer no later query will change (the adapter unknown to the gateway, a
                // malformed identity, an empty answer)
                other => (
                    QueryAnswer::Unusable,
                    None,
                    match other {
                        Err(status) => format!("status query refused: {}", in_words(&status)),
                        Ok(_) => "status query gave no answer".to_owned(),
                    },
                ),
            };
            let unanswered = if kind == QueryAnswer::NotYet {
                unanswered_so_far(
                    &ctx.store.recovery_decisions(lease.step).await?,
                    lease.attempt.as_uuid(),
                )
            } else {
                0
            };
            match (
                after_status_query(kind, evidence.attempts_left, unanswered),
                found,
            ) {
                (AfterQuery::CommitFound, Some(found)) => {
                    let result = serde_json::from_str(&found.result_json).unwrap_or(Value::Null);
                    let observed = observed(
                        snap,
                        Outcome::Succeeded,
                        Some(found.external_reference),
                        result,
                        "status-query",
                    )?;
                    commit_or_conflict(
                        ctx,
                        lease,
                        snap,
                        &observed,
                        Verification::StatusQuery,
                        category,
                        capability,
                    )
                    .await?;
                }
                (AfterQuery::AskAgain, _) => tracing::info!(
                    step = %lease.step, asked = unanswered, %reason,
                    "status query gave no answer; asking again when the recovery lease expires"
                ),
                (AfterQuery::Decide(next), _) => {
                    let reason = match kind {
                        QueryAnswer::NotFound if next == RecoveryDecision::HumanReview => {
                            format!("{reason}, and the step has no attempts left")
                        }
                        QueryAnswer::NotYet => format!(
                            "{unanswered} status queries gave no answer, the last: {reason}"
                        ),
                        _ => reason,
                    };
                    decide(ctx, lease, &record(next, json!({ "reason": reason }))).await?;
                }
                // the rule commits only what was found, and only a found answer carries one
                (AfterQuery::CommitFound, None) => {
                    decide(
                        ctx,
                        lease,
                        &record(
                            RecoveryDecision::HumanReview,
                            json!({ "reason": "status query found the effect, without its answer" }),
                        ),
                    )
                    .await?;
                }
            }
        }
        RecoveryDecision::Reconcile => {
            decide(ctx, lease, &record(decision, json!({}))).await?;
            let matching = snap.matching_observations();
            let answers: Vec<RecordedAnswer<'_>> = matching
                .iter()
                .map(|o| RecordedAnswer {
                    outcome: o.outcome.parse().ok(),
                    reference: o.external_reference.as_deref(),
                })
                .collect();
            let distinct: std::collections::BTreeSet<&str> =
                answers.iter().filter_map(|a| a.reference).collect();
            match after_reconcile(&answers) {
                AfterReconcile::CommitObserved { index, outcome } => {
                    let first = matching[index];
                    let observed = observed(
                        snap,
                        outcome,
                        first.external_reference.clone(),
                        first.observed_result.clone(),
                        &first.adapter_version,
                    )?;
                    commit_or_conflict(
                        ctx,
                        lease,
                        snap,
                        &observed,
                        Verification::LateEvidence,
                        category,
                        capability,
                    )
                    .await?;
                }
                AfterReconcile::IntegrityConflict => {
                    let identity = snap.request_identity.clone().unwrap_or_default();
                    let mut refs = distinct.iter();
                    ctx.store
                        .record_integrity_conflict(
                            lease.step,
                            &identity,
                            refs.next().copied(),
                            refs.next().copied(),
                            "late_evidence",
                        )
                        .await?;
                    decide(ctx,
                            lease,
                            &record(
                                RecoveryDecision::HumanReview,
                                json!({ "reason": "late evidence names different external references for one request identity" }),
                            ),
                        )
                        .await?;
                }
                AfterReconcile::NoEvidence => {
                    decide(ctx,
                            lease,
                            &record(
                                RecoveryDecision::HumanReview,
                                json!({ "reason": "a response was observed but no answer on record says what happened" }),
                            ),
                        )
                        .await?;
                }
            }
        }
        _ => {
            let detail = match decision {
                RecoveryDecision::HumanReview => json!({
                    "reason": "the adapter cannot say what happened to a request that may have been sent"
                }),
                _ => json!({}),
            };
            decide(ctx, lease, &record(decision, detail)).await?;
        }
    }
    Ok(())
}

/// Whether `gateway` is registered, so the call it holds a permit for may still answer. A
/// gateway that died is gone from the registry within its registration's lifetime, and one
/// that started again under the same name has already turned its earlier calls' permits into
/// unknown outcomes. A registry that cannot be read says nothing: the call is taken as held,
/// and waited for until its deadline.
async fn holds_call(ctx: &Context, gateway: &str) -> bool {
    ctx.gateways
        .records(z29c_bus::REGISTRATION_TTL)
        .await
        .map_or(true, |records| records.iter().any(|g| g.id == gateway))
}

/// A gRPC refusal as a person reads it: its code's description and the server's message.
fn in_words(status: &tonic::Status) -> String {
    match status.message() {
        "" => status.code().description().to_owned(),
        message => format!("{}: {message}", status.code().description()),
    }
}

/// Whether asking again later may bring an answer: the destination said it is still
/// processing or could not say now, or the query timed out or found no gateway.
fn answer_may_come(answer: &Result<Option<query_response::Status>, tonic::Status>) -> bool {
    match answer {
        Ok(Some(query_response::Status::Unknown(_))) => true,
        Err(s) => matches!(
            s.code(),
            tonic::Code::Unavailable
                | tonic::Code::DeadlineExceeded
                | tonic::Code::Cancelled
                | tonic::Code::ResourceExhausted
                | tonic::Code::Unknown
        ),
        Ok(_) => false,
    }
}

/// The status queries made for this attempt since recovery last decided anything else: an
/// earlier episode (a retry, a person's resolution) starts the count again.
fn unanswered_so_far(
    decisions: &[z29c_store::recovery::RecordedDecision],
    attempt: uuid::Uuid,
) -> usize {
    decisions
        .iter()
        .rev()
        .take_while(|d| d.decision == RecoveryDecision::StatusQuery.as_str())
        .filter(|d| d.attempt_id == Some(attempt))
        .count()
}

/// Records a decision and counts it by category, decision and capability.
async fn decide(
    ctx: &Context,
    lease: &LeaseClaim,
    record: &DecisionRecord,
) -> Result<uuid::Uuid, StoreError> {
    let id = ctx.store.record_decision(lease, record).await?;
    z29c_telemetry::metrics::counter!(
        z29c_telemetry::RECOVERY_DECISIONS,
        "category" => record.category.as_str(),
        "decision" => record.decision.as_str(),
        "capability" => record.capability.as_str(),
    )
    .increment(1);
    Ok(id)
}

/// The capability the gateway itself declares for the adapter (its Describe answer); `None`
/// when it does not describe the adapter or does not answer: unknown, for now. A gateway that
/// is restarting (the registry still names it) is asked again for a few seconds first.
async fn described_capability(
    chosen: &z29c_bus::gateways::Chosen,
    adapter: &str,
) -> Option<AdapterCapability> {
    use backon::Retryable;
    use z29c_proto::v1::AdapterCapability as Wire;
    let describe = || {
        let mut client = chosen.client.clone();
        async move {
            let mut req = tonic::Request::new(z29c_proto::v1::DescribeRequest {});
            req.set_timeout(QUERY_TIMEOUT);
            client.describe(req).await
        }
    };
    let answer = describe
        .retry(
            backon::ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(100))
                .with_max_delay(Duration::from_secs(1))
                .with_jitter()
                .with_total_delay(Some(DESCRIBE_PATIENCE))
                .without_max_times(),
        )
        .sleep(tokio::time::sleep)
        .when(|s| s.code() == tonic::Code::Unavailable)
        .await;
    match answer {
        Ok(r) => r
            .into_inner()
            .adapters
            .into_iter()
            .find(|a| a.name == adapter)
            .map(|a| match a.capability() {
                Wire::Idempotent => AdapterCapability::Idempotent,
                Wire::Queryable => AdapterCapability::Queryable,
                Wire::Opaque | Wire::Unspecified => AdapterCapability::Opaque,
            }),
        Err(status) => {
            tracing::warn!(gateway = %chosen.gateway, %status, "describe failed; the adapter's capability is unknown for now");
            None
        }
    }
}

fn observed(
    snap: &RecoverySnapshot,
    outcome: Outcome,
    reference: Option<String>,
    result: Value,
    adapter_version: &str,
) -> Result<Observed, StoreError> {
    let invalid = |e: z29c_core::ParseError| StoreError::Corrupt(e.to_string());
    Ok(Observed {
        request_identity: RequestIdentity::parse(snap.request_identity.clone().unwrap_or_default())
            .map_err(invalid)?,
        input_digest: InputDigest::parse(snap.input_digest.clone()).map_err(invalid)?,
        adapter_version: if adapter_version.is_empty() {
            "unknown".into()
        } else {
            adapter_version.into()
        },
        outcome,
        external_reference: reference
            .map(ExternalReference::parse)
            .transpose()
            .map_err(invalid)?,
        result,
        // committed as soon as it is read: PostgreSQL's now() is when it was seen
        seen: None,
    })
}

/// Commits a recovered receipt, unless the evidence disagrees with what a stale worker saw:
/// then it is an integrity conflict for a person, never an overwrite.
async fn commit_or_conflict(
    ctx: &Context,
    lease: &LeaseClaim,
    snap: &RecoverySnapshot,
    observed: &Observed,
    verification: Verification,
    category: RecoveryCategory,
    capability: AdapterCapability,
) -> Result<(), StoreError> {
    let found = observed
        .external_reference
        .as_ref()
        .map(|r| r.as_str().to_owned());
    let disagreeing = snap
        .matching_observations()
        .into_iter()
        .filter_map(|o| o.external_reference.clone())
        .find(|r| Some(r) != found.as_ref());
    if let Some(other) = disagreeing {
        let identity = observed.request_identity.to_string();
        ctx.store
            .record_integrity_conflict(
                lease.step,
                &identity,
                found.as_deref(),
                Some(&other),
                verification.as_str(),
            )
            .await?;
        decide(ctx,
                lease,
                &DecisionRecord {
                    category,
                    decision: RecoveryDecision::HumanReview,
                    capability,
                    detail: json!({ "reason": "evidence disagrees on the external reference", "found": found, "late": other }),
                },
            )
            .await?;
        return Ok(());
    }
    let receipt = ctx
        .store
        .commit_recovered_receipt(lease, observed, verification)
        .await?;
    z29c_telemetry::receipt_committed(
        verification.as_str(),
        receipt.outcome.as_str(),
        (receipt.committed_at - receipt.step_created_at)
            .to_std()
            .unwrap_or_default(),
    );
    tracing::info!(step = %lease.step, reference = ?receipt.external_reference, %verification, "receipt committed from evidence");
    Ok(())
}

#[cfg(test)]
mod tests {
    use z29c_store::recovery::RecordedDecision;

    use super::*;

    fn decided(decision: RecoveryDecision, attempt: uuid::Uuid) -> RecordedDecision {
        RecordedDecision {
            id: uuid::Uuid::now_v7(),
            attempt_id: Some(attempt),
            lease_version: 2,
            owner: "recovery-1".into(),
            category: "invocation_may_have_begun".into(),
            decision: decision.as_str().into(),
            capability: "queryable".into(),
            checkpoint: None,
            detail: json!({}),
            decided_at: chrono::Utc::now(),
        }
    }

    #[test]
    fn only_an_answer_a_later_query_may_change_is_asked_again() {
        let unknown = query_response::Status::Unknown(Default::default());
        assert!(answer_may_come(&Ok(Some(unknown))));
        for code in [
            tonic::Code::Unavailable,
            tonic::Code::DeadlineExceeded,
            tonic::Code::Cancelled,
            tonic::Code::ResourceExhausted,
            tonic::Code::Unknown,
        ] {
            assert!(
                answer_may_come(&Err(tonic::Status::new(code, "x"))),
                "{code:?}"
            );
        }
        for code in [
            tonic::Code::InvalidArgument,
            tonic::Code::NotFound,
            tonic::Code::PermissionDenied,
        ] {
            assert!(
                !answer_may_come(&Err(tonic::Status::new(code, "x"))),
                "{code:?}"
            );
        }
        assert!(!answer_may_come(&Ok(None)));
        let not_found = query_response::Status::NotFound(Default::default());
        assert!(!answer_may_come(&Ok(Some(not_found))));
    }

    #[test]
    fn unanswered_queries_are_counted_for_this_attempt_since_anything_else_was_decided() {
        let (this, other) = (uuid::Uuid::now_v7(), uuid::Uuid::now_v7());
        let q = RecoveryDecision::StatusQuery;
        let history = [
            decided(q, this),
            decided(q, this),
            // a person's resolution or a retry starts the count again
            decided(RecoveryDecision::RetrySameIdentity, this),
            decided(q, other),
            decided(q, this),
            decided(q, this),
        ];
        assert_eq!(unanswered_so_far(&history, this), 2);
        assert_eq!(unanswered_so_far(&history, other), 1);
        assert_eq!(unanswered_so_far(&[], this), 0);
        assert_eq!(
            unanswered_so_far(&[decided(RecoveryDecision::HumanReview, this)], this),
            0
        );
    }
}
