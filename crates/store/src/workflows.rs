//! Workflows and their steps: submission (idempotent on a client key), reads that carry
//! everything the product projection needs, and cancellation.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};
use uuid::Uuid;
use z29c_core::dag;
use z29c_core::{
    AttemptState, Checkpoint, ClientKey, InputDigest, LeasePolicy, LeaseVersion, PlatformBounds,
    ProductState, StepFacts, StepId, StepName, StepState, WorkflowId, WorkflowState, project,
    project_workflow,
};
use z29c_core::{reasons, refs};

pub use crate::ending::Receipt;
use crate::ending::{ReceiptRow, receipt_columns};
use crate::error::parse;
use crate::outbox::{self, MessageKind};
use crate::{Result, Store, StoreError, millis};

/// A step as submitted.
#[derive(Debug, Clone, Serialize)]
pub struct NewStep {
    pub name: StepName,
    pub adapter: String,
    pub operation: String,
    pub input: Value,
    pub depends_on: Vec<StepName>,
    pub policy: LeasePolicy,
}

/// A workflow as submitted.
#[derive(Debug, Clone, Serialize)]
pub struct NewWorkflow {
    #[serde(skip)]
    pub client_key: ClientKey,
    pub name: String,
    pub deadline: Option<DateTime<Utc>>,
    pub steps: Vec<NewStep>,
    /// W3C `traceparent` of the submitting span; not part of the submission's digest.
    #[serde(skip)]
    pub trace_context: Option<String>,
}

/// Limits on what one submission may contain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubmitLimits {
    pub max_steps: usize,
    pub max_input_bytes: usize,
    pub bounds: PlatformBounds,
}

impl Default for SubmitLimits {
    fn default() -> Self {
        Self {
            max_steps: 1_000,
            max_input_bytes: 64 * 1024,
            bounds: PlatformBounds::default(),
        }
    }
}

/// The answer to a submission.
#[derive(Debug, Clone)]
pub struct Submitted {
    pub workflow: WorkflowId,
    /// False when the client key named an identical earlier submission.
    pub created: bool,
    /// The new workflow as its submission's commit left it (every step ready or blocked, none
    /// leased yet), built from what was written; `None` when the key named an earlier
    /// submission, which only a read can tell.
    pub detail: Option<WorkflowDetail>,
}

/// A step's state at submission: ready unless it waits for others.
fn submitted_state(s: &NewStep) -> StepState {
    if s.depends_on.is_empty() {
        StepState::Ready
    } else {
        StepState::Blocked
    }
}

/// A step with its lease (technical detail) and its receipt (what happened), kept apart.
#[derive(Debug, Clone, Serialize)]
pub struct StepDetail {
    pub id: StepId,
    pub name: String,
    pub adapter: String,
    pub operation: String,
    pub state: StepState,
    pub input_digest: String,
    pub request_identity: Option<String>,
    pub lease_owner: Option<String>,
    pub lease_version: LeaseVersion,
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub lease_expired: bool,
    pub next_eligible_at: DateTime<Utc>,
    pub waiting_for_eligibility: bool,
    pub checkpoint: Option<Checkpoint>,
    pub last_attempt: Option<AttemptState>,
    pub attempts_made: i32,
    /// Attempts whose call began and was not given back: a call the destination turned away
    /// as rate limited is a wait, counted in `waits`, not an attempt.
    pub calls_begun: i64,
    /// Times it was given back without sending (rate limited, no permit, no gateway).
    pub waits: i32,
    pub receipt: Option<Receipt>,
    /// The input it sends: resolved once its dependencies succeeded, as submitted before.
    pub input: Value,
    pub depends_on: Vec<String>,
    /// Why it failed, waits or is being recovered, in words ([`z29c_core::reasons`]).
    pub reason: Option<String>,
}

impl StepDetail {
    pub fn facts(&self) -> StepFacts {
        StepFacts {
            state: self.state,
            checkpoint: self.checkpoint,
            last_attempt: self.last_attempt,
            receipt: self.receipt.as_ref().map(|r| r.outcome),
            lease_expired: self.lease_expired,
            waiting_for_eligibility: self.waiting_for_eligibility,
            has_waited: self.waits > 0,
        }
    }

    /// What a person is told about this step.
    pub fn product_state(&self) -> ProductState {
        project(&self.facts())
    }
}

/// Which workflows a list keeps: any of `states` (none: every state), of `name`, and the one
/// whose id or client key is `search`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkflowFilter {
    pub states: Vec<ProductState>,
    pub name: Option<String>,
    pub search: Option<String>,
}

/// One page of a list, and where the next begins (`None`: this was the last).
#[derive(Debug, Clone, Default)]
pub struct WorkflowPage {
    pub workflows: Vec<WorkflowDetail>,
    pub next: Option<WorkflowId>,
}

/// How many chunks of a page's size one list request reads at most while filtering.
pub const LIST_SCAN_CHUNKS: usize = 10;

