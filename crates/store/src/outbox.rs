//! The transactional outbox. A message is written in the same transaction as the state change
//! it announces, so a change is never announced without having happened and never happens
//! without being announced. The relay claims rows, publishes them with `Nats-Msg-Id = msg_id`
//! (JetStream drops duplicates), then marks them sent; a relay that dies mid-way leaves its
//! claim to expire and another relay publishes again under the same `msg_id`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;
use z29c_core::{OwnerId, WorkflowState};

use crate::ending::{completed_workflow, workflow_completes};
use crate::{Result, Store, millis};

/// What an outbox message announces. The bus maps each kind to its NATS subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageKind {
    StepReady,
    StepCompleted,
    LateEvidence,
    WorkflowChanged,
}

impl MessageKind {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::StepReady => "step_ready",
            Self::StepCompleted => "step_completed",
            Self::LateEvidence => "late_evidence",
            Self::WorkflowChanged => "workflow_changed",
        }
    }
}

/// A message waiting to be published.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct OutboxMessage {
    pub id: i64,
    pub msg_id: String,
    pub kind: String,
    pub workflow_id: Uuid,
    pub step_id: Option<Uuid>,
    pub payload: Value,
    pub created_at: DateTime<Utc>,
    /// The workflow's W3C `traceparent`, for the message's headers.
    pub trace_context: Option<String>,
}

pub(crate) async fn enqueue(
    conn: &mut PgConnection,
    kind: MessageKind,
    workflow: Uuid,
    step: Option<Uuid>,
    payload: Value,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO outbox (msg_id, kind, workflow_id, step_id, payload, trace_context)
         VALUES ($1 || '-' || z29c_uuid_v7()::text, $1, $2, $3, $4,
                 (SELECT trace_context FROM workflows WHERE id = $2))",
    )
    .bind(kind.as_str())
    .bind(workflow)
    .bind(step)
    .bind(payload)
    .execute(conn)
    .await?;
    Ok(())
}

/// The statement of [`Store::claim_outbox`]. The claimed rows are updated by their keys as one
/// array: joined to the pick instead, the planner may merge-join them with a walk of the whole
/// primary key, both being in `id` order.
macro_rules! outbox_claim_sql {
    () => {
        "WITH picked AS (
             SELECT id FROM outbox
             WHERE claimed_until IS NULL OR claimed_until <= now()
             ORDER BY id LIMIT $2
             FOR UPDATE SKIP LOCKED
         )
         UPDATE outbox o
         SET claimed_by = $1, claimed_until = now() + $3::bigint * interval '1 millisecond'
         WHERE o.id = ANY(ARRAY(SELECT id FROM picked))
         RETURNING o.id, o.msg_id, o.kind, o.workflow_id, o.step_id, o.payload, o.created_at,
                   o.trace_context"
    };
}

impl Store {
    /// Claims up to `limit` unsent messages, oldest first, for `hold` (PostgreSQL time).
    /// Concurrent relays claim disjoint batches; an expired claim is claimable again.
    pub async fn claim_outbox(
        &self,
        relay: &OwnerId,
        limit: i64,
        hold: Duration,
    ) -> Result<Vec<OutboxMessage>> {
        // not durable: a claim lost in a server crash is claimed again
        let mut tx = self.begin_walking_indexes(true).await?;
        let claimed = claim_in(&mut tx, relay, limit, hold).await?;
        tx.commit().await?;
        Ok(claimed)
    }

    /// Marks messages as published by deleting them: a published message is JetStream's now,
    /// and a row kept would only be another tuple for every index and for vacuum. Returns how
    /// many were newly marked.
    ///
    /// In the same statement, every running workflow named by a sent `step_completed` message
    /// whose steps have all completed is completed, with its `workflow_changed` message. A
    /// receipt commits without the workflow's lock while its siblings are open (see
    /// `leases::finish_step`), so siblings finishing at once may each have seen the others
    /// open; this runs after their COMMITs, on a snapshot that holds them all, and the row
    /// lock of the `UPDATE` waits for a step's failure or a cancellation in flight.
    ///
    /// Its COMMIT does not wait for the disk ([`Store::begin_relaxed`]) unless it completed a
    /// workflow: a mark lost in a server crash republishes under the same `Nats-Msg-Id`.
    pub async fn mark_outbox_sent(&self, ids: &[i64]) -> Result<u64> {
        let mut tx = self.begin_relaxed().await?;
        let sent = mark_sent_in(&mut tx, ids).await?;
        tx.commit().await?;
        Ok(sent)
    }

