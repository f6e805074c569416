//! `classify()`: the recovery table of docs/design.md §5. Lease expiry starts reasoning, never
//! repetition: the decision depends on durable evidence and the adapter's capability, and an
//! ambiguous step is never made plainly ready.

use serde::{Deserialize, Serialize};

use crate::capability::AdapterCapability;
use crate::checkpoint::Checkpoint;
use crate::state::{Outcome, StepState};
use crate::text_enum::text_enum;

/// What recovery knows about a step after taking its recovery lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Evidence {
    /// The expired attempt's last durable checkpoint; `None` when there was no attempt.
    pub checkpoint: Option<Checkpoint>,
    pub capability: AdapterCapability,
    /// The step already has its receipt.
    pub receipt: bool,
    /// An external result is on record without a receipt: a `ResponseObserved` checkpoint or a
    /// late observation for the step's request identity.
    pub observed_result: bool,
    /// The step policy allows another attempt.
    pub attempts_left: bool,
    /// An earlier attempt of the step began its invocation and was never told "not performed"
    /// (a 429, a refused connection, no permit): its request may have reached the external
    /// system. Every claim makes a new current attempt, so the checkpoint alone forgets it.
    pub earlier_may_have_sent: bool,
}

impl Evidence {
    /// Whether any attempt of the step, the current one or an earlier one, may have sent its
    /// request: the question is about the step, never only about its current attempt.
    pub fn may_have_sent(&self) -> bool {
        self.earlier_may_have_sent || self.checkpoint.is_some_and(Checkpoint::may_have_invoked)
    }
}

text_enum! {
    /// The row of the recovery table a step fell into. Recorded with every decision so that
    /// operators see recovery *categories*, not just expiry counts.
    pub enum RecoveryCategory("recovery category") {
        NoRequestIdentity = "no_request_identity",
        IdentityNotInvoked = "identity_not_invoked",
        InvokedIdempotent = "invoked_idempotent",
        InvokedQueryable = "invoked_queryable",
        InvokedOpaque = "invoked_opaque",
        ResultObserved = "result_observed",
        ReceiptExists = "receipt_exists",
    }
}

text_enum! {
    /// What recovery does about a step.
    pub enum RecoveryDecision("recovery decision") {
        /// Nothing was prepared: the step is ready again.
        MakeReady = "make_ready",
        /// The request identity is durable but nothing was sent: retry with it.
        Retry = "retry",
        /// A request may have been sent to an idempotent adapter: retry with the same key.
        RetrySameIdentity = "retry_same_identity",
        /// Ask the external system what happened to the request identity.
        StatusQuery = "status_query",
        /// Nobody but a person can say what happened.
        HumanReview = "human_review",
        /// A result was observed: verify it and commit the receipt from it.
        Reconcile = "reconcile",
        /// The receipt exists: acknowledge, never re-execute.
        AcknowledgeOnly = "acknowledge_only",
        /// Nothing was sent and the attempt budget is spent: failing is known to be safe.
        Fail = "fail",
    }
}

impl RecoveryDecision {
    /// The step's state once the decision is recorded: `None` keeps it with recovery (a
    /// status query or a reconciliation acts next, or the recovery lease expires and the step
    /// is looked at again). A retry in a workflow that no longer runs sends nothing: a fresh
    /// start is cancelled, and one under the same identity goes to a person, since its
    /// request may already have had an effect. Acknowledging follows the receipt's outcome and
    /// needs one (`receipt`).
    pub fn next_state(
        self,
        workflow_running: bool,
        receipt: Option<Outcome>,
    ) -> Result<Option<StepState>, &'static str> {
        use StepState as S;
        Ok(match self {
            Self::StatusQuery | Self::Reconcile => None,
            Self::MakeReady | Self::Retry if workflow_running => Some(S::Ready),
            Self::MakeReady | Self::Retry => Some(S::Cancelled),
            Self::RetrySameIdentity if workflow_running => Some(S::Ready),
            Self::RetrySameIdentity | Self::HumanReview => Some(S::NeedsReview),
            Self::AcknowledgeOnly => match receipt {
                Some(Outcome::Succeeded) => Some(S::Completed),
                Some(Outcome::Failed) => Some(S::Failed),
                None => return Err("acknowledge_only needs a receipt, and the step has none"),
            },
            Self::Fail => Some(S::Failed),
        })
    }

    /// Whether the decision may lead to another request reaching the external system.
    pub const fn may_send_again(self) -> bool {
        matches!(
            self,
            Self::MakeReady | Self::Retry | Self::RetrySameIdentity
        )
    }
}

