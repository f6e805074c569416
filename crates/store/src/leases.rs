//! The attempt protocol's writes (docs/design.md §4): claim (which persists the request identity
//! with the attempt), begin the invocation, renew, commit the receipt, or keep a stale result as
//! a late observation.
//! Every write after the claim is fenced (see the crate docs).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};
use sqlx::{FromRow, PgConnection, Row};
use uuid::Uuid;
use z29c_core::fence::FencedWrite;
use z29c_core::{
    AfterRefusal, AfterWait, AttemptId, AttemptState, Checkpoint, ExternalReference, FenceReason,
    InputDigest, LeaseClaim, LeaseKind, LeasePolicy, LeaseVersion, Outcome, OwnerId,
    RenewalDecision, RequestIdentity, StepId, StepName, StepState, Verification, Waited,
    WorkflowId, WorkflowState,
};

use crate::ending::{
    Receipt, ReceiptRow, complete_if_all_done, completed_workflow, end_workflow, open_review,
    receipt_columns, stop_unstarted_steps, workflow_completes,
};
use crate::error::parse;
use crate::events::{self, EventKind, NewEvent};
use crate::faults::{self, Break, CrashPoint};
use crate::fence::{self, Held, lease_held};
use crate::outbox::{self, MessageKind};
use crate::{Result, Store, StoreError, millis};

/// A step claimed for routine execution, with everything the worker needs and nothing it may
/// decide on its own: the times are PostgreSQL's, returned for information.
#[derive(Debug, Clone)]
pub struct ClaimedStep {
    pub lease: LeaseClaim,
    pub workflow: WorkflowId,
    pub name: StepName,
    pub adapter: String,
    pub operation: String,
    pub input: Value,
    pub input_digest: InputDigest,
    pub policy: LeasePolicy,
    /// The step's stable request identity: the one already persisted by an earlier attempt, or
    /// the one this attempt will persist.
    pub request_identity: RequestIdentity,
    pub attempt_number: i32,
    pub checkpoint_version: i64,
    pub leased_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub attempt_deadline: DateTime<Utc>,
    pub workflow_deadline: Option<DateTime<Utc>>,
    /// PostgreSQL's `now()` when the claim was made.
    pub db_now: DateTime<Utc>,
    /// The workflow's W3C `traceparent`: the attempt's spans join the submission's trace.
    pub trace_context: Option<String>,
}

#[derive(sqlx::FromRow)]
struct ClaimRow {
    id: Uuid,
    workflow_id: Uuid,
    name: String,
    adapter: String,
    operation: String,
    input: Value,
    input_digest: String,
    lease_ms: i32,
    renew_every_ms: i32,
    attempt_deadline_ms: i32,
    final_grace_ms: i32,
    adapter_timeout_ms: i32,
    schedule_to_start_ms: Option<i64>,
    max_attempts: i32,
    retry_policy: Option<Value>,
    request_identity: Option<String>,
    lease_owner: String,
    lease_version: i64,
    current_attempt_id: Uuid,
    attempts_made: i32,
    checkpoint_version: i64,
    leased_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    attempt_deadline: DateTime<Utc>,
    workflow_deadline: Option<DateTime<Utc>>,
    db_now: DateTime<Utc>,
    trace_context: Option<String>,
}

fn ms(v: i32) -> Duration {
    Duration::from_millis(u64::try_from(v).unwrap_or(0))
}

fn corrupt(e: z29c_core::ParseError) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

impl TryFrom<ClaimRow> for ClaimedStep {
    type Error = StoreError;
    fn try_from(r: ClaimRow) -> Result<Self> {
        let workflow = WorkflowId::from_uuid(r.workflow_id);
        let name = StepName::parse(r.name).map_err(corrupt)?;
        let request_identity = match r.request_identity {
            Some(id) => RequestIdentity::parse(id).map_err(corrupt)?,
            None => RequestIdentity::for_step(workflow, &name),
        };
        Ok(Self {
            lease: LeaseClaim {
                step: StepId::from_uuid(r.id),
                attempt: AttemptId::from_uuid(r.current_attempt_id),
                owner: OwnerId::parse(r.lease_owner).map_err(corrupt)?,
                version: LeaseVersion::new(r.lease_version).map_err(corrupt)?,
                kind: LeaseKind::Execution,
            },
            workflow,
            name,
            adapter: r.adapter,
            operation: r.operation,
            input: r.input,
            input_digest: InputDigest::parse(r.input_digest).map_err(corrupt)?,
            policy: LeasePolicy {
                lease: ms(r.lease_ms),
                renew_every: ms(r.renew_every_ms),
                attempt_deadline: ms(r.attempt_deadline_ms),
                final_grace: ms(r.final_grace_ms),
                adapter_timeout: ms(r.adapter_timeout_ms),
                max_attempts: u32::try_from(r.max_attempts).unwrap_or(1),
                schedule_to_start: r
                    .schedule_to_start_ms
                    .map_or(Duration::ZERO, |v| Duration::from_millis(v.max(0) as u64)),
                retry: crate::retry_policy_from_row(r.retry_policy)?,
            },
            request_identity,
            attempt_number: r.attempts_made,
            checkpoint_version: r.checkpoint_version,
            leased_at: r.leased_at,
            expires_at: r.expires_at,
            attempt_deadline: r.attempt_deadline,
            workflow_deadline: r.workflow_deadline,
            db_now: r.db_now,
            trace_context: r.trace_context,
        })
    }
}

/// What a worker observed from the adapter, to be committed as a receipt or kept as evidence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Observed {
    pub request_identity: RequestIdentity,
    pub input_digest: InputDigest,
    pub adapter_version: String,
    pub outcome: Outcome,
    pub external_reference: Option<ExternalReference>,
    pub result: Value,
    /// When the answer was seen, on PostgreSQL's clock as the observer reckons it (a worker:
    /// its claim's `db_now` plus what its monotonic clock measured since), for the attempt's
    /// `response_observed_at`: a worker goes on to its next call while its receipt waits for
    /// a statement, so the statement's time is not when the answer came. It is kept between
    /// the invocation's beginning and the statement's time; `None`: the statement's time.
    #[serde(skip)]
    pub seen: Option<DateTime<Utc>>,
}

/// What an attempt is to send, as persisted ([`Store::attempt_request`]).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct AttemptRequest {
    pub request_identity: Option<String>,
    pub input_digest: String,
    pub adapter: String,
    pub operation: String,
    pub input: Value,
}

