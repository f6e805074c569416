//! How steps and workflows end, written once for every path that ends them: the receipt as
//! stored, a review item opened, a workflow completed once all its steps have, or ended
//! otherwise with its unstarted steps stopped.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};
use sqlx::PgConnection;
use uuid::Uuid;
use z29c_core::{LeaseVersion, Outcome, StepId, Verification, WorkflowState};

use crate::error::parse;
use crate::events::{self, EventKind, NewEvent};
use crate::faults::{self, Break};
use crate::outbox::{self, MessageKind};
use crate::{Result, StoreError};

/// The condition under which the workflow row `$w` is completed: it is running, and every one
/// of its steps has completed, apart from those this same statement completes (`$finishing`,
/// a `uuid[]` expression; a statement's own updates are not visible to its other parts). Every
/// statement that completes a workflow puts it in its `WHERE`, and sets
/// [`completed_workflow!`].
macro_rules! workflow_completes {
    ($w:literal, $finishing:literal) => {
        concat!(
            $w,
            ".state = 'running' AND NOT EXISTS (SELECT 1 FROM steps x WHERE x.workflow_id = ",
            $w,
            ".id AND x.state <> 'completed' AND NOT x.id = ANY (coalesce(",
            $finishing,
            ", '{}'::uuid[])))"
        )
    };
}
pub(crate) use workflow_completes;

/// What a completed workflow's row is set to.
macro_rules! completed_workflow {
    () => {
        "state = 'completed', ended_at = now(), updated_at = now()"
    };
}
pub(crate) use completed_workflow;

/// A receipt as stored: z29c's accepted conclusion about a step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Receipt {
    pub id: Uuid,
    pub step: StepId,
    pub attempt: Option<Uuid>,
    pub lease_version: LeaseVersion,
    pub input_digest: String,
    pub adapter: String,
    pub adapter_version: String,
    pub request_identity: String,
    pub external_reference: Option<String>,
    pub outcome: Outcome,
    pub observed_result: Value,
    pub verification: Verification,
    pub committed_at: DateTime<Utc>,
    /// When the step was submitted: `committed_at` minus this is its time to receipt.
    pub step_created_at: DateTime<Utc>,
}

#[derive(sqlx::FromRow)]
pub(crate) struct ReceiptRow {
    id: Uuid,
    step_id: Uuid,
    attempt_id: Option<Uuid>,
    lease_version: i64,
    input_digest: String,
    adapter: String,
    adapter_version: String,
    request_identity: String,
    external_reference: Option<String>,
    outcome: String,
    observed_result: Value,
    verification: String,
    committed_at: DateTime<Utc>,
    step_created_at: DateTime<Utc>,
}

/// The columns a [`ReceiptRow`] reads, as a literal so queries stay `&'static str`.
macro_rules! receipt_columns {
    () => {
        "id, step_id, attempt_id, lease_version, input_digest, adapter, adapter_version, \
         request_identity, external_reference, outcome::text AS outcome, observed_result, \
         verification::text AS verification, committed_at, \
         (SELECT s.created_at FROM steps s WHERE s.id = step_receipts.step_id) AS step_created_at"
    };
}
pub(crate) use receipt_columns;

impl TryFrom<ReceiptRow> for Receipt {
    type Error = StoreError;
    fn try_from(r: ReceiptRow) -> Result<Self> {
        Ok(Self {
            id: r.id,
            step: StepId::from_uuid(r.step_id),
            attempt: r.attempt_id,
            lease_version: LeaseVersion::new(r.lease_version)
                .map_err(|e| StoreError::Corrupt(e.to_string()))?,
            input_digest: r.input_digest,
            adapter: r.adapter,
            adapter_version: r.adapter_version,
            request_identity: r.request_identity,
            external_reference: r.external_reference,
            outcome: parse(&r.outcome)?,
            observed_result: r.observed_result,
            verification: parse(&r.verification)?,
            committed_at: r.committed_at,
            step_created_at: r.step_created_at,
        })
    }
}

/// Opens a review item for a step (at most one open per step).
pub(crate) async fn open_review(
    conn: &mut sqlx::PgConnection,
    workflow: Uuid,
    step: Uuid,
    reason: &str,
) -> Result<Uuid> {
    let id = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO review_items (id, step_id, workflow_id, request_identity, reason)
         SELECT $1, s.id, s.workflow_id, s.request_identity, $3 FROM steps s
         WHERE s.id = $2 AND s.workflow_id = $4
         ON CONFLICT (step_id, workflow_id) WHERE state = 'open' DO NOTHING",
    )
    .bind(id)
    .bind(step)
    .bind(reason)
    .bind(workflow)
    .execute(&mut *conn)
    .await?;
    Ok(id)
}

