//! The step event history: lease acquisitions, renewals, expiries, checkpoints, decisions.
//! It is what an operator reads under "technical details"; it is never read back as evidence
//! of an external outcome.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;
use z29c_core::{AttemptId, StepId};

use crate::{Result, Store};

/// What a step event records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    LeaseAcquired,
    LeaseRenewed,
    LeaseReleased,
    LeaseExpired,
    RecoveryLeaseAcquired,
    Checkpoint,
    RateLimited,
    FencedWriteRejected,
    LateObservation,
    RecoveryDecision,
    ReviewOpened,
    ReviewResolved,
    DependenciesMet,
    Cancelled,
    FailedByPolicy,
    RetryScheduled,
    InputUnresolved,
}

impl EventKind {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::LeaseAcquired => "lease_acquired",
            Self::LeaseRenewed => "lease_renewed",
            Self::LeaseReleased => "lease_released",
            Self::LeaseExpired => "lease_expired",
            Self::RecoveryLeaseAcquired => "recovery_lease_acquired",
            Self::Checkpoint => "checkpoint",
            Self::RateLimited => "rate_limited",
            Self::FencedWriteRejected => "fenced_write_rejected",
            Self::LateObservation => "late_observation",
            Self::RecoveryDecision => "recovery_decision",
            Self::ReviewOpened => "review_opened",
            Self::ReviewResolved => "review_resolved",
            Self::DependenciesMet => "dependencies_met",
            Self::Cancelled => "cancelled",
            Self::FailedByPolicy => "failed_by_policy",
            Self::RetryScheduled => "retry_scheduled",
            Self::InputUnresolved => "input_unresolved",
        }
    }
}

/// One entry of a step's history.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct StepEvent {
    pub id: i64,
    pub kind: String,
    pub attempt_id: Option<Uuid>,
    pub lease_version: i64,
    pub owner: Option<String>,
    pub detail: Value,
    pub at: DateTime<Utc>,
}

/// An event to append, inside the transaction of the change it records.
#[derive(Debug)]
pub(crate) struct NewEvent<'a> {
    pub(crate) workflow: Uuid,
    pub(crate) step: Uuid,
    pub(crate) attempt: Option<Uuid>,
    pub(crate) lease_version: i64,
    pub(crate) owner: Option<&'a str>,
    pub(crate) kind: EventKind,
    pub(crate) detail: Value,
}

impl<'a> NewEvent<'a> {
    /// An event written by the holder of `claim`, naming the attempt and lease it acted under.
    pub(crate) fn by(
        claim: &'a z29c_core::LeaseClaim,
        workflow: Uuid,
        kind: EventKind,
        detail: Value,
    ) -> Self {
        Self {
            workflow,
            step: claim.step.as_uuid(),
            attempt: Some(claim.attempt.as_uuid()),
            lease_version: claim.version.get(),
            owner: Some(claim.owner.as_str()),
            kind,
            detail,
        }
    }
}

pub(crate) async fn append(conn: &mut PgConnection, e: NewEvent<'_>) -> Result<()> {
    sqlx::query(
        "INSERT INTO step_events (workflow_id, step_id, attempt_id, lease_version, owner, kind, detail)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(e.workflow)
    .bind(e.step)
    .bind(e.attempt)
    .bind(e.lease_version)
    .bind(e.owner)
    .bind(e.kind.as_str())
    .bind(e.detail)
    .execute(conn)
    .await?;
    Ok(())
}

impl Store {
    /// A step's whole history, oldest first.
    pub async fn step_events(&self, step: StepId) -> Result<Vec<StepEvent>> {
        Ok(sqlx::query_as(
            "SELECT id, kind, attempt_id, lease_version, owner, detail, at
             FROM step_events WHERE step_id = $1 ORDER BY id",
        )
        .bind(step.as_uuid())
        .fetch_all(&self.pool)
        .await?)
    }

    /// The events of one attempt, oldest first (read by the attempt's step: events are keyed
    /// by step).
    pub async fn attempt_events(&self, attempt: AttemptId) -> Result<Vec<StepEvent>> {
        Ok(sqlx::query_as(
            "SELECT id, kind, attempt_id, lease_version, owner, detail, at
             FROM step_events
             WHERE step_id = (SELECT step_id FROM attempts WHERE id = $1) AND attempt_id = $1
             ORDER BY id",
        )
        .bind(attempt.as_uuid())
        .fetch_all(&self.pool)
        .await?)
    }
}
