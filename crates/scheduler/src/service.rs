//! `WorkflowService`: validation with the field named, and answers in product states with the
//! lease history kept under technical details.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::Instrument;
use z29c_bus::gateways::Gateways;
use z29c_bus::{Bus, GatewayRecord};
use z29c_core::Action;
use z29c_core::retry::Multiplier;
use z29c_core::{
    ClientKey, LeasePolicy, PolicyError, ProductState, RetryPolicy, StatusSet, StepName, WorkflowId,
};
use z29c_proto::v1::workflow_service_server::WorkflowService;
use z29c_proto::v1::{self as pb};
use z29c_runtime::guard::ChangeAudit;
use z29c_runtime::{Guard, status_from_store};
use z29c_store::Store;
use z29c_store::submissions::SubmissionBatches;
use z29c_store::workflows::{
    NewStep, NewWorkflow, Prepared, StepDetail, SubmitLimits, WorkflowDetail, WorkflowFilter,
};

#[derive(Debug, Clone)]
pub struct Workflows {
    store: Store,
    /// The gateway registry, cached: a submission's adapters are checked against it without
    /// reading the registry each time (a name not in the cache is looked up again at once).
    gateways: Gateways,
    limits: SubmitLimits,
    guard: Guard,
    /// Wakes this scheduler's outbox relay: a new workflow's `step.ready` hints go out at once.
    relay_wake: Arc<Notify>,
    /// Submission batching, when on: concurrent submissions share statements.
    submissions: Option<SubmissionBatches>,
    /// When each adapter was last seen served in the registry: one served within
    /// `adapter_grace` still counts, so a restarting gateway (or NATS, whose registry starts
    /// empty) does not turn work away.
    served: Arc<std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>>,
    adapter_grace: Duration,
}

/// How long an adapter no longer in the registry is still taken as served, by default.
pub const ADAPTER_GRACE: Duration = Duration::from_secs(30);

impl Workflows {
    pub fn new(
        store: Store,
        bus: Bus,
        limits: SubmitLimits,
        guard: Guard,
        relay_wake: Arc<Notify>,
        submissions: Option<SubmissionBatches>,
    ) -> Self {
        Self {
            store,
            gateways: Gateways::new(bus, z29c_security::TlsConfig::default()),
            limits,
            guard,
            relay_wake,
            submissions,
            served: Arc::default(),
            adapter_grace: ADAPTER_GRACE,
        }
    }

    /// How long an adapter that left the registry is still taken as served.
    pub fn adapter_grace(mut self, grace: Duration) -> Self {
        self.adapter_grace = grace;
        self
    }

    /// Notes every adapter `gateways` serve as seen now, and says which of `wanted` is
    /// neither served nor was within the grace.
    fn first_unserved<'a>(
        &self,
        gateways: &[GatewayRecord],
        mut wanted: impl Iterator<Item = &'a str>,
    ) -> Option<&'a str> {
        let mut served = self
            .served
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = std::time::Instant::now();
        for a in gateways.iter().flat_map(|g| &g.adapters) {
            served.insert(a.name.clone(), now);
        }
        wanted.find(|w| {
            served
                .get(*w)
                .is_none_or(|seen| seen.elapsed() > self.adapter_grace)
        })
    }
}

fn invalid(field: impl std::fmt::Display, reason: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{field}: {reason}"))
}

fn timestamp(t: chrono::DateTime<chrono::Utc>) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: t.timestamp(),
        nanos: t.timestamp_subsec_nanos() as i32,
    }
}

pub fn product_to_wire(p: ProductState) -> pb::ProductState {
    match p {
        ProductState::Preparing => pb::ProductState::Preparing,
        ProductState::WaitingOnExternalService => pb::ProductState::WaitingOnExternalService,
        ProductState::RecoveringExecution => pb::ProductState::RecoveringExecution,
        ProductState::NeedsReview => pb::ProductState::NeedsReview,
        ProductState::Completed => pb::ProductState::Completed,
        ProductState::Failed => pb::ProductState::Failed,
        ProductState::Cancelled => pb::ProductState::Cancelled,
    }
}