/// Completes a running workflow whose steps have all completed, with its `workflow_changed`
/// message, in one statement. The caller holds the workflow's lock.
pub(crate) async fn complete_if_all_done(conn: &mut PgConnection, workflow: Uuid) -> Result<()> {
    sqlx::query(concat!(
        "WITH done AS (
             UPDATE workflows w SET ",
        completed_workflow!(),
        " WHERE w.id = $1 AND ",
        workflow_completes!("w", "NULL::uuid[]"),
        "
             RETURNING w.id, w.trace_context
         )
         INSERT INTO outbox (msg_id, kind, workflow_id, step_id, payload, trace_context)
         SELECT $2 || '-' || z29c_uuid_v7()::text, $2, id, NULL, $3, trace_context FROM done"
    ))
    .bind(workflow)
    .bind(MessageKind::WorkflowChanged.as_str())
    .bind(json!({ "state": WorkflowState::Completed.as_str() }))
    .execute(conn)
    .await?;
    Ok(())
}

/// Ends a running workflow in `state` (failed, cancelled, timed out), with its
/// `workflow_changed` message.
pub(crate) async fn end_workflow(
    conn: &mut PgConnection,
    workflow: Uuid,
    state: WorkflowState,
) -> Result<()> {
    sqlx::query(
        "UPDATE workflows SET state = $2::workflow_state, ended_at = now(), updated_at = now()
         WHERE id = $1 AND state = 'running'",
    )
    .bind(workflow)
    .bind(state.as_str())
    .execute(&mut *conn)
    .await?;
    outbox::enqueue(
        conn,
        MessageKind::WorkflowChanged,
        workflow,
        None,
        json!({ "state": state.as_str() }),
    )
    .await
}

/// Fails a step its policy ends (a deadline or a budget passed) when nothing it did may have
/// taken effect, with `event` (its `failed_by_policy`, saying why) in its history; its
/// workflow, if still running, fails with it, and the workflow's steps not started stop for
/// `workflow_reason`. The caller holds the step's lock.
pub(crate) async fn fail_by_policy(
    conn: &mut PgConnection,
    workflow: Uuid,
    event: NewEvent<'_>,
    workflow_reason: &str,
) -> Result<()> {
    let step = event.step;
    let running: bool = sqlx::query_scalar(
        "SELECT state = 'running' FROM workflows WHERE id = $1 FOR NO KEY UPDATE",
    )
    .bind(workflow)
    .fetch_one(&mut *conn)
    .await?;
    sqlx::query(
        "UPDATE steps SET state = 'failed', start_by = NULL, lease_owner = NULL,
             leased_at = NULL, expires_at = NULL, updated_at = now()
         WHERE id = $1",
    )
    .bind(step)
    .execute(&mut *conn)
    .await?;
    events::append(conn, event).await?;
    if running {
        end_workflow(conn, workflow, WorkflowState::Failed).await?;
        stop_unstarted_steps(conn, workflow, workflow_reason).await?;
    }
    Ok(())
}

/// Stops a finished workflow's steps that are not running. One that any of its attempts may
/// have sent (`z29c_may_have_sent`) goes to review: its effect may exist.
pub(crate) async fn stop_unstarted_steps(
    conn: &mut PgConnection,
    workflow: Uuid,
    reason: &str,
) -> Result<()> {
    let stopped: Vec<(Uuid, String, i64)> = if faults::broken(Break::CurrentAttemptOnly) {
        sqlx::query_as(
            "UPDATE steps s
             SET state = CASE WHEN a.checkpoint >= 'invocation_began'
                              THEN 'needs_review'::step_state ELSE 'cancelled'::step_state END,
                 updated_at = now()
             FROM steps s0 LEFT JOIN attempts a ON a.id = s0.current_attempt_id
             WHERE s0.id = s.id AND s.workflow_id = $1 AND s.state IN ('blocked', 'ready')
             RETURNING s.id, s.state::text, s.lease_version",
        )
        .bind(workflow)
        .fetch_all(&mut *conn)
        .await?
    } else {
        sqlx::query_as(
            "UPDATE steps s
             SET state = CASE WHEN z29c_may_have_sent(s.id)
                              THEN 'needs_review'::step_state ELSE 'cancelled'::step_state END,
                 updated_at = now()
             WHERE s.workflow_id = $1 AND s.state IN ('blocked', 'ready')
             RETURNING s.id, s.state::text, s.lease_version",
        )
        .bind(workflow)
        .fetch_all(&mut *conn)
        .await?
    };
    for (step, state, lease_version) in stopped {
        // a step that may have sent is not cancelled: its review opens, and says why
        let kind = if state == "needs_review" {
            open_review(
                conn,
                workflow,
                step,
                "workflow ended after a request may have been sent",
            )
            .await?;
            EventKind::ReviewOpened
        } else {
            EventKind::Cancelled
        };
        events::append(
            conn,
            NewEvent {
                workflow,
                step,
                attempt: None,
                lease_version,
                owner: None,
                kind,
                detail: json!({ "reason": reason, "state": state }),
            },
        )
        .await?;
    }
    Ok(())
}
