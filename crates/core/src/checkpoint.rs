//! The ordered checkpoints of one attempt (docs/design.md §4). Each is committed durably, fenced,
//! before the worker moves on; recovery reads the last one to know what may have happened.

use crate::text_enum::text_enum;

text_enum! {
    /// How far an attempt got, in protocol order. The derived order *is* the protocol order:
    /// `AttemptCreated < RequestIdentityPersisted < InvocationBegan < ResponseObserved <
    /// ReceiptCommitted`.
    pub enum Checkpoint("checkpoint") {
        /// The lease was acquired and the attempt row exists. Nothing was prepared.
        AttemptCreated = "attempt_created",
        /// The request identity is durable; the adapter has not been called.
        RequestIdentityPersisted = "request_identity_persisted",
        /// The adapter may have been called: from here on, no receipt means *unknown*.
        InvocationBegan = "invocation_began",
        /// The adapter's answer was observed and stored.
        ResponseObserved = "response_observed",
        /// The step receipt is committed.
        ReceiptCommitted = "receipt_committed",
    }
}

impl PartialOrd for Checkpoint {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Checkpoint {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.rank().cmp(&other.rank())
    }
}

impl Checkpoint {
    /// Position in the protocol, starting at 0.
    pub const fn rank(self) -> u8 {
        match self {
            Self::AttemptCreated => 0,
            Self::RequestIdentityPersisted => 1,
            Self::InvocationBegan => 2,
            Self::ResponseObserved => 3,
            Self::ReceiptCommitted => 4,
        }
    }

    /// True once the external system may have seen a request: absence of a receipt from here
    /// on means *unknown*, never *absent* (invariant 6).
    pub const fn may_have_invoked(self) -> bool {
        self.rank() >= Self::InvocationBegan.rank()
    }

    /// Whether `next` may follow `self`. Checkpoints only move forward; skipping is allowed
    /// (a receipt commit records `ResponseObserved` and `ReceiptCommitted` together), going
    /// back or repeating is not.
    pub fn may_advance_to(self, next: Checkpoint) -> bool {
        next > self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoints_are_totally_ordered_in_protocol_order() {
        for pair in Checkpoint::ALL.windows(2) {
            assert!(pair[0] < pair[1], "{} < {}", pair[0], pair[1]);
        }
        for (i, a) in Checkpoint::ALL.iter().enumerate() {
            assert_eq!(a.rank() as usize, i);
        }
    }

    #[test]
    fn checkpoints_only_move_forward() {
        for &a in Checkpoint::ALL {
            for &b in Checkpoint::ALL {
                assert_eq!(a.may_advance_to(b), b.rank() > a.rank(), "{a} -> {b}");
            }
        }
    }

    #[test]
    fn invocation_boundary_is_where_unknown_begins() {
        let unknown: Vec<_> = Checkpoint::ALL
            .iter()
            .filter(|c| c.may_have_invoked())
            .collect();
        assert_eq!(
            unknown,
            [
                &Checkpoint::InvocationBegan,
                &Checkpoint::ResponseObserved,
                &Checkpoint::ReceiptCommitted
            ]
        );
    }

    #[test]
    fn checkpoint_names_round_trip() {
        for &c in Checkpoint::ALL {
            assert_eq!(c.as_str().parse::<Checkpoint>().unwrap(), c);
        }
        assert!("began".parse::<Checkpoint>().is_err());
    }
}
