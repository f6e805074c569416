//! Recovery configuration.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct RecoveryConfig {
    /// Recovery-lease owner name; unique per instance.
    pub id: String,
    /// The fields every service has (database, NATS, metrics), at the top level.
    #[serde(flatten)]
    pub shared: z29c_runtime::SharedConfig,
    /// Where `ReviewService` listens.
    pub listen: std::net::SocketAddr,
    /// Where the gRPC health protocol alone is served without TLS (kubelet probes cannot
    /// present a client certificate), if anywhere.
    pub health_listen: Option<std::net::SocketAddr>,
    pub max_connections: u32,
    /// How often to look for expired leases.
    pub scan_ms: u64,
    /// Most expired leases handled per scan.
    pub batch: i64,
    /// How long a recovery lease lasts; a recovery worker that dies is itself recovered.
    pub recovery_lease_ms: u64,
    /// How long recovery waits, asking again every two seconds, for a registered gateway to
    /// describe a step's adapter before it decides as for an opaque adapter (a person
    /// reviews). It never decides from a capability it does not know.
    pub capability_patience_ms: u64,
    /// Mutual TLS: `ReviewService` requires a client certificate from `tls.ca_file`, and the
    /// same certificate is presented to gateways.
    pub tls: z29c_security::TlsConfig,
    /// Operator tokens and roles for `ReviewService`.
    pub auth: z29c_security::AuthConfig,
    /// Deadline cap and per-connection limits of the gRPC server.
    pub grpc: z29c_runtime::ServerLimits,
    /// Largest request `ReviewService` accepts.
    pub max_request_bytes: usize,
}

impl Default for RecoveryConfig {
    fn default() -> Self {
        Self {
            id: "recovery-1".into(),
            shared: z29c_runtime::SharedConfig::default(),
            listen: "127.0.0.1:50053".parse().expect("literal address"),
            health_listen: None,
            max_connections: 4,
            scan_ms: 500,
            batch: 50,
            recovery_lease_ms: 30_000,
            capability_patience_ms: 60_000,
            tls: Default::default(),
            auth: Default::default(),
            grpc: Default::default(),
            max_request_bytes: 64 * 1024,
        }
    }
}

impl z29c_runtime::Validate for RecoveryConfig {
    fn validate(&self) -> Result<(), z29c_runtime::config::Invalid> {
        use z29c_runtime::config::{Invalid, at_least_one};
        self.shared.validate()?;
        self.grpc.validate()?;
        at_least_one("max_connections", self.max_connections as usize)?;
        at_least_one("max_request_bytes", self.max_request_bytes)?;
        if self.batch < 1 {
            return Err(Invalid::new("batch", "must be at least 1"));
        }
        if self.scan_ms == 0 {
            return Err(Invalid::new("scan_ms", "must be at least 1"));
        }
        if self.recovery_lease_ms == 0 {
            return Err(Invalid::new("recovery_lease_ms", "must be at least 1"));
        }
        Ok(())
    }
}
