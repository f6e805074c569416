//! Recovery's writes (docs/design.md §5): find expired leases by PostgreSQL time, take a recovery
//! lease (which bumps the version and so fences the old worker out), read the evidence, and
//! record each decision as an append-only event together with the transition it implies.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};
use uuid::Uuid;
use z29c_core::fence::FencedWrite;
use z29c_core::{
    AdapterCapability, AttemptId, Checkpoint, Evidence, LeaseClaim, LeaseKind, LeaseVersion,
    Outcome, OwnerId, RecoveryCategory, RecoveryDecision, StepId, StepState, Verification,
    WorkflowId, WorkflowState,
};

use crate::ending::{Receipt, ReceiptRow, open_review, receipt_columns};
use crate::ending::{end_workflow, stop_unstarted_steps};
use crate::error::parse;
use crate::events::{self, EventKind, NewEvent};
use crate::faults::{self, Break};
use crate::leases::{Observed, finish_step};
use crate::outbox::{self, MessageKind};
use crate::{Result, Store, StoreError, fence, millis};

/// A lease that passed `expires_at` by PostgreSQL's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpiredLease {
    pub step: StepId,
    pub workflow: WorkflowId,
    pub state: StepState,
    pub version: LeaseVersion,
    pub owner: String,
    pub expired_for: chrono::Duration,
}

/// An observation kept as evidence: a stale worker's (a `late_observations` row), or the
/// answer the gateway recorded on the expired attempt (`fence_reason` `recorded_by_gateway`,
/// `id` the attempt's).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct LateObservation {
    pub id: Uuid,
    pub attempt_id: Uuid,
    pub lease_version: i64,
    pub owner: String,
    pub request_identity: String,
    pub input_digest: String,
    pub adapter_version: String,
    pub external_reference: Option<String>,
    pub outcome: String,
    pub observed_result: Value,
    pub fence_reason: Value,
    pub observed_at: DateTime<Utc>,
}

/// The attempt whose lease expired, as recovery found it.
#[derive(sqlx::FromRow)]
struct ExpiredAttempt {
    id: Uuid,
    checkpoint: String,
    lease_version: i64,
    owner: String,
    request_identity: Option<String>,
    input_digest: String,
    adapter_version: Option<String>,
    observed_result: Option<Value>,
    response_observed_at: Option<DateTime<Utc>>,
}

impl ExpiredAttempt {
    /// The answer recorded on the attempt at *response observed* (by the gateway, before it
    /// replied), as an observation of the attempt, if there is one.
    fn recorded_answer(self) -> Option<LateObservation> {
        if self.checkpoint != Checkpoint::ResponseObserved.as_str() {
            return None;
        }
        let recorded = self.observed_result?;
        Some(LateObservation {
            id: self.id,
            attempt_id: self.id,
            lease_version: self.lease_version,
            owner: self.owner,
            request_identity: self.request_identity?,
            input_digest: self.input_digest,
            adapter_version: self.adapter_version.unwrap_or_else(|| "unknown".into()),
            external_reference: recorded
                .get("external_reference")
                .and_then(Value::as_str)
                .map(str::to_owned),
            // a record that does not say what happened is no evidence: never a failure
            outcome: recorded.get("outcome").and_then(Value::as_str)?.to_owned(),
            observed_result: recorded.get("result").cloned().unwrap_or(Value::Null),
            fence_reason: json!({ "reason": "recorded_by_gateway" }),
            observed_at: self.response_observed_at.unwrap_or_else(Utc::now),
        })
    }
}

/// Everything recovery reads before it decides.
#[derive(Debug, Clone)]
pub struct RecoverySnapshot {
    pub workflow: WorkflowId,
    pub workflow_state: WorkflowState,
    pub step_name: String,
    pub adapter: String,
    pub operation: String,
    pub input_digest: String,
    pub request_identity: Option<String>,
    /// The attempt whose lease expired, if the step had one.
    pub attempt: Option<AttemptId>,
    pub checkpoint: Option<Checkpoint>,
    pub receipt: Option<Receipt>,
    pub late_observations: Vec<LateObservation>,
    /// Attempts that counted against the budget (released ones do not).
    pub attempts_used: i64,
    /// An attempt before the current one may have sent its request (`z29c_may_have_sent`'s
    /// rule, for the attempts but the current one).
    pub earlier_may_have_sent: bool,
    pub max_attempts: i32,
    /// The workflow's W3C `traceparent`: recovery's spans join the submission's trace.
    pub trace_context: Option<String>,
    /// The expired attempt's call, while a gateway still holds its permit.
    pub call_in_flight: Option<CallInFlight>,
}