/// A workflow and its steps.
#[derive(Debug, Clone, Serialize)]
pub struct WorkflowDetail {
    pub id: WorkflowId,
    pub client_key: String,
    pub name: String,
    pub state: WorkflowState,
    pub deadline: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub steps: Vec<StepDetail>,
    /// Why it failed or was cancelled, in words.
    pub reason: Option<String>,
}

impl WorkflowDetail {
    /// What a person is told about this workflow.
    pub fn product_state(&self) -> ProductState {
        project_workflow(self.state, self.steps.iter().map(StepDetail::product_state))
    }
}

#[derive(sqlx::FromRow)]
struct WorkflowRow {
    id: Uuid,
    client_key: String,
    name: String,
    state: String,
    deadline: Option<DateTime<Utc>>,
    created_at: DateTime<Utc>,
    cancel_reason: Option<String>,
}

impl WorkflowRow {
    fn detail(self, steps: Vec<StepDetail>) -> Result<WorkflowDetail> {
        let reason = reasons::workflow_reason(
            self.cancel_reason.as_deref(),
            steps
                .iter()
                .map(|s| (s.name.as_str(), s.state, s.reason.as_deref())),
        );
        Ok(WorkflowDetail {
            id: WorkflowId::from_uuid(self.id),
            client_key: self.client_key,
            name: self.name,
            state: parse(&self.state)?,
            deadline: self.deadline,
            created_at: self.created_at,
            steps,
            reason,
        })
    }
}

#[derive(sqlx::FromRow)]
struct StepRow {
    id: Uuid,
    workflow_id: Uuid,
    name: String,
    adapter: String,
    operation: String,
    state: String,
    input_digest: String,
    request_identity: Option<String>,
    lease_owner: Option<String>,
    lease_version: i64,
    expires_at: Option<DateTime<Utc>>,
    lease_expired: bool,
    next_eligible_at: DateTime<Utc>,
    waiting: bool,
    checkpoint: Option<String>,
    attempt_state: Option<String>,
    attempts_made: i32,
    calls_begun: i64,
    waits: i32,
    input: Value,
    depends_on: Vec<String>,
    event_kind: Option<String>,
    event_detail: Option<Value>,
    review_reason: Option<String>,
}

impl NewWorkflow {
    /// Checks the submission, naming the first offending field.
    pub fn validate(&self, limits: &SubmitLimits) -> Result<()> {
        if self.name.len() > 200 {
            return Err(StoreError::invalid("name", "at most 200 bytes"));
        }
        if self.steps.len() > limits.max_steps {
            return Err(StoreError::invalid(
                "steps",
                format!(
                    "{} steps, at most {} allowed",
                    self.steps.len(),
                    limits.max_steps
                ),
            ));
        }
        for (i, s) in self.steps.iter().enumerate() {
            if s.adapter.is_empty() || s.adapter.len() > 100 {
                return Err(StoreError::invalid(
                    format!("steps[{i}].adapter"),
                    "must be 1 to 100 bytes",
                ));
            }
            if s.operation.is_empty() || s.operation.len() > 100 {
                return Err(StoreError::invalid(
                    format!("steps[{i}].operation"),
                    "must be 1 to 100 bytes",
                ));
            }
            let size = serde_json::to_vec(&s.input).map_or(usize::MAX, |v| v.len());
            if size > limits.max_input_bytes {
                return Err(StoreError::invalid(
                    format!("steps[{i}].input"),
                    format!("{size} bytes, at most {} allowed", limits.max_input_bytes),
                ));
            }
            s.policy.validate(&limits.bounds).map_err(|e| {
                StoreError::invalid(format!("steps[{i}].policy.{}", e.field), e.reason)
            })?;
            // a reference names a step this one waits for: its result exists before this
            // step may start
            let references = refs::references(&s.input)
                .map_err(|e| StoreError::invalid(format!("steps[{i}].input{}", e.at), e.reason))?;
            for (at, r) in references {
                if !s.depends_on.iter().any(|d| d.as_str() == r.step) {
                    return Err(StoreError::invalid(
                        format!("steps[{i}].input{at}"),
                        format!(
                            "{r} refers to step {:?}, which is not in this step's depends_on",
                            r.step
                        ),
                    ));
                }
            }
        }
        let graph: Vec<_> = self
            .steps
            .iter()
            .map(|s| (s.name.clone(), s.depends_on.clone()))
            .collect();
        dag::validate(&graph).map_err(|e| StoreError::invalid(e.field, e.reason))?;
        Ok(())
    }

    /// Digest of everything but the client key: the same key with another payload conflicts.
    fn digest(&self) -> InputDigest {
        InputDigest::of_json(&serde_json::to_value(self).unwrap_or(Value::Null))
    }
}

/// A validated submission, with the ids and digests its statement writes and its answer
/// reports.
#[derive(Debug, Clone)]
pub struct Prepared {
    wf: NewWorkflow,
    id: WorkflowId,
    digest: InputDigest,
    step_ids: Vec<StepId>,
    input_digests: Vec<InputDigest>,
    /// Per step, its input as submitted when it refers to upstream results.
    templates: Vec<Option<Value>>,
}

