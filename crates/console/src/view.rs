//! What the console and `z29c review` show, built from the public gRPC answers. A workflow is
//! one item and a step is one row whatever happened to its leases: lease history, attempts,
//! checkpoints, evidence and recovery decisions are the step's technical details.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use z29c_core::ProductState;
use z29c_core::projection::{Happening, timeline};
use z29c_proto::v1 as pb;

/// One workflow in the list.
#[derive(Debug, Clone, Serialize)]
pub struct WorkflowRow {
    pub id: String,
    pub name: String,
    pub client_key: String,
    /// `ProductState::as_str`, e.g. `needs_review`.
    pub state: &'static str,
    /// The wording a person reads, e.g. "Delivery status needs review".
    pub label: &'static str,
    pub created_at: Option<DateTime<Utc>>,
    pub steps: usize,
    pub steps_completed: usize,
}

/// One workflow with every step's timeline and technical details.
#[derive(Debug, Clone, Serialize)]
pub struct WorkflowView {
    #[serde(flatten)]
    pub row: WorkflowRow,
    pub deadline: Option<DateTime<Utc>>,
    /// Why the workflow failed or was cancelled; empty otherwise.
    pub reason: String,
    /// Whether it has not ended as far as its product state says, so the cancel form is
    /// offered (the scheduler still refuses a workflow that ended with a step under review).
    pub cancellable: bool,
    pub step_views: Vec<StepView>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StepView {
    pub id: String,
    pub name: String,
    pub adapter: String,
    pub operation: String,
    pub state: &'static str,
    pub label: &'static str,
    /// Why the step failed, waits for a person, or has an unknown outcome; empty otherwise.
    pub reason: String,
    /// Whether [`Self::reason`] is what a person must read first (see [`needs_attention`]).
    pub attention: bool,
    /// The steps whose results this one waits for.
    pub depends_on: Vec<String>,
    /// What the step sends, indented ([`pretty_json`]); `None` when not known.
    pub input: Option<String>,
    /// What the external system answered, indented, once the step has its receipt.
    pub result: Option<String>,
    pub receipt: Option<ReceiptView>,
    /// Product states in order; worker churn never adds an entry.
    pub timeline: Vec<TimelineEntry>,
    pub technical: Technical,
}

#[derive(Debug, Clone, Serialize)]
pub struct ReceiptView {
    pub outcome: String,
    pub external_reference: String,
    pub verification: &'static str,
    pub request_identity: String,
    pub adapter_version: String,
    pub committed_at: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TimelineEntry {
    pub state: &'static str,
    pub label: &'static str,
    pub at: Option<DateTime<Utc>>,
}

/// What an engineer needs to diagnose a step, kept apart from what a person is told.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Technical {
    pub step_state: String,
    pub lease_version: i64,
    pub lease_owner: String,
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub checkpoint: String,
    /// Attempts whose call began and was not given back.
    pub attempts_made: u32,
    /// Claims given back without an attempt, and of those the waits.
    pub given_back: u32,
    pub waits: u32,
    /// Grants, takeovers, expiries and releases (renewals are counted, not listed).
    pub leases: Vec<EventView>,
    pub renewals: usize,
    pub attempts: Vec<AttemptView>,
    /// Results observed after a lease was lost: evidence, never state.
    pub evidence: Vec<EventView>,
    /// Recovery decisions, review openings and resolutions, refused writes.
    pub decisions: Vec<EventView>,
}

#[derive(Debug, Clone, Serialize)]
pub struct AttemptView {
    pub attempt_id: String,
    pub lease_version: i64,
    pub owner: String,
    /// Checkpoints reached, in order, with when.
    pub checkpoints: Vec<(String, Option<DateTime<Utc>>)>,
}

#[derive(Debug, Clone, Serialize)]
pub struct EventView {
    pub kind: String,
    pub lease_version: i64,
    pub owner: String,
    pub attempt_id: String,
    pub at: Option<DateTime<Utc>>,
    pub detail: Value,
}

/// One open review item with what a person needs to decide it.
#[derive(Debug, Clone, Serialize)]
pub struct ReviewView {
    pub id: String,
    pub version: i64,
    pub state: String,
    pub reason: String,
    pub created_at: Option<DateTime<Utc>>,
    pub workflow_id: String,
    pub workflow_name: String,
    pub workflow_label: &'static str,
    pub step_id: String,
    pub step_name: String,
    pub adapter: String,
    pub operation: String,
    pub request_identity: String,
    pub attempts_made: u32,
    /// What the step sent, indented: what a person looks for at the destination.
    pub input: Option<String>,
    /// Everything z29c holds about the step, oldest first: every attempt (whether it may have
    /// sent, the answer recorded on it), every late observation, every recovery decision.
    pub evidence: Vec<EvidenceView>,
}

/// One piece of a review item's evidence.
#[derive(Debug, Clone, Serialize)]
pub struct EvidenceView {
    pub at: Option<DateTime<Utc>>,
    pub kind: String,
    pub attempt: u32,
    pub may_have_sent: bool,
    pub outcome: String,
    pub external_reference: String,
    pub summary: String,
}

pub fn time(t: Option<&prost_types::Timestamp>) -> Option<DateTime<Utc>> {
    let t = t?;
    DateTime::from_timestamp(t.seconds, u32::try_from(t.nanos).unwrap_or(0))
}

/// The core product state behind a wire value (unspecified reads as preparing).
pub fn product(p: pb::ProductState) -> ProductState {
    use pb::ProductState as W;
    match p {
        W::Unspecified | W::Preparing => ProductState::Preparing,
        W::WaitingOnExternalService => ProductState::WaitingOnExternalService,
        W::RecoveringExecution => ProductState::RecoveringExecution,
        W::NeedsReview => ProductState::NeedsReview,
        W::Completed => ProductState::Completed,
        W::Failed => ProductState::Failed,
        W::Cancelled => ProductState::Cancelled,
    }
}

/// The wire value of a core product state.
pub fn wire(p: ProductState) -> pb::ProductState {
    use pb::ProductState as W;
    match p {
        ProductState::Preparing => W::Preparing,
        ProductState::WaitingOnExternalService => W::WaitingOnExternalService,
        ProductState::RecoveringExecution => W::RecoveringExecution,
        ProductState::NeedsReview => W::NeedsReview,
        ProductState::Completed => W::Completed,
        ProductState::Failed => W::Failed,
        ProductState::Cancelled => W::Cancelled,
    }
}

/// Whether a workflow in state `p` has ended: completed, failed or cancelled.
pub const fn ended(p: ProductState) -> bool {
    matches!(
        p,
        ProductState::Completed | ProductState::Failed | ProductState::Cancelled
    )
}

/// Whether a step's reason is the first thing a person must read: it failed, it waits for
/// them, or what happened at the destination is not known yet.
pub const fn needs_attention(p: ProductState) -> bool {
    matches!(
        p,
        ProductState::Failed | ProductState::NeedsReview | ProductState::RecoveringExecution
    )
}

/// JSON text as a person reads it: indented, or as it came when it is not JSON (shown, never
/// hidden: it is what z29c holds). Empty text is `None`.
pub fn pretty_json(text: &str) -> Option<String> {
    if text.trim().is_empty() {
        return None;
    }
    let pretty = serde_json::from_str::<Value>(text)
        .ok()
        .and_then(|v| serde_json::to_string_pretty(&v).ok());
    Some(pretty.unwrap_or_else(|| text.to_owned()))
}

fn verification(v: pb::Verification) -> &'static str {
    match v {
        pb::Verification::Unspecified => "unspecified",
        pb::Verification::Direct => "direct",
        pb::Verification::StatusQuery => "status_query",
        pb::Verification::LateEvidence => "late_evidence",
        pb::Verification::Manual => "manual",
    }
}

