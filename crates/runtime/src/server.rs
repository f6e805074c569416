//! One way every z29c gRPC server is built: mutual TLS when configured, and limits on what one
//! caller can hold — a deadline cap (a client's missing or longer deadline is cut to it), calls
//! in flight per connection, and HTTP/2 streams per connection.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use z29c_security::TlsConfig;

/// Limits of one gRPC server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ServerLimits {
    /// Longest a call may run; a client's missing or longer deadline is cut to this (the
    /// answer is `DEADLINE_EXCEEDED`). Streams (`Watch`) are not cut once they started.
    pub max_deadline_ms: u64,
    /// Calls one connection may have in flight at once; more wait.
    pub concurrency_per_connection: usize,
    /// HTTP/2 streams one connection may open at once.
    pub max_concurrent_streams: u32,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            max_deadline_ms: 30_000,
            concurrency_per_connection: 64,
            max_concurrent_streams: 256,
        }
    }
}

/// A server builder with `tls` and `limits` applied.
pub fn builder(tls: &TlsConfig, limits: &ServerLimits) -> anyhow::Result<tonic::transport::Server> {
    if !tls.enabled()? {
        tracing::warn!(
            "gRPC without TLS: any process that reaches this port may call it (set tls)"
        );
    }
    Ok(tls
        .server_builder()?
        .timeout(Duration::from_millis(limits.max_deadline_ms.max(1)))
        .concurrency_limit_per_connection(limits.concurrency_per_connection.max(1))
        .max_concurrent_streams(limits.max_concurrent_streams.max(1)))
}

impl crate::Validate for ServerLimits {
    fn validate(&self) -> Result<(), crate::config::Invalid> {
        use crate::config::{Invalid, at_least_one};
        if self.max_deadline_ms == 0 {
            return Err(Invalid::new("grpc.max_deadline_ms", "must be at least 1"));
        }
        at_least_one(
            "grpc.concurrency_per_connection",
            self.concurrency_per_connection,
        )?;
        if self.max_concurrent_streams == 0 {
            return Err(Invalid::new(
                "grpc.max_concurrent_streams",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}
