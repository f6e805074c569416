//! The fencing rule (invariant 2): a write under a lease is accepted only while the lease is
//! still the current one, by PostgreSQL's clock, for the same owner and attempt, and while the
//! workflow still permits it.
//!
//! `z29c-store` enforces this rule inside the committing transaction with a conditional
//! `UPDATE … WHERE lease_version = $n …`; when that update changes no row it reads the step
//! back and asks [`check`] *why*, so a refused write always carries its reason.

use serde::{Deserialize, Serialize};

use crate::checkpoint::Checkpoint;
use crate::ids::{AttemptId, LeaseVersion, OwnerId, StepId};
use crate::state::{StepState, WorkflowState};

/// Which kind of lease: routine execution by an executor, or recovery from evidence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LeaseKind {
    Execution,
    Recovery,
}

impl LeaseKind {
    /// The step state in which a lease of this kind is held.
    pub const fn step_state(self) -> StepState {
        match self {
            Self::Execution => StepState::Leased,
            Self::Recovery => StepState::Recovering,
        }
    }
}

/// What a worker believes it holds: the token it presents with every write.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LeaseClaim {
    pub step: StepId,
    pub attempt: AttemptId,
    pub owner: OwnerId,
    pub version: LeaseVersion,
    pub kind: LeaseKind,
}

/// The durable lease state of a step as PostgreSQL sees it, read in the same transaction as
/// the refused write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseView {
    pub state: StepState,
    pub owner: Option<OwnerId>,
    pub version: LeaseVersion,
    pub current_attempt: Option<AttemptId>,
    /// `expires_at <= now()` on PostgreSQL's clock. Never computed from a worker's clock.
    pub expired: bool,
    pub workflow: WorkflowState,
    /// The current attempt's last durable checkpoint.
    pub checkpoint: Option<Checkpoint>,
}

/// The kind of write being fenced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FencedWrite {
    /// Record a checkpoint (a receipt commit is `Advance(ReceiptCommitted)`).
    Advance(Checkpoint),
    /// Extend the lease.
    Renew,
    /// Give the lease back (rate limit, shutdown, a recovery decision). Always permitted to the
    /// current holder: giving up authority is never unsafe.
    Release,
}

/// Why a write under a lease was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "reason")]
pub enum FenceReason {
    #[error("lease superseded: presented version {presented}, current version {current}")]
    Superseded {
        presented: LeaseVersion,
        current: LeaseVersion,
    },
    #[error("lease is held by another owner")]
    NotOwner,
    #[error("step is {state}, not held under this kind of lease")]
    NotLeased { state: StepState },
    #[error("lease expired by database time")]
    Expired,
    #[error("attempt is not the step's current attempt")]
    NotCurrentAttempt,
    #[error("workflow is {workflow}, which does not permit this write")]
    WorkflowForbids { workflow: WorkflowState },
    #[error("checkpoint must move forward from {durable}")]
    CheckpointNotForward { durable: Checkpoint },
    #[error("renewal refused: the attempt deadline leaves no room beyond the final grace")]
    AttemptDeadlineReached,
    #[error("renewal carried checkpoint version {presented}, durable version is {durable}")]
    StaleCheckpoint { presented: i64, durable: i64 },
    #[error("lease changed while the write was being made")]
    Changed,
}

