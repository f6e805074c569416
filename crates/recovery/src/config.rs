//! Recovery configuration.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct RecoveryConfig {
    /// Recovery-lease owner name; unique per instance.
    pub id: String,
    /// Where `ReviewService` listens.
    pub listen: std::net::SocketAddr,
    /// Where the gRPC health protocol alone is served without TLS (kubelet probes cannot
    /// present a client certificate), if anywhere.
    pub health_listen: Option<std::net::SocketAddr>,
    /// Where `/metrics` is served (Prometheus), if anywhere.
    pub metrics_listen: Option<std::net::SocketAddr>,
    pub database_url: String,
    pub max_connections: u32,
    pub nats_url: String,
    /// TLS to NATS (with `tls://` URLs): CA for the server's certificate, and this process's
    /// certificate for servers that verify clients. PostgreSQL's TLS is set in
    /// `database_url` (`sslmode=verify-full&sslrootcert=…&sslcert=…&sslkey=…`).
    pub nats_tls: z29c_security::TlsConfig,
    pub prefix: String,
    /// How often to look for expired leases.
    pub scan_ms: u64,
    /// Most expired leases handled per scan.
    pub batch: i64,
    /// How long a recovery lease lasts; a recovery worker that dies is itself recovered.
    pub recovery_lease_ms: u64,
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
            listen: "127.0.0.1:50053".parse().expect("literal address"),
            health_listen: None,
            metrics_listen: None,
            database_url: "postgres://postgres:postgres@127.0.0.1:5432/z29c".into(),
            max_connections: 4,
            nats_url: "nats://127.0.0.1:4222".into(),
            nats_tls: Default::default(),
            prefix: "z29c".into(),
            scan_ms: 500,
            batch: 50,
            recovery_lease_ms: 30_000,
            tls: Default::default(),
            auth: Default::default(),
            grpc: Default::default(),
            max_request_bytes: 64 * 1024,
        }
    }
}
