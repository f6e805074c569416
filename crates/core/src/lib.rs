//! The pure rules of z29c: no I/O, no clocks of its own, exhaustively unit-tested.
//!
//! z29c keeps two records apart that are easy to confuse: a **lease** says who may work on a
//! step now, a **receipt** says what happened. This crate names both and holds every rule that
//! decides between them; `z29c-store` enforces the same rules inside PostgreSQL transactions.
//!
//! # Layout
//! - [`ids`]: newtype identifiers (`WorkflowId`, `StepId`, `AttemptId`, `LeaseVersion`,
//!   `RequestIdentity`, …) that parse instead of passing raw strings around.
//! - [`checkpoint`]: the ordered checkpoints of one attempt.
//! - [`state`]: workflow, step and attempt states, receipts' outcome and verification method.
//! - [`capability`]: what an adapter promises (idempotent, queryable, opaque).
//! - [`policy`]: `LeasePolicy` validated against `PlatformBounds`, and the four deadlines.
//! - [`retry`]: `RetryPolicy`: backoff, retryable refusals, and the budget for waiting.
//! - [`fence`]: the fencing rule every write under a lease must pass.
//! - [`recovery`]: `classify()`, the recovery table of docs/design.md §5.
//! - [`projection`]: `project()`, durable state to the product states people see.
//! - [`reasons`]: why a step failed, waits or is being recovered, in words people read.
//! - [`dag`]: validation of a submitted workflow's step graph.
//! - [`refs`]: references from a step's input to its dependencies' results, and resolving them.
//! - [`access`]: operator roles and which actions each allows.
//! - [`identity`]: service roles in certificates and which servers each may call.
//! - [`maintenance`]: when z29c vacuums its own tables (where no autovacuum will).
//! - [`connections`]: whether a service's pool fits the server's `max_connections`.

pub mod access;
pub mod capability;
pub mod checkpoint;
pub mod connections;
pub mod dag;
pub mod fence;
pub mod identity;
pub mod ids;
pub mod maintenance;
pub mod policy;
pub mod projection;
pub mod reasons;
pub mod recovery;
pub mod refs;
pub mod retry;
pub mod state;
mod text_enum;

pub use access::{Action, Role};
pub use capability::AdapterCapability;
pub use checkpoint::Checkpoint;
pub use dag::DagError;
pub use fence::{FenceReason, FencedWrite, LeaseClaim, LeaseKind, LeaseView};
pub use ids::{
    AttemptId, ClientKey, ExternalReference, InputDigest, LeaseVersion, OwnerId, RequestIdentity,
    StepId, StepName, WorkflowId,
};
pub use policy::{Deadlines, LeasePolicy, PlatformBounds, PolicyError, RenewalDecision};
pub use projection::{ProductState, StepFacts, project, project_workflow};
pub use recovery::{Evidence, RecoveryCategory, RecoveryDecision, classify};
pub use retry::{AfterRefusal, AfterWait, RetryPolicy, StatusSet, Waited};
pub use state::{AttemptState, Outcome, StepState, Verification, WorkflowState};

/// Error for a value that did not parse into one of z29c's domain types.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what}: {reason}")]
pub struct ParseError {
    /// The name of the field or type that was being parsed.
    pub what: &'static str,
    /// Why the input was refused.
    pub reason: String,
}

impl ParseError {
    pub(crate) fn new(what: &'static str, reason: impl Into<String>) -> Self {
        Self {
            what,
            reason: reason.into(),
        }
    }
}