pub fn row(w: &pb::Workflow) -> WorkflowRow {
    let state = product(w.state());
    WorkflowRow {
        id: w.id.clone(),
        name: w.name.clone(),
        client_key: w.client_key.clone(),
        state: state.as_str(),
        label: state.label(),
        created_at: time(w.created_at.as_ref()),
        steps: w.steps.len(),
        steps_completed: w
            .steps
            .iter()
            .filter(|s| s.state() == pb::ProductState::Completed)
            .count(),
    }
}

pub fn workflow(w: &pb::Workflow) -> WorkflowView {
    let created = time(w.created_at.as_ref());
    WorkflowView {
        row: row(w),
        deadline: time(w.deadline.as_ref()),
        reason: w.reason.clone(),
        cancellable: !ended(product(w.state())),
        step_views: w.steps.iter().map(|s| step(s, created)).collect(),
    }
}

fn event(e: &pb::StepEvent) -> EventView {
    EventView {
        kind: e.kind.clone(),
        lease_version: e.lease_version,
        owner: e.owner.clone(),
        attempt_id: e.attempt_id.clone(),
        at: time(e.at.as_ref()),
        detail: serde_json::from_str(&e.detail_json).unwrap_or(Value::Null),
    }
}

fn checkpoint_of(e: &EventView) -> Option<&str> {
    e.detail.get("checkpoint").and_then(Value::as_str)
}

