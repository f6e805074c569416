//! Receipts of many attempts in one statement: the executor's receipt batching (on unless
//! its `receipt_batch` is 1; docs/performance.md has what it bought).
//!
//! The common receipt — a success, the attempt's own answer, under a lease that is current, on
//! a step nothing waits for, in a running workflow — can be one statement with no `BEGIN` or
//! `COMMIT` around it: the fence, the receipt, the attempt's end, the step's end, its events
//! and messages, and the workflow's completion. Receipts of concurrently finishing attempts
//! share that statement ([`ReceiptBatches`]): one round trip, one plan and one `COMMIT` for
//! all of them, each row fenced on its own.
//!
//! A row whose fence or preconditions do not hold writes nothing and is answered `None`; its
//! attempt then takes the transaction of [`Store::commit_or_keep_late`] (every receipt's when
//! batching is off), which says exactly why (or commits it: a failure, a step with dependents, a workflow no longer
//! running). So this path only ever commits what that one would, and never refuses anything
//! on its own.

use serde_json::json;
use sqlx::FromRow;
use uuid::Uuid;
use z29c_core::{
    Checkpoint, ExternalReference, LeaseClaim, LeaseKind, Outcome, Verification, WorkflowState,
};

use crate::ending::{Receipt, ReceiptRow, completed_workflow, receipt_columns, workflow_completes};
use crate::events::EventKind;
use crate::faults::{self, CrashPoint};
use crate::fence::lease_held;
use crate::leases::{CommitOutcome, Observed};
use crate::outbox::MessageKind;
use crate::shared::Shared;
use crate::{Result, Store};

/// Whether a receipt may take the one-statement path at all, before asking PostgreSQL: the
/// rest (the fence, the workflow, the checkpoint, dependents, identity) is the statement's.
fn eligible(claim: &LeaseClaim, observed: &Observed) -> bool {
    claim.kind == LeaseKind::Execution
        && observed.outcome == Outcome::Succeeded
        && observed.external_reference.is_some()
        && !observed.adapter_version.is_empty()
        // the fault build's crash points sit between the fence and the receipt, and its
        // unfenced receipts are the transaction's: both need the long way
        && !faults::is_armed(CrashPoint::after(Checkpoint::ResponseObserved))
        && !faults::is_armed(CrashPoint::before(Checkpoint::ReceiptCommitted))
        && !faults::receipts_unfenced()
}

