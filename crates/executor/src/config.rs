//! Executor configuration.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct ExecutorConfig {
    /// Lease owner name; unique per instance.
    pub id: String,
    /// The fields every service has (database, NATS, metrics), at the top level.
    #[serde(flatten)]
    pub shared: z29c_runtime::SharedConfig,
    pub max_connections: u32,
    /// Attempts run at once.
    pub workers: usize,
    /// Most steps claimed in one statement.
    pub claim_batch: usize,
    /// Steps claimed ahead while every worker is busy: each waits, leased, for the next worker
    /// that frees, so a finished attempt's worker starts its next step at once instead of after
    /// a claim. One that waits longer than half its renewal interval is given back unbegun,
    /// and the executor then claims no further ahead until an attempt ends within that time.
    /// Unset: a quarter of `workers` (none below 4 workers). 0: off.
    pub claim_ahead: Option<usize>,
    /// PostgreSQL poll interval when no hint arrives.
    pub poll_ms: u64,
    /// While steps are waiting (the last claim filled every free slot), a slot that frees
    /// waits up to this long for others before claiming, until a quarter of the pool is free:
    /// one claim transaction then serves several steps instead of one. 0 claims at once.
    pub claim_gather_ms: u64,
    /// Receipt batching: receipts of attempts that finish together share one statement, up to
    /// this many (each row fenced on its own; a receipt that statement cannot take, such as a
    /// failure or one with dependents, takes its own transaction). 1: off, every receipt is its
    /// own transaction.
    pub receipt_batch: usize,
    /// Connections writing shared receipt statements at once (a pool of their own, beside
    /// `max_connections`).
    pub receipt_committers: usize,
    /// Time given to attempts in flight after a shutdown signal.
    pub shutdown_grace_ms: u64,
    /// Where the gRPC health protocol is served (SERVING while PostgreSQL answers and NATS
    /// is connected), if anywhere: the executor has no other server.
    pub health_listen: Option<std::net::SocketAddr>,
    /// Mutual TLS: the certificate presented to gateways.
    pub tls: z29c_security::TlsConfig,
    /// Fault injection (only with the `faults` feature): stall this long after the gateway
    /// answered and before committing, as a paused process would.
    #[cfg(feature = "faults")]
    pub fault_stall_after_response_ms: u64,
    /// Fault injection (only with the `faults` feature): stall this long after each claim,
    /// before anything else (a window in which the claim's commit, made without waiting for
    /// the disk, can be lost in a PostgreSQL crash).
    #[cfg(feature = "faults")]
    pub fault_stall_after_claim_ms: u64,
    /// Fault injection (only with the `faults` feature): abort the process at this point of
    /// the attempt protocol, e.g. `before_invocation_began` or `after_receipt_committed`, as a
    /// crash at that line would.
    #[cfg(feature = "faults")]
    pub fault_crash: Option<z29c_store::faults::CrashPoint>,
    /// Fault injection (only with the `faults` feature): the deliberately broken build that
    /// commits receipts without the lease check. The fault matrix's checker must catch it.
    #[cfg(feature = "faults")]
    pub fault_break_receipt_fencing: bool,
}

impl Default for ExecutorConfig {
    fn default() -> Self {
        Self {
            id: "executor-1".into(),
            shared: z29c_runtime::SharedConfig::default(),
            max_connections: 10,
            workers: 16,
            claim_batch: 8,
            claim_ahead: None,
            poll_ms: 500,
            claim_gather_ms: 5,
            receipt_batch: 32,
            receipt_committers: 2,
            shutdown_grace_ms: 10_000,
            health_listen: None,
            tls: Default::default(),
            #[cfg(feature = "faults")]
            fault_stall_after_response_ms: 0,
            #[cfg(feature = "faults")]
            fault_stall_after_claim_ms: 0,
            #[cfg(feature = "faults")]
            fault_crash: None,
            #[cfg(feature = "faults")]
            fault_break_receipt_fencing: false,
        }
    }
}

impl z29c_runtime::Validate for ExecutorConfig {
    fn validate(&self) -> Result<(), z29c_runtime::config::Invalid> {
        use z29c_runtime::config::at_least_one;
        self.shared.validate()?;
        at_least_one("max_connections", self.max_connections as usize)?;
        at_least_one("workers", self.workers)?;
        at_least_one("claim_batch", self.claim_batch)?;
        at_least_one("receipt_batch", self.receipt_batch)?;
        at_least_one("receipt_committers", self.receipt_committers)?;
        if self.poll_ms == 0 {
            return Err(z29c_runtime::config::Invalid::new(
                "poll_ms",
                "must be at least 1 (the executor would poll PostgreSQL without pause)",
            ));
        }
        Ok(())
    }
}