impl AttemptRequest {
    /// The first part of a caller's request that is not this attempt's, named, if any. The
    /// input is compared as the value PostgreSQL holds (which the claim handed its executor),
    /// and its digest as stored: hashing the input again here would not reproduce a digest
    /// taken before PostgreSQL normalised it (`1e16` comes back as `10000000000000000`).
    pub fn differs_from(
        &self,
        identity: &str,
        input: &Value,
        input_digest: &str,
        adapter: &str,
        operation: &str,
    ) -> Option<&'static str> {
        if self.request_identity.as_deref() != Some(identity) {
            Some("request_identity")
        } else if self.adapter != adapter {
            Some("adapter")
        } else if self.operation != operation {
            Some("operation")
        } else if self.input_digest != input_digest {
            Some("input_digest")
        } else if self.input != *input {
            Some("input_json")
        } else {
            None
        }
    }
}

/// The lease after a granted renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renewed {
    pub expires_at: DateTime<Utc>,
    pub db_now: DateTime<Utc>,
}

/// The result of [`Store::commit_or_keep_late`].
#[derive(Debug, Clone, PartialEq)]
pub enum CommitOutcome {
    /// The receipt is committed under the current lease.
    Committed(Receipt),
    /// The lease was no longer current (or the step already had its receipt): the observation
    /// is kept as late evidence and nothing else changed.
    Late { observation: Uuid, reason: Value },
}

/// What [`Store::observe_response`] made of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observation {
    /// On the attempt, under its lease: checkpoint *response observed*.
    Recorded,
    /// The lease had moved on: kept as this late observation.
    Late(Uuid),
}

/// Why a late observation was kept instead of committed.
fn late_reason(reason: &FenceReason) -> Value {
    serde_json::to_value(reason).unwrap_or_else(|_| json!({ "reason": reason.to_string() }))
}

/// The claim, in one statement. A ready step's workflow is looked up by key, per candidate, as
/// the ready index is walked in order: a join let the planner start from `workflows` instead,
/// and walk every workflow ever submitted for the running ones (11 ms per claim, and growing,
/// after six minutes of a steady run; `claims_do_not_read_finished_history`).
macro_rules! claim_sql {
    () => {
        "WITH picked AS (
                 SELECT s.id FROM steps s
                 WHERE s.state = 'ready' AND s.next_eligible_at <= now()
                   AND (SELECT w.state FROM workflows w WHERE w.id = s.workflow_id) = 'running'
                 ORDER BY s.next_eligible_at, s.id
                 LIMIT $2
                 FOR UPDATE OF s SKIP LOCKED
             ), leased AS (
                 UPDATE steps s
                 SET state = 'leased', lease_owner = $1, lease_version = s.lease_version + 1,
                     leased_at = now(),
                     expires_at = now() + s.lease_ms * interval '1 millisecond',
                     attempt_deadline = now() + s.attempt_deadline_ms * interval '1 millisecond',
                     current_attempt_id = z29c_uuid_v7(),
                     attempts_made = s.attempts_made + 1,
                     request_identity = CASE WHEN $4
                         THEN 'z29c:' || s.workflow_id::text || ':' || s.name || ':'
                              || (s.attempts_made + 1)
                         ELSE coalesce(s.request_identity,
                             'z29c:' || s.workflow_id::text || ':' || s.name) END,
                     checkpoint_version = s.checkpoint_version + 1, updated_at = now()
                 FROM picked WHERE s.id = picked.id
                 RETURNING s.*
             ), attempt AS (
                 INSERT INTO attempts (id, step_id, workflow_id, number, lease_version, owner,
                     request_identity, checkpoint, input_digest, adapter, attempt_deadline)
                 SELECT current_attempt_id, id, workflow_id, attempts_made, lease_version,
                     lease_owner, request_identity, 'request_identity_persisted', input_digest,
                     adapter, attempt_deadline
                 FROM leased
             ), event AS (
                 INSERT INTO step_events (workflow_id, step_id, attempt_id, lease_version, owner,
                     kind, detail)
                 SELECT workflow_id, id, current_attempt_id, lease_version, lease_owner,
                     'lease_acquired',
                     jsonb_build_object('expires_at', expires_at, 'attempt', attempts_made)
                 FROM leased
                 UNION ALL
                 SELECT workflow_id, id, current_attempt_id, lease_version, lease_owner,
                     $3,
                     jsonb_build_object('checkpoint', 'request_identity_persisted',
                                        'checkpoint_version', checkpoint_version)
                 FROM leased
             )
             SELECT l.id, l.workflow_id, l.name, l.adapter, l.operation, l.input,
                    l.input_digest, l.lease_ms, l.renew_every_ms, l.attempt_deadline_ms,
                    l.final_grace_ms, l.adapter_timeout_ms, l.schedule_to_start_ms, l.max_attempts,
                    l.retry_policy, l.request_identity, l.lease_owner, l.lease_version,
                    l.current_attempt_id, l.attempts_made, l.checkpoint_version, l.leased_at,
                    l.expires_at, l.attempt_deadline, w.deadline AS workflow_deadline,
                    now() AS db_now, w.trace_context
             FROM leased l JOIN workflows w ON w.id = l.workflow_id"
    };
}

impl Store {
    /// Claims up to `max` ready, eligible steps of running workflows for `owner`, in one
    /// statement: `FOR UPDATE SKIP LOCKED`, `lease_version + 1`, `expires_at = now() + lease`,
    /// a new attempt and a `lease_acquired` event per step.
    ///
    /// The attempt is created at checkpoint *request identity persisted* (docs/design.md §4 steps 1
    /// and 2 in one transaction): the identity is the step's own, kept from an earlier attempt,
    /// or [`RequestIdentity::for_step`], which depends on nothing but the step. So no attempt
    /// ever exists without its identity, and the step saves a commit. The SQL spells
    /// `for_step`'s format; `claim_persists_the_steps_stable_request_identity` holds them equal.
    ///
    /// Its COMMIT does not wait for the disk ([`Store::begin_relaxed`]). A claim is a lease,
    /// not a fact: nothing outside z29c learns of it, and every write that relies on it is
    /// fenced on the attempt it created (a random id no later claim can repeat) and commits
    /// durably. PostgreSQL writes and flushes its log in order, so the first of those,
    /// *invocation began* (committed before anything is sent), makes the claim durable too.
    /// A claim lost in a server crash is a lease that never existed: the step is ready again,
    /// and its executor's writes under it are refused like those under an expired lease
    /// (`a_claim_lost_in_a_crash_fences_like_an_expired_lease`). This takes one wait for the
    /// disk (3.6 ms per `fdatasync` on the benchmark's machine) off every step's way to its
    /// start.
    pub async fn claim(&self, owner: &OwnerId, max: i64) -> Result<Vec<ClaimedStep>> {
        let rows = sqlx::query_as::<_, ClaimRow>(claim_sql!())
            .bind(owner.as_str())
            .bind(max)
            .bind(EventKind::Checkpoint.as_str())
            // the broken build that gives every attempt an identity of its own
            .bind(faults::broken(Break::NewIdentityPerRetry));
        let mut tx = self.begin_walking_indexes(true).await?;
        let rows = rows.fetch_all(&mut *tx).await?;
        if !rows.is_empty() {
            // the attempt and its request identity are one transaction: both points are here
            faults::crash_if_armed(CrashPoint::before(Checkpoint::AttemptCreated));
            faults::crash_if_armed(CrashPoint::before(Checkpoint::RequestIdentityPersisted));
        }
        tx.commit().await?;
        rows.into_iter().map(ClaimedStep::try_from).collect()
    }

