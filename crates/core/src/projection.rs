//! `project()`: durable state to the product states a person sees (docs/design.md §7). Worker
//! churn never shows: a takeover changes nothing visible unless what is *known* changed.

use serde::{Deserialize, Serialize};

use crate::checkpoint::Checkpoint;
use crate::state::{AttemptState, Outcome, StepState, WorkflowState};
use crate::text_enum::text_enum;

text_enum! {
    /// What a person is told about a step or a workflow.
    pub enum ProductState("product state") {
        Preparing = "preparing",
        WaitingOnExternalService = "waiting_on_external_service",
        RecoveringExecution = "recovering_execution",
        NeedsReview = "needs_review",
        Completed = "completed",
        Failed = "failed",
        Cancelled = "cancelled",
    }
}

impl ProductState {
    /// The wording shown in the console and the CLI.
    pub const fn label(self) -> &'static str {
        match self {
            Self::Preparing => "Preparing",
            Self::WaitingOnExternalService => "Waiting on an external service",
            Self::RecoveringExecution => "Recovering execution",
            Self::NeedsReview => "Delivery status needs review",
            Self::Completed => "Completed",
            Self::Failed => "Failed",
            Self::Cancelled => "Cancelled",
        }
    }

    /// Order of attention when several steps of one workflow differ: a person is shown the
    /// state that most needs them.
    const fn urgency(self) -> u8 {
        match self {
            Self::NeedsReview => 6,
            Self::RecoveringExecution => 5,
            Self::WaitingOnExternalService => 4,
            Self::Preparing => 3,
            Self::Failed => 2,
            Self::Cancelled => 1,
            Self::Completed => 0,
        }
    }
}

/// The durable facts about one step that its product state is computed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepFacts {
    pub state: StepState,
    /// The last durable checkpoint of the step's latest attempt, if it had one.
    pub checkpoint: Option<Checkpoint>,
    /// The latest attempt's state, if it had one.
    pub last_attempt: Option<AttemptState>,
    /// The receipt's outcome, if the step has its receipt.
    pub receipt: Option<Outcome>,
    /// The lease has passed `expires_at` by PostgreSQL's clock and nobody took it over yet.
    pub lease_expired: bool,
    /// `next_eligible_at` is in the future (a rate limit's retry-after).
    pub waiting_for_eligibility: bool,
    /// The step has been given back without sending at least once (rate limited, no permit,
    /// no gateway): until a call of it begins, it is waiting on an external service, also
    /// between its turns.
    #[serde(default)]
    pub has_waited: bool,
}

/// The product state of one step.
///
/// Only a receipt says *Completed*. Once an invocation may have begun, no state without a
/// receipt reads as finished: an unknown outcome shows as needing review, never as failed or
/// cancelled, because the external effect may exist.
pub fn project(f: &StepFacts) -> ProductState {
    use ProductState as P;
    match f.receipt {
        Some(Outcome::Succeeded) => return P::Completed,
        Some(Outcome::Failed) => return P::Failed,
        None => {}
    }
    let invoked = AttemptState::may_have_sent(f.checkpoint, f.last_attempt);
    match f.state {
        StepState::NeedsReview => P::NeedsReview,
        // terminal without a receipt: only honest when nothing can have been sent
        StepState::Completed => P::NeedsReview,
        StepState::Failed | StepState::Cancelled if invoked => P::NeedsReview,
        StepState::Failed => P::Failed,
        StepState::Cancelled => P::Cancelled,
        StepState::Blocked if !invoked => P::Preparing,
        // a wait goes on through the claims between its turns: one state for the whole wait
        StepState::Recovering | StepState::Leased if !invoked && f.has_waited => {
            P::WaitingOnExternalService
        }
        StepState::Recovering | StepState::Leased if !invoked => P::Preparing,
        StepState::Recovering => P::RecoveringExecution,
        StepState::Leased if f.lease_expired => P::RecoveringExecution,
        StepState::Leased => P::WaitingOnExternalService,
        // waiting for a turn (blocked steps never ran; the arm keeps impossible rows honest)
        StepState::Ready | StepState::Blocked if f.waiting_for_eligibility => {
            P::WaitingOnExternalService
        }
        StepState::Ready | StepState::Blocked
            if invoked && f.last_attempt == Some(AttemptState::Expired) =>
        {
            P::RecoveringExecution
        }
        StepState::Ready if f.has_waited => P::WaitingOnExternalService,
        StepState::Ready | StepState::Blocked => P::Preparing,
    }
}