/// Status queries that bring no answer (the request still in progress at the destination, a
/// timeout, an error) a step is given before a person is asked. Recovery asks each time its
/// recovery lease on the step expires, so the destination has a lease's length between two.
pub const UNANSWERED_QUERIES_BEFORE_REVIEW: usize = 5;

/// What follows the `asked`-th status query of a step when it brought no answer: `None` asks
/// again when the recovery lease expires; after [`UNANSWERED_QUERIES_BEFORE_REVIEW`], a person
/// decides. Never a retry, never a failure: a request still in progress would be sent twice,
/// and its effect may yet commit.
pub const fn after_unanswered_query(asked: usize) -> Option<RecoveryDecision> {
    if asked >= UNANSWERED_QUERIES_BEFORE_REVIEW {
        Some(RecoveryDecision::HumanReview)
    } else {
        None
    }
}

/// What a status query brought, as recovery weighs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueryAnswer {
    /// The destination names the request's effect.
    Found,
    /// The destination never received the request.
    NotFound,
    /// No answer yet: the request is still being processed, or the query timed out or found
    /// no gateway. A later query may bring one.
    NotYet,
    /// An answer no later query will change (the adapter unknown to the gateway, a malformed
    /// identity, an empty answer).
    Unusable,
}

/// What recovery does after a status query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterQuery {
    /// Commit the receipt from the destination's answer.
    CommitFound,
    /// Record this decision.
    Decide(RecoveryDecision),
    /// Nothing now: ask again when the recovery lease expires.
    AskAgain,
}

/// The rule after a status query, given whether the step has attempts left and how many
/// queries of its current attempt have gone unanswered (this one included). "No such
/// request" is the only answer that allows sending again; no answer yet is never a "no".
pub const fn after_status_query(
    answer: QueryAnswer,
    attempts_left: bool,
    unanswered: usize,
) -> AfterQuery {
    match answer {
        QueryAnswer::Found => AfterQuery::CommitFound,
        QueryAnswer::NotFound if attempts_left => {
            AfterQuery::Decide(RecoveryDecision::RetrySameIdentity)
        }
        QueryAnswer::NotFound | QueryAnswer::Unusable => {
            AfterQuery::Decide(RecoveryDecision::HumanReview)
        }
        QueryAnswer::NotYet => match after_unanswered_query(unanswered) {
            Some(d) => AfterQuery::Decide(d),
            None => AfterQuery::AskAgain,
        },
    }
}

/// One answer on record for the step's request identity, as a reconciliation weighs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordedAnswer<'a> {
    /// What the answer says happened; `None` when the record does not say in words z29c reads.
    pub outcome: Option<Outcome>,
    pub reference: Option<&'a str>,
}

/// What a reconciliation does with the answers on record for the step's request identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterReconcile {
    /// Commit the receipt from the answer at `index`, which says `outcome`.
    CommitObserved { index: usize, outcome: Outcome },
    /// The answers name different external references: an integrity conflict for a person.
    IntegrityConflict,
    /// A response was observed but no answer of it was kept, or none that says what happened
    /// in words z29c reads while none says it succeeded: a person decides.
    NoEvidence,
}

