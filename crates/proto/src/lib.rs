//! z29c's wire types: the gRPC services (`WorkflowService`, `AdapterGateway`, `ReviewService`)
//! and the NATS envelopes, generated at build time from `proto/z29c/v1`.

#![allow(missing_debug_implementations, unreachable_pub, clippy::all)]

pub mod codec;
pub mod envelope;

/// Version 1 of the z29c protocol.
pub mod v1 {
    tonic::include_proto!("z29c.v1");
}
