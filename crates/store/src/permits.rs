//! Adapter concurrency permits, called by the adapter gateway alone (DESIGN.md §7). A permit
//! is separate from any step lease: it is taken just before an invocation and bounds how many
//! calls z29c intentionally has in flight per adapter and operation class, across all gateway
//! instances. An unknown outcome keeps its permit counting until resolution or a safety window.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;
use z29c_core::{AttemptId, RequestIdentity};

use crate::{Result, Store, StoreError, millis};

/// What a permit is for.
#[derive(Debug, Clone)]
pub struct PermitRequest<'a> {
    pub adapter: &'a str,
    pub operation_class: &'a str,
    pub attempt: Option<AttemptId>,
    pub request_identity: &'a RequestIdentity,
    pub gateway: &'a str,
    /// How long the permit counts if nobody releases it.
    pub hold: Duration,
}

/// A permit as stored.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Permit {
    pub id: Uuid,
    pub adapter: String,
    pub operation_class: String,
    pub attempt_id: Option<Uuid>,
    pub request_identity: String,
    pub gateway: String,
    pub state: String,
    pub acquired_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub released_at: Option<DateTime<Utc>>,
    pub release_reason: Option<String>,
}

macro_rules! permit_columns {
    () => {
        "id, adapter, operation_class, attempt_id, request_identity, gateway, state, \
         acquired_at, expires_at, released_at, release_reason"
    };
}

/// Releases the permits still held for an unknown outcome of `identity`, now that the outcome
/// is known; the release names why. Runs inside the transaction that made it known.
pub(crate) async fn release_unknown_for(
    conn: &mut sqlx::PgConnection,
    identity: &str,
    reason: &str,
) -> Result<u64> {
    Ok(sqlx::query(
        "UPDATE adapter_permits
         SET state = 'released', released_at = clock_timestamp(), release_reason = $2
         WHERE request_identity = $1 AND state = 'unknown'",
    )
    .bind(identity)
    .bind(reason)
    .execute(conn)
    .await?
    .rows_affected())
}

