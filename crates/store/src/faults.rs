//! Deterministic fault points for the scenario harness (docs/design.md §4). They do something only
//! in a build with the `faults` feature, which no release build has: `scripts/release` builds
//! `-p z29c-cli` alone, so the feature is not unified on.
//!
//! A [`CrashPoint`] names one side of one durable boundary of the attempt protocol. The store
//! owns the points *inside* its transactions (right before `COMMIT`); the process that made
//! the commit owns the points after it returned: the adapter gateway for *invocation began*
//! ([`CrashPoint::in_gateway`]), the executor for the others. [`break_receipt_fencing`] is the deliberately broken build
//! the checker must catch: it lets a receipt commit under a lease that is no longer current.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use z29c_core::Checkpoint;

/// Which side of a boundary a crash point is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The transaction's work is done, `COMMIT` was not sent: nothing of it is durable.
    Before,
    /// `COMMIT` returned: the checkpoint is durable, the next step has not started.
    After,
}

/// `before_<checkpoint>` or `after_<checkpoint>`, e.g. `after_invocation_began`.
///
/// The gateway records a definite answer (*response observed*) before it replies, and the
/// executor's receipt transaction writes it again with the receipt: `before_response_observed`
/// is an executor crash with the answer in its memory (and, for a definite answer, in the
/// gateway's record), `after_response_observed` a crash inside the receipt transaction once
/// the attempt's response is written, and `before_receipt_committed` a crash right before its
/// `COMMIT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct CrashPoint {
    pub side: Side,
    pub checkpoint: Checkpoint,
}

impl CrashPoint {
    /// The ten points, in protocol order.
    pub fn all() -> Vec<CrashPoint> {
        Checkpoint::ALL
            .iter()
            .flat_map(|&checkpoint| {
                [Side::Before, Side::After].map(|side| CrashPoint { side, checkpoint })
            })
            .collect()
    }

    pub fn before(checkpoint: Checkpoint) -> Self {
        Self {
            side: Side::Before,
            checkpoint,
        }
    }

    pub fn after(checkpoint: Checkpoint) -> Self {
        Self {
            side: Side::After,
            checkpoint,
        }
    }

    /// Whether the adapter gateway reaches this point, not the executor: the gateway commits
    /// *invocation began* in the transaction that takes the call's permit.
    pub fn in_gateway(self) -> bool {
        self.checkpoint == Checkpoint::InvocationBegan
    }
}

impl fmt::Display for CrashPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let side = match self.side {
            Side::Before => "before",
            Side::After => "after",
        };
        write!(f, "{side}_{}", self.checkpoint)
    }
}

impl FromStr for CrashPoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (side, rest) = if let Some(rest) = s.strip_prefix("before_") {
            (Side::Before, rest)
        } else if let Some(rest) = s.strip_prefix("after_") {
            (Side::After, rest)
        } else {
            return Err(format!(
                "crash point {s:?}: expected before_<checkpoint> or after_<checkpoint>"
            ));
        };
        let checkpoint = rest
            .parse()
            .map_err(|e| format!("crash point {s:?}: {e}"))?;
        Ok(Self { side, checkpoint })
    }
}

impl TryFrom<String> for CrashPoint {
    type Error = String;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<CrashPoint> for String {
    fn from(p: CrashPoint) -> Self {
        p.to_string()
    }
}

/// A deliberately broken build, one per rule the checker must defend: each breaks one rule
/// of the attempt protocol, and a scenario run on it must be judged guilty by the checker
/// (the suite proves it does). Switched on for a process by `Z29C_FAULT_BREAK`, a
/// comma-separated list of names, in a build with the `faults` feature; never in a release.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Break {
    /// "Could something have been sent?" asked of the step's current attempt only.
    CurrentAttemptOnly,
    /// Every attempt gets a request identity of its own, so no retry is recognised.
    NewIdentityPerRetry,
    /// Recovery treats an opaque adapter as idempotent, and sends again.
    OpaqueRetried,
    /// A `409` for a request still in flight is read as a refusal.
    ConflictRefused,
    /// A status query's "still being processed" is read as "no such request", which recovery
    /// answers with a retry.
    InProgressAsNotFound,
    /// An answer that arrives after its attempt's lease moved on is thrown away instead of
    /// kept as a late observation.
    LateResultDropped,
    /// A full operation class still grants a permit (one without a slot): the adapter's
    /// limit no longer bounds the calls in flight.
    PermitLimitIgnored,
    /// Recovery acts on a step while its expired attempt's call is still in flight at a
    /// gateway, so a person reviews it before its answer is in.
    ReviewDuringCall,
}

