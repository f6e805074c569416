//! A Rust client for z29c's public gRPC API: submit workflows, follow them to their end, list
//! and cancel them, and work the review queue. Answers speak in product states
//! (docs/design.md §7) and are the generated wire types, re-exported as [`pb`].
//!
//! ```no_run
//! use z29c_client::{Access, Client, End, ListFilter, pb};
//!
//! # async fn order() -> z29c_client::Result<()> {
//! let access = Access::new().token("eyJhbGciOi…");
//! let client = Client::connect("http://127.0.0.1:50051", &access).await?;
//!
//! let file = z29c_client::workflow_file::parse(
//!     r#"
//! client_key: order-1042
//! name: order
//! steps:
//!   - { name: reserve, adapter: inventory, operation: reservations, input: { sku: A-7 } }
//!   - name: charge
//!     adapter: payments
//!     operation: charges
//!     input: { amount: 1999, reservation: "${steps.reserve.result/id}" }
//!     depends_on: [reserve]
//! "#,
//! )?;
//! let submitted = client.submit_file(file).await?;
//! let ended = client.await_end(&submitted.workflow.id).await?;
//! match ended.end {
//!     End::Completed => {
//!         let charge = ended.step("charge").expect("a step of the file");
//!         let reference = charge.receipt.as_ref().map(|r| r.external_reference.as_str());
//!         assert!(reference.is_some() && !charge.result_json.is_empty());
//!     }
//!     End::NeedsReview => { /* a person decides: see `Reviews` */ }
//!     End::Failed | End::Cancelled => eprintln!("{}", ended.workflow.reason),
//! }
//!
//! let waiting = ListFilter::new().state(pb::ProductState::NeedsReview).name("order");
//! for workflow in client.list_all(&waiting).await? {
//!     client.cancel(&workflow.id, "the customer withdrew the order").await?;
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # Layout
//! - [`Access`]: TLS and the operator token, for either service.
//! - [`Client`]: the scheduler's `WorkflowService`.
//! - [`Reviews`]: a recovery instance's `ReviewService`.
//! - [`Error`]: what went wrong, keeping the server's gRPC code and message.

mod error;
mod reviews;
mod workflows;

use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use tonic::transport::Channel;
use z29c_security::Bearer;

pub use error::{Error, Result};
pub use reviews::{Resolution, Reviews};
pub use workflows::{Client, End, Ended, Events, ListFilter, Page, Submitted};
pub use z29c_proto::v1 as pb;
pub use z29c_proto::workflow_file;
pub use z29c_security::TlsConfig;

/// How to reach the services: TLS (a CA and, for mutual TLS, this client's certificate) and
/// an operator token sent as `authorization: Bearer …`. The default is plaintext without a
/// token, which only a loopback development deployment accepts.
#[derive(Debug, Clone)]
pub struct Access {
    tls: TlsConfig,
    token: Option<SecretString>,
    connect_timeout: Duration,
    call_timeout: Duration,
}

impl Default for Access {
    fn default() -> Self {
        Self {
            tls: TlsConfig::default(),
            token: None,
            connect_timeout: Duration::from_secs(5),
            call_timeout: Duration::from_secs(30),
        }
    }
}

impl Access {
    pub fn new() -> Self {
        Self::default()
    }

    /// Certificate files; an `http://` URL is then reached as `https://`.
    #[must_use]
    pub fn tls(mut self, tls: TlsConfig) -> Self {
        self.tls = tls;
        self
    }

    /// The operator token (a JWT); an empty one sends none.
    #[must_use]
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(SecretString::from(token.into()));
        self
    }

    /// How long connecting may take (5 s by default).
    #[must_use]
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The deadline of each call other than a watch (30 s by default).
    #[must_use]
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    async fn channel(&self, url: &str) -> Result<(Channel, Bearer)> {
        let bearer = Bearer::new(self.token.as_ref().map(ExposeSecret::expose_secret))
            .map_err(Error::config)?;
        let endpoint = self
            .tls
            .endpoint(url)
            .map_err(Error::config)?
            .connect_timeout(self.connect_timeout);
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| Error::unreachable(url, &e))?;
        Ok((channel, bearer))
    }
}