impl Store {
    /// Sets the in-flight limit of an adapter's operation class.
    pub async fn set_permit_limit(
        &self,
        adapter: &str,
        operation_class: &str,
        max_in_flight: i32,
    ) -> Result<()> {
        if max_in_flight <= 0 {
            return Err(StoreError::invalid("max_in_flight", "must be positive"));
        }
        sqlx::query(
            "INSERT INTO adapter_limits (adapter, operation_class, max_in_flight)
             VALUES ($1, $2, $3)
             ON CONFLICT (adapter, operation_class)
             DO UPDATE SET max_in_flight = EXCLUDED.max_in_flight, updated_at = now()",
        )
        .bind(adapter)
        .bind(operation_class)
        .bind(max_in_flight)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Takes a permit if fewer than the limit count now. The limit row is locked for the
    /// decision, so gateways racing for the last permit cannot both get it.
    pub async fn acquire_permit(&self, req: &PermitRequest<'_>) -> Result<Permit> {
        let mut tx = self.begin().await?;
        let permit = acquire_permit_in(&mut tx, req).await?;
        tx.commit().await?;
        Ok(permit)
    }

    /// Releases a permit on a known outcome (or after resolution). Releasing twice is a no-op.
    pub async fn release_permit(&self, id: Uuid, reason: &str) -> Result<()> {
        let mut conn = self.pool.acquire().await?;
        release_permit_in(&mut conn, id, reason).await
    }

    /// Keeps a permit counting after an unknown outcome, for at most `safety_window`: the call
    /// may still be running at the destination.
    pub async fn hold_permit_unknown(&self, id: Uuid, safety_window: Duration) -> Result<()> {
        sqlx::query(
            "UPDATE adapter_permits
             SET state = 'unknown',
                 expires_at = clock_timestamp() + $2::bigint * interval '1 millisecond'
             WHERE id = $1 AND state = 'held'",
        )
        .bind(id)
        .bind(millis(safety_window))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Records the end of permits whose time ran out without a release (a holder that died, or
    /// an unknown outcome whose safety window passed): they stopped counting at `expires_at`,
    /// and now the history says so and why. Returns how many were closed.
    pub async fn close_expired_permits(&self) -> Result<u64> {
        Ok(sqlx::query(
            "UPDATE adapter_permits
             SET state = 'released', released_at = greatest(expires_at, acquired_at),
                 release_reason = CASE WHEN state = 'unknown' THEN 'safety window passed'
                                       ELSE 'hold expired' END
             WHERE state <> 'released' AND expires_at <= clock_timestamp()",
        )
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    /// Every permit of an adapter's operation class, oldest first: the history that shows the
    /// limit was never exceeded.
    pub async fn permit_history(
        &self,
        adapter: &str,
        operation_class: &str,
    ) -> Result<Vec<Permit>> {
        Ok(sqlx::query_as(concat!(
            "SELECT ",
            permit_columns!(),
            " FROM adapter_permits WHERE adapter = $1 AND operation_class = $2
              ORDER BY acquired_at, id"
        ))
        .bind(adapter)
        .bind(operation_class)
        .fetch_all(&self.pool)
        .await?)
    }
}

/// The statements of [`Store::acquire_permit`], on the caller's transaction (alone, or a
/// shared one: [`crate::batch::GroupCommit`]). Within one transaction, a permit taken earlier
/// counts against a later one.
pub(crate) async fn acquire_permit_in(
    conn: &mut sqlx::PgConnection,
    req: &PermitRequest<'_>,
) -> Result<Permit> {
    let limit: Option<i32> = sqlx::query_scalar(
        "SELECT max_in_flight FROM adapter_limits
         WHERE adapter = $1 AND operation_class = $2 FOR UPDATE",
    )
    .bind(req.adapter)
    .bind(req.operation_class)
    .fetch_optional(&mut *conn)
    .await?;
    let limit = limit.ok_or(StoreError::NotFound {
        what: "adapter limit",
    })?;
    // One statement after the lock: its snapshot is taken once the lock is ours, so it
    // counts every permit committed before; the lock is held only through it and COMMIT.
    let permit: Option<Permit> = sqlx::query_as(concat!(
        "INSERT INTO adapter_permits (id, adapter, operation_class, attempt_id,
             request_identity, gateway, expires_at)
         SELECT $1, $2, $3, $4, $5, $6,
             clock_timestamp() + $7::bigint * interval '1 millisecond'
         WHERE (SELECT count(*) FROM adapter_permits
                WHERE adapter = $2 AND operation_class = $3 AND state <> 'released'
                  AND expires_at > clock_timestamp()) < $8
         RETURNING ",
        permit_columns!()
    ))
    .bind(Uuid::now_v7())
    .bind(req.adapter)
    .bind(req.operation_class)
    .bind(req.attempt.map(|a| a.as_uuid()))
    .bind(req.request_identity.as_str())
    .bind(req.gateway)
    .bind(millis(req.hold))
    .bind(i64::from(limit))
    .fetch_optional(&mut *conn)
    .await?;
    let permit = permit.ok_or_else(|| StoreError::PermitsExhausted {
        adapter: req.adapter.to_owned(),
        operation_class: req.operation_class.to_owned(),
        limit,
    })?;
    Ok(permit)
}

/// The statement of [`Store::release_permit`], on the caller's connection or transaction.
pub(crate) async fn release_permit_in(
    conn: &mut sqlx::PgConnection,
    id: Uuid,
    reason: &str,
) -> Result<()> {
    sqlx::query(
        "UPDATE adapter_permits
         SET state = 'released', released_at = clock_timestamp(), release_reason = $2
         WHERE id = $1 AND state <> 'released'",
    )
    .bind(id)
    .bind(reason)
    .execute(conn)
    .await?;
    Ok(())
}