fn product_from_wire(p: pb::ProductState) -> Option<ProductState> {
    Some(match p {
        pb::ProductState::Unspecified => return None,
        pb::ProductState::Preparing => ProductState::Preparing,
        pb::ProductState::WaitingOnExternalService => ProductState::WaitingOnExternalService,
        pb::ProductState::RecoveringExecution => ProductState::RecoveringExecution,
        pb::ProductState::NeedsReview => ProductState::NeedsReview,
        pb::ProductState::Completed => ProductState::Completed,
        pb::ProductState::Failed => ProductState::Failed,
        pb::ProductState::Cancelled => ProductState::Cancelled,
    })
}

fn policy_from_wire(p: Option<pb::LeasePolicy>) -> Result<LeasePolicy, PolicyError> {
    let d = LeasePolicy::default();
    let Some(p) = p else { return Ok(d) };
    let ms = |v: u64, default: Duration| {
        if v == 0 {
            default
        } else {
            Duration::from_millis(v)
        }
    };
    Ok(LeasePolicy {
        lease: ms(p.lease_ms, d.lease),
        renew_every: ms(p.renew_every_ms, d.renew_every),
        attempt_deadline: ms(p.attempt_deadline_ms, d.attempt_deadline),
        final_grace: ms(p.final_grace_ms, d.final_grace),
        adapter_timeout: ms(p.adapter_timeout_ms, d.adapter_timeout),
        max_attempts: if p.max_attempts == 0 {
            d.max_attempts
        } else {
            p.max_attempts
        },
        schedule_to_start: Duration::from_millis(p.schedule_to_start_ms),
        retry: RetryPolicy {
            initial_backoff: ms(p.initial_backoff_ms, d.retry.initial_backoff),
            max_backoff: ms(p.max_backoff_ms, d.retry.max_backoff),
            backoff_multiplier: if p.backoff_multiplier == 0.0 {
                d.retry.backoff_multiplier
            } else {
                Multiplier(p.backoff_multiplier)
            },
            retryable_statuses: StatusSet::parse(p.retryable_statuses)?,
            max_waits: p.max_waits,
            max_wait: ms(p.max_wait_ms, d.retry.max_wait),
        },
    })
}

/// Turns a submission into the store's form, naming the first bad field.
pub fn new_workflow(req: pb::SubmitRequest) -> Result<NewWorkflow, Status> {
    let client_key =
        ClientKey::parse(req.client_key).map_err(|e| invalid("client_key", e.reason))?;
    let mut steps = Vec::with_capacity(req.steps.len());
    for (i, s) in req.steps.into_iter().enumerate() {
        let name =
            StepName::parse(s.name).map_err(|e| invalid(format!("steps[{i}].name"), e.reason))?;
        // an input left out (or null) is an empty object
        let input = match s.input_json.trim() {
            "" => serde_json::Value::Object(Default::default()),
            text => match serde_json::from_str(text)
                .map_err(|e| invalid(format!("steps[{i}].input_json"), format!("not JSON: {e}")))?
            {
                serde_json::Value::Null => serde_json::Value::Object(Default::default()),
                v => v,
            },
        };
        let depends_on = s
            .depends_on
            .into_iter()
            .enumerate()
            .map(|(j, d)| {
                StepName::parse(d)
                    .map_err(|e| invalid(format!("steps[{i}].depends_on[{j}]"), e.reason))
            })
            .collect::<Result<_, _>>()?;
        if let Some(c) = s
            .operation
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':')))
        {
            return Err(invalid(
                format!("steps[{i}].operation"),
                format!(
                    "{:?} holds {c:?}: use letters, digits, '-', '_', '.' and ':'",
                    s.operation
                ),
            ));
        }
        if s.operation == z29c_core::capability::STATUS_QUERY_CLASS {
            return Err(invalid(
                format!("steps[{i}].operation"),
                "status_query is the operation class status queries take their permits in",
            ));
        }
        steps.push(NewStep {
            name,
            adapter: s.adapter,
            operation: s.operation,
            input,
            depends_on,
            policy: policy_from_wire(s.policy)
                .map_err(|e| invalid(format!("steps[{i}].policy.{}", e.field), e.reason))?,
        });
    }
    let deadline = req
        .deadline
        .map(|t| {
            chrono::DateTime::from_timestamp(t.seconds, t.nanos.max(0) as u32)
                .ok_or_else(|| invalid("deadline", "out of range"))
        })
        .transpose()?;
    Ok(NewWorkflow {
        client_key,
        name: req.name,
        deadline,
        steps,
        trace_context: None,
    })
}

