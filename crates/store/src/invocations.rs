//! *Invocation began* of many calls in one statement: the gateway's invocation batching (on
//! unless its `invocation_batch` is 1).
//!
//! Right before it sends, the gateway commits the attempt's checkpoint *invocation began*
//! under the step's lease and takes the call's permit, together
//! ([`Store::begin_invocation_with_permit`]: a transaction of five round trips and a `COMMIT`
//! per call). Calls that arrive together share one statement instead ([`InvocationBatches`]),
//! with no `BEGIN` or `COMMIT` around it: the releases of the permits of calls that have
//! ended, each call's fence (its step row looked up by key and locked, in step order, the
//! lease matched on the row's newest version), a free slot for each call whose fence held, and,
//! for each call that got one, its permit, its checkpoint and its event.
//!
//! A call whose fence or preconditions do not hold, or that finds no free slot, writes nothing
//! and is answered `None`; it then takes the transaction (every call's when batching is off),
//! which says exactly why (the fence's reason, a full class) or begins it. So this path only
//! ever commits what that one would, and never refuses anything on its own.

use uuid::Uuid;
use z29c_core::{Checkpoint, LeaseClaim, LeaseKind};

use crate::events::EventKind;
use crate::faults::{self, CrashPoint};
use crate::fence::lease_held;
use crate::permits::{EndedPermit, Permit, PermitRequest};
use crate::shared::Shared;
use crate::{Result, Store, millis};

/// Whether a call may take the one-statement path at all, before asking PostgreSQL: the rest
/// (the fence, the workflow, the checkpoint, a free slot) is the statement's.
fn eligible(claim: &LeaseClaim, req: &PermitRequest<'_>) -> bool {
    claim.kind == LeaseKind::Execution
        && req.attempt == Some(claim.attempt)
        // the fault build's crash point sits between the fence and the COMMIT: the long way
        && !faults::is_armed(CrashPoint::before(Checkpoint::InvocationBegan))
}

/// One call of a shared statement: its lease and its permit's request.
#[derive(Debug, Clone)]
pub struct Call<'a> {
    pub claim: &'a LeaseClaim,
    pub permit: PermitRequest<'a>,
}

