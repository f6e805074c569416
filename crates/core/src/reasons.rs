//! Why a step is where it is, in words a person reads: made from the step's receipt when it
//! has one, else from the latest event that explains its state. `None` where there is nothing
//! to explain (a step that completed, or runs as it should).

use serde_json::Value;

use crate::{Outcome, StepState, Verification};

/// A receipt's parts that explain a failure.
#[derive(Debug, Clone, Copy)]
pub struct ReceiptFacts<'a> {
    pub outcome: Outcome,
    pub verification: Verification,
    /// What the receipt recorded: the destination's answer, or a person's resolution.
    pub result: &'a Value,
}

/// The latest of the step's explaining events (kind as stored, and its detail).
#[derive(Debug, Clone, Copy)]
pub struct LastEvent<'a> {
    pub kind: &'a str,
    pub detail: &'a Value,
}

/// Everything a step's reason is made from.
#[derive(Debug, Clone, Copy)]
pub struct StepReasonFacts<'a> {
    pub state: StepState,
    pub adapter: &'a str,
    pub receipt: Option<ReceiptFacts<'a>>,
    pub last: Option<LastEvent<'a>>,
    /// The open review item's reason, when the step waits for a person.
    pub review: Option<&'a str>,
    /// Its current attempt's call may have begun.
    pub invoked: bool,
}

/// The event kinds a reason is read from, latest first. A lease taken again between the
/// turns of a wait does not end the wait, so `lease_acquired` is not among them.
pub const EXPLAINING_EVENTS: &[&str] = &[
    "failed_by_policy",
    "input_unresolved",
    "review_opened",
    "review_resolved",
    "cancelled",
    "rate_limited",
    "retry_scheduled",
    "lease_released",
    "lease_expired",
    "recovery_lease_acquired",
    "recovery_decision",
];

fn text<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key)
        .and_then(Value::as_str)
        .filter(|s| !s.trim().is_empty())
}

/// "401 Unauthorized", or the number alone for a status HTTP has no name for.
pub fn status_words(status: u64) -> String {
    u16::try_from(status)
        .ok()
        .and_then(|s| http::StatusCode::from_u16(s).ok())
        .and_then(|s| s.canonical_reason())
        .map_or_else(|| status.to_string(), |r| format!("{status} {r}"))
}

/// Why a refusal was final: "refused: 401 Unauthorized from payments: Invalid API Key".
fn refusal(adapter: &str, result: &Value) -> String {
    let status = result.get("status").and_then(Value::as_u64).unwrap_or(0);
    let said = text(result, "reason");
    match (status, said) {
        (0, Some(said)) => format!("refused before sending to {adapter}: {said}"),
        (0, None) => format!("refused before sending to {adapter}"),
        (s, Some(said)) => format!("refused: {} from {adapter}: {said}", status_words(s)),
        (s, None) => format!("refused: {} from {adapter}", status_words(s)),
    }
}

/// Why the step is where it is, or `None` when there is nothing to explain.
pub fn step_reason(f: &StepReasonFacts<'_>) -> Option<String> {
    if let Some(r) = f.receipt {
        return match (r.outcome, r.verification) {
            (Outcome::Succeeded, _) => None,
            (Outcome::Failed, Verification::Manual) => Some(match text(r.result, "reason") {
                Some(why) => match text(r.result, "resolved_by") {
                    Some(who) => format!("resolved as failed by {who}: {why}"),
                    None => format!("resolved as failed: {why}"),
                },
                None => "resolved as failed by a person".to_owned(),
            }),
            (Outcome::Failed, _) => Some(refusal(f.adapter, r.result)),
        };
    }
    let last = f.last;
    let said = |kinds: &[&str]| {
        last.filter(|e| kinds.contains(&e.kind))
            .and_then(|e| text(e.detail, "reason"))
    };
    match f.state {
        StepState::Completed => None,
        StepState::Failed => Some(
            said(&["failed_by_policy", "input_unresolved"])
                .unwrap_or("failed")
                .to_owned(),
        ),
        StepState::NeedsReview => Some(format!(
            "needs review: {}",
            f.review
                .or_else(|| said(&["review_opened"]))
                .unwrap_or("its outcome is unknown")
        )),
        StepState::Cancelled => Some(match said(&["cancelled"]) {
            Some(why) => format!("cancelled: {why}"),
            None => "cancelled".to_owned(),
        }),
        StepState::Blocked => None,
        // a call under way, its lease held: nothing to explain until it ends, unless it is
        // another turn of a wait or of a retried refusal
        StepState::Leased
            if f.invoked
                && !last.is_some_and(|e| matches!(e.kind, "rate_limited" | "retry_scheduled")) =>
        {
            None
        }
        StepState::Ready | StepState::Leased | StepState::Recovering => {
            let e = last?;
            match e.kind {
                "rate_limited" => Some(match text(e.detail, "why") {
                    Some(why) => format!("waiting: {why}"),
                    None => "waiting".to_owned(),
                }),
                "retry_scheduled" => Some(format!(
                    "{}; sending again under the same request identity",
                    refusal(f.adapter, e.detail)
                )),
                "lease_released" => {
                    text(e.detail, "surrendered").map(|why| format!("being recovered: {why}"))
                }
                "lease_expired" => Some(
                    "being recovered: its worker stopped renewing the lease before an answer was recorded"
                        .to_owned(),
                ),
                "recovery_decision" => {
                    let action = text(e.detail, "action").unwrap_or("decide");
                    let category = text(e.detail, "category").unwrap_or("an unknown outcome");
                    Some(format!(
                        "recovered from {}: {}",
                        category.replace('_', " "),
                        action.replace('_', " ")
                    ))
                }
                _ => None,
            }
        }
    }
}