pub fn step_to_wire(s: &StepDetail, events: Vec<pb::StepEvent>) -> pb::Step {
    let product = s.product_state();
    pb::Step {
        id: s.id.to_string(),
        name: s.name.clone(),
        adapter: s.adapter.clone(),
        operation: s.operation.clone(),
        state: product_to_wire(product) as i32,
        state_label: product.label().into(),
        receipt: s.receipt.as_ref().map(|r| pb::Receipt {
            request_identity: r.request_identity.clone(),
            external_reference: r.external_reference.clone().unwrap_or_default(),
            outcome: r.outcome.to_string(),
            verification: match r.verification {
                z29c_core::Verification::Direct => pb::Verification::Direct,
                z29c_core::Verification::StatusQuery => pb::Verification::StatusQuery,
                z29c_core::Verification::LateEvidence => pb::Verification::LateEvidence,
                z29c_core::Verification::Manual => pb::Verification::Manual,
            } as i32,
            input_digest: r.input_digest.clone(),
            adapter: r.adapter.clone(),
            adapter_version: r.adapter_version.clone(),
            committed_at: Some(timestamp(r.committed_at)),
        }),
        technical: Some(pb::TechnicalDetails {
            step_state: s.state.to_string(),
            lease_version: s.lease_version.get(),
            lease_owner: s.lease_owner.clone().unwrap_or_default(),
            lease_expires_at: s.lease_expires_at.map(timestamp),
            checkpoint: s.checkpoint.map(|c| c.to_string()).unwrap_or_default(),
            attempts: u32::try_from(s.calls_begun).unwrap_or(0),
            events,
            given_back: u32::try_from(i64::from(s.attempts_made) - s.calls_begun).unwrap_or(0),
            waits: u32::try_from(s.waits).unwrap_or(0),
        }),
        input_json: s.input.to_string(),
        result_json: s
            .receipt
            .as_ref()
            .map(|r| r.observed_result.to_string())
            .unwrap_or_default(),
        reason: s.reason.clone().unwrap_or_default(),
        depends_on: s.depends_on.clone(),
        next_attempt_at: s
            .waiting_for_eligibility
            .then(|| timestamp(s.next_eligible_at)),
    }
}

pub fn workflow_to_wire(w: &WorkflowDetail, steps: Vec<pb::Step>) -> pb::Workflow {
    let product = w.product_state();
    pb::Workflow {
        id: w.id.to_string(),
        client_key: w.client_key.clone(),
        name: w.name.clone(),
        state: product_to_wire(product) as i32,
        state_label: product.label().into(),
        steps,
        created_at: Some(timestamp(w.created_at)),
        deadline: w.deadline.map(timestamp),
        reason: w.reason.clone().unwrap_or_default(),
    }
}

/// The longest call every registered gateway serving `adapter` lets run, if any says.
fn call_limit(gateways: &[GatewayRecord], adapter: &str) -> Option<Duration> {
    gateways
        .iter()
        .filter(|g| g.adapters.iter().any(|a| a.name == adapter))
        .filter_map(|g| g.max_call_ms)
        .min()
        .map(Duration::from_millis)
}

fn parse_id(field: &str, s: &str) -> Result<WorkflowId, Status> {
    s.parse()
        .map_err(|e: z29c_core::ParseError| invalid(field, e.reason))
}