    /// What a claim of up to `max` steps would do now, as PostgreSQL's plan with its actual
    /// rows and buffers (`EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`), in a transaction that is
    /// rolled back: nothing is claimed. For finding out why claims are slow.
    pub async fn claim_plan(&self, owner: &OwnerId, max: i64) -> Result<Value> {
        let mut tx = self.begin_walking_indexes(false).await?;
        let plan: Value = sqlx::query_scalar(concat!(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ",
            claim_sql!()
        ))
        .bind(owner.as_str())
        .bind(max)
        .bind(EventKind::Checkpoint.as_str())
        .bind(false)
        .fetch_one(&mut *tx)
        .await?;
        tx.rollback().await?;
        Ok(plan)
    }

    /// The request attempt `attempt` of step `step` is to send, as persisted when it was
    /// claimed: its request identity, and the step's adapter, operation and (resolved) input
    /// with its digest. A gateway sends this, and refuses a caller that asks for anything
    /// else. None of it changes once the attempt exists. `None`: no such attempt of that step.
    pub async fn attempt_request(
        &self,
        step: StepId,
        attempt: AttemptId,
    ) -> Result<Option<AttemptRequest>> {
        Ok(sqlx::query_as::<_, AttemptRequest>(
            "SELECT a.request_identity, a.input_digest, a.adapter, s.operation, s.input
             FROM attempts a JOIN steps s ON s.id = a.step_id
             WHERE a.id = $1 AND a.step_id = $2",
        )
        .bind(attempt.as_uuid())
        .bind(step.as_uuid())
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Checkpoint *invocation began* (fenced), committed before the adapter is called: from
    /// here on, no receipt means *unknown*. Refused for a cancelled workflow, which is where a
    /// cancelled step stops. Returns the new checkpoint version.
    pub async fn begin_invocation(&self, claim: &LeaseClaim) -> Result<i64> {
        let mut tx = self.begin().await?;
        let out = begin_invocation_in(&mut tx, claim).await?;
        tx.commit().await?;
        Ok(out)
    }

    /// Renews the lease (fenced), carrying the worker's latest checkpoint version. Refused when
    /// the lease is no longer current, when the workflow is not running, when the checkpoint
    /// version is stale, and once the attempt deadline leaves no more than the final grace;
    /// a granted expiry never passes the attempt deadline.
    pub async fn renew(&self, claim: &LeaseClaim, checkpoint_version: i64) -> Result<Renewed> {
        let mut tx = self.begin().await?;
        let row: Option<(DateTime<Utc>, DateTime<Utc>, Uuid)> = sqlx::query_as(concat!(
            "UPDATE steps s
             SET expires_at = LEAST(now() + s.lease_ms * interval '1 millisecond',
                                    s.attempt_deadline),
                 updated_at = now()
             WHERE s.id = $1 AND ",
            lease_held!("$2", "$3", "'leased'"),
            "
               AND s.current_attempt_id = $4
               AND s.checkpoint_version = $5
               AND now() + s.final_grace_ms * interval '1 millisecond' < s.attempt_deadline
               AND EXISTS (SELECT 1 FROM workflows w
                           WHERE w.id = s.workflow_id AND w.state = 'running')
             RETURNING s.expires_at, now(), s.workflow_id"
        ))
        .bind(claim.step.as_uuid())
        .bind(claim.version.get())
        .bind(claim.owner.as_str())
        .bind(claim.attempt.as_uuid())
        .bind(checkpoint_version)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((expires_at, db_now, workflow)) = row else {
            let reason = self
                .renewal_refusal(&mut tx, claim, checkpoint_version)
                .await?;
            return Err(StoreError::Fenced(reason));
        };
        events::append(
            &mut tx,
            NewEvent::by(
                claim,
                workflow,
                EventKind::LeaseRenewed,
                json!({ "expires_at": expires_at, "checkpoint_version": checkpoint_version }),
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(Renewed { expires_at, db_now })
    }

    async fn renewal_refusal(
        &self,
        conn: &mut PgConnection,
        claim: &LeaseClaim,
        checkpoint_version: i64,
    ) -> Result<FenceReason> {
        let reason = fence::diagnose(conn, claim, FencedWrite::Renew).await?;
        if reason != FenceReason::Changed {
            return Ok(reason);
        }
        // the lease itself is current: the checkpoint version or the deadline refused it
        let (durable, deadline, lease_ms, grace_ms, now): (
            i64,
            DateTime<Utc>,
            i32,
            i32,
            DateTime<Utc>,
        ) = sqlx::query_as(
            "SELECT checkpoint_version, attempt_deadline, lease_ms, final_grace_ms, now()
                 FROM steps WHERE id = $1",
        )
        .bind(claim.step.as_uuid())
        .fetch_one(&mut *conn)
        .await?;
        if durable != checkpoint_version {
            return Ok(FenceReason::StaleCheckpoint {
                presented: checkpoint_version,
                durable,
            });
        }
        let policy = LeasePolicy {
            lease: ms(lease_ms),
            final_grace: ms(grace_ms),
            ..LeasePolicy::default()
        };
        Ok(match policy.renewal(now, deadline) {
            RenewalDecision::Refuse => FenceReason::AttemptDeadlineReached,
            RenewalDecision::Grant { .. } => FenceReason::Changed,
        })
    }

    /// *Response observed*, recorded by whoever saw the answer first (the gateway that made the
    /// call) before the answer travels on: under the attempt's lease, the attempt's checkpoint
    /// with the outcome, the external reference and the result; once the lease has moved on
    /// (its worker paused, dead or cut off, recovery in charge), a late observation. Either
    /// way a worker that pauses, dies or gives up waiting after this loses nothing: recovery
    /// reconciles from what is recorded here.
    pub async fn observe_response(
        &self,
        claim: &LeaseClaim,
        observed: &Observed,
    ) -> Result<Observation> {
        check_observed(observed)?;
        let mut tx = self.begin().await?;
        let held = match fence::fence(
            &mut tx,
            claim,
            FencedWrite::Advance(Checkpoint::ResponseObserved),
        )
        .await
        {
            Ok(held) => held,
            Err(StoreError::Fenced(reason)) => {
                drop(tx);
                let id = self
                    .append_late_observation(claim, observed, &late_reason(&reason))
                    .await?;
                return Ok(Observation::Late(id));
            }
            Err(e) => return Err(e),
        };
        check_identity(&held, observed)?;
        sqlx::query(
            "UPDATE attempts
             SET checkpoint = 'response_observed', adapter_version = $3,
                 response_observed_at = greatest(invocation_began_at, now()),
                 observed_result = jsonb_build_object('outcome', $4::text,
                     'external_reference', $5::text, 'result', $2::jsonb),
                 updated_at = now()
             WHERE id = $1",
        )
        .bind(claim.attempt.as_uuid())
        .bind(&observed.result)
        .bind(&observed.adapter_version)
        .bind(observed.outcome.as_str())
        .bind(
            observed
                .external_reference
                .as_ref()
                .map(ExternalReference::as_str),
        )
        .execute(&mut *tx)
        .await?;
        events::append(
            &mut tx,
            NewEvent::by(
                claim,
                held.workflow,
                EventKind::Checkpoint,
                checkpoint_detail(&held, Checkpoint::ResponseObserved),
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(Observation::Recorded)
    }

    /// Commits *response observed*, the step receipt (verification `direct`), the release of
    /// dependents and the outbox event in one fenced transaction. A step that already has its
    /// receipt is [`StoreError::Conflict`]; a stale lease is [`StoreError::Fenced`].
    pub async fn commit_receipt(&self, claim: &LeaseClaim, observed: &Observed) -> Result<Receipt> {
        let mut tx = self.begin().await?;
        let out = commit_receipt_in(&mut tx, claim, observed).await?;
        tx.commit().await?;
        Ok(out)
    }

    /// Commits the receipt, or, when the lease is no longer current or the step already has
    /// its receipt, keeps the observation as late evidence. Nothing observed is thrown away.
    pub async fn commit_or_keep_late(
        &self,
        claim: &LeaseClaim,
        observed: &Observed,
    ) -> Result<CommitOutcome> {
        let committed = self.commit_receipt(claim, observed).await;
        self.keep_late_unless_committed(claim, observed, committed)
            .await
    }

    /// What [`Store::commit_or_keep_late`] does with the result of the receipt's commit.
    pub(crate) async fn keep_late_unless_committed(
        &self,
        claim: &LeaseClaim,
        observed: &Observed,
        committed: Result<Receipt>,
    ) -> Result<CommitOutcome> {
        let reason = match committed {
            Ok(receipt) => return Ok(CommitOutcome::Committed(receipt)),
            Err(StoreError::Fenced(reason)) => late_reason(&reason),
            Err(StoreError::Conflict(msg)) => json!({ "reason": "receipt_exists", "detail": msg }),
            Err(e) => return Err(e),
        };
        let observation = self
            .append_late_observation(claim, observed, &reason)
            .await?;
        Ok(CommitOutcome::Late {
            observation,
            reason,
        })
    }

    /// Appends a stale worker's observation as typed late evidence: it names the attempt, the
    /// lease version it held, the request identity and input digest it used, and what it saw.
    /// It never changes current state; recovery consumes it.
    pub async fn append_late_observation(
        &self,
        claim: &LeaseClaim,
        observed: &Observed,
        reason: &Value,
    ) -> Result<Uuid> {
        check_observed(observed)?;
        let id = Uuid::now_v7();
        if faults::broken(Break::LateResultDropped) {
            tracing::error!(step = %claim.step, "fault: a late result is dropped");
            return Ok(id);
        }
        let mut tx = self.begin().await?;
        let workflow: Option<Uuid> = sqlx::query_scalar(
            "INSERT INTO late_observations (id, step_id, workflow_id, attempt_id, lease_version,
                 owner, request_identity, input_digest, adapter_version, external_reference,
                 outcome, observed_result, fence_reason)
             SELECT $1, s.id, s.workflow_id, $3, $4, $5, $6, $7, $8, $9, $10::outcome, $11, $12
             FROM steps s WHERE s.id = $2
             RETURNING workflow_id",
        )
        .bind(id)
        .bind(claim.step.as_uuid())
        .bind(claim.attempt.as_uuid())
        .bind(claim.version.get())
        .bind(claim.owner.as_str())
        .bind(observed.request_identity.as_str())
        .bind(observed.input_digest.as_str())
        .bind(&observed.adapter_version)
        .bind(
            observed
                .external_reference
                .as_ref()
                .map(ExternalReference::as_str),
        )
        .bind(observed.outcome.as_str())
        .bind(&observed.result)
        .bind(reason)
        .fetch_optional(&mut *tx)
        .await?;
        let workflow = workflow.ok_or(StoreError::NotFound { what: "step" })?;
        // evidence that contradicts the receipt for the same request identity is an integrity
        // conflict for a person: the receipt stays, the contradiction is kept beside it
        let receipt: Option<Option<String>> = sqlx::query_scalar(
            "SELECT external_reference FROM step_receipts
             WHERE step_id = $1 AND request_identity = $2",
        )
        .bind(claim.step.as_uuid())
        .bind(observed.request_identity.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        let observed_reference = observed
            .external_reference
            .as_ref()
            .map(ExternalReference::as_str);
        if let Some(known) = receipt
            && observed.outcome == Outcome::Succeeded
            && known.as_deref() != observed_reference
        {
            sqlx::query(
                "INSERT INTO integrity_conflicts (id, step_id, workflow_id, request_identity,
                     known_reference, observed_reference, source, detail)
                 VALUES ($1, $2, $3, $4, $5, $6, 'late_evidence', $7)",
            )
            .bind(Uuid::now_v7())
            .bind(claim.step.as_uuid())
            .bind(workflow)
            .bind(observed.request_identity.as_str())
            .bind(known.as_deref())
            .bind(observed_reference)
            .bind(json!({ "observation": id }))
            .execute(&mut *tx)
            .await?;
            open_review(
                &mut tx,
                workflow,
                claim.step.as_uuid(),
                "integrity conflict: late evidence names a different external reference than the receipt",
            )
            .await?;
        }
        events::append(
            &mut tx,
            NewEvent::by(
                claim,
                workflow,
                EventKind::LateObservation,
                json!({ "observation": id, "reason": reason }),
            ),
        )
        .await?;
        outbox::enqueue(
            &mut tx,
            MessageKind::LateEvidence,
            workflow,
            Some(claim.step.as_uuid()),
            json!({ "observation": id }),
        )
        .await?;
        tx.commit().await?;
        Ok(id)
    }

    /// Gives the step back after an answer that sent nothing (`why`: rate limited, no permit
    /// free, no gateway for its adapter, not sent): no lease is held while it waits, and it is
    /// claimable again at `now() + retry_after` (PostgreSQL time). Waiting is not execution:
    /// the attempt is `released`, not failed. Each such wait counts against the step's budget
    /// (`max_waits`, `max_wait_ms`); past it the step ends now ([`RetryPolicy::after_wait`]):
    /// it fails, or goes to review when an earlier attempt may have sent.
    pub async fn release_rate_limited(
        &self,
        claim: &LeaseClaim,
        retry_after: Duration,
        why: &str,
    ) -> Result<AfterWait> {
        self.release(
            claim,
            retry_after,
            Giving::Waiting {
                why,
                unbegun: false,
            },
        )
        .await
    }

    /// Gives the step back to wait, as [`Store::release_rate_limited`], when its worker could
    /// not reach a gateway and *invocation began* is not on record: the gateway commits that
    /// before it sends, and this release, fenced, means it never will under this lease, so
    /// nothing was sent. A conflict when the invocation began: only recovery may decide then.
    pub async fn release_unsent(
        &self,
        claim: &LeaseClaim,
        retry_after: Duration,
        why: &str,
    ) -> Result<AfterWait> {
        self.release(claim, retry_after, Giving::Waiting { why, unbegun: true })
            .await
    }

    /// Gives back a step whose invocation has not begun (graceful shutdown): it is ready again
    /// at once. After invocation began this is a conflict: only recovery may decide then.
    pub async fn release_unbegun(&self, claim: &LeaseClaim) -> Result<()> {
        self.release(claim, Duration::ZERO, Giving::Unbegun)
            .await
            .map(drop)
    }

    /// After a definite refusal with `status` (`reason`, the destination's words): tries the
    /// step again, under the same request identity, when its policy names the status and
    /// attempts are left ([`RetryPolicy::after_refusal`], counting every attempt that was not
    /// given back unsent). The attempt ends `refused`, the step is ready after the backoff.
    /// [`AfterRefusal::Final`] changes nothing: the refusal is the step's outcome, and the
    /// caller commits it as the receipt.
    pub async fn retry_refused(
        &self,
        claim: &LeaseClaim,
        status: u16,
        reason: &str,
    ) -> Result<AfterRefusal> {
        let mut tx = self.begin().await?;
        let held = fence::fence(&mut tx, claim, FencedWrite::Release).await?;
        let (used, max_attempts, retry): (i64, i32, Option<Value>) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM attempts a
                     WHERE a.step_id = s.id AND a.state <> 'released'),
                    s.max_attempts, s.retry_policy
             FROM steps s WHERE s.id = $1",
        )
        .bind(claim.step.as_uuid())
        .fetch_one(&mut *tx)
        .await?;
        let policy = crate::retry_policy_from_row(retry)?;
        let decision = policy.after_refusal(
            status,
            u32::try_from(used).unwrap_or(u32::MAX),
            u32::try_from(max_attempts).unwrap_or(0),
        );
        if let AfterRefusal::Retry { after } = decision {
            // decided and carried out under one fence, in one transaction
            release_in(
                &mut tx,
                claim,
                &held,
                after,
                Giving::Refused { status, reason },
            )
            .await?;
            tx.commit().await?;
        }
        Ok(decision)
    }

    async fn release(
        &self,
        claim: &LeaseClaim,
        delay: Duration,
        giving: Giving<'_>,
    ) -> Result<AfterWait> {
        let mut tx = self.begin().await?;
        let held = fence::fence(&mut tx, claim, FencedWrite::Release).await?;
        let after = release_in(&mut tx, claim, &held, delay, giving).await?;
        tx.commit().await?;
        Ok(after)
    }

    /// Ends the lease now (fenced) without deciding anything, so recovery takes the step at
    /// once instead of after expiry: for an adapter answer of *unknown*, or a worker that must
    /// stop after invocation began. Recovery then decides from evidence.
    pub async fn surrender(&self, claim: &LeaseClaim, why: &str) -> Result<()> {
        let mut tx = self.begin().await?;
        let held = fence::fence(&mut tx, claim, FencedWrite::Release).await?;
        sqlx::query("UPDATE steps SET expires_at = now(), updated_at = now() WHERE id = $1")
            .bind(claim.step.as_uuid())
            .execute(&mut *tx)
            .await?;
        events::append(
            &mut tx,
            NewEvent::by(
                claim,
                held.workflow,
                EventKind::LeaseReleased,
                json!({ "surrendered": why }),
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }
}

/// Gives the step back under the lease `held` was fenced with (see [`Store::release_rate_limited`],
/// [`Store::release_unbegun`], [`Store::retry_refused`]), inside the caller's transaction.
async fn release_in(
    tx: &mut PgConnection,
    claim: &LeaseClaim,
    held: &Held,
    delay: Duration,
    giving: Giving<'_>,
) -> Result<AfterWait> {
    let unbegun = matches!(
        giving,
        Giving::Unbegun | Giving::Waiting { unbegun: true, .. }
    );
    if unbegun && held.checkpoint >= Some(Checkpoint::InvocationBegan) {
        return Err(StoreError::Conflict(
            "invocation began: the step can only be given to recovery".into(),
        ));
    }
    let attempt_state = match giving {
        Giving::Refused { .. } => AttemptState::Refused,
        Giving::Unbegun | Giving::Waiting { .. } => AttemptState::Released,
    };
    // an unbegun release asks the attempt's own row, in the update: a gateway committing
    // *invocation began* at this moment holds that row, and the fence's read of it may be
    // from before that commit
    let ended = sqlx::query(
        "UPDATE attempts SET state = $2::attempt_state, updated_at = now()
         WHERE id = $1 AND (NOT $3 OR checkpoint < 'invocation_began')",
    )
    .bind(claim.attempt.as_uuid())
    .bind(attempt_state.as_str())
    .bind(unbegun)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if ended == 0 {
        return Err(StoreError::Conflict(
            "invocation began: the step can only be given to recovery".into(),
        ));
    }
    // the workflow's state as it is now, locked against a concurrent end (deadline,
    // cancel), so a step is never made ready in a workflow that just ended; whether any
    // attempt of the step, this one now released, may have sent its request; and what the
    // step has waited so far. A wait may end the workflow (its budget spent), so a wait locks
    // it for that from the start: two siblings each holding a share lock and then asking for
    // more would deadlock.
    let lock = if matches!(giving, Giving::Waiting { .. }) {
        "FOR NO KEY UPDATE OF w"
    } else {
        "FOR SHARE OF w"
    };
    let (workflow_state, may_have_sent, waits, waited_ms, retry): (
        String,
        bool,
        i32,
        i64,
        Option<Value>,
    ) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT w.state::text, z29c_may_have_sent(s.id), s.waits, s.waited_ms, s.retry_policy
         FROM workflows w JOIN steps s ON s.workflow_id = w.id
         WHERE w.id = $1 AND s.id = $2 {lock}"
    )))
    .bind(held.workflow)
    .bind(claim.step.as_uuid())
    .fetch_one(&mut *tx)
    .await?;
    let running = parse::<WorkflowState>(&workflow_state)? == WorkflowState::Running;
    // an ended workflow stops the step; one whose earlier attempt may have had an effect
    // is not cancelled but goes to review
    let mut review = None;
    let mut after = AfterWait::Wait { after: delay };
    if !running {
        if may_have_sent && !faults::broken(Break::CurrentAttemptOnly) {
            review = Some(
                "workflow ended after an earlier attempt's request may have been sent".to_owned(),
            );
        }
    } else if let Giving::Waiting { why, .. } = giving {
        let so_far = Waited {
            waits: u32::try_from(waits).unwrap_or(0),
            total: Duration::from_millis(u64::try_from(waited_ms).unwrap_or(0)),
        };
        after = crate::retry_policy_from_row(retry)?.after_wait(so_far, delay, may_have_sent, why);
        match &after {
            AfterWait::Wait { .. } => {}
            AfterWait::Review(reason) => review = Some(reason.clone()),
            AfterWait::Fail(reason) => {
                crate::ending::fail_by_policy(
                    &mut *tx,
                    held.workflow,
                    NewEvent::by(
                        claim,
                        held.workflow,
                        EventKind::FailedByPolicy,
                        json!({ "reason": reason, "waits": so_far.waits + 1,
                                "waited_ms": waited_ms }),
                    ),
                    "a step waited past its budget without sending",
                )
                .await?;
                return Ok(after);
            }
        }
    }
    // every wait counts at least the step's initial backoff
    let delay = match after {
        AfterWait::Wait { after } => after,
        _ => delay,
    };
    let next = match (running, &review) {
        (_, Some(_)) => StepState::NeedsReview,
        (true, None) => StepState::Ready,
        (false, None) => StepState::Cancelled,
    };
    sqlx::query(
        "UPDATE steps
         SET state = $2::step_state, lease_owner = NULL, leased_at = NULL, expires_at = NULL,
             next_eligible_at = now() + $3::bigint * interval '1 millisecond',
             waits = waits + $4, waited_ms = waited_ms + $5,
             updated_at = now()
         WHERE id = $1",
    )
    .bind(claim.step.as_uuid())
    .bind(next.as_str())
    .bind(millis(delay))
    .bind(i32::from(matches!(giving, Giving::Waiting { .. })))
    .bind(if matches!(giving, Giving::Waiting { .. }) {
        millis(delay)
    } else {
        0
    })
    .execute(&mut *tx)
    .await?;
    if let Some(reason) = &review {
        open_review(&mut *tx, held.workflow, claim.step.as_uuid(), reason).await?;
        events::append(
            &mut *tx,
            NewEvent::by(
                claim,
                held.workflow,
                EventKind::ReviewOpened,
                json!({ "reason": reason }),
            ),
        )
        .await?;
    }
    let (kind, detail) = match giving {
        Giving::Unbegun => (
            EventKind::LeaseReleased,
            json!({ "retry_after_ms": millis(delay), "state": next.as_str() }),
        ),
        Giving::Waiting { why, .. } => (
            EventKind::RateLimited,
            json!({ "retry_after_ms": millis(delay), "state": next.as_str(), "why": why,
                    "waits": waits + 1 }),
        ),
        Giving::Refused { status, reason } => (
            EventKind::RetryScheduled,
            json!({ "retry_after_ms": millis(delay), "state": next.as_str(),
                    "status": status, "reason": reason }),
        ),
    };
    events::append(&mut *tx, NewEvent::by(claim, held.workflow, kind, detail)).await?;
    if next == StepState::Ready && delay.is_zero() {
        outbox::enqueue(
            &mut *tx,
            MessageKind::StepReady,
            held.workflow,
            Some(claim.step.as_uuid()),
            json!({}),
        )
        .await?;
    }
    Ok(after)
}

/// How a step is given back by its worker.
#[derive(Debug, Clone, Copy)]
enum Giving<'a> {
    /// Before its invocation began (shutdown, no time left).
    Unbegun,
    /// Nothing sent, for this reason: it waits, against its budget. `unbegun`: only if
    /// *invocation began* is not on record (the gateway could not be reached).
    Waiting { why: &'a str, unbegun: bool },
    /// A definite refusal its policy retries.
    Refused { status: u16, reason: &'a str },
}

fn check_observed(o: &Observed) -> Result<()> {
    if o.outcome == Outcome::Succeeded && o.external_reference.is_none() {
        return Err(StoreError::invalid(
            "external_reference",
            "a success needs the external system's reference",
        ));
    }
    if o.adapter_version.is_empty() {
        return Err(StoreError::invalid("adapter_version", "must not be empty"));
    }
    Ok(())
}

/// The observation must be about this step's effect: same request identity, same input.
fn check_identity(held: &Held, o: &Observed) -> Result<()> {
    if held.request_identity.as_deref() != Some(o.request_identity.as_str()) {
        return Err(StoreError::Conflict(format!(
            "observation names request identity {:?}, the step's is {:?}",
            o.request_identity.as_str(),
            held.request_identity
        )));
    }
    if held.input_digest != o.input_digest.as_str() {
        return Err(StoreError::Conflict(
            "observation's input digest differs from the step's".into(),
        ));
    }
    Ok(())
}

async fn has_receipt(conn: &mut PgConnection, step: Uuid) -> Result<bool> {
    Ok(
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM step_receipts WHERE step_id = $1)")
            .bind(step)
            .fetch_one(conn)
            .await?,
    )
}

/// What a checkpoint event records besides its kind.
fn checkpoint_detail(held: &Held, cp: Checkpoint) -> Value {
    json!({ "checkpoint": cp.as_str(), "checkpoint_version": held.checkpoint_version })
}

/// Writes the receipt and everything that follows from it, inside the fenced transaction:
/// the step's end, its dependents' release, the workflow's end, and the outbox messages. A
/// direct receipt (`Verification::Direct`, the attempt's own answer) also ends its attempt
/// here: its checkpoint, result and two checkpoint events are part of the same statement.
pub(crate) async fn finish_step(
    conn: &mut PgConnection,
    claim: &LeaseClaim,
    held: &Held,
    attempt: Option<Uuid>,
    observed: &Observed,
    verification: Verification,
) -> Result<Receipt> {
    let step = claim.step.as_uuid();
    let step_state = match observed.outcome {
        Outcome::Succeeded => "completed",
        Outcome::Failed => "failed",
    };
    // One statement writes the receipt; the attempt's end and its checkpoint events (direct
    // receipts); the step's end and its `lease_released` event; the `step_completed` message;
    // and, for a success with nothing to release whose siblings have all completed in this
    // statement's snapshot, the workflow's completion and its `workflow_changed` message. It
    // also says whether the step has dependents to release.
    //
    // The completion needs no lock taken first: completed steps stay completed, so a snapshot
    // that sees every sibling completed is right, and the `UPDATE` re-checks `running` on the
    // newest row version if a cancellation or a deadline got there first. A snapshot that
    // still sees a sibling open completes nothing; whichever finished last, the relay settles
    // it when it publishes the `step_completed` message ([`crate::Store::mark_outbox_sent`]).
    // Events and messages are inserted in their order, so ids follow it.
    let row = sqlx::query(concat!(
        "WITH r AS (
             INSERT INTO step_receipts (id, step_id, workflow_id, attempt_id, lease_version,
                 input_digest, adapter, adapter_version, request_identity, external_reference,
                 outcome, observed_result, verification)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11::outcome, $12,
                     $13::verification)
             RETURNING *
         ), a AS (
             UPDATE attempts
             SET checkpoint = 'receipt_committed', state = $11::text::attempt_state,
                 response_observed_at = greatest(invocation_began_at,
                                                 least(now(), coalesce($25, now()))),
                 observed_result = $12, adapter_version = $8,
                 updated_at = now()
             WHERE $19 AND id = $4
         ), s AS (
             UPDATE steps
             SET state = $14::step_state, lease_owner = NULL, leased_at = NULL,
                 expires_at = NULL, request_identity = coalesce(request_identity, $9),
                 checkpoint_version = $18, updated_at = now()
             WHERE id = $2
         ), e AS (
             INSERT INTO step_events (workflow_id, step_id, attempt_id, lease_version, owner,
                                      kind, detail)
             SELECT $3, $2, $4, $5, $15, v.kind, v.detail
             FROM r CROSS JOIN LATERAL (VALUES
                 (1, $20::text, $21::jsonb),
                 (2, $20::text, $22::jsonb),
                 (3, $16::text, jsonb_build_object('receipt', r.id, 'verification', $13::text))
             ) AS v (ord, kind, detail)
             -- the gateway's record already has its response_observed event
             WHERE ($19 AND (v.ord <> 1 OR NOT $26)) OR v.ord = 3
             ORDER BY v.ord
         ), deps AS (
             SELECT EXISTS (SELECT 1 FROM step_dependencies WHERE depends_on = $2) AS found
         ), done AS (
             UPDATE workflows w SET ",
        completed_workflow!(),
        "
             WHERE w.id = $3 AND $11::text = 'succeeded' AND NOT (SELECT found FROM deps)
               AND ",
        workflow_completes!("w", "ARRAY[$2::uuid]"),
        "
             RETURNING w.trace_context
         ), o AS (
             INSERT INTO outbox (msg_id, kind, workflow_id, step_id, payload, trace_context)
             SELECT m.kind || '-' || z29c_uuid_v7()::text, m.kind, $3, m.step_id, m.payload,
                    m.trace_context
             FROM (SELECT 1 AS ord, $17::text AS kind, $2::uuid AS step_id,
                          jsonb_build_object('outcome', $11::text, 'verification', $13::text)
                              AS payload,
                          (SELECT trace_context FROM workflows WHERE id = $3) AS trace_context
                   UNION ALL
                   SELECT 2, $23::text, NULL, $24::jsonb, trace_context FROM done) AS m
             ORDER BY m.ord
         )
         SELECT ",
        receipt_columns!(),
        ", (SELECT found FROM deps) AS has_dependents FROM r AS step_receipts"
    ))
    .bind(Uuid::now_v7())
    .bind(step)
    .bind(held.workflow)
    .bind(attempt)
    .bind(claim.version.get())
    .bind(observed.input_digest.as_str())
    .bind(&held.adapter)
    .bind(&observed.adapter_version)
    .bind(observed.request_identity.as_str())
    .bind(
        observed
            .external_reference
            .as_ref()
            .map(ExternalReference::as_str),
    )
    .bind(observed.outcome.as_str())
    .bind(&observed.result)
    .bind(verification.as_str())
    .bind(step_state)
    .bind(claim.owner.as_str())
    .bind(EventKind::LeaseReleased.as_str())
    .bind(MessageKind::StepCompleted.as_str())
    .bind(held.checkpoint_version)
    .bind(verification == Verification::Direct)
    .bind(EventKind::Checkpoint.as_str())
    .bind(checkpoint_detail(held, Checkpoint::ResponseObserved))
    .bind(checkpoint_detail(held, Checkpoint::ReceiptCommitted))
    .bind(MessageKind::WorkflowChanged.as_str())
    .bind(json!({ "state": WorkflowState::Completed.as_str() }))
    .bind(observed.seen)
    .bind(held.checkpoint == Some(Checkpoint::ResponseObserved))
    .fetch_one(&mut *conn)
    .await?;
    let has_dependents: bool = row.try_get("has_dependents")?;
    let receipt = Receipt::try_from(ReceiptRow::from_row(&row)?)?;
    // A success with nothing to release is done: the statement completed the workflow if
    // every sibling had, and otherwise took no workflow lock, so the siblings of a fan-out
    // commit side by side. Whether it was the last one after all (siblings finishing at the
    // same moment each see the others open) is settled after COMMIT, by the outbox relay that
    // publishes its `step_completed` message: [`crate::Store::mark_outbox_sent`] completes the
    // workflow once every step has, in the same transaction.
    if observed.outcome == Outcome::Succeeded && !has_dependents {
        return Ok(receipt);
    }
    // Everything else locks the workflow, so the last one sees all the others. A step without
    // dependents takes it last, so it is held only through this transaction's COMMIT. A step
    // with dependents takes it before it locks their rows, in the order a cancellation takes
    // them (workflow, then steps), so the two cannot deadlock.
    let early = match has_dependents {
        true => Some(lock_workflow(conn, held.workflow).await?),
        false => None,
    };
    if early == Some(WorkflowState::Running) && observed.outcome == Outcome::Succeeded {
        release_dependents(conn, held.workflow, step).await?;
    }
    let workflow_state = match early {
        Some(state) => state,
        None => lock_workflow(conn, held.workflow).await?,
    };
    if workflow_state != WorkflowState::Running {
        // a cancelled workflow records what its in-flight step did, and nothing more
        return Ok(receipt);
    }
    match observed.outcome {
        Outcome::Failed => {
            end_workflow(conn, held.workflow, WorkflowState::Failed).await?;
            stop_unstarted_steps(conn, held.workflow, "a step failed").await?;
        }
        // a statement after the lock has a fresh snapshot: every sibling that finished before
        // us is visible, so the last one to finish completes the workflow
        Outcome::Succeeded => complete_if_all_done(conn, held.workflow).await?,
    }
    Ok(receipt)
}