    /// [`Store::mark_outbox_sent`] for `sent`, then [`Store::claim_outbox`] for the next batch,
    /// in one transaction: a relay that keeps up pays one `COMMIT` per batch instead of two.
    /// Its COMMIT does not wait for the disk unless the mark completed a workflow, as the
    /// mark's alone: a claim lost in a server crash is claimed again, and what it had
    /// published goes out again under the same `Nats-Msg-Id`.
    pub async fn mark_outbox_sent_and_claim(
        &self,
        sent: &[i64],
        relay: &OwnerId,
        limit: i64,
        hold: Duration,
    ) -> Result<(u64, Vec<OutboxMessage>)> {
        let mut tx = self.begin_walking_indexes(true).await?;
        let marked = mark_sent_in(&mut tx, sent).await?;
        let next = claim_in(&mut tx, relay, limit, hold).await?;
        tx.commit().await?;
        Ok((marked, next))
    }

    /// What a relay's claim of up to `limit` messages would do now, as PostgreSQL's plan with
    /// its actual rows and buffers (`EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`), in a
    /// transaction that is rolled back: nothing is claimed. For finding out why a relay is slow.
    pub async fn outbox_claim_plan(&self, relay: &OwnerId, limit: i64) -> Result<Value> {
        let mut tx = self.begin_walking_indexes(true).await?;
        let plan: Value = sqlx::query_scalar(concat!(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ",
            outbox_claim_sql!()
        ))
        .bind(relay.as_str())
        .bind(limit)
        .bind(1_000_i64)
        .fetch_one(&mut *tx)
        .await?;
        tx.rollback().await?;
        Ok(plan)
    }

    /// How many messages wait to be published.
    pub async fn outbox_backlog(&self) -> Result<i64> {
        Ok(sqlx::query_scalar("SELECT count(*) FROM outbox")
            .fetch_one(&self.pool)
            .await?)
    }
}

/// [`outbox_claim_sql`] on the caller's transaction, which walks indexes in order
/// ([`Store::begin_walking_indexes`]).
async fn claim_in(
    conn: &mut PgConnection,
    relay: &OwnerId,
    limit: i64,
    hold: Duration,
) -> Result<Vec<OutboxMessage>> {
    Ok(sqlx::query_as(outbox_claim_sql!())
        .bind(relay.as_str())
        .bind(limit)
        .bind(millis(hold))
        .fetch_all(conn)
        .await
        .map(|mut rows: Vec<OutboxMessage>| {
            rows.sort_by_key(|m| m.id);
            rows
        })?)
}

/// The statement of [`Store::mark_outbox_sent`], on the caller's transaction. A mark may be
/// lost with a commit that did not wait for the disk; a workflow's completion, once a client
/// may have read it, may not: when the statement completed a workflow, its transaction's
/// `COMMIT` waits for the disk.
async fn mark_sent_in(conn: &mut PgConnection, ids: &[i64]) -> Result<u64> {
    let (sent, completed): (i64, i64) = sqlx::query_as(concat!(
        "WITH sent AS (
             DELETE FROM outbox WHERE id = ANY($1)
             RETURNING workflow_id, kind
         ), done AS (
             UPDATE workflows w SET ",
        completed_workflow!(),
        "
             WHERE w.id IN (SELECT workflow_id FROM sent WHERE kind = $2) AND ",
        workflow_completes!("w", "NULL::uuid[]"),
        "
             RETURNING w.id, w.trace_context
         ), announced AS (
             INSERT INTO outbox (msg_id, kind, workflow_id, step_id, payload, trace_context)
             SELECT $3 || '-' || z29c_uuid_v7()::text, $3, id, NULL, $4, trace_context
             FROM done
         )
         SELECT (SELECT count(*) FROM sent), (SELECT count(*) FROM done)"
    ))
    .bind(ids)
    .bind(MessageKind::StepCompleted.as_str())
    .bind(MessageKind::WorkflowChanged.as_str())
    .bind(serde_json::json!({ "state": WorkflowState::Completed.as_str() }))
    .fetch_one(&mut *conn)
    .await?;
    if completed > 0 {
        sqlx::query("SET LOCAL synchronous_commit = on")
            .execute(&mut *conn)
            .await?;
    }
    Ok(sent as u64)
}
