//! States of workflows, steps and attempts, and the two facts a receipt carries about itself:
//! its outcome and how it was verified.

use crate::checkpoint::Checkpoint;
use crate::text_enum::text_enum;

text_enum! {
    /// A workflow's own state. Step detail lives on the steps.
    pub enum WorkflowState("workflow state") {
        Running = "running",
        Completed = "completed",
        Failed = "failed",
        Cancelled = "cancelled",
    }
}

impl WorkflowState {
    pub const fn is_terminal(self) -> bool {
        !matches!(self, Self::Running)
    }

    /// Whether a worker under a valid lease may record `next` for a step of this workflow.
    ///
    /// A running workflow permits every checkpoint. A cancelled or failed one stops new work at
    /// its next safe boundary (no new preparation, no new invocation) but still lets an
    /// invocation that already began record what it observed: ending a workflow does not
    /// un-send a request, and the outcome must not be thrown away. A completed workflow has
    /// nothing left in flight and permits nothing.
    pub fn permits(self, next: Checkpoint) -> bool {
        match self {
            Self::Running => true,
            Self::Cancelled | Self::Failed => next > Checkpoint::InvocationBegan,
            Self::Completed => false,
        }
    }

    /// Renewal keeps a worker's authority alive; a cancelled workflow grants no more of it.
    pub const fn permits_renewal(self) -> bool {
        matches!(self, Self::Running)
    }
}

text_enum! {
    /// A step's state. Exactly the `Leased` and `Recovering` states hold a lease.
    pub enum StepState("step state") {
        /// Waiting for its dependencies.
        Blocked = "blocked",
        /// Claimable once `next_eligible_at` has passed. Holds no lease.
        Ready = "ready",
        /// An executor holds the lease for routine execution.
        Leased = "leased",
        /// A recovery worker holds the lease and is deciding from evidence.
        Recovering = "recovering",
        /// The outcome is unknown and a person must decide. Holds no lease.
        NeedsReview = "needs_review",
        Completed = "completed",
        Failed = "failed",
        Cancelled = "cancelled",
    }
}

impl StepState {
    pub const fn holds_lease(self) -> bool {
        matches!(self, Self::Leased | Self::Recovering)
    }

    pub const fn is_terminal(self) -> bool {
        matches!(self, Self::Completed | Self::Failed | Self::Cancelled)
    }
}

text_enum! {
    /// One attempt's state. At most one attempt of a step is `Active`.
    pub enum AttemptState("attempt state") {
        /// Its lease is (or was last known to be) current.
        Active = "active",
        /// Ended with a receipt saying the step succeeded.
        Succeeded = "succeeded",
        /// Ended with a receipt saying the step failed.
        Failed = "failed",
        /// Gave its lease back before any external effect (rate limit, shutdown, cancellation).
        Released = "released",
        /// Its lease expired and recovery took over. What it did is known only from evidence.
        Expired = "expired",
        /// Answered with a definite refusal its step's policy retries: nothing happened, and
        /// the next attempt sends under the same request identity.
        Refused = "refused",
    }
}

impl AttemptState {
    /// Whether an attempt that reached `checkpoint` and ended in `state` may have sent its
    /// request: from *invocation began* on, unless it ended knowing nothing was done (given
    /// back before sending, or refused outright). The database asks the same of every attempt
    /// of a step (`z29c_attempt_may_have_sent`).
    pub fn may_have_sent(checkpoint: Option<Checkpoint>, state: Option<AttemptState>) -> bool {
        checkpoint.is_some_and(Checkpoint::may_have_invoked)
            && !matches!(state, Some(AttemptState::Released | AttemptState::Refused))
    }
}

text_enum! {
    /// What a receipt says happened.
    pub enum Outcome("outcome") {
        Succeeded = "succeeded",
        Failed = "failed",
    }
}

text_enum! {
    /// How z29c came to know what a receipt says.
    pub enum Verification("verification method") {
        /// The worker holding the lease observed the adapter's answer.
        Direct = "direct",
        /// Recovery asked the external system by request identity.
        StatusQuery = "status_query",
        /// A stale worker's observation, matched on request identity and input digest.
        LateEvidence = "late_evidence",
        /// A person resolved a review item.
        Manual = "manual",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attempt_may_have_sent_from_invocation_unless_it_ended_knowing_nothing_was_done() {
        use AttemptState as A;
        use Checkpoint as C;
        let cases = [
            (None, Some(A::Expired), false),
            (Some(C::RequestIdentityPersisted), Some(A::Expired), false),
            (Some(C::InvocationBegan), None, true),
            (Some(C::InvocationBegan), Some(A::Active), true),
            (Some(C::InvocationBegan), Some(A::Expired), true),
            (Some(C::InvocationBegan), Some(A::Released), false),
            (Some(C::ResponseObserved), Some(A::Refused), false),
            (Some(C::ReceiptCommitted), Some(A::Failed), true),
            (Some(C::ReceiptCommitted), Some(A::Succeeded), true),
        ];
        for (c, s, sent) in cases {
            assert_eq!(AttemptState::may_have_sent(c, s), sent, "{c:?} {s:?}");
        }
    }

    #[test]
    fn running_workflow_permits_every_checkpoint() {
        for &c in Checkpoint::ALL {
            assert!(WorkflowState::Running.permits(c));
        }
    }

    #[test]
    fn ended_workflows_permit_only_recording_an_outcome_already_in_flight() {
        for s in [WorkflowState::Cancelled, WorkflowState::Failed] {
            for &c in Checkpoint::ALL {
                let expected = matches!(
                    c,
                    Checkpoint::ResponseObserved | Checkpoint::ReceiptCommitted
                );
                assert_eq!(s.permits(c), expected, "{s} {c}");
            }
        }
    }

    #[test]
    fn completed_workflows_permit_nothing_and_only_running_ones_renew() {
        for &c in Checkpoint::ALL {
            assert!(!WorkflowState::Completed.permits(c), "{c}");
        }
        for &s in WorkflowState::ALL {
            assert_eq!(s.permits_renewal(), s == WorkflowState::Running, "{s}");
        }
    }

    #[test]
    fn only_leased_and_recovering_steps_hold_a_lease() {
        for &s in StepState::ALL {
            assert_eq!(
                s.holds_lease(),
                matches!(s, StepState::Leased | StepState::Recovering),
                "{s}"
            );
            assert!(!(s.holds_lease() && s.is_terminal()), "{s}");
        }
    }

    #[test]
    fn state_names_round_trip() {
        for &s in StepState::ALL {
            assert_eq!(s.as_str().parse::<StepState>().unwrap(), s);
        }
        for &s in WorkflowState::ALL {
            assert_eq!(s.as_str().parse::<WorkflowState>().unwrap(), s);
        }
        for &s in AttemptState::ALL {
            assert_eq!(s.as_str().parse::<AttemptState>().unwrap(), s);
        }
        for &s in Verification::ALL {
            assert_eq!(s.as_str().parse::<Verification>().unwrap(), s);
        }
        for &s in Outcome::ALL {
            assert_eq!(s.as_str().parse::<Outcome>().unwrap(), s);
        }
    }
}