/// Locks the workflow's row until the transaction ends and returns its state.
async fn lock_workflow(conn: &mut PgConnection, workflow: Uuid) -> Result<WorkflowState> {
    let state: String =
        sqlx::query_scalar("SELECT state::text FROM workflows WHERE id = $1 FOR NO KEY UPDATE")
            .bind(workflow)
            .fetch_one(&mut *conn)
            .await?;
    parse(&state)
}

async fn release_dependents(conn: &mut PgConnection, workflow: Uuid, step: Uuid) -> Result<()> {
    let ready: Vec<(Uuid, i64)> = sqlx::query_as(
        "UPDATE steps s
         SET pending_deps = s.pending_deps - 1,
             state = CASE WHEN s.pending_deps = 1 THEN 'ready'::step_state ELSE s.state END,
             start_by = CASE WHEN s.pending_deps = 1
                             THEN now() + s.schedule_to_start_ms * interval '1 millisecond' END,
             next_eligible_at = now(), updated_at = now()
         FROM step_dependencies d
         WHERE d.depends_on = $1 AND d.step_id = s.id AND s.state = 'blocked'
         RETURNING s.id, s.lease_version, s.state = 'ready' AS now_ready",
    )
    .bind(step)
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .filter_map(|(id, v, ready): (Uuid, i64, bool)| ready.then_some((id, v)))
    .collect();
    for (id, lease_version) in ready {
        if let Err(e) = resolve_input(conn, id).await? {
            // a reference that names nothing the receipts hold: the step cannot be sent
            crate::ending::fail_by_policy(
                conn,
                workflow,
                NewEvent {
                    workflow,
                    step: id,
                    attempt: None,
                    lease_version,
                    owner: None,
                    kind: EventKind::InputUnresolved,
                    detail: json!({ "reason": format!("input: {e}") }),
                },
                "a step's input could not be resolved",
            )
            .await?;
            // the workflow has failed, and its other steps were stopped with it
            return Ok(());
        }
        events::append(
            conn,
            NewEvent {
                workflow,
                step: id,
                attempt: None,
                lease_version,
                owner: None,
                kind: EventKind::DependenciesMet,
                detail: json!({ "after": step }),
            },
        )
        .await?;
        outbox::enqueue(conn, MessageKind::StepReady, workflow, Some(id), json!({})).await?;
    }
    Ok(())
}