impl Prepared {
    /// Validates `wf` against `limits` and gives it and its steps their ids. An input without
    /// references has its escapes (`$${`) written out now; one with references is kept as
    /// its template until its dependencies have succeeded.
    pub fn new(mut wf: NewWorkflow, limits: &SubmitLimits) -> Result<Self> {
        wf.validate(limits)?;
        let mut templates = Vec::with_capacity(wf.steps.len());
        for (i, s) in wf.steps.iter_mut().enumerate() {
            let has_references = !refs::references(&s.input)
                .map_err(|e| StoreError::invalid(format!("steps[{i}].input{}", e.at), e.reason))?
                .is_empty();
            if has_references {
                templates.push(Some(s.input.clone()));
            } else {
                if refs::needs_resolving(&s.input) {
                    s.input = refs::resolve(&s.input, &|_| None).map_err(|e| {
                        StoreError::invalid(format!("steps[{i}].input{}", e.at), e.reason)
                    })?;
                }
                templates.push(None);
            }
        }
        let digest = wf.digest();
        let step_ids = wf.steps.iter().map(|_| StepId::new()).collect();
        // each input's digest is both written and answered: hashed once
        let input_digests = wf
            .steps
            .iter()
            .map(|s| InputDigest::of_json(&s.input))
            .collect();
        Ok(Self {
            wf,
            id: WorkflowId::new(),
            digest,
            step_ids,
            input_digests,
            templates,
        })
    }

    pub fn client_key(&self) -> &ClientKey {
        &self.wf.client_key
    }

    /// The submission as validated.
    pub fn workflow(&self) -> &NewWorkflow {
        &self.wf
    }

    /// The answer for this submission, written by a commit at `created_at`.
    fn created(&self, created_at: DateTime<Utc>) -> Submitted {
        let wf = &self.wf;
        let steps = wf
            .steps
            .iter()
            .zip(self.step_ids.iter().zip(&self.input_digests))
            .map(|(s, (step, digest))| StepDetail {
                id: *step,
                name: s.name.as_str().to_owned(),
                adapter: s.adapter.clone(),
                operation: s.operation.clone(),
                state: submitted_state(s),
                input_digest: digest.as_str().to_owned(),
                request_identity: None,
                lease_owner: None,
                lease_version: LeaseVersion::NEVER_LEASED,
                lease_expires_at: None,
                lease_expired: false,
                next_eligible_at: created_at,
                waiting_for_eligibility: false,
                checkpoint: None,
                last_attempt: None,
                attempts_made: 0,
                calls_begun: 0,
                waits: 0,
                receipt: None,
                input: s.input.clone(),
                // in the steps' order, as a read gives them
                depends_on: wf
                    .steps
                    .iter()
                    .filter(|x| s.depends_on.contains(&x.name))
                    .map(|x| x.name.as_str().to_owned())
                    .collect(),
                reason: None,
            })
            .collect();
        Submitted {
            workflow: self.id,
            created: true,
            detail: Some(WorkflowDetail {
                id: self.id,
                client_key: wf.client_key.as_str().to_owned(),
                name: wf.name.clone(),
                state: WorkflowState::Running,
                deadline: wf.deadline,
                created_at,
                steps,
                reason: None,
            }),
        }
    }
}

impl Store {
    /// Submits a workflow, idempotently on its client key: the same key and payload return the
    /// first submission (`created = false`); the same key with a different payload is
    /// [`StoreError::Conflict`]. Steps without dependencies are ready at once.
    ///
    /// A new workflow is written by one statement, in one round trip and one commit: the
    /// workflow, its steps, their dependencies and the ready steps' `step.ready` messages
    /// (data-modifying CTEs; the references between them are checked at the statement's end,
    /// when all are in). Its answer, [`Submitted::detail`], is built from what was written, not read back.
    pub async fn submit_workflow(
        &self,
        wf: &NewWorkflow,
        limits: &SubmitLimits,
    ) -> Result<Submitted> {
        self.submit_prepared(&Prepared::new(wf.clone(), limits)?)
            .await
    }

    /// [`Store::submit_workflow`] of a validated submission.
    pub async fn submit_prepared(&self, prepared: &Prepared) -> Result<Submitted> {
        match self
            .insert_workflows(std::slice::from_ref(prepared))
            .await?
            .pop()
            .flatten()
        {
            Some(created) => Ok(created),
            None => self.submitted_before(prepared).await,
        }
    }

    /// The answer for a submission whose client key was taken: the earlier submission if it
    /// was the same, [`StoreError::Conflict`] if not.
    async fn submitted_before(&self, prepared: &Prepared) -> Result<Submitted> {
        self.earlier_submission(prepared)
            .await?
            .ok_or(StoreError::NotFound {
                what: "workflow of the client key",
            })
    }

