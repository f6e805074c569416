//! Adapter concurrency permits, called by the adapter gateway alone (docs/design.md §6). A permit
//! is separate from any step lease: it is taken just before an invocation and bounds how many
//! calls z29c intentionally has in flight per adapter and operation class, across all gateway
//! instances. An unknown outcome keeps its permit counting until resolution or a safety window.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;
use z29c_core::{AttemptId, LeaseClaim, RequestIdentity};

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

/// A permit whose call has ended with a known outcome, to be released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndedPermit {
    pub permit: Uuid,
    /// Why: the outcome (`succeeded`, `rejected`, `rate_limited`, `not_sent`).
    pub reason: &'static str,
    /// When the call ended, on the gateway's monotonic clock. A release made later records
    /// `released_at` as PostgreSQL's time minus the wait, so the permit history says when the
    /// call ended; the slot itself is freed only by the release, which errs on the safe side.
    pub ended: std::time::Instant,
}

impl EndedPermit {
    /// A call that ends now.
    pub fn now(permit: Uuid, reason: &'static str) -> Self {
        Self {
            permit,
            reason,
            ended: std::time::Instant::now(),
        }
    }
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
/// is known; the release names why and frees their slots. Runs inside the transaction that
/// made it known.
pub(crate) async fn release_unknown_for(
    conn: &mut sqlx::PgConnection,
    identity: &str,
    reason: &str,
) -> Result<u64> {
    Ok(sqlx::query(
        "WITH p AS (
             UPDATE adapter_permits
             SET state = 'released', released_at = clock_timestamp(), release_reason = $2
             WHERE request_identity = $1 AND state = 'unknown'
             RETURNING id, adapter, operation_class, slot
         ), freed AS (
             -- one row per permit, each looked up by its key (see `take_free_slot`)
             UPDATE adapter_permit_slots s SET permit_id = NULL, expires_at = NULL
             WHERE (s.adapter, s.operation_class, s.slot, s.permit_id)
                   IN (SELECT adapter, operation_class, slot, id FROM p)
         )
         SELECT 1 FROM p",
    )
    .bind(identity)
    .bind(reason)
    .execute(conn)
    .await?
    .rows_affected())
}

