//! The fenced write: one conditional statement on the step row that only matches while the
//! presented lease is current by PostgreSQL's clock: an `UPDATE` of the checkpoint version, or,
//! where the same transaction updates the row again (a receipt, a release), a `SELECT … FOR NO
//! KEY UPDATE`. Either takes the step's row lock, so a recovery worker taking over the step
//! waits for this transaction, and this transaction, if it comes second, sees the new version
//! (PostgreSQL re-checks the condition on it) and changes nothing.

use sqlx::PgConnection;
use uuid::Uuid;
use z29c_core::fence::{self, FencedWrite};
use z29c_core::{
    AttemptId, Checkpoint, FenceReason, LeaseClaim, LeaseKind, LeaseVersion, LeaseView, OwnerId,
    StepState, WorkflowState,
};

use crate::error::parse;
use crate::{Result, StoreError};

/// The step as it stands once the fenced update matched.
#[derive(Debug, Clone)]
pub(crate) struct Held {
    pub(crate) workflow: Uuid,
    pub(crate) workflow_state: WorkflowState,
    pub(crate) checkpoint: Option<Checkpoint>,
    /// The version this write records. A fence that [locks only](locks_only) computes it;
    /// the update that follows it stores it.
    pub(crate) checkpoint_version: i64,
    pub(crate) request_identity: Option<String>,
    pub(crate) input_digest: String,
    pub(crate) adapter: String,
}

#[derive(sqlx::FromRow)]
struct HeldRow {
    workflow_id: Uuid,
    workflow_state: String,
    checkpoint: Option<String>,
    checkpoint_version: i64,
    request_identity: Option<String>,
    input_digest: String,
    adapter: String,
}

#[derive(sqlx::FromRow)]
struct ViewRow {
    state: String,
    lease_owner: Option<String>,
    lease_version: i64,
    current_attempt_id: Option<Uuid>,
    expired: bool,
    workflow_state: String,
    checkpoint: Option<String>,
}

/// Whether `write` is followed, in its transaction, by an update of the step's row that ends
/// the lease or the step ([`crate::leases::finish_step`] for a receipt, which records the
/// checkpoint version the fence returns; the release paths). Such a fence only locks the row:
/// one row version per write instead of two.
fn locks_only(write: FencedWrite) -> bool {
    matches!(
        write,
        FencedWrite::Release | FencedWrite::Advance(Checkpoint::ReceiptCommitted)
    )
}

/// The lease condition, written once: the step row `s` is at lease version `$version`, owned
/// by `$owner`, in `$state` (`leased` or `recovering`), and its lease has not expired by
/// PostgreSQL's clock. Every fenced statement puts it in its `WHERE` with this macro (each
/// binds its own placeholders or columns); the attempt a lease must still name is the
/// statement's own condition beside it, since a recovery lease names none.
macro_rules! lease_held {
    ($version:literal, $owner:literal, $state:literal) => {
        concat!(
            "s.lease_version = ",
            $version,
            " AND s.lease_owner = ",
            $owner,
            " AND s.state = ",
            $state,
            " AND s.expires_at > now()"
        )
    };
}
pub(crate) use lease_held;

/// The fenced update of the step row: it matches only while the presented lease is current by
/// PostgreSQL's clock (`$1` step, `$2` lease version, `$3` owner, `$4` leased state, `$5` the
/// attempt or NULL) and advances the checkpoint version by `$6`. Written once for [`fence`] and
/// [`fence_invocation_began`], which runs it as a CTE.
macro_rules! fenced_update {
    () => {
        concat!(
            "UPDATE steps s
             SET checkpoint_version = s.checkpoint_version + $6, updated_at = now()
             WHERE s.id = $1 AND ",
            lease_held!("$2", "$3", "$4::step_state"),
            "
               AND ($5::uuid IS NULL OR s.current_attempt_id = $5)
             RETURNING s.workflow_id, s.checkpoint_version, s.request_identity, s.input_digest,
                       s.adapter,
                       (SELECT w.state::text FROM workflows w WHERE w.id = s.workflow_id)
                           AS workflow_state,
                       (SELECT a.checkpoint::text FROM attempts a WHERE a.id = s.current_attempt_id)
                           AS checkpoint"
        )
    };
}