/// Why a workflow failed or was cancelled: the cancellation's reason, else the first step
/// with a reason, named.
pub fn workflow_reason<'a>(
    cancel_reason: Option<&str>,
    steps: impl IntoIterator<Item = (&'a str, StepState, Option<&'a str>)>,
) -> Option<String> {
    if let Some(why) = cancel_reason.filter(|s| !s.trim().is_empty()) {
        return Some(format!("cancelled: {why}"));
    }
    let steps: Vec<_> = steps.into_iter().collect();
    // a step that failed explains its workflow before the steps stopped because of it
    let first = |wanted: StepState| {
        steps
            .iter()
            .find(|(_, state, reason)| *state == wanted && reason.is_some())
    };
    first(StepState::Failed)
        .or_else(|| first(StepState::NeedsReview))
        .map(|(name, _, reason)| format!("step {name}: {}", reason.unwrap_or_default()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn facts<'a>(
        state: StepState,
        receipt: Option<ReceiptFacts<'a>>,
        last: Option<LastEvent<'a>>,
    ) -> StepReasonFacts<'a> {
        StepReasonFacts {
            state,
            adapter: "payments",
            receipt,
            last,
            review: None,
            invoked: false,
        }
    }

    #[test]
    fn a_refusal_says_status_api_and_reason() {
        let result = json!({ "status": 401, "reason": "Invalid API Key provided" });
        let r = ReceiptFacts {
            outcome: Outcome::Failed,
            verification: Verification::Direct,
            result: &result,
        };
        assert_eq!(
            step_reason(&facts(StepState::Failed, Some(r), None)).unwrap(),
            "refused: 401 Unauthorized from payments: Invalid API Key provided"
        );
        let bare = json!({ "status": 422, "reason": "" });
        let r = ReceiptFacts { result: &bare, ..r };
        assert_eq!(
            step_reason(&facts(StepState::Failed, Some(r), None)).unwrap(),
            "refused: 422 Unprocessable Entity from payments"
        );
        let before = json!({ "status": 0, "reason": "input has no field amount" });
        let r = ReceiptFacts {
            result: &before,
            ..r
        };
        assert_eq!(
            step_reason(&facts(StepState::Failed, Some(r), None)).unwrap(),
            "refused before sending to payments: input has no field amount"
        );
        assert_eq!(status_words(499), "499");
        assert_eq!(status_words(70_000), "70000");
    }

    #[test]
    fn a_success_and_a_running_step_have_nothing_to_explain() {
        let result = json!({ "id": "ch_1" });
        let r = ReceiptFacts {
            outcome: Outcome::Succeeded,
            verification: Verification::Direct,
            result: &result,
        };
        assert_eq!(
            step_reason(&facts(StepState::Completed, Some(r), None)),
            None
        );
        let detail = json!({ "why": "rate limited by the destination" });
        let waited = LastEvent {
            kind: "rate_limited",
            detail: &detail,
        };
        let calling = StepReasonFacts {
            invoked: true,
            ..facts(StepState::Leased, None, Some(waited))
        };
        assert_eq!(
            step_reason(&calling).unwrap(),
            "waiting: rate limited by the destination",
            "another turn of the wait"
        );
        let decided = json!({ "category": "unknown_outcome", "action": "retry_same_identity" });
        let after_recovery = StepReasonFacts {
            last: Some(LastEvent {
                kind: "recovery_decision",
                detail: &decided,
            }),
            ..calling
        };
        assert_eq!(step_reason(&after_recovery), None, "a call under way");
        assert_eq!(
            step_reason(&facts(StepState::Leased, None, Some(waited))).unwrap(),
            "waiting: rate limited by the destination",
            "claimed again between the turns of its wait"
        );
        assert_eq!(step_reason(&facts(StepState::Blocked, None, None)), None);
        assert_eq!(step_reason(&facts(StepState::Ready, None, None)), None);
    }

    #[test]
    fn a_persons_resolution_names_them() {
        let result = json!({ "resolved_by": "ops@example.com", "reason": "bank says no" });
        let r = ReceiptFacts {
            outcome: Outcome::Failed,
            verification: Verification::Manual,
            result: &result,
        };
        assert_eq!(
            step_reason(&facts(StepState::Failed, Some(r), None)).unwrap(),
            "resolved as failed by ops@example.com: bank says no"
        );
    }

    #[test]
    fn failures_without_a_receipt_say_their_events_reason() {
        for kind in ["failed_by_policy", "input_unresolved"] {
            let detail = json!({ "reason": "waited 3 times, at most 2 allowed" });
            let e = LastEvent {
                kind,
                detail: &detail,
            };
            assert_eq!(
                step_reason(&facts(StepState::Failed, None, Some(e))).unwrap(),
                "waited 3 times, at most 2 allowed"
            );
        }
        assert_eq!(
            step_reason(&facts(StepState::Failed, None, None)).unwrap(),
            "failed"
        );
        let detail = json!({ "reason": "a step failed" });
        let e = LastEvent {
            kind: "cancelled",
            detail: &detail,
        };
        assert_eq!(
            step_reason(&facts(StepState::Cancelled, None, Some(e))).unwrap(),
            "cancelled: a step failed"
        );
    }

    #[test]
    fn review_says_the_items_reason_first() {
        let detail = json!({ "reason": "from the event" });
        let e = LastEvent {
            kind: "review_opened",
            detail: &detail,
        };
        let mut f = facts(StepState::NeedsReview, None, Some(e));
        assert_eq!(step_reason(&f).unwrap(), "needs review: from the event");
        f.review = Some("opaque adapter: the answer was lost");
        assert_eq!(
            step_reason(&f).unwrap(),
            "needs review: opaque adapter: the answer was lost"
        );
        f.last = None;
        f.review = None;
        assert_eq!(
            step_reason(&f).unwrap(),
            "needs review: its outcome is unknown"
        );
    }

    #[test]
    fn waiting_and_recovering_steps_say_why() {
        let cases = [
            (
                "rate_limited",
                json!({ "why": "rate limited by the destination" }),
                Some("waiting: rate limited by the destination"),
            ),
            (
                "retry_scheduled",
                json!({ "status": 408, "reason": "slow" }),
                Some(
                    "refused: 408 Request Timeout from payments: slow; sending again under the same request identity",
                ),
            ),
            (
                "lease_released",
                json!({ "surrendered": "outcome unknown: no answer within 1759 ms" }),
                Some("being recovered: outcome unknown: no answer within 1759 ms"),
            ),
            ("lease_released", json!({ "retry_after_ms": 5 }), None),
            (
                "recovery_decision",
                json!({ "category": "unknown_outcome", "action": "query_status" }),
                Some("recovered from unknown outcome: query status"),
            ),
            ("recovery_lease_acquired", json!({}), None),
        ];
        for (kind, detail, want) in cases {
            let e = LastEvent {
                kind,
                detail: &detail,
            };
            assert!(EXPLAINING_EVENTS.contains(&kind));
            for state in [StepState::Ready, StepState::Leased, StepState::Recovering] {
                assert_eq!(
                    step_reason(&facts(state, None, Some(e))).as_deref(),
                    want,
                    "{kind} {state}"
                );
            }
        }
        let detail = json!({});
        let e = LastEvent {
            kind: "lease_expired",
            detail: &detail,
        };
        assert!(
            step_reason(&facts(StepState::Recovering, None, Some(e)))
                .unwrap()
                .starts_with("being recovered")
        );
    }

    #[test]
    fn a_workflow_says_its_cancellation_or_its_first_failed_step() {
        assert_eq!(
            workflow_reason(Some("customer asked"), []).unwrap(),
            "cancelled: customer asked"
        );
        let steps = [
            ("reserve", StepState::Completed, None),
            ("ship", StepState::NeedsReview, Some("needs review: lost")),
            (
                "charge",
                StepState::Failed,
                Some("refused: 401 Unauthorized"),
            ),
            (
                "notify",
                StepState::Cancelled,
                Some("cancelled: a step failed"),
            ),
        ];
        assert_eq!(
            workflow_reason(Some(" "), steps).unwrap(),
            "step charge: refused: 401 Unauthorized"
        );
        assert_eq!(
            workflow_reason(None, steps.into_iter().filter(|s| s.0 != "charge")).unwrap(),
            "step ship: needs review: lost"
        );
        assert_eq!(
            workflow_reason(None, [("a", StepState::Completed, None)]),
            None
        );
    }
}
