//! The adapter API: what a gateway asks of an adapter, and nothing more. An adapter makes the
//! call and says what it established; the gateway keeps everything around it (the permit,
//! *invocation began* under the step's lease, recording the answer before it replies,
//! registration), so an adapter never touches PostgreSQL and cannot break fencing.
//!
//! The HTTP adapter ([`HttpAdapter`]) speaks an API by its declared contract. A team with an
//! API that is not HTTP and JSON builds its own gateway binary: it implements [`Adapter`],
//! marks the adapter `kind = "custom"` in the gateway's file, and passes the implementation to
//! [`crate::run_with`] (see `examples/custom-gateway`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::config::{AdapterConfig, AdapterKind, GatewayConfig};
use crate::contract::HttpContract;
use crate::http::{self, CallOutcome, QueryOutcome};

/// One call, as the gateway hands it to an adapter once its permit is taken and *invocation
/// began* is durable.
#[derive(Debug, Clone, Copy)]
pub struct Invocation<'a> {
    /// The step's operation.
    pub operation: &'a str,
    /// The step's request identity: the same on every attempt. An idempotent adapter sends it
    /// so the API de-duplicates; a queryable one leaves it where a query can find it.
    pub identity: &'a str,
    /// The step's input.
    pub input: &'a Value,
    /// The time the call has: past it the gateway stops waiting and answers *unknown* itself.
    pub timeout: Duration,
}

/// A status query about one request identity.
#[derive(Debug, Clone, Copy)]
pub struct Inquiry<'a> {
    pub identity: &'a str,
    pub timeout: Duration,
}

/// An adapter. Say only what is known: an answer that proves nothing is
/// [`CallOutcome::Unknown`], and recovery decides by the adapter's declared capability.
#[tonic::async_trait]
pub trait Adapter: Send + Sync + 'static {
    /// Makes the call.
    async fn invoke(&self, call: Invocation<'_>) -> CallOutcome;
    /// Asks whether the request `ask.identity` arrived (for a queryable adapter; others are
    /// never asked). [`QueryOutcome::NotFound`] only when the API knows it never arrived.
    async fn query(&self, ask: Inquiry<'_>) -> QueryOutcome;
}

/// The adapters of a custom gateway binary, by the name its configuration gives them.
pub type Adapters = HashMap<String, Arc<dyn Adapter>>;

/// An API spoken over HTTP by its declared contract ([`crate::contract`]). Its headers are
/// marked sensitive where secret, so `Debug` shows them redacted.
#[derive(Debug)]
pub struct HttpAdapter {
    client: reqwest::Client,
    base_url: String,
    contract: HttpContract,
    headers: reqwest::header::HeaderMap,
}

impl HttpAdapter {
    /// The adapter `config` describes, its secret headers read now; the error names the
    /// header and where its value was to come from, never a value.
    pub fn new(client: reqwest::Client, config: &AdapterConfig) -> Result<Self, String> {
        Ok(Self {
            client,
            base_url: config.base_url.clone(),
            headers: config.http.resolve_headers()?,
            contract: config.http.clone(),
        })
    }

    fn call<'a>(
        &'a self,
        operation: &'a str,
        identity: &'a str,
        input: &'a Value,
        timeout: Duration,
    ) -> http::Call<'a> {
        http::Call {
            contract: &self.contract,
            headers: &self.headers,
            base_url: &self.base_url,
            operation,
            identity,
            input,
            timeout,
        }
    }
}

#[tonic::async_trait]
impl Adapter for HttpAdapter {
    async fn invoke(&self, c: Invocation<'_>) -> CallOutcome {
        http::invoke(
            &self.client,
            self.call(c.operation, c.identity, c.input, c.timeout),
        )
        .await
    }

    async fn query(&self, ask: Inquiry<'_>) -> QueryOutcome {
        http::query(
            &self.client,
            self.call("", ask.identity, &Value::Null, ask.timeout),
        )
        .await
    }
}

/// The adapters of a gateway: each of `config`'s adapters marked `custom` is taken from
/// `custom`, every other one is an [`HttpAdapter`]. Refused, naming the adapter and never a
/// secret, when one cannot be made (a secret's variable unset, its file unreadable) or a custom
/// adapter has no implementation, or an implementation no configuration.
pub fn build(config: &GatewayConfig, mut custom: Adapters) -> anyhow::Result<Adapters> {
    // a redirect is never followed: it would send the request (and its headers) again,
    // elsewhere; a 3xx no contract names reads as unknown
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()?;
    let mut adapters = Adapters::new();
    for a in &config.adapters {
        let adapter: Arc<dyn Adapter> = match a.kind {
            AdapterKind::Http => Arc::new(
                HttpAdapter::new(client.clone(), a)
                    .map_err(|e| anyhow::anyhow!("adapter {:?}: {e}", a.name))?,
            ),
            AdapterKind::Custom => custom.remove(&a.name).ok_or_else(|| {
                anyhow::anyhow!(
                    "adapter {:?} is custom, and this gateway binary has no implementation of that name",
                    a.name
                )
            })?,
        };
        adapters.insert(a.name.clone(), adapter);
    }
    if let Some(name) = custom.keys().next() {
        anyhow::bail!("adapter {name:?} is implemented but not configured (kind = \"custom\")");
    }
    Ok(adapters)
}