impl Break {
    pub const ALL: [Break; 8] = [
        Break::CurrentAttemptOnly,
        Break::NewIdentityPerRetry,
        Break::OpaqueRetried,
        Break::ConflictRefused,
        Break::InProgressAsNotFound,
        Break::LateResultDropped,
        Break::PermitLimitIgnored,
        Break::ReviewDuringCall,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Break::CurrentAttemptOnly => "current_attempt_only",
            Break::NewIdentityPerRetry => "new_identity_per_retry",
            Break::OpaqueRetried => "opaque_retried",
            Break::ConflictRefused => "conflict_refused",
            Break::InProgressAsNotFound => "in_progress_as_not_found",
            Break::LateResultDropped => "late_result_dropped",
            Break::PermitLimitIgnored => "permit_limit_ignored",
            Break::ReviewDuringCall => "review_during_call",
        }
    }
}

impl fmt::Display for Break {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Break {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|b| b.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|b| b.as_str()).collect();
                format!("no broken build {s:?}: one of {}", names.join(", "))
            })
    }
}

/// Parses `Z29C_FAULT_BREAK`'s value; an unknown name is an error naming the known ones.
pub fn parse_breaks(list: &str) -> Result<Vec<Break>, String> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::parse)
        .collect()
}

#[cfg(feature = "faults")]
mod switches {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::{Break, CrashPoint};

    static BREAKS: OnceLock<Vec<Break>> = OnceLock::new();

    /// Whether this process runs as the broken build `b` (`Z29C_FAULT_BREAK`, read once).
    pub fn broken(b: Break) -> bool {
        BREAKS
            .get_or_init(|| {
                let list = std::env::var("Z29C_FAULT_BREAK").unwrap_or_default();
                match super::parse_breaks(&list) {
                    Ok(breaks) => {
                        for b in &breaks {
                            tracing::error!(broken = %b, "fault: this build is broken on purpose");
                        }
                        breaks
                    }
                    Err(e) => {
                        // a test asked for a break this build does not know: say so loudly
                        tracing::error!(error = %e, "Z29C_FAULT_BREAK");
                        std::process::abort();
                    }
                }
            })
            .contains(&b)
    }

    static CRASH: OnceLock<CrashPoint> = OnceLock::new();
    static UNFENCED_RECEIPTS: AtomicBool = AtomicBool::new(false);

    /// Arms `point` for this process. The first call wins.
    pub fn arm(point: CrashPoint) {
        let _ = CRASH.set(point);
    }

    /// The broken build: receipts commit without their lease check.
    pub fn break_receipt_fencing() {
        tracing::error!("fault: receipt fencing is OFF; this build is broken on purpose");
        UNFENCED_RECEIPTS.store(true, Ordering::SeqCst);
    }

    pub(crate) fn receipts_unfenced() -> bool {
        UNFENCED_RECEIPTS.load(Ordering::SeqCst)
    }

    pub fn is_armed(point: CrashPoint) -> bool {
        CRASH.get() == Some(&point)
    }

    /// Aborts the process if `point` is armed: no unwinding, no destructors, no `ROLLBACK`
    /// sent, exactly what a SIGKILL at this line would leave.
    pub fn crash_if_armed(point: CrashPoint) {
        if CRASH.get() == Some(&point) {
            tracing::error!(%point, "fault: crashing here");
            std::process::abort();
        }
    }
}

#[cfg(feature = "faults")]
pub(crate) use switches::receipts_unfenced;
#[cfg(feature = "faults")]
pub use switches::{arm, break_receipt_fencing, broken, crash_if_armed, is_armed};

#[cfg(not(feature = "faults"))]
#[inline(always)]
pub fn broken(_b: Break) -> bool {
    false
}

#[cfg(not(feature = "faults"))]
#[inline(always)]
pub fn crash_if_armed(_point: CrashPoint) {}

#[cfg(not(feature = "faults"))]
#[inline(always)]
pub fn is_armed(_point: CrashPoint) -> bool {
    false
}

#[cfg(not(feature = "faults"))]
#[inline(always)]
pub(crate) fn receipts_unfenced() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_points_round_trip_and_bad_names_are_named() {
        let all = CrashPoint::all();
        assert_eq!(all.len(), 10);
        for p in all {
            assert_eq!(p.to_string().parse::<CrashPoint>(), Ok(p));
        }
        assert!(
            "during_invocation_began"
                .parse::<CrashPoint>()
                .unwrap_err()
                .contains("before_<checkpoint>")
        );
        assert!("after_lunch".parse::<CrashPoint>().is_err());
    }

    #[test]
    fn broken_builds_round_trip_and_an_unknown_one_is_named() {
        for b in Break::ALL {
            assert_eq!(b.as_str().parse::<Break>(), Ok(b));
        }
        assert_eq!(
            parse_breaks("opaque_retried, conflict_refused"),
            Ok(vec![Break::OpaqueRetried, Break::ConflictRefused])
        );
        assert_eq!(parse_breaks(""), Ok(vec![]));
        let e = parse_breaks("opaque_retried,everything").unwrap_err();
        assert!(
            e.contains("\"everything\"") && e.contains("current_attempt_only"),
            "{e}"
        );
    }
}