    /// The workflow already submitted under `prepared`'s client key, if any: the same
    /// submission, or [`StoreError::Conflict`] if it was a different one. A retried submit is
    /// answered from it even when the submission could no longer be accepted anew.
    pub async fn earlier_submission(&self, prepared: &Prepared) -> Result<Option<Submitted>> {
        let key = prepared.client_key().as_str();
        let row: Option<(Uuid, String)> = sqlx::query_as(
            "SELECT w.id, w.submission_digest
                 FROM workflow_keys k JOIN workflows w ON w.id = k.workflow_id
                 WHERE k.client_key = $1",
        )
        .bind(key)
        .fetch_optional(&self.pool)
        .await?;
        let Some((existing, existing_digest)) = row else {
            return Ok(None);
        };
        if existing_digest != prepared.digest.as_str() {
            return Err(StoreError::Conflict(format!(
                "client key {key:?} was used for a different submission ({existing})"
            )));
        }
        Ok(Some(Submitted {
            workflow: WorkflowId::from_uuid(existing),
            created: false,
            detail: None,
        }))
    }

    /// Writes every submission of `batch` whose client key is free, in one statement (one
    /// round trip, one commit), and answers each: the new workflow, or `None` where the key
    /// was taken (by an earlier submission, or by another of the batch), which wrote nothing.
    /// Keys are inserted in key order, so two batches that share keys cannot deadlock.
    pub async fn insert_workflows(&self, batch: &[Prepared]) -> Result<Vec<Option<Submitted>>> {
        self.insert_audited_workflows(batch, &[]).await
    }