/// A call a gateway holds a permit for: it may still answer.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct CallInFlight {
    /// The gateway that holds the permit; a gateway no longer registered holds no call.
    pub gateway: String,
    /// When the call is over at the latest: its own deadline (the adapter timeout from
    /// *invocation began*, and a second for the answer), or its permit's end if that comes
    /// first. The gateway releases the permit sooner, once the answer is on record.
    pub until: DateTime<Utc>,
}

impl RecoverySnapshot {
    /// The evidence `z29c_core::classify` decides from. A late observation counts only when it
    /// names this step's request identity and input digest.
    pub fn evidence(&self, capability: AdapterCapability) -> Evidence {
        Evidence {
            checkpoint: self.checkpoint,
            capability,
            receipt: self.receipt.is_some(),
            observed_result: !self.matching_observations().is_empty(),
            attempts_left: self.attempts_used < i64::from(self.max_attempts),
            earlier_may_have_sent: self.earlier_may_have_sent,
        }
    }

    /// Late observations that match the step's request identity and input digest.
    pub fn matching_observations(&self) -> Vec<&LateObservation> {
        self.late_observations
            .iter()
            .filter(|o| {
                Some(o.request_identity.as_str()) == self.request_identity.as_deref()
                    && o.input_digest == self.input_digest
            })
            .collect()
    }
}

/// A recovery lease and what was found under it.
#[derive(Debug, Clone)]
pub struct RecoveryLease {
    pub lease: LeaseClaim,
    pub expires_at: DateTime<Utc>,
    pub snapshot: RecoverySnapshot,
}

/// One recovery decision, as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecisionRecord {
    pub category: RecoveryCategory,
    pub decision: RecoveryDecision,
    pub capability: AdapterCapability,
    pub detail: Value,
}

/// A recorded decision, read back.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct RecordedDecision {
    pub id: Uuid,
    pub attempt_id: Option<Uuid>,
    pub lease_version: i64,
    pub owner: String,
    pub category: String,
    pub decision: String,
    pub capability: String,
    pub checkpoint: Option<String>,
    pub detail: Value,
    pub decided_at: DateTime<Utc>,
}

#[derive(sqlx::FromRow)]
struct ExpiredRow {
    id: Uuid,
    workflow_id: Uuid,
    state: String,
    lease_version: i64,
    lease_owner: String,
    expired_ms: f64,
}

#[derive(sqlx::FromRow)]
struct TakenRow {
    workflow_id: Uuid,
    name: String,
    adapter: String,
    operation: String,
    input_digest: String,
    request_identity: Option<String>,
    current_attempt_id: Option<Uuid>,
    lease_version: i64,
    expires_at: DateTime<Utc>,
    max_attempts: i32,
    workflow_state: String,
    prior_owner: Option<String>,
    prior_version: i64,
    trace_context: Option<String>,
}