/// The product state of a workflow from its own state and its steps' product states.
pub fn project_workflow(
    workflow: WorkflowState,
    steps: impl IntoIterator<Item = ProductState>,
) -> ProductState {
    let most_urgent = steps.into_iter().max_by_key(|s| s.urgency());
    match (workflow, most_urgent) {
        // an unknown outcome outlives the workflow's end: someone still has to look
        (_, Some(ProductState::NeedsReview)) => ProductState::NeedsReview,
        (WorkflowState::Completed, _) => ProductState::Completed,
        (WorkflowState::Failed, _) => ProductState::Failed,
        (WorkflowState::Cancelled, _) => ProductState::Cancelled,
        (WorkflowState::Running, None) => ProductState::Preparing,
        (WorkflowState::Running, Some(ProductState::Completed)) => ProductState::Completed,
        // a running workflow whose steps all ended is being wound up
        (WorkflowState::Running, Some(ProductState::Failed | ProductState::Cancelled)) => {
            ProductState::Preparing
        }
        (WorkflowState::Running, Some(s)) => s,
    }
}

/// Something in a step's history that a person may notice. Everything else a step records
/// (lease grants and renewals, a takeover before anything was sent, rejected writes, late
/// evidence) is technical detail and never moves the visible timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Happening {
    /// An invocation may have begun (checkpoint `invocation_began`).
    Invoked,
    /// The adapter said "not now", or refused in a way the step's policy retries: the step
    /// waits for its turn.
    RateLimited,
    /// The worker's lease ended without a result (expired, or taken by recovery).
    LeaseLost,
    /// The step now waits for a person.
    ReviewOpened,
    /// A lease or checkpoint change a person need not see.
    Churn,
}

impl Happening {
    /// Reads a step event's `kind` (and, for checkpoints, its checkpoint name).
    pub fn of_event(kind: &str, checkpoint: Option<&str>) -> Self {
        match (kind, checkpoint) {
            ("checkpoint", Some("invocation_began")) => Self::Invoked,
            ("rate_limited" | "retry_scheduled", _) => Self::RateLimited,
            ("lease_expired" | "recovery_lease_acquired", _) => Self::LeaseLost,
            ("review_opened", _) => Self::ReviewOpened,
            _ => Self::Churn,
        }
    }
}