/// The attempt a lease must still name: an execution lease's own; a recovery lease names none.
fn fenced_attempt(claim: &LeaseClaim) -> Option<Uuid> {
    match claim.kind {
        LeaseKind::Execution => Some(claim.attempt.as_uuid()),
        LeaseKind::Recovery => None,
    }
}

/// Fences `write` under `claim` inside the caller's transaction. On success the step row is
/// locked until the transaction ends; on refusal the caller must let the transaction roll back.
pub(crate) async fn fence(
    conn: &mut PgConnection,
    claim: &LeaseClaim,
    write: FencedWrite,
) -> Result<Held> {
    let attempt = fenced_attempt(claim);
    // A write that changes the step's row anyway (its end, a release) only locks it here;
    // a checkpoint that leaves the step leased records its version here. Either way the
    // lease is matched on the row's newest version once the lock is held.
    let sql = if locks_only(write) {
        concat!(
            "SELECT s.workflow_id, s.checkpoint_version + $6 AS checkpoint_version,
                    s.request_identity, s.input_digest, s.adapter,
                    (SELECT w.state::text FROM workflows w WHERE w.id = s.workflow_id)
                        AS workflow_state,
                    (SELECT a.checkpoint::text FROM attempts a WHERE a.id = s.current_attempt_id)
                        AS checkpoint
             FROM steps s
             WHERE s.id = $1 AND ",
            lease_held!("$2", "$3", "$4::step_state"),
            "
               AND ($5::uuid IS NULL OR s.current_attempt_id = $5)
             FOR NO KEY UPDATE OF s"
        )
    } else {
        fenced_update!()
    };
    let row: Option<HeldRow> = sqlx::query_as(sql)
        .bind(claim.step.as_uuid())
        .bind(claim.version.get())
        .bind(claim.owner.as_str())
        .bind(claim.kind.step_state().as_str())
        .bind(attempt)
        .bind(i64::from(matches!(write, FencedWrite::Advance(_))))
        .fetch_optional(&mut *conn)
        .await?;
    held(conn, claim, write, row).await
}

/// [`fence`] for *invocation began*, with the attempt's checkpoint and its event written by
/// the same statement (one round trip instead of two). They are written before core's rule
/// has looked at the step, so on any refusal the caller must let the transaction roll back,
/// as after every fence; the statement only writes where the lease matched.
pub(crate) async fn fence_invocation_began(
    conn: &mut PgConnection,
    claim: &LeaseClaim,
    event_kind: &str,
) -> Result<Held> {
    let write = FencedWrite::Advance(Checkpoint::InvocationBegan);
    let row: Option<HeldRow> = sqlx::query_as(concat!(
        "WITH f AS (",
        fenced_update!(),
        "), a AS (
                 UPDATE attempts SET checkpoint = $7::checkpoint, invocation_began_at = now(),
                                     updated_at = now()
                 WHERE id = $9 AND EXISTS (SELECT 1 FROM f)
             ), e AS (
                 INSERT INTO step_events (workflow_id, step_id, attempt_id, lease_version,
                                          owner, kind, detail)
                 SELECT f.workflow_id, $1, $9, $2, $3, $8,
                        jsonb_build_object('checkpoint', $7::text,
                                           'checkpoint_version', f.checkpoint_version)
                 FROM f
             )
             SELECT * FROM f"
    ))
    .bind(claim.step.as_uuid())
    .bind(claim.version.get())
    .bind(claim.owner.as_str())
    .bind(claim.kind.step_state().as_str())
    .bind(fenced_attempt(claim))
    .bind(1_i64)
    .bind(Checkpoint::InvocationBegan.as_str())
    .bind(event_kind)
    .bind(claim.attempt.as_uuid())
    .fetch_optional(&mut *conn)
    .await?;
    held(conn, claim, write, row).await
}