impl Store {
    /// Leases (execution or recovery) past `expires_at` by PostgreSQL time, oldest first.
    pub async fn scan_expired(&self, limit: i64) -> Result<Vec<ExpiredLease>> {
        let rows: Vec<ExpiredRow> = sqlx::query_as(
            "SELECT id, workflow_id, state::text AS state, lease_version, lease_owner,
                    extract(epoch FROM now() - expires_at)::float8 * 1000 AS expired_ms
             FROM steps
             WHERE state IN ('leased', 'recovering') AND expires_at <= now()
             ORDER BY expires_at LIMIT $1",
        )
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|r| {
                Ok(ExpiredLease {
                    step: StepId::from_uuid(r.id),
                    workflow: WorkflowId::from_uuid(r.workflow_id),
                    state: parse(&r.state)?,
                    version: LeaseVersion::new(r.lease_version)
                        .map_err(|e| StoreError::Corrupt(e.to_string()))?,
                    owner: r.lease_owner,
                    expired_for: chrono::Duration::milliseconds(r.expired_ms as i64),
                })
            })
            .collect()
    }

    /// Takes a recovery lease on a step whose lease (at `expected`) has expired. The version is
    /// bumped, so the old holder can no longer write; the expired attempt becomes `expired`.
    /// Two recovery workers racing for one step: one gets it, the other gets `Fenced`.
    pub async fn take_recovery_lease(
        &self,
        step: StepId,
        expected: LeaseVersion,
        owner: &OwnerId,
        hold: Duration,
    ) -> Result<RecoveryLease> {
        let mut tx = self.begin().await?;
        let row: Option<TakenRow> = sqlx::query_as(
            "WITH prior AS (
                 SELECT id, lease_owner, lease_version FROM steps WHERE id = $1 FOR UPDATE
             )
             UPDATE steps s
             SET state = 'recovering', lease_owner = $3, lease_version = s.lease_version + 1,
                 leased_at = now(),
                 expires_at = now() + $4::bigint * interval '1 millisecond',
                 updated_at = now()
             FROM prior
             WHERE s.id = prior.id AND s.lease_version = $2
               AND s.state IN ('leased', 'recovering') AND s.expires_at <= now()
             RETURNING s.workflow_id, s.name, s.adapter, s.operation, s.input_digest,
                 s.request_identity, s.current_attempt_id, s.lease_version, s.expires_at,
                 s.max_attempts, prior.lease_owner AS prior_owner,
                 prior.lease_version AS prior_version,
                 (SELECT w.state::text FROM workflows w WHERE w.id = s.workflow_id)
                     AS workflow_state,
                 (SELECT w.trace_context FROM workflows w WHERE w.id = s.workflow_id)
                     AS trace_context",
        )
        .bind(step.as_uuid())
        .bind(expected.get())
        .bind(owner.as_str())
        .bind(millis(hold))
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            let view = fence::view(&mut tx, step.as_uuid()).await?;
            let reason = if view.version != expected {
                z29c_core::FenceReason::Superseded {
                    presented: expected,
                    current: view.version,
                }
            } else if !view.state.holds_lease() {
                z29c_core::FenceReason::NotLeased { state: view.state }
            } else {
                // still current: expiry is PostgreSQL's to decide, and it has not
                z29c_core::FenceReason::Changed
            };
            return Err(StoreError::Fenced(reason));
        };
        let attempt = row.current_attempt_id;
        let expired: Option<ExpiredAttempt> = match attempt {
            Some(a) => {
                sqlx::query_as(
                    "UPDATE attempts SET state = CASE WHEN state = 'active'
                     THEN 'expired'::attempt_state ELSE state END, updated_at = now()
                 WHERE id = $1
                 RETURNING id, checkpoint::text AS checkpoint, lease_version, owner,
                           request_identity, input_digest, adapter_version, observed_result,
                           response_observed_at",
                )
                .bind(a)
                .fetch_optional(&mut *tx)
                .await?
            }
            None => None,
        };
        let checkpoint = expired.as_ref().map(|e| e.checkpoint.clone());
        // the answer the gateway recorded under this attempt's lease, before its worker went
        // quiet: evidence as good as a late observation
        let recorded = expired.and_then(ExpiredAttempt::recorded_answer);
        for (kind, version, who, detail) in [
            (
                EventKind::LeaseExpired,
                row.prior_version,
                row.prior_owner.as_deref(),
                json!({ "checkpoint": checkpoint }),
            ),
            (
                EventKind::RecoveryLeaseAcquired,
                row.lease_version,
                Some(owner.as_str()),
                json!({ "checkpoint": checkpoint, "expires_at": row.expires_at }),
            ),
        ] {
            events::append(
                &mut tx,
                NewEvent {
                    workflow: row.workflow_id,
                    step: step.as_uuid(),
                    attempt,
                    lease_version: version,
                    owner: who,
                    kind,
                    detail,
                },
            )
            .await?;
        }
        let receipt: Option<ReceiptRow> = sqlx::query_as(concat!(
            "SELECT ",
            receipt_columns!(),
            " FROM step_receipts WHERE step_id = $1"
        ))
        .bind(step.as_uuid())
        .fetch_optional(&mut *tx)
        .await?;
        let mut late_observations = late_observations(&mut tx, step.as_uuid()).await?;
        late_observations.extend(recorded);
        // the budget, and whether an attempt before the current one may have sent: the
        // current attempt's checkpoint alone forgets an earlier request
        let (attempts_used, earlier_may_have_sent): (i64, bool) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE state <> 'released'),
                    coalesce(bool_or(z29c_attempt_may_have_sent(checkpoint, state))
                             FILTER (WHERE id IS DISTINCT FROM $2), false)
             FROM attempts WHERE step_id = $1",
        )
        .bind(step.as_uuid())
        .bind(attempt)
        .fetch_one(&mut *tx)
        .await?;
        // the expired attempt's call, if a gateway still holds its permit; permits are looked
        // up through the slots they occupy (a table as small as the adapters' limits)
        // it is in flight no longer than its permit counts, nor than its own deadline (the
        // adapter timeout from *invocation began*, and the gateway's margin for the answer)
        let call_in_flight: Option<CallInFlight> = sqlx::query_as(
            "SELECT gateway, until FROM (
                 SELECT p.gateway,
                        LEAST(slot.expires_at,
                              a.invocation_began_at
                                  + (st.adapter_timeout_ms + 1000) * interval '1 millisecond')
                            AS until
                 FROM adapter_permit_slots slot
                 JOIN adapter_permits p ON p.id = slot.permit_id
                 JOIN attempts a ON a.id = p.attempt_id
                 JOIN steps st ON st.id = a.step_id
                 WHERE p.attempt_id = $1 AND p.state = 'held'
             ) held
             WHERE until > now()
             ORDER BY until DESC LIMIT 1",
        )
        .bind(attempt)
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;

        let lease = LeaseClaim {
            step,
            attempt: attempt.map_or_else(AttemptId::new, AttemptId::from_uuid),
            owner: owner.clone(),
            version: LeaseVersion::new(row.lease_version)
                .map_err(|e| StoreError::Corrupt(e.to_string()))?,
            kind: LeaseKind::Recovery,
        };
        Ok(RecoveryLease {
            lease,
            expires_at: row.expires_at,
            snapshot: RecoverySnapshot {
                workflow: WorkflowId::from_uuid(row.workflow_id),
                workflow_state: parse(&row.workflow_state)?,
                step_name: row.name,
                adapter: row.adapter,
                operation: row.operation,
                input_digest: row.input_digest,
                request_identity: row.request_identity,
                attempt: attempt.map(AttemptId::from_uuid),
                checkpoint: checkpoint.as_deref().map(parse).transpose()?,
                receipt: receipt.map(Receipt::try_from).transpose()?,
                late_observations,
                attempts_used,
                earlier_may_have_sent: earlier_may_have_sent
                    && !faults::broken(Break::CurrentAttemptOnly),
                max_attempts: row.max_attempts,
                trace_context: row.trace_context,
                call_in_flight: call_in_flight.filter(|_| !faults::broken(Break::ReviewDuringCall)),
            },
        })
    }

    /// Leaves the step with recovery for `recheck`, and no later than `until`, by PostgreSQL's
    /// clock: its expired attempt's call is still in flight, and recovery decides once the
    /// answer is on record or the call's deadline has passed
    /// (`z29c_core::recovery::waits_for_call`). The recovery lease simply runs out then, and
    /// the step is taken up again. Fenced by the recovery lease.
    pub async fn wait_for_call(
        &self,
        lease: &LeaseClaim,
        until: DateTime<Utc>,
        recheck: Duration,
    ) -> Result<()> {
        let mut tx = self.begin().await?;
        fence::fence(&mut tx, lease, FencedWrite::Release).await?;
        sqlx::query(
            "UPDATE steps
             SET expires_at = LEAST($2, now() + $3::bigint * interval '1 millisecond'),
                 updated_at = now()
             WHERE id = $1",
        )
        .bind(lease.step.as_uuid())
        .bind(until)
        .bind(millis(recheck))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records a decision (append-only) and applies the transition it implies, in one fenced
    /// transaction under the recovery lease. `StatusQuery` and `Reconcile` keep the lease: the
    /// recovery worker asks, then commits a receipt or records a further decision. A decision
    /// that would send a fresh request (`MakeReady`, `Retry`) after an invocation may have begun
    /// is refused: only the same request identity may be sent again.
    pub async fn record_decision(
        &self,
        lease: &LeaseClaim,
        record: &DecisionRecord,
    ) -> Result<Uuid> {
        let mut tx = self.begin().await?;
        let held = fence::fence(&mut tx, lease, FencedWrite::Release).await?;
        let (checkpoint, may_have_sent): (Option<String>, bool) = sqlx::query_as(
            "SELECT (SELECT checkpoint::text FROM attempts WHERE id = $1), z29c_may_have_sent($2)",
        )
        .bind(lease.attempt.as_uuid())
        .bind(lease.step.as_uuid())
        .fetch_one(&mut *tx)
        .await?;
        let checkpoint: Option<Checkpoint> = checkpoint.as_deref().map(parse).transpose()?;
        use RecoveryDecision as D;
        // behind classify's own rule, the database's: once any attempt may have sent, a
        // fresh request or a failure could hide an effect
        let may_have_sent = if faults::broken(Break::CurrentAttemptOnly) {
            checkpoint.is_some_and(Checkpoint::may_have_invoked)
        } else {
            may_have_sent
        };
        if matches!(record.decision, D::MakeReady | D::Retry | D::Fail) && may_have_sent {
            return Err(StoreError::Conflict(format!(
                "{} after an invocation may have begun: only the same request identity may be sent again, or a person decides",
                record.decision
            )));
        }
        let id = Uuid::now_v7();
        sqlx::query(
            "INSERT INTO recovery_decisions (id, step_id, workflow_id, attempt_id, lease_version,
                 owner, category, decision, capability, checkpoint, detail)
             SELECT $1, $2, $3, a.id, $5, $6, $7::recovery_category, $8::recovery_decision,
                 $9::adapter_capability, $10::checkpoint, $11
             FROM (SELECT $4::uuid AS want) x LEFT JOIN attempts a ON a.id = x.want",
        )
        .bind(id)
        .bind(lease.step.as_uuid())
        .bind(held.workflow)
        .bind(lease.attempt.as_uuid())
        .bind(lease.version.get())
        .bind(lease.owner.as_str())
        .bind(record.category.as_str())
        .bind(record.decision.as_str())
        .bind(record.capability.as_str())
        .bind(checkpoint.map(Checkpoint::as_str))
        .bind(&record.detail)
        .execute(&mut *tx)
        .await?;
        events::append(
            &mut tx,
            NewEvent {
                workflow: held.workflow,
                step: lease.step.as_uuid(),
                attempt: Some(lease.attempt.as_uuid()),
                lease_version: lease.version.get(),
                owner: Some(lease.owner.as_str()),
                kind: EventKind::RecoveryDecision,
                detail: json!({
                    "decision": id,
                    "category": record.category.as_str(),
                    "action": record.decision.as_str(),
                    "capability": record.capability.as_str(),
                }),
            },
        )
        .await?;

        // the workflow's state as it is now, locked against a concurrent end (deadline,
        // cancel): a decision must not make a step ready in a workflow that just ended
        let workflow_state: String =
            sqlx::query_scalar("SELECT state::text FROM workflows WHERE id = $1 FOR SHARE")
                .bind(held.workflow)
                .fetch_one(&mut *tx)
                .await?;
        let running = parse::<WorkflowState>(&workflow_state)? == WorkflowState::Running;
        let receipt: Option<String> = if record.decision == D::AcknowledgeOnly {
            sqlx::query_scalar("SELECT outcome::text FROM step_receipts WHERE step_id = $1")
                .bind(lease.step.as_uuid())
                .fetch_optional(&mut *tx)
                .await?
        } else {
            None
        };
        let receipt = receipt.as_deref().map(parse::<Outcome>).transpose()?;
        let next = record
            .decision
            .next_state(running, receipt)
            .map_err(|e| StoreError::Conflict(e.into()))?;
        // a retry after an attempt that failed to finish waits, capped and jittered
        let wait = match record.decision {
            D::Retry | D::RetrySameIdentity => {
                let (made, retry): (i32, Option<Value>) =
                    sqlx::query_as("SELECT attempts_made, retry_policy FROM steps WHERE id = $1")
                        .bind(lease.step.as_uuid())
                        .fetch_one(&mut *tx)
                        .await?;
                crate::retry_policy_from_row(retry)?.backoff(u32::try_from(made).unwrap_or(1))
            }
            _ => std::time::Duration::ZERO,
        };
        if let Some(next) = next {
            sqlx::query(
                "UPDATE steps
                 SET state = $2::step_state, lease_owner = NULL, leased_at = NULL,
                     expires_at = NULL, updated_at = now(),
                     next_eligible_at = now() + $3::bigint * interval '1 millisecond'
                 WHERE id = $1",
            )
            .bind(lease.step.as_uuid())
            .bind(next.as_str())
            .bind(crate::millis(wait))
            .execute(&mut *tx)
            .await?;
            match next {
                StepState::Ready => {
                    outbox::enqueue(
                        &mut tx,
                        MessageKind::StepReady,
                        held.workflow,
                        Some(lease.step.as_uuid()),
                        json!({}),
                    )
                    .await?;
                }
                StepState::NeedsReview => {
                    let reason = record
                        .detail
                        .get("reason")
                        .and_then(Value::as_str)
                        .unwrap_or("outcome unknown after the lease expired");
                    open_review(&mut tx, held.workflow, lease.step.as_uuid(), reason).await?;
                    events::append(
                        &mut tx,
                        NewEvent::by(
                            lease,
                            held.workflow,
                            EventKind::ReviewOpened,
                            json!({ "reason": reason }),
                        ),
                    )
                    .await?;
                }
                StepState::Failed if record.decision == D::Fail && running => {
                    end_workflow(&mut tx, held.workflow, WorkflowState::Failed).await?;
                    stop_unstarted_steps(&mut tx, held.workflow, "a step failed by policy").await?;
                }
                _ => {}
            }
        }
        tx.commit().await?;
        Ok(id)
    }

    /// Commits a step's receipt from evidence gathered under a recovery lease (a status query,
    /// late evidence, a person's resolution). Fenced like any other write.
    pub async fn commit_recovered_receipt(
        &self,
        lease: &LeaseClaim,
        observed: &Observed,
        verification: Verification,
    ) -> Result<Receipt> {
        if verification == Verification::Direct {
            return Err(StoreError::invalid(
                "verification",
                "a recovered receipt is verified by status query, late evidence or a person",
            ));
        }
        let mut tx = self.begin().await?;
        let held = fence::fence(
            &mut tx,
            lease,
            FencedWrite::Advance(Checkpoint::ReceiptCommitted),
        )
        .await?;
        if held.request_identity.as_deref() != Some(observed.request_identity.as_str())
            || held.input_digest != observed.input_digest.as_str()
        {
            return Err(StoreError::Conflict(
                "evidence does not match the step's request identity and input digest".into(),
            ));
        }
        let attempt: Option<Uuid> =
            sqlx::query_scalar("SELECT current_attempt_id FROM steps WHERE id = $1")
                .bind(lease.step.as_uuid())
                .fetch_one(&mut *tx)
                .await?;
        let receipt = finish_step(&mut tx, lease, &held, attempt, observed, verification).await?;
        crate::permits::release_unknown_for(
            &mut tx,
            observed.request_identity.as_str(),
            &format!("outcome known by {verification}"),
        )
        .await?;
        tx.commit().await?;
        Ok(receipt)
    }

    /// Records that one request identity was reported with two different external references.
    /// Never an overwrite: the receipt stays, the conflict is a row for a person.
    pub async fn record_integrity_conflict(
        &self,
        step: StepId,
        request_identity: &str,
        known_reference: Option<&str>,
        observed_reference: Option<&str>,
        source: &str,
    ) -> Result<Uuid> {
        let id = Uuid::now_v7();
        sqlx::query(
            "INSERT INTO integrity_conflicts (id, step_id, workflow_id, request_identity,
                 known_reference, observed_reference, source)
             SELECT $1, s.id, s.workflow_id, $3, $4, $5, $6 FROM steps s WHERE s.id = $2",
        )
        .bind(id)
        .bind(step.as_uuid())
        .bind(request_identity)
        .bind(known_reference)
        .bind(observed_reference)
        .bind(source)
        .execute(&self.pool)
        .await?;
        Ok(id)
    }

    /// A step's late observations, oldest first.
    pub async fn late_observations(&self, step: StepId) -> Result<Vec<LateObservation>> {
        let mut conn = self.pool.acquire().await?;
        late_observations(&mut conn, step.as_uuid()).await
    }

    /// A step's recovery decisions, oldest first.
    pub async fn recovery_decisions(&self, step: StepId) -> Result<Vec<RecordedDecision>> {
        Ok(sqlx::query_as(
            "SELECT id, attempt_id, lease_version, owner, category::text AS category,
                    decision::text AS decision, capability::text AS capability,
                    checkpoint::text AS checkpoint, detail, decided_at
             FROM recovery_decisions WHERE step_id = $1 ORDER BY decided_at, id",
        )
        .bind(step.as_uuid())
        .fetch_all(&self.pool)
        .await?)
    }
}

async fn late_observations(
    conn: &mut sqlx::PgConnection,
    step: Uuid,
) -> Result<Vec<LateObservation>> {
    Ok(sqlx::query_as(
        "SELECT id, attempt_id, lease_version, owner, request_identity, input_digest,
                adapter_version, external_reference, outcome::text AS outcome, observed_result,
                fence_reason, observed_at
         FROM late_observations WHERE step_id = $1 ORDER BY observed_at, id",
    )
    .bind(step)
    .fetch_all(conn)
    .await?)
}