impl Store {
    /// Commits the receipts of `batch` that may be committed in one statement, and answers
    /// `None` for the others, which wrote nothing. Each row is fenced on its own: its lease
    /// must be current by PostgreSQL's clock (the step row is locked, in step order, and
    /// re-checked on its newest version), its attempt at *invocation began* or *response
    /// observed* (the gateway records the answer before it replies), its workflow
    /// running, its identity and input the step's, and no step may depend on it.
    pub async fn commit_receipts(
        &self,
        batch: &[(&LeaseClaim, &Observed)],
    ) -> Result<Vec<Option<Receipt>>> {
        let rows: Vec<usize> = (0..batch.len())
            .filter(|&i| eligible(batch[i].0, batch[i].1))
            .collect();
        let mut answers: Vec<Option<Receipt>> = vec![None; batch.len()];
        if rows.is_empty() {
            return Ok(answers);
        }
        let pick = |f: &dyn Fn(&LeaseClaim, &Observed) -> String| -> Vec<String> {
            rows.iter().map(|&i| f(batch[i].0, batch[i].1)).collect()
        };
        let receipt_ids: Vec<Uuid> = rows.iter().map(|_| Uuid::now_v7()).collect();
        let steps: Vec<Uuid> = rows.iter().map(|&i| batch[i].0.step.as_uuid()).collect();
        let versions: Vec<i64> = rows.iter().map(|&i| batch[i].0.version.get()).collect();
        let attempts: Vec<Uuid> = rows.iter().map(|&i| batch[i].0.attempt.as_uuid()).collect();
        let results: Vec<serde_json::Value> =
            rows.iter().map(|&i| batch[i].1.result.clone()).collect();
        let written = sqlx::query(concat!(
            "WITH i AS (
                 SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::int8[], $4::text[],
                                      $5::uuid[], $6::text[], $7::text[], $8::text[],
                                      $9::text[], $10::jsonb[], $16::timestamptz[])
                     WITH ORDINALITY AS i (receipt_id, step_id, lease_version, owner,
                                           attempt_id, input_digest, adapter_version,
                                           request_identity, external_reference, result,
                                           seen, ord)
             ), f AS (
                 -- each step row looked up by its key and locked, in step order, and matched
                 -- on its newest version; said of the join, the lease's state would lead the
                 -- planner to the partial index of leased steps, through every lease ended
                 -- since it was last vacuumed
                 SELECT s.id, s.workflow_id, s.adapter, s.checkpoint_version + 1 AS version,
                        i.receipt_id, i.lease_version, i.owner, i.attempt_id, i.input_digest,
                        i.adapter_version, i.request_identity, i.external_reference, i.result,
                        i.seen, i.ord
                 FROM (SELECT * FROM i ORDER BY step_id) i
                 CROSS JOIN LATERAL (
                     SELECT s.* FROM steps s
                     WHERE s.id = i.step_id AND ",
            lease_held!("i.lease_version", "i.owner", "'leased'"),
            "
                       AND s.current_attempt_id = i.attempt_id
                       AND s.request_identity = i.request_identity
                       AND s.input_digest = i.input_digest
                     FOR NO KEY UPDATE OF s
                 ) s
                 WHERE (SELECT w.state FROM workflows w WHERE w.id = s.workflow_id) = 'running'
                   AND (SELECT a.checkpoint FROM attempts a WHERE a.id = s.current_attempt_id)
                       IN ('invocation_began', 'response_observed')
                   AND NOT EXISTS (SELECT 1 FROM step_dependencies d WHERE d.depends_on = s.id)
             ), r AS (
                 INSERT INTO step_receipts (id, step_id, workflow_id, attempt_id, lease_version,
                     input_digest, adapter, adapter_version, request_identity,
                     external_reference, outcome, observed_result, verification)
                 SELECT receipt_id, id, workflow_id, attempt_id, lease_version, input_digest,
                        adapter, adapter_version, request_identity, external_reference,
                        'succeeded', result, 'direct'
                 FROM f ORDER BY ord
                 RETURNING *
             ), a AS (
                 UPDATE attempts a
                 SET checkpoint = 'receipt_committed', state = 'succeeded',
                     response_observed_at = greatest(a.invocation_began_at,
                                                     least(now(), coalesce(f.seen, now()))),
                     observed_result = f.result,
                     adapter_version = f.adapter_version, updated_at = now()
                 FROM f WHERE a.id = ANY ($5::uuid[]) AND a.id = f.attempt_id
             ), s AS (
                 UPDATE steps s
                 SET state = 'completed', lease_owner = NULL, leased_at = NULL,
                     expires_at = NULL, checkpoint_version = f.version, updated_at = now()
                 FROM f WHERE s.id = ANY ($2::uuid[]) AND s.id = f.id
             ), e AS (
                 INSERT INTO step_events (workflow_id, step_id, attempt_id, lease_version, owner,
                                          kind, detail)
                 SELECT f.workflow_id, f.id, f.attempt_id, f.lease_version, f.owner, v.kind,
                        v.detail
                 FROM f CROSS JOIN LATERAL (VALUES
                     (1, $11::text, jsonb_build_object('checkpoint', 'response_observed',
                                                       'checkpoint_version', f.version)),
                     (2, $11::text, jsonb_build_object('checkpoint', 'receipt_committed',
                                                       'checkpoint_version', f.version)),
                     (3, $12::text, jsonb_build_object('receipt', f.receipt_id,
                                                       'verification', 'direct'))
                 ) AS v (n, kind, detail)
                 -- the gateway's record already has its response_observed event
                 WHERE v.n <> 1 OR (SELECT a.checkpoint FROM attempts a WHERE a.id = f.attempt_id)
                                   = 'invocation_began'
                 ORDER BY f.ord, v.n
             ), done AS (
                 UPDATE workflows w SET ",
            completed_workflow!(),
            "
                 WHERE w.id IN (SELECT workflow_id FROM f) AND ",
            workflow_completes!("w", "(SELECT array_agg(id) FROM f)"),
            "
                 RETURNING w.id, w.trace_context
             ), o AS (
                 INSERT INTO outbox (msg_id, kind, workflow_id, step_id, payload, trace_context)
                 SELECT m.kind || '-' || z29c_uuid_v7()::text, m.kind, m.workflow_id,
                        m.step_id, m.payload, m.trace_context
                 FROM (SELECT f.ord, 1 AS n, $13::text AS kind, f.workflow_id, f.id AS step_id,
                              jsonb_build_object('outcome', 'succeeded',
                                                 'verification', 'direct') AS payload,
                              (SELECT w.trace_context FROM workflows w
                               WHERE w.id = f.workflow_id) AS trace_context
                       FROM f
                       UNION ALL
                       SELECT (SELECT max(f.ord) FROM f WHERE f.workflow_id = done.id), 2,
                              $14::text, done.id, NULL, $15::jsonb, done.trace_context
                       FROM done) AS m
                 ORDER BY m.ord, m.n
             )
             SELECT ",
            receipt_columns!(),
            " FROM r AS step_receipts"
        ))
        .bind(&receipt_ids)
        .bind(&steps)
        .bind(&versions)
        .bind(pick(&|c, _| c.owner.to_string()))
        .bind(&attempts)
        .bind(pick(&|_, o| o.input_digest.to_string()))
        .bind(pick(&|_, o| o.adapter_version.clone()))
        .bind(pick(&|_, o| o.request_identity.to_string()))
        .bind(pick(&|_, o| {
            o.external_reference
                .as_ref()
                .map(ExternalReference::as_str)
                .unwrap_or_default()
                .to_owned()
        }))
        .bind(&results)
        .bind(EventKind::Checkpoint.as_str())
        .bind(EventKind::LeaseReleased.as_str())
        .bind(MessageKind::StepCompleted.as_str())
        .bind(MessageKind::WorkflowChanged.as_str())
        .bind(json!({ "state": WorkflowState::Completed.as_str() }))
        .bind(rows.iter().map(|&i| batch[i].1.seen).collect::<Vec<_>>())
        .fetch_all(self.pool())
        .await?;
        for row in written {
            let receipt = Receipt::try_from(ReceiptRow::from_row(&row)?)?;
            let at = rows
                .iter()
                .position(|&i| batch[i].0.step == receipt.step)
                .map(|k| rows[k]);
            if let Some(at) = at {
                debug_assert_eq!(receipt.verification, Verification::Direct);
                answers[at] = Some(receipt);
            }
        }
        Ok(answers)
    }
}