/// The rule of a reconciliation. Two references for one request identity are never chosen
/// between. An answer that says the request succeeded outranks one that says it was refused
/// (the same identity may have been answered both ways, and the success is an effect that must
/// not be hidden); a success is committed only with its reference (a receipt of success names
/// the effect), so one without goes to a person. A failure is committed only when every answer
/// is a readable refusal (the first that names a reference, if one does): an unreadable answer
/// may hide an effect, so it goes to a person instead.
pub fn after_reconcile(answers: &[RecordedAnswer<'_>]) -> AfterReconcile {
    let mut references: Vec<&str> = answers.iter().filter_map(|a| a.reference).collect();
    references.sort_unstable();
    references.dedup();
    if answers.is_empty() {
        return AfterReconcile::NoEvidence;
    }
    if references.len() > 1 {
        return AfterReconcile::IntegrityConflict;
    }
    let succeeded = |a: &RecordedAnswer<'_>| a.outcome == Some(Outcome::Succeeded);
    if answers.iter().any(succeeded) {
        return match answers
            .iter()
            .position(|a| succeeded(a) && a.reference.is_some())
        {
            Some(index) => AfterReconcile::CommitObserved {
                index,
                outcome: Outcome::Succeeded,
            },
            None => AfterReconcile::NoEvidence,
        };
    }
    if answers.iter().all(|a| a.outcome == Some(Outcome::Failed)) {
        return AfterReconcile::CommitObserved {
            index: answers
                .iter()
                .position(|a| a.reference.is_some())
                .unwrap_or(0),
            outcome: Outcome::Failed,
        };
    }
    AfterReconcile::NoEvidence
}

/// Whether recovery waits before acting on `decision` because the expired attempt's call is
/// still in flight at a gateway (its permit is held, until the answer is recorded or the call's
/// own deadline passes). The call may yet answer: a person asked to review it now would decide
/// without that answer, a retry under the same identity would reach the destination while the
/// first request is still being processed, and a status query would ask too soon. Only what
/// is already on record (a receipt, an observed answer) is acted on at once.
pub const fn waits_for_call(decision: RecoveryDecision, call_in_flight: bool) -> bool {
    call_in_flight
        && !matches!(
            decision,
            RecoveryDecision::Reconcile | RecoveryDecision::AcknowledgeOnly
        )
}

/// Classifies durable evidence into a row of the recovery table and its decision.
///
/// The order of the checks is the point: a receipt outranks everything, an observed result
/// outranks what the checkpoint says, and once an invocation may have begun the adapter's
/// capability alone decides whether anything may be sent again. "Began" is asked of every
/// attempt of the step ([`Evidence::may_have_sent`]), so a crash of a later attempt before its
/// own invocation cannot hide an earlier attempt's request. An unknown outcome is never turned
/// into a failure, even when the attempt budget is spent.
pub fn classify(e: &Evidence) -> (RecoveryCategory, RecoveryDecision) {
    use RecoveryCategory as C;
    use RecoveryDecision as D;

    if e.receipt {
        return (C::ReceiptExists, D::AcknowledgeOnly);
    }
    let checkpoint = e.checkpoint.unwrap_or(Checkpoint::AttemptCreated);
    if e.observed_result || checkpoint >= Checkpoint::ResponseObserved {
        return (C::ResultObserved, D::Reconcile);
    }
    if e.may_have_sent() {
        return match e.capability {
            AdapterCapability::Idempotent if e.attempts_left => {
                (C::InvokedIdempotent, D::RetrySameIdentity)
            }
            AdapterCapability::Idempotent => (C::InvokedIdempotent, D::HumanReview),
            AdapterCapability::Queryable => (C::InvokedQueryable, D::StatusQuery),
            AdapterCapability::Opaque => (C::InvokedOpaque, D::HumanReview),
        };
    }
    let (category, retry) = if checkpoint == Checkpoint::RequestIdentityPersisted {
        (C::IdentityNotInvoked, D::Retry)
    } else {
        (C::NoRequestIdentity, D::MakeReady)
    };
    if e.attempts_left {
        (category, retry)
    } else {
        (category, D::Fail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_decision_has_its_next_state_and_an_ended_workflow_sends_nothing() {
        use StepState as S;
        let receipts = [None, Some(Outcome::Succeeded), Some(Outcome::Failed)];
        for &d in RecoveryDecision::ALL {
            for running in [true, false] {
                for receipt in receipts {
                    let next = d.next_state(running, receipt);
                    match d {
                        RecoveryDecision::AcknowledgeOnly => {
                            let want = match receipt {
                                Some(Outcome::Succeeded) => Ok(Some(S::Completed)),
                                Some(Outcome::Failed) => Ok(Some(S::Failed)),
                                None => {
                                    Err("acknowledge_only needs a receipt, and the step has none")
                                }
                            };
                            assert_eq!(next, want, "{d} {running} {receipt:?}");
                        }
                        _ => {
                            let next = next.expect("only acknowledging needs a receipt");
                            // only a running workflow makes a step ready again
                            if next == Some(S::Ready) {
                                assert!(running && d.may_send_again(), "{d}");
                            }
                            // a step that may have sent never ends cancelled or failed here
                            // unless recovery decided failure (nothing was sent)
                            if d == RecoveryDecision::RetrySameIdentity && !running {
                                assert_eq!(next, Some(S::NeedsReview));
                            }
                            match d {
                                RecoveryDecision::StatusQuery | RecoveryDecision::Reconcile => {
                                    assert_eq!(next, None)
                                }
                                RecoveryDecision::HumanReview => {
                                    assert_eq!(next, Some(S::NeedsReview))
                                }
                                RecoveryDecision::Fail => assert_eq!(next, Some(S::Failed)),
                                RecoveryDecision::MakeReady | RecoveryDecision::Retry => {
                                    assert_eq!(
                                        next,
                                        Some(if running { S::Ready } else { S::Cancelled })
                                    )
                                }
                                RecoveryDecision::RetrySameIdentity => assert_eq!(
                                    next,
                                    Some(if running { S::Ready } else { S::NeedsReview })
                                ),
                                RecoveryDecision::AcknowledgeOnly => unreachable!(),
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn after_a_status_query_only_no_such_request_sends_again() {
        let answers = [
            QueryAnswer::Found,
            QueryAnswer::NotFound,
            QueryAnswer::NotYet,
            QueryAnswer::Unusable,
        ];
        for answer in answers {
            for attempts_left in [true, false] {
                for unanswered in 0..UNANSWERED_QUERIES_BEFORE_REVIEW * 2 {
                    let next = after_status_query(answer, attempts_left, unanswered);
                    let want = match answer {
                        QueryAnswer::Found => AfterQuery::CommitFound,
                        QueryAnswer::NotFound if attempts_left => {
                            AfterQuery::Decide(RecoveryDecision::RetrySameIdentity)
                        }
                        QueryAnswer::NotYet if unanswered < UNANSWERED_QUERIES_BEFORE_REVIEW => {
                            AfterQuery::AskAgain
                        }
                        _ => AfterQuery::Decide(RecoveryDecision::HumanReview),
                    };
                    assert_eq!(next, want, "{answer:?} {attempts_left} {unanswered}");
                    // never a failure; a retry only on a definite "never received"
                    if let AfterQuery::Decide(d) = next {
                        assert_ne!(d, RecoveryDecision::Fail);
                        if d.may_send_again() {
                            assert_eq!(answer, QueryAnswer::NotFound);
                        }
                    }
                }
            }
        }
    }

    fn answer(outcome: Option<Outcome>, reference: Option<&str>) -> RecordedAnswer<'_> {
        RecordedAnswer { outcome, reference }
    }

    fn done(index: usize) -> AfterReconcile {
        AfterReconcile::CommitObserved {
            index,
            outcome: Outcome::Succeeded,
        }
    }

    fn refused(index: usize) -> AfterReconcile {
        AfterReconcile::CommitObserved {
            index,
            outcome: Outcome::Failed,
        }
    }

    #[test]
    fn a_reconciliation_commits_one_reference_and_never_chooses_between_two() {
        const OK: Option<Outcome> = Some(Outcome::Succeeded);
        const NO: Option<Outcome> = Some(Outcome::Failed);
        use AfterReconcile::*;
        assert_eq!(after_reconcile(&[]), NoEvidence);
        // a success is committed with its reference, never without
        assert_eq!(
            after_reconcile(&[answer(OK, None)]),
            AfterReconcile::NoEvidence
        );
        assert_eq!(after_reconcile(&[answer(OK, Some("r1"))]), done(0));
        let same = [
            answer(OK, Some("r1")),
            answer(OK, Some("r1")),
            answer(OK, None),
        ];
        assert_eq!(after_reconcile(&same), done(0));
        let two = [answer(OK, Some("r1")), answer(OK, Some("r2"))];
        assert_eq!(after_reconcile(&two), IntegrityConflict);
        // two references are a conflict whatever the answers say
        let refused_and_not = [answer(NO, Some("r1")), answer(OK, Some("r2"))];
        assert_eq!(after_reconcile(&refused_and_not), IntegrityConflict);
    }

    #[test]
    fn a_success_on_record_outranks_a_refusal_before_it() {
        const OK: Option<Outcome> = Some(Outcome::Succeeded);
        const NO: Option<Outcome> = Some(Outcome::Failed);
        let refused_then_done = [answer(NO, None), answer(OK, Some("r1"))];
        assert_eq!(after_reconcile(&refused_then_done), done(1));
        // among successes, the one that names its reference
        let unnamed_first = [answer(NO, None), answer(OK, None), answer(OK, Some("r1"))];
        assert_eq!(after_reconcile(&unnamed_first), done(2));
        let unread_then_done = [answer(None, None), answer(OK, Some("r1"))];
        assert_eq!(after_reconcile(&unread_then_done), done(1));
        // a success without its reference is not committed, and no refusal stands in for it
        let refused_then_unnamed = [answer(NO, None), answer(OK, None)];
        assert_eq!(
            after_reconcile(&refused_then_unnamed),
            AfterReconcile::NoEvidence
        );
    }

    #[test]
    fn a_failure_is_committed_only_when_every_answer_is_a_readable_refusal() {
        const NO: Option<Outcome> = Some(Outcome::Failed);
        use AfterReconcile::*;
        assert_eq!(after_reconcile(&[answer(NO, None)]), refused(0));
        assert_eq!(
            after_reconcile(&[answer(NO, None), answer(NO, None)]),
            refused(0)
        );
        // the refusal that names a reference, if one does
        assert_eq!(
            after_reconcile(&[answer(NO, None), answer(NO, Some("r1"))]),
            refused(1)
        );
        assert_eq!(after_reconcile(&[answer(None, None)]), NoEvidence);
        assert_eq!(
            after_reconcile(&[answer(NO, None), answer(None, Some("r1"))]),
            NoEvidence
        );
    }

    #[test]
    fn recovery_waits_for_a_call_in_flight_unless_the_answer_is_already_on_record() {
        for &d in RecoveryDecision::ALL {
            assert!(
                !waits_for_call(d, false),
                "{d}: nothing in flight, nothing to wait for"
            );
            let acts_on_record = matches!(
                d,
                RecoveryDecision::Reconcile | RecoveryDecision::AcknowledgeOnly
            );
            assert_eq!(waits_for_call(d, true), !acts_on_record, "{d}");
        }
        // the decisions a call in flight could make wrong
        for d in [
            RecoveryDecision::HumanReview,
            RecoveryDecision::RetrySameIdentity,
            RecoveryDecision::StatusQuery,
        ] {
            assert!(waits_for_call(d, true), "{d}");
        }
    }

    #[test]
    fn an_unanswered_query_is_asked_again_then_goes_to_a_person_never_to_a_retry() {
        for asked in 0..UNANSWERED_QUERIES_BEFORE_REVIEW {
            assert_eq!(after_unanswered_query(asked), None, "{asked}");
        }
        for asked in UNANSWERED_QUERIES_BEFORE_REVIEW..UNANSWERED_QUERIES_BEFORE_REVIEW * 3 {
            let next = after_unanswered_query(asked);
            assert_eq!(next, Some(RecoveryDecision::HumanReview), "{asked}");
            assert!(!next.is_some_and(RecoveryDecision::may_send_again));
        }
    }

    fn all_evidence() -> Vec<Evidence> {
        let mut out = Vec::new();
        let checkpoints = std::iter::once(None).chain(Checkpoint::ALL.iter().copied().map(Some));
        for checkpoint in checkpoints {
            for &capability in AdapterCapability::ALL {
                for receipt in [false, true] {
                    for observed_result in [false, true] {
                        for attempts_left in [false, true] {
                            for earlier_may_have_sent in [false, true] {
                                out.push(Evidence {
                                    checkpoint,
                                    capability,
                                    receipt,
                                    observed_result,
                                    attempts_left,
                                    earlier_may_have_sent,
                                });
                            }
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn every_combination_is_classified_as_the_table_says() {
        use RecoveryCategory as C;
        use RecoveryDecision as D;
        let all = all_evidence();
        assert_eq!(all.len(), 6 * 3 * 2 * 2 * 2 * 2);
        for e in all {
            let got = classify(&e);
            let cp = e.checkpoint.unwrap_or(Checkpoint::AttemptCreated);
            let expected = if e.receipt {
                (C::ReceiptExists, D::AcknowledgeOnly)
            } else if e.observed_result || cp >= Checkpoint::ResponseObserved {
                (C::ResultObserved, D::Reconcile)
            } else if cp == Checkpoint::InvocationBegan || e.earlier_may_have_sent {
                match (e.capability, e.attempts_left) {
                    (AdapterCapability::Idempotent, true) => {
                        (C::InvokedIdempotent, D::RetrySameIdentity)
                    }
                    (AdapterCapability::Idempotent, false) => {
                        (C::InvokedIdempotent, D::HumanReview)
                    }
                    (AdapterCapability::Queryable, _) => (C::InvokedQueryable, D::StatusQuery),
                    (AdapterCapability::Opaque, _) => (C::InvokedOpaque, D::HumanReview),
                }
            } else if cp == Checkpoint::RequestIdentityPersisted {
                (
                    C::IdentityNotInvoked,
                    if e.attempts_left { D::Retry } else { D::Fail },
                )
            } else {
                (
                    C::NoRequestIdentity,
                    if e.attempts_left {
                        D::MakeReady
                    } else {
                        D::Fail
                    },
                )
            };
            assert_eq!(got, expected, "{e:?}");
        }
    }

    #[test]
    fn a_receipt_is_only_ever_acknowledged() {
        for e in all_evidence().into_iter().filter(|e| e.receipt) {
            assert_eq!(classify(&e).1, RecoveryDecision::AcknowledgeOnly, "{e:?}");
        }
    }

    #[test]
    fn after_invocation_only_an_idempotent_adapter_is_sent_again() {
        for e in all_evidence() {
            let invoked = e.may_have_sent();
            let (_, d) = classify(&e);
            if invoked && d.may_send_again() {
                assert_eq!(e.capability, AdapterCapability::Idempotent, "{e:?}");
                assert_eq!(d, RecoveryDecision::RetrySameIdentity, "{e:?}");
            }
        }
    }

    #[test]
    fn an_opaque_unknown_always_goes_to_a_person() {
        for e in all_evidence() {
            let invoked = e.may_have_sent();
            if invoked
                && e.capability == AdapterCapability::Opaque
                && !e.receipt
                && !e.observed_result
                && e.checkpoint < Some(Checkpoint::ResponseObserved)
            {
                assert_eq!(classify(&e).1, RecoveryDecision::HumanReview, "{e:?}");
            }
        }
    }

    #[test]
    fn failure_is_decided_only_when_nothing_can_have_been_sent() {
        for e in all_evidence() {
            if classify(&e).1 == RecoveryDecision::Fail {
                assert!(!e.receipt && !e.observed_result, "{e:?}");
                assert!(!e.may_have_sent(), "{e:?}");
                assert!(!e.attempts_left, "{e:?}");
            }
        }
    }

    #[test]
    fn an_earlier_attempt_that_may_have_sent_is_never_forgotten() {
        // the current attempt got no further than its identity, but an earlier one began
        for e in all_evidence()
            .into_iter()
            .filter(|e| e.earlier_may_have_sent && !e.receipt && !e.observed_result)
            .filter(|e| e.checkpoint < Some(Checkpoint::ResponseObserved))
        {
            let (_, d) = classify(&e);
            assert!(
                matches!(
                    d,
                    RecoveryDecision::RetrySameIdentity
                        | RecoveryDecision::StatusQuery
                        | RecoveryDecision::HumanReview
                ),
                "{e:?} → {d:?}"
            );
        }
    }

    #[test]
    fn decision_names_round_trip() {
        for &d in RecoveryDecision::ALL {
            assert_eq!(d.as_str().parse::<RecoveryDecision>().unwrap(), d);
        }
        for &c in RecoveryCategory::ALL {
            assert_eq!(c.as_str().parse::<RecoveryCategory>().unwrap(), c);
        }
    }
}
