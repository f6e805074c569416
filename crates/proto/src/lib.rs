//! z29c's wire types: the gRPC services (`WorkflowService`, `AdapterGateway`, `ReviewService`)
//! and the NATS envelopes, generated at build time from `proto/z29c/v1`; and the checks every
//! message from the network passes before anything acts on it.
//!
//! # Layout
//! - [`v1`]: the generated types and services.
//! - [`codec`]: the services' codec (a message that does not decode is `INVALID_ARGUMENT`).
//! - [`envelope`]: decoding and checking a NATS envelope.
//! - [`validate`]: checking requests field by field (the gateway's `Invoke`).
//! - [`workflow_file`]: the YAML workflow file and its conversion to a submission.

#![allow(missing_debug_implementations, unreachable_pub, clippy::all)]

pub mod codec;
pub mod envelope;
pub mod validate;
pub mod workflow_file;

/// Version 1 of the z29c protocol.
pub mod v1 {
    tonic::include_proto!("z29c.v1");
}