/// Resolves the references of a step's input from its dependencies' receipts, once they have
/// all succeeded, and writes the result as the input every attempt sends, with its digest.
/// A step without references is left as it is.
async fn resolve_input(
    conn: &mut PgConnection,
    step: Uuid,
) -> Result<std::result::Result<(), z29c_core::refs::RefError>> {
    let template: Option<Value> =
        sqlx::query_scalar("SELECT input_template FROM steps WHERE id = $1")
            .bind(step)
            .fetch_one(&mut *conn)
            .await?;
    let Some(template) = template else {
        return Ok(Ok(()));
    };
    let upstream: Vec<(String, Value, Option<String>)> = sqlx::query_as(
        "SELECT u.name, r.observed_result, r.external_reference
         FROM step_dependencies d
         JOIN steps u ON u.id = d.depends_on
         JOIN step_receipts r ON r.step_id = u.id AND r.outcome = 'succeeded'
         WHERE d.step_id = $1",
    )
    .bind(step)
    .fetch_all(&mut *conn)
    .await?;
    let lookup = |name: &str| {
        upstream
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, result, reference)| z29c_core::refs::Upstream {
                result,
                reference: reference.as_deref(),
            })
    };
    let input = match z29c_core::refs::resolve(&template, &lookup) {
        Ok(input) => input,
        Err(e) => return Ok(Err(e)),
    };
    sqlx::query("UPDATE steps SET input = $2, input_digest = $3 WHERE id = $1")
        .bind(step)
        .bind(&input)
        .bind(InputDigest::of_json(&input).as_str())
        .execute(&mut *conn)
        .await?;
    Ok(Ok(()))
}