    /// [`Store::insert_workflows`], with `audits[i]` (the allowed call that submitted
    /// `batch[i]`, if it is audited) written in the same statement, for the workflows the
    /// statement created only: the record of the change commits with it or not at all.
    pub async fn insert_audited_workflows(
        &self,
        batch: &[Prepared],
        audits: &[Option<&crate::audit::AuditEntry>],
    ) -> Result<Vec<Option<Submitted>>> {
        let mut order: Vec<usize> = (0..batch.len()).collect();
        order.sort_by(|&a, &b| {
            batch[a]
                .client_key()
                .as_str()
                .cmp(batch[b].client_key().as_str())
        });
        let (mut ids, mut keys, mut digests, mut names, mut deadlines, mut traces) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        let (mut steps, mut dependent, mut dependency, mut dependency_workflow) =
            (vec![], vec![], vec![], vec![]);
        let (mut ready, mut ready_workflow) = (vec![], vec![]);
        let mut audit_rows = vec![];
        for &k in &order {
            let p = &batch[k];
            let wf = &p.wf;
            let workflow = p.id.as_uuid();
            if let Some(Some(e)) = audits.get(k) {
                let e = e.clipped();
                audit_rows.push(json!({
                    "workflow_id": workflow,
                    "service": e.service,
                    "method": e.method,
                    "subject": e.subject,
                    "action": e.action,
                    "outcome": e.outcome,
                    "detail": e.detail,
                    "peer": e.peer,
                }));
            }
            ids.push(workflow);
            keys.push(wf.client_key.as_str());
            digests.push(p.digest.as_str());
            names.push(wf.name.as_str());
            deadlines.push(wf.deadline);
            traces.push(wf.trace_context.as_deref().filter(|t| t.len() <= 256));
            let position = |name: &StepName| {
                wf.steps
                    .iter()
                    .position(|x| &x.name == name)
                    .ok_or_else(|| StoreError::invalid("depends_on", "unknown step"))
            };
            for (i, s) in wf.steps.iter().enumerate() {
                for dep in &s.depends_on {
                    dependent.push(p.step_ids[i].as_uuid());
                    dependency.push(p.step_ids[position(dep)?].as_uuid());
                    dependency_workflow.push(workflow);
                }
                if s.depends_on.is_empty() {
                    ready.push(p.step_ids[i].as_uuid());
                    ready_workflow.push(workflow);
                }
                let policy = &s.policy;
                steps.push(json!({
                    "workflow_id": workflow,
                    "id": p.step_ids[i].as_uuid(),
                    "name": s.name.as_str(),
                    "position": i,
                    "adapter": s.adapter,
                    "operation": s.operation,
                    "input": s.input,
                    "input_template": p.templates[i],
                    "input_digest": p.input_digests[i].as_str(),
                    "lease_ms": millis(policy.lease),
                    "renew_every_ms": millis(policy.renew_every),
                    "attempt_deadline_ms": millis(policy.attempt_deadline),
                    "final_grace_ms": millis(policy.final_grace),
                    "adapter_timeout_ms": millis(policy.adapter_timeout),
                    "schedule_to_start_ms": (!policy.schedule_to_start.is_zero())
                        .then(|| millis(policy.schedule_to_start)),
                    "max_attempts": policy.max_attempts,
                    "retry_policy": crate::retry_policy_to_row(&policy.retry),
                    "state": submitted_state(s).as_str(),
                    "pending_deps": s.depends_on.len(),
                }));
            }
        }
        self.cover_ids(ids.iter().copied()).await?;
        // steps, dependencies and messages are written for the workflows the first insert
        // took: a taken key writes nothing else
        let created: Vec<(Uuid, DateTime<Utc>)> = sqlx::query_as(
            "WITH x AS (
                 SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[],
                                      $5::timestamptz[], $6::text[])
                     WITH ORDINALITY AS x (id, client_key, digest, name, deadline,
                                           trace_context, n)
             ), k AS (
                 -- a client key is unique across the partitions of workflows, so it is taken
                 -- in a table of its own
                 INSERT INTO workflow_keys (client_key, workflow_id)
                 SELECT x.client_key, x.id FROM x ORDER BY x.n
                 ON CONFLICT (client_key) DO NOTHING
                 RETURNING workflow_id
             ), w AS (
                 INSERT INTO workflows (id, client_key, submission_digest, name, deadline,
                                        trace_context)
                 SELECT x.id, x.client_key, x.digest, x.name, x.deadline, x.trace_context
                 FROM x JOIN k ON k.workflow_id = x.id
                 ORDER BY x.n
                 RETURNING id, trace_context, created_at
             ), s AS (
                 INSERT INTO steps (id, workflow_id, name, position, adapter, operation, input,
                     input_digest, lease_ms, renew_every_ms, attempt_deadline_ms, final_grace_ms,
                     adapter_timeout_ms, max_attempts, state, pending_deps, schedule_to_start_ms,
                     start_by, retry_policy, input_template)
                 SELECT x.id, w.id, x.name, x.position, x.adapter, x.operation, x.input,
                     x.input_digest, x.lease_ms, x.renew_every_ms, x.attempt_deadline_ms,
                     x.final_grace_ms, x.adapter_timeout_ms, x.max_attempts,
                     x.state::step_state, x.pending_deps, x.schedule_to_start_ms,
                     CASE WHEN x.state = 'ready'
                          THEN now() + x.schedule_to_start_ms * interval '1 millisecond' END,
                     x.retry_policy, x.input_template
                 FROM jsonb_to_recordset($7) AS x(workflow_id uuid, id uuid, name text,
                     position integer, adapter text, operation text, input jsonb,
                     input_digest text, lease_ms integer, renew_every_ms integer,
                     attempt_deadline_ms integer, final_grace_ms integer,
                     adapter_timeout_ms integer, max_attempts integer,
                     state text, pending_deps integer, schedule_to_start_ms bigint,
                     retry_policy jsonb, input_template jsonb)
                 JOIN w ON w.id = x.workflow_id
             ), d AS (
                 INSERT INTO step_dependencies (step_id, depends_on, workflow_id)
                 SELECT x.step_id, x.depends_on, x.workflow_id
                 FROM unnest($8::uuid[], $9::uuid[], $10::uuid[])
                     AS x(step_id, depends_on, workflow_id)
                 JOIN w ON w.id = x.workflow_id
             ), o AS (
                 INSERT INTO outbox (msg_id, kind, workflow_id, step_id, payload, trace_context)
                 SELECT $11::text || '-' || z29c_uuid_v7()::text, $11, w.id, r.id, '{}',
                        w.trace_context
                 FROM unnest($12::uuid[], $13::uuid[]) AS r(id, workflow_id)
                 JOIN w ON w.id = r.workflow_id
             ), a AS (
                 INSERT INTO audit_log (service, method, subject, action, outcome, detail, peer)
                 SELECT x.service, x.method, x.subject, x.action, x.outcome, x.detail, x.peer
                 FROM jsonb_to_recordset($14) AS x(workflow_id uuid, service text, method text,
                     subject text, action text, outcome text, detail text, peer text)
                 JOIN w ON w.id = x.workflow_id
             )
             SELECT id, created_at FROM w",
        )
        .bind(&ids)
        .bind(&keys)
        .bind(&digests)
        .bind(&names)
        .bind(&deadlines)
        .bind(&traces)
        .bind(Value::Array(steps))
        .bind(&dependent)
        .bind(&dependency)
        .bind(&dependency_workflow)
        .bind(MessageKind::StepReady.as_str())
        .bind(&ready)
        .bind(&ready_workflow)
        .bind(Value::Array(audit_rows))
        .fetch_all(&self.pool)
        .await?;
        Ok(batch
            .iter()
            .map(|p| {
                created
                    .iter()
                    .find(|(id, _)| *id == p.id.as_uuid())
                    .map(|&(_, at)| p.created(at))
            })
            .collect())
    }

    /// A workflow with its steps, their latest attempt and their receipts.
    ///
    /// Read by index whatever the plan cache holds ([`Store::begin_walking_indexes`]): every
    /// submission answers with this read, and so do `Get` and each tick of `Watch`. A
    /// connection caches a generic plan after five runs, and on a fresh database (tables not
    /// yet analyzed) that plan hash-joined the steps with all of `attempts` and all of
    /// `step_receipts`, by sequential scans, and kept doing so as they grew: at 50 % load of
    /// the latency benchmark these two reads were 64 % of PostgreSQL's statement time (3.8 and
    /// 2.9 ms, 684 and 491 buffers per call, after 30 s).
    pub async fn workflow(&self, id: WorkflowId) -> Result<WorkflowDetail> {
        let mut tx = self.begin_walking_indexes(false).await?;
        let row: WorkflowRow = sqlx::query_as(
            "SELECT id, client_key, name, state::text AS state, deadline, created_at,
                    cancel_reason
             FROM workflows WHERE id = $1",
        )
        .bind(id.as_uuid())
        .fetch_optional(&mut *tx)
        .await?
        .ok_or(StoreError::NotFound { what: "workflow" })?;
        let mut details = step_details(&mut tx, &[row.id]).await?;
        tx.commit().await?;
        let steps = details.remove(&row.id).unwrap_or_default();
        row.detail(steps)
    }

    /// A page of workflows, newest first, that `filter` keeps; `before` is where the previous
    /// page ended ([`WorkflowPage::next`]). Read by index, as [`Store::workflow`]. A product
    /// state is worked out from the steps, so the rows are read in chunks of `limit` and
    /// filtered here, up to [`LIST_SCAN_CHUNKS`] chunks a page: a page may hold fewer than
    /// `limit` workflows and still have a next one.
    pub async fn list_workflows(
        &self,
        limit: i64,
        before: Option<WorkflowId>,
        filter: &WorkflowFilter,
    ) -> Result<WorkflowPage> {
        let limit = limit.max(1);
        // the stored states a wanted product state may come from
        let stored: Option<Vec<&str>> = (!filter.states.is_empty()).then(|| {
            let mut stored = Vec::new();
            for p in &filter.states {
                stored.extend_from_slice(match p {
                    ProductState::Completed => &["completed", "running"][..],
                    ProductState::Failed => &["failed"],
                    ProductState::Cancelled => &["cancelled"],
                    ProductState::NeedsReview => &["running", "completed", "failed", "cancelled"],
                    _ => &["running"],
                });
            }
            stored.sort_unstable();
            stored.dedup();
            stored
        });
        let search_id = filter
            .search
            .as_deref()
            .and_then(|s| s.parse::<Uuid>().ok());
        let mut tx = self.begin_walking_indexes(false).await?;
        let mut page = WorkflowPage::default();
        let mut cursor = before.map(|b| b.as_uuid());
        for _ in 0..LIST_SCAN_CHUNKS {
            let rows: Vec<WorkflowRow> = sqlx::query_as(
                "SELECT id, client_key, name, state::text AS state, deadline, created_at,
                        cancel_reason
                 FROM workflows
                 WHERE ($2::uuid IS NULL
                        OR (created_at, id) < (SELECT created_at, id FROM workflows WHERE id = $2))
                   AND ($3::text IS NULL OR name = $3)
                   AND ($4::text IS NULL OR client_key = $4 OR id = $5)
                   AND ($6::text[] IS NULL OR state::text = ANY ($6))
                 ORDER BY created_at DESC, id DESC LIMIT $1",
            )
            .bind(limit)
            .bind(cursor)
            .bind(filter.name.as_deref())
            .bind(filter.search.as_deref())
            .bind(search_id)
            .bind(stored.as_deref())
            .fetch_all(&mut *tx)
            .await?;
            let full = rows.len() as i64 == limit;
            cursor = rows.last().map(|r| r.id);
            let ids: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
            let mut details = step_details(&mut tx, &ids).await?;
            for r in rows {
                let steps = details.remove(&r.id).unwrap_or_default();
                let w = r.detail(steps)?;
                if filter.states.is_empty() || filter.states.contains(&w.product_state()) {
                    page.workflows.push(w);
                }
                if page.workflows.len() as i64 == limit {
                    break;
                }
            }
            page.next = match page.workflows.len() as i64 == limit {
                true => page.workflows.last().map(|w| w.id),
                false => full.then(|| cursor.map(WorkflowId::from_uuid)).flatten(),
            };
            if !full || page.workflows.len() as i64 == limit {
                break;
            }
        }
        tx.commit().await?;
        Ok(page)
    }

    /// Running workflows whose deadline has passed (PostgreSQL time), oldest deadline first.
    /// Every scheduler asks twice a second: the partial index `workflows_overdue` holds only
    /// running workflows with a deadline, and the ask walks it (never the whole table of every
    /// workflow that ever ran), whatever plan the connection cached.
    pub async fn overdue_workflows(&self, limit: i64) -> Result<Vec<WorkflowId>> {
        let mut tx = self.begin_walking_indexes(false).await?;
        let ids: Vec<Uuid> = sqlx::query_scalar(
            "SELECT id FROM workflows
             WHERE state = 'running' AND deadline IS NOT NULL AND deadline <= now()
             ORDER BY deadline LIMIT $1",
        )
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(ids.into_iter().map(WorkflowId::from_uuid).collect())
    }

    /// Ready steps whose schedule-to-start deadline has passed (PostgreSQL time), oldest
    /// deadline first, through the partial index `steps_start_by`.
    pub async fn steps_past_start_by(&self, limit: i64) -> Result<Vec<StepId>> {
        let mut tx = self.begin_walking_indexes(false).await?;
        let ids: Vec<Uuid> = sqlx::query_scalar(
            "SELECT id FROM steps
             WHERE state = 'ready' AND start_by IS NOT NULL AND start_by <= now()
             ORDER BY start_by LIMIT $1",
        )
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(ids.into_iter().map(StepId::from_uuid).collect())
    }

    /// Ends a step that waited, ready, past its schedule-to-start deadline. Nothing was sent,
    /// so it fails, with the reason in its history, and its workflow fails with it (its steps
    /// not started stop; one that may have sent goes to review). A step one of whose attempts
    /// may have sent is not failed: its deadline was met once, and it is cleared. Returns
    /// whether the step failed; `false` also when it was claimed meanwhile.
    pub async fn fail_unstarted(&self, step: StepId) -> Result<bool> {
        let mut tx = self.begin().await?;
        // the workflow first, then the step, in the order a cancellation locks them
        let workflow: Option<Uuid> =
            sqlx::query_scalar("SELECT workflow_id FROM steps WHERE id = $1")
                .bind(step.as_uuid())
                .fetch_optional(&mut *tx)
                .await?;
        let Some(workflow) = workflow else {
            return Err(StoreError::NotFound { what: "step" });
        };
        sqlx::query("SELECT 1 FROM workflows WHERE id = $1 FOR NO KEY UPDATE")
            .bind(workflow)
            .execute(&mut *tx)
            .await?;
        let due: Option<(i64, Option<i64>, bool)> = sqlx::query_as(
            "SELECT lease_version, schedule_to_start_ms, z29c_may_have_sent(id) FROM steps
             WHERE id = $1 AND state = 'ready' AND start_by <= now()
             FOR UPDATE",
        )
        .bind(step.as_uuid())
        .fetch_optional(&mut *tx)
        .await?;
        let Some((lease_version, limit_ms, may_have_sent)) = due else {
            return Ok(false);
        };
        if may_have_sent {
            sqlx::query("UPDATE steps SET start_by = NULL WHERE id = $1")
                .bind(step.as_uuid())
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            return Ok(false);
        }
        let reason = format!(
            "not started within its schedule-to-start deadline ({} ms); nothing was sent",
            limit_ms.unwrap_or_default()
        );
        crate::ending::fail_by_policy(
            &mut tx,
            workflow,
            crate::events::NewEvent {
                workflow,
                step: step.as_uuid(),
                attempt: None,
                lease_version,
                owner: None,
                kind: crate::events::EventKind::FailedByPolicy,
                detail: json!({ "reason": reason, "schedule_to_start_ms": limit_ms }),
            },
            "a step was not started within its schedule-to-start deadline",
        )
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Cancels a running workflow. Steps not yet started are cancelled; a step whose last
    /// attempt may have reached the external system goes to review instead, because its effect
    /// may exist. Leased steps stop at their next safe checkpoint (renewal and new checkpoints
    /// are refused) while an invocation already begun may still record its outcome. Cancelling
    /// a cancelled workflow is a no-op; cancelling a finished one is a conflict.
    pub async fn cancel_workflow(&self, id: WorkflowId, reason: &str) -> Result<WorkflowState> {
        self.cancel_workflow_audited(id, reason, None).await
    }

    /// [`Store::cancel_workflow`], with `audit` (the allowed call that asked for it) written
    /// in the same transaction: a cancel that commits is on record, even if its service dies
    /// before answering. A no-op cancel is recorded too; a refused one is not (nothing
    /// commits).
    pub async fn cancel_workflow_audited(
        &self,
        id: WorkflowId,
        reason: &str,
        audit: Option<&crate::audit::AuditEntry>,
    ) -> Result<WorkflowState> {
        let mut tx = self.begin().await?;
        let state: Option<String> =
            sqlx::query_scalar("SELECT state::text FROM workflows WHERE id = $1 FOR UPDATE")
                .bind(id.as_uuid())
                .fetch_optional(&mut *tx)
                .await?;
        let state: WorkflowState = parse(&state.ok_or(StoreError::NotFound { what: "workflow" })?)?;
        match state {
            WorkflowState::Cancelled => {}
            WorkflowState::Completed | WorkflowState::Failed => {
                return Err(StoreError::Conflict(format!("workflow is already {state}")));
            }
            WorkflowState::Running => {
                sqlx::query(
                    "UPDATE workflows SET state = 'cancelled', cancel_reason = $2,
                         ended_at = now(), updated_at = now()
                     WHERE id = $1",
                )
                .bind(id.as_uuid())
                .bind(reason)
                .execute(&mut *tx)
                .await?;
                crate::ending::stop_unstarted_steps(&mut tx, id.as_uuid(), reason).await?;
                outbox::enqueue(
                    &mut tx,
                    MessageKind::WorkflowChanged,
                    id.as_uuid(),
                    None,
                    json!({ "state": "cancelled" }),
                )
                .await?;
            }
        }
        if let Some(e) = audit {
            crate::audit::write(&mut *tx, e).await?;
        }
        tx.commit().await?;
        Ok(WorkflowState::Cancelled)
    }
}