impl Store {
    /// Begins the invocations of `calls` that may begin in one statement per adapter and
    /// operation class, and answers `None` for the others, which wrote nothing. Each call is
    /// fenced on its own: its lease must be current by PostgreSQL's clock (the step row is
    /// locked, in step order, and re-checked on its newest version), its attempt the step's
    /// current one and at *request identity persisted*, its workflow running, and a slot below
    /// its class's limit free. `ended` are released by the first statement that succeeds; the
    /// answer's second part says whether one did (a failed statement wrote nothing at all).
    ///
    /// Returns, per call, its permit and the attempt's new checkpoint version.
    pub async fn begin_invocations(
        &self,
        calls: &[Call<'_>],
        ended: &[EndedPermit],
    ) -> (Vec<Option<(Permit, i64)>>, bool) {
        let mut answers = vec![None; calls.len()];
        // without the permits' period, each call begins in a transaction of its own, which
        // says why
        if self.cover_now().await.is_err() {
            return (answers, false);
        }
        let mut rows: Vec<usize> = (0..calls.len())
            .filter(|&i| eligible(calls[i].claim, &calls[i].permit))
            .collect();
        rows.sort_by(|&a, &b| {
            let (a, b) = (&calls[a].permit, &calls[b].permit);
            (a.adapter, a.operation_class).cmp(&(b.adapter, b.operation_class))
        });
        let mut groups: Vec<&[usize]> = rows
            .chunk_by(|&a, &b| {
                let (a, b) = (&calls[a].permit, &calls[b].permit);
                (a.adapter, a.operation_class) == (b.adapter, b.operation_class)
            })
            .collect();
        let mut released = ended.is_empty();
        if groups.is_empty() && !released {
            groups.push(&[]); // nothing to begin, permits to release
        }
        for these in groups {
            let release = if released { &[][..] } else { ended };
            match self.begin_class(calls, these, release).await {
                Ok(began) => {
                    released = true;
                    for (&k, b) in these.iter().zip(began) {
                        answers[k] = b;
                    }
                }
                // it wrote nothing: these calls take their transactions, and the releases
                // go with the next statement or stay with their callers
                Err(e) => {
                    tracing::warn!(error = %e, calls = these.len(), "shared invocation statement failed; each begins on its own");
                }
            }
        }
        (answers, released)
    }

    /// One statement: `ended` released, and the calls `rows` of `calls` (one adapter and
    /// operation class) fenced, given a slot, their permits, checkpoints and events.
    async fn begin_class(
        &self,
        calls: &[Call<'_>],
        rows: &[usize],
        ended: &[EndedPermit],
    ) -> Result<Vec<Option<(Permit, i64)>>> {
        let (adapter, class) = rows
            .first()
            .map(|&i| (calls[i].permit.adapter, calls[i].permit.operation_class))
            .unwrap_or(("", ""));
        let permit_ids: Vec<Uuid> = rows.iter().map(|_| Uuid::now_v7()).collect();
        let steps: Vec<Uuid> = rows
            .iter()
            .map(|&i| calls[i].claim.step.as_uuid())
            .collect();
        let versions: Vec<i64> = rows.iter().map(|&i| calls[i].claim.version.get()).collect();
        let owners: Vec<String> = rows
            .iter()
            .map(|&i| calls[i].claim.owner.to_string())
            .collect();
        let attempts: Vec<Uuid> = rows
            .iter()
            .map(|&i| calls[i].claim.attempt.as_uuid())
            .collect();
        let identities: Vec<String> = rows
            .iter()
            .map(|&i| calls[i].permit.request_identity.to_string())
            .collect();
        let gateways: Vec<String> = rows
            .iter()
            .map(|&i| calls[i].permit.gateway.to_owned())
            .collect();
        let holds: Vec<i64> = rows.iter().map(|&i| millis(calls[i].permit.hold)).collect();
        let ended_ids: Vec<Uuid> = ended.iter().map(|e| e.permit).collect();
        let ended_reasons: Vec<&str> = ended.iter().map(|e| e.reason).collect();
        let ended_ago: Vec<i64> = ended
            .iter()
            .map(|e| i64::try_from(e.ended.elapsed().as_micros()).unwrap_or(i64::MAX))
            .collect();
        let began: Vec<BeganRow> = sqlx::query_as(concat!(
            "WITH i AS (
                 SELECT * FROM unnest($1::uuid[], $2::int8[], $3::text[], $4::uuid[],
                                      $5::uuid[], $6::text[], $7::text[], $8::int8[])
                     WITH ORDINALITY AS i (step_id, lease_version, owner, attempt_id,
                                           permit_id, request_identity, gateway, hold_ms, ord)
             ), ended AS (
                 SELECT * FROM unnest($11::uuid[], $12::text[], $13::int8[]) AS e (id, reason, ago)
             ), f AS (
                 -- each step row looked up by its key and locked, in step order, and matched
                 -- on its newest version (as the receipt's shared statement does)
                 SELECT s.id, s.workflow_id, s.checkpoint_version + 1 AS version,
                        i.lease_version, i.owner, i.attempt_id, i.permit_id,
                        i.request_identity, i.gateway, i.hold_ms, i.ord,
                        row_number() OVER (ORDER BY i.ord) AS rn
                 FROM (SELECT * FROM i ORDER BY step_id) i
                 CROSS JOIN LATERAL (
                     SELECT s.* FROM steps s
                     WHERE s.id = i.step_id AND ",
            lease_held!("i.lease_version", "i.owner", "'leased'"),
            "
                       AND s.current_attempt_id = i.attempt_id
                     FOR NO KEY UPDATE OF s
                 ) s
                 WHERE (SELECT w.state FROM workflows w WHERE w.id = s.workflow_id) = 'running'
                   AND (SELECT a.checkpoint FROM attempts a WHERE a.id = s.current_attempt_id)
                       = 'request_identity_persisted'
             ), lim AS (
                 SELECT max_in_flight AS n, floor(random() * max_in_flight)::int AS start
                 FROM adapter_limits WHERE adapter = $9 AND operation_class = $10
             ), above AS (
                 -- free slots below the limit, from a random one on, wrapping around (below),
                 -- as `take_free_slot` looks for one; a slot this statement's releases free
                 -- is free (`freed` leaves it to the permit that takes it)
                 SELECT slot FROM adapter_permit_slots
                 WHERE adapter = $9 AND operation_class = $10
                   AND slot >= (SELECT start FROM lim) AND slot < (SELECT n FROM lim)
                   AND (permit_id IS NULL OR expires_at <= clock_timestamp()
                        OR permit_id = ANY ($11::uuid[]))
                 ORDER BY slot
                 LIMIT (SELECT count(*) FROM f)
                 FOR UPDATE SKIP LOCKED
             ), below AS (
                 SELECT slot FROM adapter_permit_slots
                 WHERE adapter = $9 AND operation_class = $10
                   AND slot < (SELECT start FROM lim)
                   AND (permit_id IS NULL OR expires_at <= clock_timestamp()
                        OR permit_id = ANY ($11::uuid[]))
                 ORDER BY slot
                 LIMIT greatest((SELECT count(*) FROM f) - (SELECT count(*) FROM above), 0)
                 FOR UPDATE SKIP LOCKED
             ), picked AS (
                 SELECT slot, row_number() OVER () AS rn
                 FROM (SELECT slot FROM above UNION ALL SELECT slot FROM below) x
             ), rel AS (
                 UPDATE adapter_permits p
                 -- when the call ended: `ago` is measured as the statement is sent, and `now()`
                 -- is when it began, so the estimate is late by the time on the wire alone.
                 -- Not `clock_timestamp()`: this runs at the statement's end, after its own
                 -- permits were taken, and a release estimated that late would show the
                 -- gateway's calls overlapping more than it ran (scale_out counts them)
                 SET state = 'released',
                     released_at = greatest(p.acquired_at,
                                            now() - e.ago * interval '1 microsecond'),
                     release_reason = e.reason
                 FROM ended e
                 WHERE p.id = ANY ($11::uuid[]) AND p.id = e.id AND p.state <> 'released'
                 RETURNING p.id, p.adapter, p.operation_class, p.slot
             ), freed AS (
                 -- one row per permit, each looked up by its key (see `take_free_slot`)
                 UPDATE adapter_permit_slots s SET permit_id = NULL, expires_at = NULL
                 WHERE (s.adapter, s.operation_class, s.slot, s.permit_id)
                       IN (SELECT adapter, operation_class, slot, id FROM rel)
                   -- a row is updated once per statement: `taken` has the slots it re-takes
                   AND NOT (s.adapter = $9 AND s.operation_class = $10
                            AND s.slot IN (SELECT slot FROM picked))
             ), taken AS (
                 UPDATE adapter_permit_slots s
                 SET permit_id = f.permit_id,
                     expires_at = clock_timestamp() + f.hold_ms * interval '1 millisecond'
                 FROM picked p JOIN f ON f.rn = p.rn
                 WHERE s.adapter = $9 AND s.operation_class = $10 AND s.slot = p.slot
                 RETURNING s.slot, s.expires_at, s.permit_id
             ), b AS (
                 SELECT f.*, t.slot, t.expires_at FROM f JOIN taken t ON t.permit_id = f.permit_id
             ), p AS (
                 INSERT INTO adapter_permits (id, adapter, operation_class, attempt_id,
                     request_identity, gateway, expires_at, slot)
                 SELECT permit_id, $9, $10, attempt_id, request_identity, gateway, expires_at,
                        slot
                 FROM b ORDER BY ord
                 RETURNING id, adapter, operation_class, attempt_id, request_identity, gateway,
                           state, acquired_at, expires_at, released_at, release_reason
             ), s AS (
                 UPDATE steps s SET checkpoint_version = b.version, updated_at = now()
                 FROM b WHERE s.id = ANY ($1::uuid[]) AND s.id = b.id
             ), a AS (
                 UPDATE attempts a
                 SET checkpoint = $14::checkpoint, invocation_began_at = now(),
                     updated_at = now()
                 FROM b WHERE a.id = ANY ($4::uuid[]) AND a.id = b.attempt_id
             ), e AS (
                 INSERT INTO step_events (workflow_id, step_id, attempt_id, lease_version,
                                          owner, kind, detail)
                 SELECT b.workflow_id, b.id, b.attempt_id, b.lease_version, b.owner, $15,
                        jsonb_build_object('checkpoint', $14::text,
                                           'checkpoint_version', b.version)
                 FROM b ORDER BY b.ord
             )
             SELECT p.*, b.version AS checkpoint_version FROM p JOIN b ON b.permit_id = p.id"
        ))
        .bind(&steps)
        .bind(&versions)
        .bind(&owners)
        .bind(&attempts)
        .bind(&permit_ids)
        .bind(&identities)
        .bind(&gateways)
        .bind(&holds)
        .bind(adapter)
        .bind(class)
        .bind(&ended_ids)
        .bind(&ended_reasons)
        .bind(&ended_ago)
        .bind(Checkpoint::InvocationBegan.as_str())
        .bind(EventKind::Checkpoint.as_str())
        .fetch_all(self.pool())
        .await?;
        let mut answers = vec![None; rows.len()];
        for row in began {
            if let Some(k) = permit_ids.iter().position(|&id| id == row.permit.id) {
                answers[k] = Some((row.permit, row.checkpoint_version));
            }
        }
        Ok(answers)
    }
}

#[derive(sqlx::FromRow)]
struct BeganRow {
    #[sqlx(flatten)]
    permit: Permit,
    checkpoint_version: i64,
}

/// A call waiting for the next shared statement.
struct Waiting {
    claim: LeaseClaim,
    permit: crate::permits::OwnedPermitRequest,
    ended: Vec<EndedPermit>,
}

/// What the shared statement did for one call.
#[derive(Debug, Clone)]
struct Answer {
    began: Option<(Permit, i64)>,
    /// Whether the call's ended permits were released.
    released: bool,
}

/// Committers that begin the invocations of concurrently arriving calls in shared statements
/// ([`Store::begin_invocations`]), each with the permits of the calls that ended before it.
/// Cheap to clone; committers stop when every handle is gone.
#[derive(Clone)]
pub struct InvocationBatches {
    store: Store,
    shared: Shared<Waiting, Answer>,
}

impl std::fmt::Debug for InvocationBatches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InvocationBatches").finish_non_exhaustive()
    }
}