pub fn step(s: &pb::Step, workflow_created: Option<DateTime<Utc>>) -> StepView {
    let state = product(s.state());
    let t = s.technical.clone().unwrap_or_default();
    let events: Vec<EventView> = t.events.iter().map(event).collect();
    let happenings = events
        .iter()
        .map(|e| (Happening::of_event(&e.kind, checkpoint_of(e)), e.at));
    let ended = s
        .receipt
        .as_ref()
        .and_then(|r| time(r.committed_at.as_ref()))
        .or_else(|| events.last().and_then(|e| e.at));
    let timeline = timeline(workflow_created, happenings, (state, ended))
        .into_iter()
        .map(|(p, at)| TimelineEntry {
            state: p.as_str(),
            label: p.label(),
            at,
        })
        .collect();

    let mut technical = Technical {
        step_state: t.step_state.clone(),
        lease_version: t.lease_version,
        lease_owner: t.lease_owner.clone(),
        lease_expires_at: time(t.lease_expires_at.as_ref()),
        checkpoint: t.checkpoint.clone(),
        attempts_made: t.attempts,
        given_back: t.given_back,
        waits: t.waits,
        ..Technical::default()
    };
    for e in events {
        match e.kind.as_str() {
            "lease_renewed" => technical.renewals += 1,
            k if k.starts_with("lease_") || k == "recovery_lease_acquired" => {
                technical.leases.push(e);
            }
            "checkpoint" => {
                let cp = checkpoint_of(&e).unwrap_or("?").to_owned();
                match technical
                    .attempts
                    .iter_mut()
                    .find(|a| a.attempt_id == e.attempt_id)
                {
                    Some(a) => a.checkpoints.push((cp, e.at)),
                    None => technical.attempts.push(AttemptView {
                        attempt_id: e.attempt_id.clone(),
                        lease_version: e.lease_version,
                        owner: e.owner.clone(),
                        checkpoints: vec![(cp, e.at)],
                    }),
                }
            }
            "late_observation" => technical.evidence.push(e),
            "recovery_decision"
            | "review_opened"
            | "review_resolved"
            | "fenced_write_rejected"
            | "failed_by_policy"
            | "cancelled"
            | "rate_limited" => technical.decisions.push(e),
            _ => {}
        }
    }
    StepView {
        id: s.id.clone(),
        name: s.name.clone(),
        adapter: s.adapter.clone(),
        operation: s.operation.clone(),
        state: state.as_str(),
        label: state.label(),
        reason: s.reason.clone(),
        attention: needs_attention(state) && !s.reason.is_empty(),
        depends_on: s.depends_on.clone(),
        input: pretty_json(&s.input_json),
        result: pretty_json(&s.result_json),
        receipt: s.receipt.as_ref().map(|r| ReceiptView {
            outcome: r.outcome.clone(),
            external_reference: r.external_reference.clone(),
            verification: verification(r.verification()),
            request_identity: r.request_identity.clone(),
            adapter_version: r.adapter_version.clone(),
            committed_at: time(r.committed_at.as_ref()),
        }),
        timeline,
        technical,
    }
}