/// Committers that write the receipts of concurrently finishing attempts in shared statements
/// ([`Store::commit_receipts`]). A batch is whatever is waiting when a committer is free (no
/// timer), so a lone receipt waits for nothing. Cheap to clone; committers stop when every
/// handle is gone.
#[derive(Clone)]
pub struct ReceiptBatches {
    store: Store,
    shared: Shared<(LeaseClaim, Observed), Option<Receipt>>,
}

impl std::fmt::Debug for ReceiptBatches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceiptBatches").finish_non_exhaustive()
    }
}

impl ReceiptBatches {
    /// Starts `committers` tasks, each writing up to `max_batch` receipts per statement on
    /// `batches` (a pool with [`crate::BATCH_SESSION_SETTINGS`]); a receipt the statement cannot take goes
    /// to its transaction on `store`.
    pub fn start(batches: &Store, store: &Store, committers: usize, max_batch: usize) -> Self {
        let batches = batches.clone();
        let shared = Shared::start(
            committers,
            max_batch,
            move |batch: Vec<(LeaseClaim, Observed)>| {
                let store = batches.clone();
                async move {
                    let rows: Vec<(&LeaseClaim, &Observed)> =
                        batch.iter().map(|(c, o)| (c, o)).collect();
                    // a failed statement wrote nothing: each receipt goes its own way
                    store.commit_receipts(&rows).await.unwrap_or_else(|e| {
                    tracing::warn!(error = %e, receipts = rows.len(), "shared receipt statement failed; each commits on its own");
                    vec![None; rows.len()]
                })
                }
            },
        );
        Self {
            store: store.clone(),
            shared,
        }
    }

    /// Commits the receipt in the next shared statement, or, where that statement cannot take
    /// it, in a transaction of its own that says why; a refused receipt is kept as late
    /// evidence, exactly as [`Store::commit_or_keep_late`].
    pub async fn commit_or_keep_late(
        &self,
        claim: &LeaseClaim,
        observed: &Observed,
    ) -> Result<CommitOutcome> {
        if eligible(claim, observed)
            && let Some(Some(receipt)) = self.shared.ask((claim.clone(), observed.clone())).await
        {
            return Ok(CommitOutcome::Committed(receipt));
        }
        self.store.commit_or_keep_late(claim, observed).await
    }
}

/// How an executor commits its receipts, chosen once from its configuration: each in a
/// transaction of its own, or in shared statements with the receipts finishing beside it.
/// Either commits exactly what the other would, and keeps a refused receipt as late evidence.
#[derive(Debug, Clone)]
pub enum ReceiptPath {
    Direct(Store),
    Batched(ReceiptBatches),
}

impl ReceiptPath {
    /// [`Store::commit_or_keep_late`], on this path.
    pub async fn commit_or_keep_late(
        &self,
        claim: &LeaseClaim,
        observed: &Observed,
    ) -> Result<CommitOutcome> {
        match self {
            Self::Direct(store) => store.commit_or_keep_late(claim, observed).await,
            Self::Batched(batches) => batches.commit_or_keep_late(claim, observed).await,
        }
    }
}