/// What a fenced statement's row says: the lease held, or why not (read back when no row
/// matched); then what remains of the rule (workflow state, checkpoint order), which is core's.
async fn held(
    conn: &mut PgConnection,
    claim: &LeaseClaim,
    write: FencedWrite,
    row: Option<HeldRow>,
) -> Result<Held> {
    let Some(row) = row else {
        return Err(StoreError::Fenced(diagnose(conn, claim, write).await?));
    };
    let held = Held {
        workflow: row.workflow_id,
        workflow_state: parse(&row.workflow_state)?,
        checkpoint: row.checkpoint.as_deref().map(parse).transpose()?,
        checkpoint_version: row.checkpoint_version,
        request_identity: row.request_identity,
        input_digest: row.input_digest,
        adapter: row.adapter,
    };
    let view = LeaseView {
        state: claim.kind.step_state(),
        owner: Some(claim.owner.clone()),
        version: claim.version,
        current_attempt: Some(claim.attempt),
        expired: false,
        workflow: held.workflow_state,
        checkpoint: held.checkpoint,
    };
    fence::check(claim, &view, write).map_err(StoreError::Fenced)?;
    Ok(held)
}

/// The broken build's stand-in for [`fence`]: the step as it stands, with no lease check.
/// Reached only when `faults::break_receipt_fencing` was called (the `faults` feature).
pub(crate) async fn unfenced(conn: &mut PgConnection, claim: &LeaseClaim) -> Result<Held> {
    let row: HeldRow = sqlx::query_as(
        "SELECT s.workflow_id, s.checkpoint_version, s.request_identity, s.input_digest,
                s.adapter, w.state::text AS workflow_state, a.checkpoint::text AS checkpoint
         FROM steps s
         JOIN workflows w ON w.id = s.workflow_id
         LEFT JOIN attempts a ON a.id = $2
         WHERE s.id = $1
         FOR UPDATE OF s",
    )
    .bind(claim.step.as_uuid())
    .bind(claim.attempt.as_uuid())
    .fetch_optional(&mut *conn)
    .await?
    .ok_or(StoreError::NotFound { what: "step" })?;
    Ok(Held {
        workflow: row.workflow_id,
        workflow_state: parse(&row.workflow_state)?,
        checkpoint: row.checkpoint.as_deref().map(parse).transpose()?,
        checkpoint_version: row.checkpoint_version,
        request_identity: row.request_identity,
        input_digest: row.input_digest,
        adapter: row.adapter,
    })
}

/// Reads the step back to say why a fenced update matched no row.
pub(crate) async fn diagnose(
    conn: &mut PgConnection,
    claim: &LeaseClaim,
    write: FencedWrite,
) -> Result<FenceReason> {
    let view = view(conn, claim.step.as_uuid()).await?;
    Ok(fence::check(claim, &view, write)
        .err()
        .unwrap_or(FenceReason::Changed))
}

pub(crate) async fn view(conn: &mut PgConnection, step: Uuid) -> Result<LeaseView> {
    let row: ViewRow = sqlx::query_as(
        "SELECT s.state::text AS state, s.lease_owner, s.lease_version, s.current_attempt_id,
                coalesce(s.expires_at <= now(), false) AS expired,
                w.state::text AS workflow_state, a.checkpoint::text AS checkpoint
         FROM steps s
         JOIN workflows w ON w.id = s.workflow_id
         LEFT JOIN attempts a ON a.id = s.current_attempt_id
         WHERE s.id = $1",
    )
    .bind(step)
    .fetch_optional(conn)
    .await?
    .ok_or(StoreError::NotFound { what: "step" })?;
    Ok(LeaseView {
        state: parse::<StepState>(&row.state)?,
        owner: row
            .lease_owner
            .map(OwnerId::parse)
            .transpose()
            .map_err(|e| StoreError::Corrupt(e.to_string()))?,
        version: LeaseVersion::new(row.lease_version)
            .map_err(|e| StoreError::Corrupt(e.to_string()))?,
        current_attempt: row.current_attempt_id.map(AttemptId::from_uuid),
        expired: row.expired,
        workflow: parse(&row.workflow_state)?,
        checkpoint: row.checkpoint.as_deref().map(parse).transpose()?,
    })
}