impl Workflows {
    async fn detail(&self, id: WorkflowId, with_events: bool) -> Result<pb::Workflow, Status> {
        let w = self.store.workflow(id).await.map_err(status_from_store)?;
        let mut steps = Vec::with_capacity(w.steps.len());
        for s in &w.steps {
            let events = if with_events {
                self.store
                    .step_events(s.id)
                    .await
                    .map_err(status_from_store)?
                    .into_iter()
                    .map(|e| pb::StepEvent {
                        kind: e.kind,
                        lease_version: e.lease_version,
                        attempt_id: e.attempt_id.map(|a| a.to_string()).unwrap_or_default(),
                        detail_json: e.detail.to_string(),
                        at: Some(timestamp(e.at)),
                        owner: e.owner.unwrap_or_default(),
                    })
                    .collect()
            } else {
                Vec::new()
            };
            steps.push(step_to_wire(s, events));
        }
        Ok(workflow_to_wire(&w, steps))
    }

    /// Refuses a submission a gateway cannot carry out: an adapter no registered gateway
    /// serves, a retry of refusals at an adapter that does not de-duplicate, a call longer
    /// than a serving gateway allows. An acceptance goes by a read of the registry at most
    /// [`z29c_bus::gateways::REFRESH`] old; a refusal by a read made for it, so a gateway
    /// registered since counts, and only once the adapter has been out of the registry for
    /// longer than the grace. An unreadable registry is `UNAVAILABLE`, never "not served".
    async fn check_adapters(&self, wf: &NewWorkflow) -> Result<(), Status> {
        let unserved = |gateways: &[GatewayRecord]| {
            let adapter =
                self.first_unserved(gateways, wf.steps.iter().map(|s| s.adapter.as_str()))?;
            wf.steps.iter().position(|s| s.adapter == adapter)
        };
        let unreadable = |e: z29c_bus::BusError| {
            Status::unavailable(format!("gateway registry unavailable: {e}"))
        };
        let mut gateways = self
            .gateways
            .records(z29c_bus::gateways::REFRESH)
            .await
            .map_err(unreadable)?;
        if unserved(&gateways).is_some() {
            gateways = self
                .gateways
                .records(Duration::ZERO)
                .await
                .map_err(unreadable)?;
        }
        if let Some(i) = unserved(&gateways) {
            let mut served: Vec<&str> = gateways
                .iter()
                .flat_map(|g| g.adapters.iter().map(|a| a.name.as_str()))
                .collect();
            served.sort_unstable();
            served.dedup();
            let served = if served.is_empty() {
                "no gateway is registered".to_owned()
            } else {
                format!("served: {}", served.join(", "))
            };
            return Err(Status::failed_precondition(format!(
                "steps[{i}].adapter: no gateway serves adapter {:?} ({served}); start a gateway that serves it and submit again",
                wf.steps[i].adapter
            )));
        }
        // a step's call must fit every gateway it may be sent to: none cuts it short; and a
        // refusal is sent again only where every gateway's adapter de-duplicates
        for (i, s) in wf.steps.iter().enumerate() {
            if !s.policy.retry.retryable_statuses.is_empty()
                && let Some(capability) = gateways
                    .iter()
                    .flat_map(|g| &g.adapters)
                    .filter(|a| a.name == s.adapter)
                    .map(|a| a.capability)
                    .find(|c| *c != z29c_core::AdapterCapability::Idempotent)
            {
                return Err(invalid(
                    format!("steps[{i}].policy.retryable_statuses"),
                    format!(
                        "adapter {:?} is {capability}: a refusal is sent again only to an idempotent adapter, which de-duplicates by request identity",
                        s.adapter
                    ),
                ));
            }
            if let Some(max_call) = call_limit(&gateways, &s.adapter) {
                s.policy
                    .fits_call_limit(max_call)
                    .map_err(|e| invalid(format!("steps[{i}].policy.{}", e.field), e.reason))?;
            }
        }
        Ok(())
    }

