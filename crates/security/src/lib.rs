//! Who may talk to z29c, and how much.
//!
//! Services prove who they are to each other with certificates (mutual TLS: every internal
//! gRPC server requires a client certificate signed by the deployment's CA, naming a role
//! that server accepts). Operators prove
//! who they are with tokens (JWT, verified against configured keys) whose roles decide what
//! they may do (`z29c_core::access`). Each caller's submissions are rate-limited. `z29c dev`
//! and the test harness make a throwaway CA and signing secret with [`pki::DevPki`].
//!
//! # Layout
//! - [`tls`]: certificate files → tonic server and client TLS settings.
//! - [`identity`]: the role a peer's certificate names, checked by every server.
//! - [`token`]: operator tokens: verification, roles, and minting (dev, tests, `z29c token`).
//! - [`client`]: a token attached to every call of a client.
//! - [`rate`]: per-caller rate limits.
//! - [`pki`]: a throwaway CA and certificates, written to a directory.
//! - [`secret_url`]: a database URL whose password is never shown.

pub mod client;
pub mod identity;
pub mod pki;
pub mod rate;
pub mod secret_url;
pub mod tls;
pub mod token;

pub use client::{Authed, Bearer};
pub use secret_url::DatabaseUrl;
pub use tls::TlsConfig;
pub use token::{AuthConfig, Caller, Denied, Verifier};
