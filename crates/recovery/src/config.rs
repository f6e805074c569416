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
    /// How long finished workflows are kept, and how their history is removed.
    pub retention: RetentionConfig,
}

/// Retention by whole time periods (`z29c_store::retention`): every table that grows with
/// work is partitioned by period, and a period is dropped whole once it may go.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetentionConfig {
    /// How long a period lasts (`1d`, `1h`, `10m`; at least `1s`). The history of the
    /// workflows made in one period is dropped together, so a workflow is kept up to a
    /// period longer than `keep`.
    #[serde(with = "humantime_serde")]
    pub period: std::time::Duration,
    /// How long a finished workflow is kept after it finished (`90d`); none keeps
    /// everything. A period goes once it ended this long ago, each of its workflows
    /// finished this long ago, none of its review items is open and none of its permits is
    /// held.
    #[serde(with = "humantime_serde")]
    pub keep: Option<std::time::Duration>,
    /// Where each period is written before it is dropped, one gzip'd CSV per table
    /// (`<table>_<period>.csv.gz`), if anywhere. A period whose export fails is not dropped.
    pub export_dir: Option<std::path::PathBuf>,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            period: std::time::Duration::from_secs(24 * 60 * 60),
            keep: None,
            export_dir: None,
        }
    }
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
            retention: RetentionConfig::default(),
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
        if self.retention.period < std::time::Duration::from_secs(1) {
            return Err(Invalid::new("retention.period", "must be at least 1s"));
        }
        if self
            .retention
            .keep
            .is_some_and(|k| k < std::time::Duration::from_secs(1))
        {
            return Err(Invalid::new("retention.keep", "must be at least 1s"));
        }
        Ok(())
    }
}