/// The statements of [`Store::begin_invocation`], on the caller's transaction.
pub(crate) async fn begin_invocation_in(
    conn: &mut PgConnection,
    claim: &LeaseClaim,
) -> Result<i64> {
    // the fence, the attempt's checkpoint and its event are one statement
    let held =
        fence::fence_invocation_began(&mut *conn, claim, EventKind::Checkpoint.as_str()).await?;
    if held.checkpoint < Some(Checkpoint::RequestIdentityPersisted) {
        return Err(StoreError::invalid(
            "checkpoint",
            "the request identity must be persisted before invocation begins",
        ));
    }
    faults::crash_if_armed(CrashPoint::before(Checkpoint::InvocationBegan));
    Ok(held.checkpoint_version)
}

/// The statements of [`Store::commit_receipt`], on the caller's transaction.
pub(crate) async fn commit_receipt_in(
    conn: &mut PgConnection,
    claim: &LeaseClaim,
    observed: &Observed,
) -> Result<Receipt> {
    check_observed(observed)?;
    let held = match fence::fence(
        &mut *conn,
        claim,
        FencedWrite::Advance(Checkpoint::ReceiptCommitted),
    )
    .await
    {
        Ok(held) => held,
        Err(StoreError::Fenced(reason)) => {
            if has_receipt(&mut *conn, claim.step.as_uuid()).await? {
                return Err(StoreError::Conflict("step already has its receipt".into()));
            }
            if !faults::receipts_unfenced() {
                return Err(StoreError::Fenced(reason));
            }
            // the broken build (faults feature only): the lease check is ignored
            fence::unfenced(&mut *conn, claim).await?
        }
        Err(e) => return Err(e),
    };
    if held.checkpoint < Some(Checkpoint::InvocationBegan) {
        return Err(StoreError::invalid(
            "checkpoint",
            "a receipt needs an invocation that began",
        ));
    }
    check_identity(&held, observed)?;
    // the response observed (nothing is committed until the receipt is: a crash here leaves
    // the attempt at `invocation_began`, an unknown outcome)
    faults::crash_if_armed(CrashPoint::after(Checkpoint::ResponseObserved));
    // the attempt's end and its checkpoint events are written with the receipt, in one
    // statement (a direct receipt)
    let receipt = finish_step(
        &mut *conn,
        claim,
        &held,
        Some(claim.attempt.as_uuid()),
        observed,
        Verification::Direct,
    )
    .await?;
    faults::crash_if_armed(CrashPoint::before(Checkpoint::ReceiptCommitted));
    Ok(receipt)
}