/// Decides whether `claim` may perform `write` on a step whose durable state is `view`.
pub fn check(claim: &LeaseClaim, view: &LeaseView, write: FencedWrite) -> Result<(), FenceReason> {
    if view.version != claim.version {
        return Err(FenceReason::Superseded {
            presented: claim.version,
            current: view.version,
        });
    }
    if view.state != claim.kind.step_state() {
        return Err(FenceReason::NotLeased { state: view.state });
    }
    if view.owner.as_ref() != Some(&claim.owner) {
        return Err(FenceReason::NotOwner);
    }
    if view.expired {
        return Err(FenceReason::Expired);
    }
    if claim.kind == LeaseKind::Execution && view.current_attempt != Some(claim.attempt) {
        return Err(FenceReason::NotCurrentAttempt);
    }
    match write {
        FencedWrite::Advance(next) => {
            if !view.workflow.permits(next) {
                return Err(FenceReason::WorkflowForbids {
                    workflow: view.workflow,
                });
            }
            if claim.kind == LeaseKind::Execution
                && let Some(durable) = view.checkpoint
                && !durable.may_advance_to(next)
            {
                return Err(FenceReason::CheckpointNotForward { durable });
            }
        }
        FencedWrite::Renew => {
            if !view.workflow.permits_renewal() {
                return Err(FenceReason::WorkflowForbids {
                    workflow: view.workflow,
                });
            }
        }
        FencedWrite::Release => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(kind: LeaseKind) -> LeaseClaim {
        LeaseClaim {
            step: StepId::new(),
            attempt: AttemptId::new(),
            owner: OwnerId::parse("worker-a").unwrap(),
            version: LeaseVersion::new(7).unwrap(),
            kind,
        }
    }

    fn view_for(c: &LeaseClaim) -> LeaseView {
        LeaseView {
            state: c.kind.step_state(),
            owner: Some(c.owner.clone()),
            version: c.version,
            current_attempt: Some(c.attempt),
            expired: false,
            workflow: WorkflowState::Running,
            checkpoint: Some(Checkpoint::AttemptCreated),
        }
    }

    fn writes() -> Vec<FencedWrite> {
        let mut w: Vec<_> = Checkpoint::ALL
            .iter()
            .map(|&c| FencedWrite::Advance(c))
            .collect();
        w.extend([FencedWrite::Renew, FencedWrite::Release]);
        w
    }

    #[test]
    fn stale_lease_version_is_refused_for_every_write() {
        for kind in [LeaseKind::Execution, LeaseKind::Recovery] {
            let c = claim(kind);
            let v = LeaseView {
                version: c.version.next(),
                ..view_for(&c)
            };
            for w in writes() {
                assert!(
                    matches!(check(&c, &v, w), Err(FenceReason::Superseded { .. })),
                    "{kind:?} {w:?}"
                );
            }
        }
    }

    #[test]
    fn expired_lease_is_refused_for_every_write() {
        for kind in [LeaseKind::Execution, LeaseKind::Recovery] {
            let c = claim(kind);
            let v = LeaseView {
                expired: true,
                ..view_for(&c)
            };
            for w in writes() {
                assert_eq!(
                    check(&c, &v, w),
                    Err(FenceReason::Expired),
                    "{kind:?} {w:?}"
                );
            }
        }
    }

    #[test]
    fn other_owner_is_refused() {
        let c = claim(LeaseKind::Execution);
        let v = LeaseView {
            owner: Some(OwnerId::parse("worker-b").unwrap()),
            ..view_for(&c)
        };
        assert_eq!(
            check(&c, &v, FencedWrite::Renew),
            Err(FenceReason::NotOwner)
        );
    }

    #[test]
    fn lease_of_the_wrong_kind_or_no_lease_is_refused() {
        for kind in [LeaseKind::Execution, LeaseKind::Recovery] {
            let c = claim(kind);
            for &state in StepState::ALL {
                let v = LeaseView {
                    state,
                    ..view_for(&c)
                };
                let r = check(&c, &v, FencedWrite::Release);
                if state == kind.step_state() {
                    assert_eq!(r, Ok(()));
                } else {
                    assert_eq!(r, Err(FenceReason::NotLeased { state }), "{kind:?} {state}");
                }
            }
        }
    }

    #[test]
    fn execution_lease_is_bound_to_its_attempt() {
        let c = claim(LeaseKind::Execution);
        let v = LeaseView {
            current_attempt: Some(AttemptId::new()),
            ..view_for(&c)
        };
        assert_eq!(
            check(&c, &v, FencedWrite::Release),
            Err(FenceReason::NotCurrentAttempt)
        );
    }

    #[test]
    fn current_lease_may_advance_only_forward_and_as_the_workflow_permits() {
        let c = claim(LeaseKind::Execution);
        for &workflow in WorkflowState::ALL {
            for &durable in Checkpoint::ALL {
                for &next in Checkpoint::ALL {
                    let v = LeaseView {
                        workflow,
                        checkpoint: Some(durable),
                        ..view_for(&c)
                    };
                    let r = check(&c, &v, FencedWrite::Advance(next));
                    let expected = if !workflow.permits(next) {
                        Err(FenceReason::WorkflowForbids { workflow })
                    } else if next <= durable {
                        Err(FenceReason::CheckpointNotForward { durable })
                    } else {
                        Ok(())
                    };
                    assert_eq!(r, expected, "{workflow} {durable} -> {next}");
                }
            }
        }
    }

    #[test]
    fn renewal_is_refused_unless_the_workflow_runs() {
        let c = claim(LeaseKind::Execution);
        for &workflow in WorkflowState::ALL {
            let v = LeaseView {
                workflow,
                ..view_for(&c)
            };
            assert_eq!(
                check(&c, &v, FencedWrite::Renew).is_ok(),
                workflow == WorkflowState::Running,
                "{workflow}"
            );
            // giving the lease back is always allowed to its holder
            assert_eq!(check(&c, &v, FencedWrite::Release), Ok(()));
        }
    }
}