/// A step's visible timeline: product states in order, each with when it began. It starts
/// *Preparing* at `created`, follows what a person may notice, and ends in `now` (the step's
/// current product state). Consecutive repeats collapse, so worker churn shows as nothing and
/// a takeover after an invocation as one *Recovering execution* entry, never a new item.
pub fn timeline<T: Copy>(
    created: T,
    happenings: impl IntoIterator<Item = (Happening, T)>,
    now: (ProductState, T),
) -> Vec<(ProductState, T)> {
    let mut out: Vec<(ProductState, T)> = vec![(ProductState::Preparing, created)];
    let push = |out: &mut Vec<(ProductState, T)>, state: ProductState, at: T| {
        if out.last().map(|(s, _)| *s) != Some(state) {
            out.push((state, at));
        }
    };
    // whether something may have been sent since the step last started over
    let mut invoked = false;
    for (h, at) in happenings {
        match h {
            Happening::Invoked => {
                invoked = true;
                push(&mut out, ProductState::WaitingOnExternalService, at);
            }
            Happening::RateLimited => push(&mut out, ProductState::WaitingOnExternalService, at),
            Happening::LeaseLost if invoked => {
                push(&mut out, ProductState::RecoveringExecution, at);
            }
            Happening::ReviewOpened => push(&mut out, ProductState::NeedsReview, at),
            Happening::LeaseLost | Happening::Churn => {}
        }
    }
    push(&mut out, now.0, now.1);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_churn_leaves_the_timeline_alone() {
        use Happening as H;
        use ProductState as P;
        // claimed, renewed, released, claimed by another worker before anything was sent,
        // then sent once and answered: preparing, waiting, completed
        let t = timeline(
            0,
            [
                (H::Churn, 1),
                (H::Churn, 2),
                (H::LeaseLost, 3),
                (H::Churn, 4),
                (H::Invoked, 5),
                (H::Churn, 6),
            ],
            (P::Completed, 7),
        );
        assert_eq!(
            t,
            vec![
                (P::Preparing, 0),
                (P::WaitingOnExternalService, 5),
                (P::Completed, 7)
            ]
        );
    }

    #[test]
    fn a_takeover_after_an_invocation_is_one_recovering_entry() {
        use Happening as H;
        use ProductState as P;
        let t = timeline(
            0,
            [
                (H::Invoked, 1),
                (H::LeaseLost, 2),
                (H::LeaseLost, 3),
                (H::Churn, 4),
                (H::Invoked, 5),
            ],
            (P::Completed, 6),
        );
        assert_eq!(
            t,
            vec![
                (P::Preparing, 0),
                (P::WaitingOnExternalService, 1),
                (P::RecoveringExecution, 2),
                (P::WaitingOnExternalService, 5),
                (P::Completed, 6),
            ]
        );
        let review = timeline(
            0,
            [(H::Invoked, 1), (H::LeaseLost, 2), (H::ReviewOpened, 3)],
            (P::NeedsReview, 4),
        );
        assert_eq!(review.last(), Some(&(P::NeedsReview, 3)));
        assert_eq!(review.len(), 4);
    }

    #[test]
    fn event_kinds_read_as_happenings() {
        use Happening as H;
        assert_eq!(
            H::of_event("checkpoint", Some("invocation_began")),
            H::Invoked
        );
        assert_eq!(H::of_event("checkpoint", Some("attempt_created")), H::Churn);
        assert_eq!(H::of_event("rate_limited", None), H::RateLimited);
        assert_eq!(H::of_event("retry_scheduled", None), H::RateLimited);
        assert_eq!(H::of_event("lease_expired", None), H::LeaseLost);
        assert_eq!(H::of_event("recovery_lease_acquired", None), H::LeaseLost);
        assert_eq!(H::of_event("review_opened", None), H::ReviewOpened);
        for k in [
            "lease_acquired",
            "lease_renewed",
            "lease_released",
            "late_observation",
            "fenced_write_rejected",
            "recovery_decision",
            "dependencies_met",
        ] {
            assert_eq!(H::of_event(k, None), H::Churn, "{k}");
        }
    }

    fn all_facts() -> Vec<StepFacts> {
        let mut out = Vec::new();
        let checkpoints: Vec<_> = std::iter::once(None)
            .chain(Checkpoint::ALL.iter().copied().map(Some))
            .collect();
        let attempts: Vec<_> = std::iter::once(None)
            .chain(AttemptState::ALL.iter().copied().map(Some))
            .collect();
        let receipts = [None, Some(Outcome::Succeeded), Some(Outcome::Failed)];
        for &state in StepState::ALL {
            for &checkpoint in &checkpoints {
                for &last_attempt in &attempts {
                    for receipt in receipts {
                        for lease_expired in [false, true] {
                            for waiting_for_eligibility in [false, true] {
                                for has_waited in [false, true] {
                                    out.push(StepFacts {
                                        state,
                                        checkpoint,
                                        last_attempt,
                                        receipt,
                                        lease_expired,
                                        waiting_for_eligibility,
                                        has_waited,
                                    });
                                }
                            }
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn only_a_receipt_reads_as_completed() {
        for f in all_facts() {
            let p = project(&f);
            assert_eq!(
                p == ProductState::Completed,
                f.receipt == Some(Outcome::Succeeded),
                "{f:?} -> {p}"
            );
        }
    }

    #[test]
    fn an_unknown_outcome_never_reads_as_finished_or_not_started() {
        for f in all_facts() {
            let invoked = AttemptState::may_have_sent(f.checkpoint, f.last_attempt);
            if invoked && f.receipt.is_none() {
                let p = project(&f);
                assert!(
                    !matches!(
                        p,
                        ProductState::Completed
                            | ProductState::Failed
                            | ProductState::Cancelled
                            | ProductState::Preparing
                    ) || (p == ProductState::Preparing
                        && matches!(f.state, StepState::Ready | StepState::Blocked)
                        && f.last_attempt != Some(AttemptState::Expired)),
                    "{f:?} -> {p}"
                );
            }
        }
    }

    #[test]
    fn a_takeover_before_invocation_is_invisible() {
        for f in all_facts() {
            let invoked = AttemptState::may_have_sent(f.checkpoint, f.last_attempt);
            if !invoked && f.receipt.is_none() && f.state.holds_lease() && !f.has_waited {
                assert_eq!(project(&f), ProductState::Preparing, "{f:?}");
            }
        }
    }

    #[test]
    fn every_combination_has_a_defined_state() {
        let all = all_facts();
        assert_eq!(all.len(), 8 * 6 * 7 * 3 * 2 * 2 * 2);
        for f in all {
            let p = project(&f);
            let expected = match (f.receipt, f.state) {
                (Some(Outcome::Succeeded), _) => ProductState::Completed,
                (Some(Outcome::Failed), _) => ProductState::Failed,
                (None, StepState::NeedsReview | StepState::Completed) => ProductState::NeedsReview,
                (None, StepState::Blocked) if f.checkpoint.is_none() => ProductState::Preparing,
                _ => p, // the remaining rows are pinned by the targeted tests below
            };
            assert_eq!(p, expected, "{f:?}");
            assert!(!p.label().is_empty());
        }
    }

    #[test]
    fn leased_steps_show_waiting_then_recovering_once_the_lease_lapses() {
        let base = StepFacts {
            state: StepState::Leased,
            checkpoint: Some(Checkpoint::InvocationBegan),
            last_attempt: Some(AttemptState::Active),
            receipt: None,
            lease_expired: false,
            waiting_for_eligibility: false,
            has_waited: false,
        };
        assert_eq!(project(&base), ProductState::WaitingOnExternalService);
        assert_eq!(
            project(&StepFacts {
                lease_expired: true,
                ..base
            }),
            ProductState::RecoveringExecution
        );
        assert_eq!(
            project(&StepFacts {
                state: StepState::Recovering,
                ..base
            }),
            ProductState::RecoveringExecution
        );
        assert_eq!(
            project(&StepFacts {
                state: StepState::Cancelled,
                ..base
            }),
            ProductState::NeedsReview
        );
    }

    #[test]
    fn rate_limited_and_retried_steps_read_as_the_person_would_expect() {
        let ready = StepFacts {
            state: StepState::Ready,
            checkpoint: Some(Checkpoint::InvocationBegan),
            last_attempt: Some(AttemptState::Released),
            receipt: None,
            lease_expired: false,
            waiting_for_eligibility: true,
            has_waited: false,
        };
        assert_eq!(project(&ready), ProductState::WaitingOnExternalService);
        let eligible = StepFacts {
            waiting_for_eligibility: false,
            ..ready
        };
        assert_eq!(project(&eligible), ProductState::Preparing);
        let retried = StepFacts {
            last_attempt: Some(AttemptState::Expired),
            ..eligible
        };
        assert_eq!(project(&retried), ProductState::RecoveringExecution);
        let never_ran = StepFacts {
            checkpoint: None,
            last_attempt: None,
            ..eligible
        };
        assert_eq!(project(&never_ran), ProductState::Preparing);
        let failed = StepFacts {
            state: StepState::Failed,
            checkpoint: Some(Checkpoint::RequestIdentityPersisted),
            ..never_ran
        };
        assert_eq!(project(&failed), ProductState::Failed);
        let cancelled = StepFacts {
            state: StepState::Cancelled,
            ..never_ran
        };
        assert_eq!(project(&cancelled), ProductState::Cancelled);
    }

    /// A rate-limited step is claimed again at each turn and given back: through all of it,
    /// until a call of it begins, it reads as waiting, never flipping back to preparing.
    #[test]
    fn a_wait_reads_as_one_state_through_its_turns() {
        let waiting = StepFacts {
            state: StepState::Ready,
            checkpoint: Some(Checkpoint::RequestIdentityPersisted),
            last_attempt: Some(AttemptState::Released),
            receipt: None,
            lease_expired: false,
            waiting_for_eligibility: true,
            has_waited: true,
        };
        let turns = [
            waiting,
            StepFacts {
                waiting_for_eligibility: false,
                ..waiting
            },
            StepFacts {
                state: StepState::Leased,
                last_attempt: Some(AttemptState::Active),
                waiting_for_eligibility: false,
                ..waiting
            },
        ];
        for f in turns {
            assert_eq!(project(&f), ProductState::WaitingOnExternalService, "{f:?}");
        }
        // once a call begins it is waiting on the call; a lapsed lease is recovery's
        let calling = StepFacts {
            checkpoint: Some(Checkpoint::InvocationBegan),
            ..turns[2]
        };
        assert_eq!(project(&calling), ProductState::WaitingOnExternalService);
        assert_eq!(
            project(&StepFacts {
                lease_expired: true,
                ..calling
            }),
            ProductState::RecoveringExecution
        );
        // a step that never waited still reads as preparing before its first call
        assert_eq!(
            project(&StepFacts {
                has_waited: false,
                ..turns[2]
            }),
            ProductState::Preparing
        );
    }

    #[test]
    fn workflow_shows_the_state_that_most_needs_a_person() {
        use ProductState as P;
        let r = WorkflowState::Running;
        assert_eq!(
            project_workflow(r, [P::Completed, P::NeedsReview, P::Preparing]),
            P::NeedsReview
        );
        assert_eq!(
            project_workflow(
                r,
                [
                    P::Completed,
                    P::RecoveringExecution,
                    P::WaitingOnExternalService
                ]
            ),
            P::RecoveringExecution
        );
        assert_eq!(
            project_workflow(r, [P::Completed, P::WaitingOnExternalService, P::Preparing]),
            P::WaitingOnExternalService
        );
        assert_eq!(
            project_workflow(r, [P::Completed, P::Preparing]),
            P::Preparing
        );
        assert_eq!(project_workflow(r, []), P::Preparing);
        assert_eq!(
            project_workflow(WorkflowState::Completed, [P::Completed, P::Completed]),
            P::Completed
        );
        assert_eq!(
            project_workflow(WorkflowState::Cancelled, [P::Cancelled, P::Completed]),
            P::Cancelled
        );
        assert_eq!(
            project_workflow(WorkflowState::Cancelled, [P::Cancelled, P::NeedsReview]),
            P::NeedsReview
        );
        assert_eq!(
            project_workflow(WorkflowState::Failed, [P::Failed, P::Cancelled]),
            P::Failed
        );
        for &w in WorkflowState::ALL {
            for &s in P::ALL {
                let p = project_workflow(w, [s]);
                if s == P::NeedsReview {
                    assert_eq!(p, P::NeedsReview);
                }
            }
        }
    }
}