impl InvocationBatches {
    /// Starts `committers` tasks, each beginning up to `max_batch` calls per statement on
    /// `batches` (a pool with [`crate::BATCH_SESSION_SETTINGS`]); a call the statement
    /// cannot take goes to its transaction on `store`.
    pub fn start(batches: &Store, store: &Store, committers: usize, max_batch: usize) -> Self {
        let batches = batches.clone();
        let shared = Shared::start(committers, max_batch, move |batch: Vec<Waiting>| {
            let store = batches.clone();
            async move {
                let calls: Vec<Call<'_>> = batch
                    .iter()
                    .map(|w| Call {
                        claim: &w.claim,
                        permit: w.permit.borrow(),
                    })
                    .collect();
                let ended: Vec<EndedPermit> =
                    batch.iter().flat_map(|w| w.ended.iter().copied()).collect();
                let (began, released) = store.begin_invocations(&calls, &ended).await;
                began
                    .into_iter()
                    .map(|began| Answer { began, released })
                    .collect()
            }
        });
        Self {
            store: store.clone(),
            shared,
        }
    }

    /// [`Store::begin_invocation_with_permit`]: in the next shared statement, or, where that
    /// statement cannot take the call, in a transaction of its own that says why (the fence's
    /// reason, a full class) or begins it.
    pub async fn begin_invocation_with_permit(
        &self,
        claim: &LeaseClaim,
        req: &PermitRequest<'_>,
        ended: &[EndedPermit],
    ) -> Result<(Permit, i64)> {
        let mut ended = ended;
        if eligible(claim, req) {
            let waiting = Waiting {
                claim: claim.clone(),
                permit: crate::permits::OwnedPermitRequest::from(req),
                ended: ended.to_vec(),
            };
            if let Some(answer) = self.shared.ask(waiting).await {
                if let Some(began) = answer.began {
                    return Ok(began);
                }
                if answer.released {
                    ended = &[];
                }
            }
        }
        self.store
            .begin_invocation_with_permit(claim, req, ended)
            .await
    }
}

/// How a gateway begins its invocations (with their permits), chosen once from its
/// configuration: each in a transaction of its own, or in shared statements with the calls
/// arriving beside it. Either begins exactly what the other would.
#[derive(Debug, Clone)]
pub enum InvocationPath {
    Direct(Store),
    Batched(InvocationBatches),
}

impl InvocationPath {
    /// [`Store::begin_invocation_with_permit`], on this path.
    pub async fn begin_invocation_with_permit(
        &self,
        claim: &LeaseClaim,
        req: &PermitRequest<'_>,
        ended: &[EndedPermit],
    ) -> Result<(Permit, i64)> {
        match self {
            Self::Direct(store) => store.begin_invocation_with_permit(claim, req, ended).await,
            Self::Batched(batches) => {
                batches
                    .begin_invocation_with_permit(claim, req, ended)
                    .await
            }
        }
    }
}
