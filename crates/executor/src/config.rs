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
    /// TLS to NATS (with `tls://` URLs): CA for the server's certificate, and this process's
    /// certificate for servers that verify clients. PostgreSQL's TLS is set in
    /// `database_url` (`sslmode=verify-full&sslrootcert=…&sslcert=…&sslkey=…`).
    pub nats_tls: z29c_security::TlsConfig,
    pub prefix: String,
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
    /// Where `/metrics` is served (Prometheus), if anywhere.
    pub metrics_listen: Option<std::net::SocketAddr>,
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
            database_url: "postgres://postgres:postgres@127.0.0.1:5432/z29c".into(),
            max_connections: 10,
            nats_url: "nats://127.0.0.1:4222".into(),
            nats_tls: Default::default(),
            prefix: "z29c".into(),
            workers: 16,
            claim_batch: 8,
            claim_ahead: None,
            poll_ms: 500,
            claim_gather_ms: 5,
            receipt_batch: 32,
            receipt_committers: 2,
            shutdown_grace_ms: 10_000,
            metrics_listen: None,
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
