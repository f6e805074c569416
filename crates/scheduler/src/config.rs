//! Scheduler configuration.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};
use z29c_core::PlatformBounds;
use z29c_runtime::ServerLimits;
use z29c_security::{AuthConfig, TlsConfig};
use z29c_store::workflows::SubmitLimits;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct SchedulerConfig {
    pub id: String,
    /// The fields every service has (database, NATS, metrics), at the top level.
    #[serde(flatten)]
    pub shared: z29c_runtime::SharedConfig,
    pub listen: SocketAddr,
    pub max_connections: u32,
    /// Apply migrations at start (under an advisory lock, so several instances may).
    pub migrate: bool,
    pub max_steps: usize,
    pub max_input_bytes: usize,
    pub max_request_bytes: usize,
    pub bounds: PlatformBounds,
    /// Where the gRPC health protocol alone is served without TLS (kubelet probes cannot
    /// present a client certificate), if anywhere.
    pub health_listen: Option<std::net::SocketAddr>,
    /// Where the HTTP/JSON API (`docs/openapi.yaml`) is served, if anywhere: the same
    /// `WorkflowService` behind the same tokens, roles and limits, with `tls` as the gRPC port
    /// has it (a client certificate from `tls.ca_file` required).
    pub http_listen: Option<std::net::SocketAddr>,
    /// How long an adapter that left the gateway registry is still taken as served: a
    /// restarting gateway, or NATS (whose registry starts empty), does not turn work away
    /// meanwhile; past it, work for the adapter is refused until a gateway serves it again.
    pub adapter_grace_ms: u64,
    /// Each caller's workflow submissions per second (0: no limit) and burst.
    pub submissions_per_second: u32,
    pub submission_burst: u32,
    /// Mutual TLS: this server requires a client certificate from `tls.ca_file`.
    pub tls: TlsConfig,
    /// Operator tokens and roles.
    pub auth: AuthConfig,
    /// Deadline cap and per-connection limits of the gRPC server.
    pub grpc: ServerLimits,
    /// How often to look for z29c tables that no autovacuum visits (the server's
    /// `autovacuum` is off, or the table's) and vacuum those past autovacuum's own threshold;
    /// 0: never. Where autovacuum runs, each look is one read of the statistics.
    pub vacuum_every_ms: u64,
    /// Submission batching: submissions that arrive together share one statement and one
    /// commit, up to this many; 1 = each its own.
    pub submission_batch: usize,
    /// Such statements at once, on connections of their own beside `max_connections`.
    pub submission_committers: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            id: "scheduler-1".into(),
            shared: z29c_runtime::SharedConfig::default(),
            listen: "127.0.0.1:50051".parse().expect("literal address"),
            max_connections: 10,
            migrate: true,
            max_steps: 1_000,
            max_input_bytes: 64 * 1024,
            max_request_bytes: 4 * 1024 * 1024,
            bounds: PlatformBounds::default(),
            health_listen: None,
            http_listen: None,
            adapter_grace_ms: 30_000,
            submissions_per_second: 500,
            submission_burst: 1_000,
            tls: TlsConfig::default(),
            auth: AuthConfig::default(),
            grpc: ServerLimits::default(),
            vacuum_every_ms: 10_000,
            submission_batch: 32,
            submission_committers: 2,
        }
    }
}

impl SchedulerConfig {
    pub fn limits(&self) -> SubmitLimits {
        SubmitLimits {
            max_steps: self.max_steps,
            max_input_bytes: self.max_input_bytes,
            bounds: self.bounds,
        }
    }
}

impl z29c_runtime::Validate for SchedulerConfig {
    fn validate(&self) -> Result<(), z29c_runtime::config::Invalid> {
        use z29c_runtime::config::at_least_one;
        self.shared.validate()?;
        self.grpc.validate()?;
        at_least_one("max_connections", self.max_connections as usize)?;
        at_least_one("max_steps", self.max_steps)?;
        at_least_one("max_input_bytes", self.max_input_bytes)?;
        at_least_one("max_request_bytes", self.max_request_bytes)?;
        at_least_one("submission_batch", self.submission_batch)?;
        at_least_one("submission_committers", self.submission_committers)?;
        // bounds that a step leaving its policy to the defaults could not meet would refuse
        // every such submission: say so at start instead
        z29c_core::LeasePolicy::default()
            .validate(&self.bounds)
            .map_err(|e| {
                z29c_runtime::config::Invalid::new(
                    "bounds",
                    format!("the default step policy does not fit them: {e}"),
                )
            })?;
        Ok(())
    }
}