/// The steps of `workflows`, each with its latest attempt and its receipt, on the caller's
/// transaction (one that walks indexes: [`Store::workflow`]).
async fn step_details(
    conn: &mut sqlx::PgConnection,
    workflows: &[Uuid],
) -> Result<std::collections::HashMap<Uuid, Vec<StepDetail>>> {
    let rows: Vec<StepRow> = sqlx::query_as(
        "SELECT s.id, s.workflow_id, s.name, s.adapter, s.operation, s.state::text AS state,
                s.input_digest, s.request_identity, s.lease_owner, s.lease_version,
                s.expires_at, coalesce(s.expires_at <= now(), false) AS lease_expired,
                s.next_eligible_at, s.next_eligible_at > now() AS waiting,
                a.checkpoint::text AS checkpoint, a.state::text AS attempt_state,
                s.attempts_made, s.waits, s.input,
                (SELECT count(*) FROM attempts x
                 WHERE x.step_id = s.id AND x.invocation_began_at IS NOT NULL
                   AND x.state <> 'released') AS calls_begun,
                ARRAY(SELECT u.name FROM step_dependencies d JOIN steps u ON u.id = d.depends_on
                      WHERE d.step_id = s.id ORDER BY u.position) AS depends_on,
                e.kind AS event_kind, e.detail AS event_detail,
                (SELECT ri.reason FROM review_items ri
                 WHERE ri.step_id = s.id AND ri.state = 'open'
                 ORDER BY ri.created_at DESC LIMIT 1) AS review_reason
         FROM steps s LEFT JOIN attempts a ON a.id = s.current_attempt_id
         LEFT JOIN LATERAL (
             SELECT x.kind, x.detail FROM step_events x
             WHERE x.step_id = s.id AND x.kind = ANY ($2)
             ORDER BY x.id DESC LIMIT 1
         ) e ON true
         WHERE s.workflow_id = ANY($1)
         ORDER BY s.workflow_id, s.position",
    )
    .bind(workflows)
    .bind(reasons::EXPLAINING_EVENTS)
    .fetch_all(&mut *conn)
    .await?;
    let receipts: Vec<ReceiptRow> = sqlx::query_as(concat!(
        "SELECT ",
        receipt_columns!(),
        // by step: receipts have no index on their workflow, and need none
        " FROM step_receipts
         WHERE step_id IN (SELECT id FROM steps WHERE workflow_id = ANY($1))"
    ))
    .bind(workflows)
    .fetch_all(&mut *conn)
    .await?;
    let mut receipts: std::collections::HashMap<Uuid, Receipt> = receipts
        .into_iter()
        .map(|r| Receipt::try_from(r).map(|r| (r.step.as_uuid(), r)))
        .collect::<Result<_>>()?;
    let mut out: std::collections::HashMap<Uuid, Vec<StepDetail>> = Default::default();
    for r in rows {
        let state: StepState = parse(&r.state)?;
        let checkpoint: Option<Checkpoint> = r.checkpoint.as_deref().map(parse).transpose()?;
        let last_attempt: Option<AttemptState> =
            r.attempt_state.as_deref().map(parse).transpose()?;
        let receipt = receipts.remove(&r.id);
        let reason = reasons::step_reason(&reasons::StepReasonFacts {
            state,
            adapter: &r.adapter,
            receipt: receipt.as_ref().map(|x| reasons::ReceiptFacts {
                outcome: x.outcome,
                verification: x.verification,
                result: &x.observed_result,
            }),
            last: r
                .event_kind
                .as_deref()
                .zip(r.event_detail.as_ref())
                .map(|(kind, detail)| reasons::LastEvent { kind, detail }),
            review: r.review_reason.as_deref(),
            invoked: AttemptState::may_have_sent(checkpoint, last_attempt),
        });
        let detail = StepDetail {
            id: StepId::from_uuid(r.id),
            name: r.name,
            adapter: r.adapter,
            operation: r.operation,
            state,
            input_digest: r.input_digest,
            request_identity: r.request_identity,
            lease_owner: r.lease_owner,
            lease_version: LeaseVersion::new(r.lease_version)
                .map_err(|e| StoreError::Corrupt(e.to_string()))?,
            lease_expires_at: r.expires_at,
            lease_expired: r.lease_expired,
            next_eligible_at: r.next_eligible_at,
            waiting_for_eligibility: r.waiting,
            checkpoint,
            last_attempt,
            attempts_made: r.attempts_made,
            calls_begun: r.calls_begun,
            waits: r.waits,
            receipt,
            input: r.input,
            depends_on: r.depends_on,
            reason,
        };
        out.entry(r.workflow_id).or_default().push(detail);
    }
    Ok(out)
}