impl Store {
    /// Sets the in-flight limit of an adapter's operation class: that many slots. A lowered
    /// limit drops the free slots above it at once and the occupied ones as their permits end;
    /// no new permit takes a slot above the limit.
    pub async fn set_permit_limit(
        &self,
        adapter: &str,
        operation_class: &str,
        max_in_flight: i32,
    ) -> Result<()> {
        if max_in_flight <= 0 {
            return Err(StoreError::invalid("max_in_flight", "must be positive"));
        }
        let mut tx = self.begin().await?;
        let changed = sqlx::query(
            "INSERT INTO adapter_limits (adapter, operation_class, max_in_flight)
             VALUES ($1, $2, $3)
             ON CONFLICT (adapter, operation_class)
             DO UPDATE SET max_in_flight = EXCLUDED.max_in_flight, updated_at = now()
             WHERE adapter_limits.max_in_flight <> EXCLUDED.max_in_flight",
        )
        .bind(adapter)
        .bind(operation_class)
        .bind(max_in_flight)
        .execute(&mut *tx)
        .await?;
        // the slots that permits ended on since a lowered limit go now
        sqlx::query(
            "DELETE FROM adapter_permit_slots
             WHERE adapter = $1 AND operation_class = $2 AND slot >= $3
               AND (permit_id IS NULL OR expires_at <= clock_timestamp())",
        )
        .bind(adapter)
        .bind(operation_class)
        .bind(max_in_flight)
        .execute(&mut *tx)
        .await?;
        // a limit as it was has its slots: gateways racing to set a class's default on its
        // first call, say, make them once
        if changed.rows_affected() == 0 {
            tx.commit().await?;
            return Ok(());
        }
        sqlx::query(
            "INSERT INTO adapter_permit_slots (adapter, operation_class, slot)
             SELECT $1, $2, g FROM generate_series(0, $3 - 1) AS g
             ON CONFLICT DO NOTHING",
        )
        .bind(adapter)
        .bind(operation_class)
        .bind(max_in_flight)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        // the slots are looked up by key; fresh statistics keep every plan on the key
        sqlx::query("ANALYZE adapter_permit_slots")
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Takes a permit if a slot below the limit is free: gateways racing for the last one
    /// lock different slots or none, never the same one twice.
    pub async fn acquire_permit(&self, req: &PermitRequest<'_>) -> Result<Permit> {
        self.cover_now().await?;
        let mut conn = self.pool.acquire().await?;
        acquire_permit_in(&mut conn, req).await
    }

    /// Commits the attempt's checkpoint *invocation began* (fenced by `claim`, exactly as
    /// [`Store::begin_invocation`]) and takes the call's permit, in one transaction, right
    /// before the gateway sends the request (docs/design.md §4 step 2 and §6): both name the same
    /// moment, so one `COMMIT` serves both. Either both are durable or neither is: a class at
    /// its limit ([`StoreError::PermitsExhausted`]) leaves the invocation not begun, and a
    /// refused fence ([`StoreError::Fenced`]) takes no permit. Returns the permit and the
    /// attempt's new checkpoint version.
    ///
    /// `ended` are permits of calls that have ended, released first in the same transaction
    /// (so their slots are free for this one): a gateway's releases ride on its next permit
    /// instead of a `COMMIT` each. If this transaction fails they are not released; the caller
    /// keeps them for the next try.
    pub async fn begin_invocation_with_permit(
        &self,
        claim: &LeaseClaim,
        req: &PermitRequest<'_>,
        ended: &[EndedPermit],
    ) -> Result<(Permit, i64)> {
        self.cover_now().await?;
        let mut tx = self.begin().await?;
        let out = begin_invocation_with_permit_in(&mut tx, claim, req, ended).await?;
        tx.commit().await?;
        Ok(out)
    }

    /// Releases a permit on a known outcome (or after resolution). Releasing twice is a no-op.
    /// Its COMMIT does not wait for the disk ([`Store::begin_relaxed`]): a release lost in a
    /// server crash leaves the permit counting until its hold runs out, which errs on the safe
    /// side.
    pub async fn release_permit(&self, id: Uuid, reason: &str) -> Result<()> {
        let mut tx = self.begin_relaxed().await?;
        release_permit_in(&mut tx, id, reason, std::time::Instant::now()).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Releases the permits of calls that have ended, in one transaction whose COMMIT does not
    /// wait for the disk, as [`Store::release_permit`].
    pub async fn release_permits(&self, ended: &[EndedPermit]) -> Result<()> {
        let mut tx = self.begin_relaxed().await?;
        for e in ended {
            release_permit_in(&mut tx, e.permit, e.reason, e.ended).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Keeps a permit counting after an unknown outcome, for at most `safety_window`: the call
    /// may still be running at the destination. Its slot stays taken as long.
    pub async fn hold_permit_unknown(&self, id: Uuid, safety_window: Duration) -> Result<()> {
        sqlx::query(
            "WITH p AS (
                 UPDATE adapter_permits
                 SET state = 'unknown',
                     expires_at = clock_timestamp() + $2::bigint * interval '1 millisecond'
                 WHERE id = $1 AND state = 'held'
                 RETURNING id, adapter, operation_class, slot, expires_at
             )
             UPDATE adapter_permit_slots SET expires_at = (SELECT expires_at FROM p)
             WHERE adapter = (SELECT adapter FROM p)
               AND operation_class = (SELECT operation_class FROM p)
               AND slot = (SELECT slot FROM p) AND permit_id = $1",
        )
        .bind(id)
        .bind(millis(safety_window))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Turns the permits `gateway` holds for `adapter` into unknown outcomes counting for
    /// `safety_window`, and never longer than they counted already: called by a gateway as it starts, when any permit it holds is a call
    /// of its earlier run, ended with that process. Returns how many there were.
    pub async fn hold_earlier_permits_unknown(
        &self,
        gateway: &str,
        adapter: &str,
        safety_window: Duration,
    ) -> Result<u64> {
        Ok(sqlx::query(
            "WITH held AS (
                 -- looked up through the slots they occupy (as few as the adapter's limits)
                 SELECT p.id FROM adapter_permit_slots slot
                 JOIN adapter_permits p ON p.id = slot.permit_id
                 WHERE slot.adapter = $2 AND p.gateway = $1 AND p.state = 'held'
             ), p AS (
                 UPDATE adapter_permits
                 SET state = 'unknown',
                     expires_at = LEAST(expires_at,
                                        clock_timestamp() + $3::bigint * interval '1 millisecond')
                 WHERE id IN (SELECT id FROM held) AND state = 'held'
                 RETURNING id, adapter, operation_class, slot, expires_at
             ), moved AS (
                 UPDATE adapter_permit_slots s SET expires_at = p.expires_at
                 FROM p
                 WHERE (s.adapter, s.operation_class, s.slot, s.permit_id)
                       = (p.adapter, p.operation_class, p.slot, p.id)
             )
             SELECT 1 FROM p",
        )
        .bind(gateway)
        .bind(adapter)
        .bind(millis(safety_window))
        .execute(&self.pool)
        .await?
        .rows_affected())
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

/// The statements of [`Store::begin_invocation_with_permit`], on the caller's transaction
/// (alone, or a batch's shared one). The fence comes first: it locks
/// the step row, so a permit is only ever taken under a current lease.
pub(crate) async fn begin_invocation_with_permit_in(
    conn: &mut sqlx::PgConnection,
    claim: &LeaseClaim,
    req: &PermitRequest<'_>,
    ended: &[EndedPermit],
) -> Result<(Permit, i64)> {
    for e in ended {
        release_permit_in(&mut *conn, e.permit, e.reason, e.ended).await?;
    }
    let version = crate::leases::begin_invocation_in(&mut *conn, claim).await?;
    let permit = acquire_permit_in(&mut *conn, req).await?;
    Ok((permit, version))
}

/// The statement of [`Store::acquire_permit`], on the caller's connection or transaction
/// (alone, or a batch's shared one). Within one transaction, a permit
/// taken earlier holds its slot against a later one.
pub(crate) async fn acquire_permit_in(
    conn: &mut sqlx::PgConnection,
    req: &PermitRequest<'_>,
) -> Result<Permit> {
    // A free slot below the limit that nobody else is taking: one row lock, held through this
    // statement's COMMIT, and only against a racer for the same slot. A slot taken between
    // this statement's snapshot and its lock is rechecked and dropped, which can leave it with
    // no row while later slots are free: a few tries tell that from a full class.
    for _ in 0..ACQUIRE_TRIES {
        if let Some(permit) = take_free_slot(&mut *conn, req).await? {
            return Ok(permit);
        }
    }
    if crate::faults::broken(crate::faults::Break::PermitLimitIgnored) {
        return permit_without_slot(conn, req).await;
    }
    let limit: Option<i32> = sqlx::query_scalar(
        "SELECT max_in_flight FROM adapter_limits WHERE adapter = $1 AND operation_class = $2",
    )
    .bind(req.adapter)
    .bind(req.operation_class)
    .fetch_optional(&mut *conn)
    .await?;
    Err(match limit {
        None => StoreError::NotFound {
            what: "adapter limit",
        },
        Some(limit) => StoreError::PermitsExhausted {
            adapter: req.adapter.to_owned(),
            operation_class: req.operation_class.to_owned(),
            limit,
        },
    })
}

/// The broken build's permit past the limit: counted in the history, holding no slot.
async fn permit_without_slot(
    conn: &mut sqlx::PgConnection,
    req: &PermitRequest<'_>,
) -> Result<Permit> {
    tracing::error!(
        adapter = req.adapter,
        class = req.operation_class,
        "fault: a permit past the limit"
    );
    Ok(sqlx::query_as(concat!(
        "INSERT INTO adapter_permits (id, adapter, operation_class, attempt_id,
             request_identity, gateway, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6, clock_timestamp() + $7::bigint * interval '1 millisecond')
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
    .fetch_one(conn)
    .await?)
}

/// How often [`acquire_permit_in`] looks for a free slot before it calls the class full.
const ACQUIRE_TRIES: usize = 3;

async fn take_free_slot(
    conn: &mut sqlx::PgConnection,
    req: &PermitRequest<'_>,
) -> Result<Option<Permit>> {
    Ok(sqlx::query_as(concat!(
        // every slot is named by its whole key, never joined: a join lets the planner walk
        // all of a class's slots for the one it wants (60 ms at 100,000 slots)
        // The search starts at a random slot below the limit and wraps around. Starting at
        // slot 0 every time gave the same few slots every permit: each took two row versions
        // per step, and while any snapshot was open (an autovacuum's ANALYZE holds one for
        // seconds) none could be pruned, so every take and release walked ever longer chains
        // of them (15 buffers per release in a drain, 73 in a steady run).
        "WITH lim AS (
             SELECT max_in_flight AS n, floor(random() * max_in_flight)::int AS start
             FROM adapter_limits WHERE adapter = $2 AND operation_class = $3
         ), taken AS (
             UPDATE adapter_permit_slots
             SET permit_id = $1,
                 expires_at = clock_timestamp() + $7::bigint * interval '1 millisecond'
             WHERE adapter = $2 AND operation_class = $3
               AND slot = coalesce(
                   (SELECT slot FROM adapter_permit_slots
                    WHERE adapter = $2 AND operation_class = $3
                      AND slot >= (SELECT start FROM lim) AND slot < (SELECT n FROM lim)
                      AND (permit_id IS NULL OR expires_at <= clock_timestamp())
                    ORDER BY slot
                    LIMIT 1
                    FOR UPDATE SKIP LOCKED),
                   (SELECT slot FROM adapter_permit_slots
                    WHERE adapter = $2 AND operation_class = $3
                      AND slot < (SELECT start FROM lim)
                      AND (permit_id IS NULL OR expires_at <= clock_timestamp())
                    ORDER BY slot
                    LIMIT 1
                    FOR UPDATE SKIP LOCKED))
             RETURNING slot, expires_at
         )
         INSERT INTO adapter_permits (id, adapter, operation_class, attempt_id,
             request_identity, gateway, expires_at, slot)
         SELECT $1, $2, $3, $4, $5, $6, expires_at, slot FROM taken
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
    .fetch_optional(conn)
    .await?)
}

/// The statement of [`Store::release_permit`], on the caller's connection or transaction:
/// the permit's end and its slot freed (unless its hold ran out and another permit took it).
pub(crate) async fn release_permit_in(
    conn: &mut sqlx::PgConnection,
    permit: Uuid,
    reason: &str,
    ended: std::time::Instant,
) -> Result<()> {
    let ago = i64::try_from(ended.elapsed().as_micros()).unwrap_or(i64::MAX);
    sqlx::query(
        "WITH p AS (
             UPDATE adapter_permits
             SET state = 'released',
                 released_at = greatest(acquired_at,
                                        clock_timestamp() - $3 * interval '1 microsecond'),
                 release_reason = $2
             WHERE id = $1 AND state <> 'released'
             RETURNING adapter, operation_class, slot
         )
         UPDATE adapter_permit_slots SET permit_id = NULL, expires_at = NULL
         WHERE adapter = (SELECT adapter FROM p)
           AND operation_class = (SELECT operation_class FROM p)
           AND slot = (SELECT slot FROM p) AND permit_id = $1",
    )
    .bind(permit)
    .bind(reason)
    .bind(ago)
    .execute(conn)
    .await?;
    Ok(())
}

/// A [`PermitRequest`] that can move into a write.
pub(crate) struct OwnedPermitRequest {
    adapter: String,
    operation_class: String,
    attempt: Option<AttemptId>,
    request_identity: RequestIdentity,
    gateway: String,
    hold: Duration,
}

impl OwnedPermitRequest {
    pub(crate) fn from(req: &PermitRequest<'_>) -> Self {
        Self {
            adapter: req.adapter.to_owned(),
            operation_class: req.operation_class.to_owned(),
            attempt: req.attempt,
            request_identity: req.request_identity.clone(),
            gateway: req.gateway.to_owned(),
            hold: req.hold,
        }
    }

    pub(crate) fn borrow(&self) -> PermitRequest<'_> {
        PermitRequest {
            adapter: &self.adapter,
            operation_class: &self.operation_class,
            attempt: self.attempt,
            request_identity: &self.request_identity,
            gateway: &self.gateway,
            hold: self.hold,
        }
    }
}
