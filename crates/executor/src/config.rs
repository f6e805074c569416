//! Executor configuration.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct ExecutorConfig {
    /// Lease owner name; unique per instance.
    pub id: String,
    pub database_url: String,
    pub max_connections: u32,
    pub nats_url: String,
    pub prefix: String,
    /// Attempts run at once.
    pub workers: usize,
    /// Most steps claimed in one statement.
    pub claim_batch: usize,
    /// PostgreSQL poll interval when no hint arrives.
    pub poll_ms: u64,
    /// Time given to attempts in flight after a shutdown signal.
    pub shutdown_grace_ms: u64,
    /// Fault injection (only with the `faults` feature): stall this long after the gateway
    /// answered and before committing, as a paused process would.
    #[cfg(feature = "faults")]
    pub fault_stall_after_response_ms: u64,
    /// Fault injection (only with the `faults` feature): abort the process right after this
    /// checkpoint is durable (`attempt_created`, `request_identity_persisted`,
    /// `invocation_began`), as a crash at that boundary would.
    #[cfg(feature = "faults")]
    pub fault_abort_after: Option<z29c_core::Checkpoint>,
}

impl Default for ExecutorConfig {
    fn default() -> Self {
        Self {
            id: "executor-1".into(),
            database_url: "postgres://postgres:postgres@127.0.0.1:5432/z29c".into(),
            max_connections: 10,
            nats_url: "nats://127.0.0.1:4222".into(),
            prefix: "z29c".into(),
            workers: 16,
            claim_batch: 8,
            poll_ms: 500,
            shutdown_grace_ms: 10_000,
            #[cfg(feature = "faults")]
            fault_stall_after_response_ms: 0,
            #[cfg(feature = "faults")]
            fault_abort_after: None,
        }
    }
}