/// A review item with its workflow's and step's details (`w` is the item's workflow).
pub fn review(item: &pb::ReviewItem, w: Option<&pb::Workflow>) -> ReviewView {
    let created = w.and_then(|w| time(w.created_at.as_ref()));
    let step = w
        .and_then(|w| w.steps.iter().find(|s| s.id == item.step_id))
        .map(|s| step(s, created));
    let (adapter, operation, attempts_made, input) = match step {
        Some(s) => (s.adapter, s.operation, s.technical.attempts_made, s.input),
        None => Default::default(),
    };
    let evidence = item
        .evidence
        .iter()
        .map(|e| EvidenceView {
            at: time(e.at.as_ref()),
            kind: e.kind.clone(),
            attempt: e.attempt,
            may_have_sent: e.may_have_sent,
            outcome: e.outcome.clone(),
            external_reference: e.external_reference.clone(),
            summary: e.summary.clone(),
        })
        .collect();
    ReviewView {
        id: item.id.clone(),
        version: item.version,
        state: item.state.clone(),
        reason: item.reason.clone(),
        created_at: time(item.created_at.as_ref()),
        workflow_id: item.workflow_id.clone(),
        workflow_name: w.map(|w| w.name.clone()).unwrap_or_default(),
        workflow_label: w.map_or("", |w| product(w.state()).label()),
        step_id: item.step_id.clone(),
        step_name: item.step_name.clone(),
        adapter,
        operation,
        request_identity: item.request_identity.clone(),
        attempts_made,
        input,
        evidence,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: i64) -> Option<prost_types::Timestamp> {
        Some(prost_types::Timestamp {
            seconds: 1_700_000_000 + s,
            nanos: 0,
        })
    }

    fn ev(kind: &str, owner: &str, version: i64, detail: &str, at: i64) -> pb::StepEvent {
        pb::StepEvent {
            kind: kind.into(),
            lease_version: version,
            attempt_id: format!("a{version}"),
            detail_json: detail.into(),
            at: ts(at),
            owner: owner.into(),
        }
    }

    #[test]
    fn a_takeover_is_technical_detail_of_the_same_step() {
        let s = pb::Step {
            id: "s".into(),
            name: "charge".into(),
            state: pb::ProductState::Completed as i32,
            technical: Some(pb::TechnicalDetails {
                events: vec![
                    ev("lease_acquired", "executor-1", 1, "{}", 1),
                    ev(
                        "checkpoint",
                        "executor-1",
                        1,
                        r#"{"checkpoint":"attempt_created"}"#,
                        1,
                    ),
                    ev("lease_renewed", "executor-1", 1, "{}", 2),
                    ev("lease_expired", "executor-1", 1, "{}", 3),
                    ev("lease_acquired", "executor-2", 2, "{}", 4),
                    ev(
                        "checkpoint",
                        "executor-2",
                        2,
                        r#"{"checkpoint":"invocation_began"}"#,
                        5,
                    ),
                    ev("late_observation", "executor-1", 1, r#"{"outcome":"x"}"#, 6),
                ],
                ..Default::default()
            }),
            ..Default::default()
        };
        let v = step(&s, time(ts(0).as_ref()));
        let states: Vec<&str> = v.timeline.iter().map(|t| t.state).collect();
        assert_eq!(
            states,
            ["preparing", "waiting_on_external_service", "completed"]
        );
        assert_eq!(v.technical.leases.len(), 3);
        assert_eq!(v.technical.renewals, 1);
        let owners: Vec<&str> = v
            .technical
            .attempts
            .iter()
            .map(|a| a.owner.as_str())
            .collect();
        assert_eq!(owners, ["executor-1", "executor-2"]);
        assert_eq!(v.technical.evidence.len(), 1);
        assert_eq!(v.label, "Completed");
    }

    #[test]
    fn every_product_state_crosses_the_wire_and_back() {
        for &p in ProductState::ALL {
            assert_eq!(product(wire(p)), p);
        }
    }

    #[test]
    fn a_failed_steps_reason_comes_first_and_its_json_is_indented() {
        let s = pb::Step {
            state: pb::ProductState::Failed as i32,
            reason: "refused with 401: Invalid API Key provided".into(),
            input_json: r#"{"amount":900,"note":"<b>"}"#.into(),
            result_json: "not json at all".into(),
            depends_on: vec!["reserve".into()],
            ..Default::default()
        };
        let v = step(&s, None);
        assert!(v.attention);
        assert_eq!(v.reason, "refused with 401: Invalid API Key provided");
        assert_eq!(
            v.input.as_deref(),
            Some("{\n  \"amount\": 900,\n  \"note\": \"<b>\"\n}")
        );
        assert_eq!(
            v.result.as_deref(),
            Some("not json at all"),
            "kept as it came"
        );
        assert_eq!(v.depends_on, ["reserve"]);
        // a completed step's words are no alarm, and nothing known is nothing shown
        let done = step(
            &pb::Step {
                state: pb::ProductState::Completed as i32,
                reason: "resolved by rita".into(),
                ..Default::default()
            },
            None,
        );
        assert!(!done.attention);
        assert_eq!((done.input, done.result), (None, None));
    }

    #[test]
    fn only_a_workflow_that_has_not_ended_can_be_cancelled() {
        for &p in ProductState::ALL {
            let w = pb::Workflow {
                state: wire(p) as i32,
                ..Default::default()
            };
            let want = !matches!(
                p,
                ProductState::Completed | ProductState::Failed | ProductState::Cancelled
            );
            assert_eq!(workflow(&w).cancellable, want, "{p}");
        }
    }
}