    async fn submit_traced(
        &self,
        request: Request<pb::SubmitRequest>,
        audit: ChangeAudit,
    ) -> Result<Response<pb::SubmitResponse>, Status> {
        let mut wf = new_workflow(request.into_inner())?;
        wf.trace_context = z29c_telemetry::trace::current_traceparent();
        let steps = wf.steps.len();
        let prepared = Prepared::new(wf, &self.limits).map_err(status_from_store)?;
        let submitted = match self.check_adapters(prepared.workflow()).await {
            Ok(()) => match &self.submissions {
                Some(batches) => {
                    batches
                        .submit_audited(prepared, audit.entry().cloned())
                        .await
                }
                None => self.store.submit_audited(&prepared, audit.entry()).await,
            }
            .map_err(status_from_store)?,
            // a retried submit is answered with the workflow it created, even when its
            // adapter is no longer served
            Err(refused) => self
                .store
                .earlier_submission(&prepared)
                .await
                .map_err(status_from_store)?
                .ok_or(refused)?,
        };
        if submitted.created {
            // the statement that created the workflow wrote its audit row; a submission that
            // changed nothing (the same key and payload again) is recorded through the queue
            // as the entry drops
            audit.written();
            self.relay_wake.notify_one();
        }
        tracing::Span::current().record("workflow", tracing::field::display(&submitted.workflow));
        tracing::info!(workflow = %submitted.workflow, created = submitted.created, steps, "workflow submitted");
        z29c_telemetry::metrics::counter!(
            z29c_telemetry::WORKFLOW_SUBMISSIONS,
            "created" => if submitted.created { "true" } else { "false" }
        )
        .increment(1);
        // a new workflow is answered as its commit left it, without reading it back; an
        // earlier submission of the same key is read as it is now
        let workflow = match &submitted.detail {
            Some(w) => workflow_to_wire(
                w,
                w.steps
                    .iter()
                    .map(|s| step_to_wire(s, Vec::new()))
                    .collect(),
            ),
            None => self.detail(submitted.workflow, false).await?,
        };
        Ok(Response::new(pb::SubmitResponse {
            workflow: Some(workflow),
            created: submitted.created,
        }))
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::WorkflowEvent, Status>> + Send>>;

#[tonic::async_trait]
impl WorkflowService for Workflows {
    async fn submit(
        &self,
        request: Request<pb::SubmitRequest>,
    ) -> Result<Response<pb::SubmitResponse>, Status> {
        let (_, audit) = self
            .guard
            .admit_change(&request, "Submit", Action::Submit)
            .await?;
        // the submission is the root of the workflow's trace (or joins the caller's)
        let span = tracing::info_span!(
            "workflow.submit",
            workflow = tracing::field::Empty,
            trace_id = tracing::field::Empty
        );
        z29c_telemetry::trace::set_parent(
            &span,
            z29c_telemetry::trace::grpc_traceparent(&request).as_deref(),
        );
        self.submit_traced(request, audit).instrument(span).await
    }

    async fn get(
        &self,
        request: Request<pb::GetRequest>,
    ) -> Result<Response<pb::Workflow>, Status> {
        self.guard.admit(&request, "Get", Action::Read).await?;
        let id = parse_id("workflow_id", &request.into_inner().workflow_id)?;
        Ok(Response::new(self.detail(id, true).await?))
    }

    async fn list(
        &self,
        request: Request<pb::ListRequest>,
    ) -> Result<Response<pb::ListResponse>, Status> {
        self.guard.admit(&request, "List", Action::Read).await?;
        let req = request.into_inner();
        let size = if req.page_size == 0 {
            50
        } else {
            req.page_size.min(500)
        } as i64;
        let before = if req.page_token.is_empty() {
            None
        } else {
            Some(parse_id("page_token", &req.page_token)?)
        };
        let states = req
            .states
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                pb::ProductState::try_from(s)
                    .ok()
                    .and_then(product_from_wire)
                    .ok_or_else(|| invalid(format!("states[{i}]"), format!("no product state {s}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let text = |s: String| Some(s.trim().to_owned()).filter(|s| !s.is_empty());
        let filter = WorkflowFilter {
            states,
            name: text(req.name),
            search: text(req.search),
        };
        let page = self
            .store
            .list_workflows(size, before, &filter)
            .await
            .map_err(status_from_store)?;
        let next_page_token = page.next.map(|w| w.to_string()).unwrap_or_default();
        let workflows = page
            .workflows
            .iter()
            .map(|w| workflow_to_wire(w, w.steps.iter().map(|s| step_to_wire(s, vec![])).collect()))
            .collect();
        Ok(Response::new(pb::ListResponse {
            workflows,
            next_page_token,
        }))
    }

    async fn cancel(
        &self,
        request: Request<pb::CancelRequest>,
    ) -> Result<Response<pb::Workflow>, Status> {
        let (_, audit) = self
            .guard
            .admit_change(&request, "Cancel", Action::Cancel)
            .await?;
        let req = request.into_inner();
        let id = parse_id("workflow_id", &req.workflow_id)?;
        let reason = if req.reason.trim().is_empty() {
            "cancelled by request".to_owned()
        } else {
            req.reason
        };
        self.store
            .cancel_workflow_audited(id, &reason, audit.entry())
            .await
            .map_err(status_from_store)?;
        audit.written();
        Ok(Response::new(self.detail(id, false).await?))
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        self.guard.admit(&request, "Watch", Action::Read).await?;
        let id = parse_id("workflow_id", &request.into_inner().workflow_id)?;
        // fail fast on an unknown workflow
        self.store.workflow(id).await.map_err(status_from_store)?;
        let store = self.store.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            let mut last: Option<(ProductState, Vec<ProductState>)> = None;
            loop {
                let w = match store.workflow(id).await {
                    Ok(w) => w,
                    Err(e) => {
                        let _ = tx.send(Err(status_from_store(e))).await;
                        return;
                    }
                };
                let now = (
                    w.product_state(),
                    w.steps
                        .iter()
                        .map(StepDetail::product_state)
                        .collect::<Vec<_>>(),
                );
                if last.as_ref() != Some(&now) {
                    // one event per step whose product state changed, then the workflow's own
                    let mut events: Vec<(String, i32)> = w
                        .steps
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| {
                            last.as_ref()
                                .is_none_or(|(_, prev)| prev.get(*i) != Some(&now.1[*i]))
                        })
                        .map(|(i, s)| (s.name.clone(), product_to_wire(now.1[i]) as i32))
                        .collect();
                    if events.is_empty() {
                        events.push((String::new(), 0));
                    }
                    for (step_name, step_state) in events {
                        let event = pb::WorkflowEvent {
                            workflow_id: id.to_string(),
                            state: product_to_wire(now.0) as i32,
                            state_label: now.0.label().into(),
                            step_name,
                            step_state,
                            at: Some(timestamp(chrono::Utc::now())),
                        };
                        if tx.send(Ok(event)).await.is_err() {
                            return;
                        }
                    }
                    last = Some(now);
                }
                let finished = matches!(
                    w.product_state(),
                    ProductState::Completed | ProductState::Failed | ProductState::Cancelled
                );
                if finished {
                    return;
                }
                // a watcher that went away (a workflow in review may wait for days) stops
                // the polling at once
                tokio::select! {
                    _ = tx.closed() => return,
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(name: &str) -> pb::StepDefinition {
        pb::StepDefinition {
            name: name.into(),
            adapter: "http".into(),
            operation: "charge".into(),
            ..Default::default()
        }
    }

    fn submission(steps: Vec<pb::StepDefinition>) -> pb::SubmitRequest {
        pb::SubmitRequest {
            client_key: "order-7".into(),
            name: "checkout".into(),
            steps,
            deadline: None,
        }
    }

    /// The field an `INVALID_ARGUMENT` names, before its reason.
    fn refused_field(req: pb::SubmitRequest) -> String {
        let status = new_workflow(req).expect_err("refused");
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        status
            .message()
            .split_once(':')
            .map(|(f, _)| f.to_owned())
            .unwrap_or_default()
    }

    #[test]
    fn a_submission_becomes_the_stores_form_with_an_empty_input_as_an_object() {
        let mut charge = step("charge");
        charge.input_json = r#"{"amount": 12}"#.into();
        let mut ship = step("ship");
        ship.depends_on = vec!["charge".into()];
        let w = new_workflow(submission(vec![charge, ship])).unwrap();
        assert_eq!(w.client_key.as_str(), "order-7");
        assert_eq!(w.steps[0].input, serde_json::json!({ "amount": 12 }));
        assert_eq!(w.steps[1].input, serde_json::json!({}));
        assert_eq!(w.steps[1].depends_on[0].as_str(), "charge");
    }

    #[test]
    fn each_bad_field_is_named_with_its_place() {
        let mut bad_key = submission(vec![step("a")]);
        bad_key.client_key = String::new();
        assert_eq!(refused_field(bad_key), "client_key");

        assert_eq!(
            refused_field(submission(vec![step("a"), step("")])),
            "steps[1].name"
        );

        let mut bad_input = step("a");
        bad_input.input_json = "{not json".into();
        assert_eq!(
            refused_field(submission(vec![bad_input])),
            "steps[0].input_json"
        );

        let mut bad_dep = step("a");
        bad_dep.depends_on = vec!["b".into(), String::new()];
        assert_eq!(
            refused_field(submission(vec![bad_dep])),
            "steps[0].depends_on[1]"
        );

        let mut far = submission(vec![step("a")]);
        far.deadline = Some(prost_types::Timestamp {
            seconds: i64::MAX,
            nanos: 0,
        });
        assert_eq!(refused_field(far), "deadline");

        let mut unretryable = step("a");
        unretryable.policy = Some(pb::LeasePolicy {
            retryable_statuses: vec![408, 503],
            ..Default::default()
        });
        assert_eq!(
            refused_field(submission(vec![step("b"), unretryable])),
            "steps[1].policy.retryable_statuses"
        );
    }

    #[test]
    fn a_policy_field_left_at_zero_takes_the_default() {
        let d = LeasePolicy::default();
        assert_eq!(policy_from_wire(None).unwrap(), d);
        let p = policy_from_wire(Some(pb::LeasePolicy {
            lease_ms: 3_000,
            max_attempts: 0,
            ..Default::default()
        }))
        .unwrap();
        assert_eq!(p.retry, d.retry);
        assert_eq!(p.lease, Duration::from_millis(3_000));
        assert_eq!(p.max_attempts, d.max_attempts);
        assert_eq!(p.adapter_timeout, d.adapter_timeout);
    }

    fn gateway(adapter: &str, max_call_ms: Option<u64>) -> GatewayRecord {
        GatewayRecord {
            id: format!("gw-{max_call_ms:?}"),
            endpoint: "http://127.0.0.1:1".into(),
            adapters: vec![z29c_bus::AdapterRecord {
                name: adapter.into(),
                version: "1".into(),
                capability: z29c_core::AdapterCapability::Idempotent,
            }],
            max_call_ms,
        }
    }

    #[test]
    fn the_call_limit_is_the_least_of_the_gateways_that_serve_the_adapter() {
        let gateways = [
            gateway("http", Some(60_000)),
            gateway("http", Some(30_000)),
            gateway("http", None),
            gateway("ledger", Some(5_000)),
        ];
        assert_eq!(
            call_limit(&gateways, "http"),
            Some(Duration::from_millis(30_000))
        );
        assert_eq!(call_limit(&gateways, "mail"), None);
        assert_eq!(call_limit(&[gateway("http", None)], "http"), None);
    }

    #[test]
    fn every_product_state_has_its_wire_name() {
        for (state, wire) in [
            (ProductState::Preparing, pb::ProductState::Preparing),
            (ProductState::NeedsReview, pb::ProductState::NeedsReview),
            (ProductState::Completed, pb::ProductState::Completed),
            (ProductState::Cancelled, pb::ProductState::Cancelled),
        ] {
            assert_eq!(product_to_wire(state), wire);
        }
    }
}
