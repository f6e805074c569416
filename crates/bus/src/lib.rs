//! z29c on NATS: subject names, the JetStream stream, pull consumers, envelopes, and publishing
//! with `Nats-Msg-Id` so JetStream drops duplicates.
//!
//! NATS carries hints, not truth. A consumer that receives an envelope re-reads PostgreSQL
//! before acting; a lost message only delays work (every service also polls), a duplicate
//! changes nothing. Every name is under a configurable prefix, so deployments, and tests, share
//! a NATS server without seeing each other's messages.

pub mod auth;
pub mod gateways;

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer, stream};
use bytes::Bytes;
use prost::Message as _;
use z29c_proto::v1::{Envelope, envelope::Body};

pub use z29c_proto::v1 as wire;

/// The header JetStream de-duplicates on.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";
/// W3C trace context of the publishing span.
pub const TRACEPARENT_HEADER: &str = "traceparent";

pub type Result<T, E = BusError> = std::result::Result<T, E>;

/// What went wrong on the bus, phrased as what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    /// NATS is unreachable or refused the request. Retry later; PostgreSQL polling covers the gap.
    #[error("nats: {0}")]
    Nats(String),
    /// A message that is not a z29c envelope. Terminate it; never redeliver it forever.
    #[error("malformed envelope: {0}")]
    Malformed(String),
    /// The prefix cannot be used in subject or stream names.
    #[error("invalid prefix {0:?}: use 1 to 32 letters, digits, '-' or '_'")]
    InvalidPrefix(String),
}

fn nats<E: std::fmt::Display>(e: E) -> BusError {
    BusError::Nats(e.to_string())
}

/// How long [`Bus::connect_with`] keeps trying a server that is not reachable yet.
pub const CONNECT_PATIENCE: Duration = Duration::from_secs(30);

/// Why one try at connecting failed.
#[derive(Debug, thiserror::Error)]
enum Connecting {
    #[error("{0}")]
    Connect(async_nats::ConnectError),
    #[error("creating the stream: {0}")]
    Stream(jetstream::context::CreateStreamError),
}

impl Connecting {
    /// Worth another try: the server may come up, or answer, in a moment.
    fn transient(&self) -> bool {
        use async_nats::ConnectErrorKind as C;
        use jetstream::context::CreateStreamErrorKind as S;
        match self {
            Connecting::Connect(e) => match e.kind() {
                C::Dns | C::TimedOut | C::MaxReconnects => true,
                // a refused or dropped connection may work in a moment; a TLS handshake that
                // fails (an io error of kind InvalidData) will not
                C::Io => std::error::Error::source(e)
                    .and_then(|s| s.downcast_ref::<std::io::Error>())
                    .is_none_or(|io| io.kind() != std::io::ErrorKind::InvalidData),
                _ => false,
            },
            Connecting::Stream(e) => matches!(e.kind(), S::TimedOut | S::JetStreamUnavailable),
        }
    }
}

/// The kinds of hint z29c publishes, one subject each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topic {
    StepReady,
    StepCompleted,
    LateEvidence,
    WorkflowChanged,
}

impl Topic {
    pub const ALL: [Topic; 4] = [
        Topic::StepReady,
        Topic::StepCompleted,
        Topic::LateEvidence,
        Topic::WorkflowChanged,
    ];

    const fn suffix(self) -> &'static str {
        match self {
            Self::StepReady => "step.ready",
            Self::StepCompleted => "step.completed",
            Self::LateEvidence => "evidence.late",
            Self::WorkflowChanged => "workflow.changed",
        }
    }

    /// The topic an outbox kind (as stored by `z29c-store`) is published on.
    pub fn from_outbox_kind(kind: &str) -> Option<Self> {
        match kind {
            "step_ready" => Some(Self::StepReady),
            "step_completed" => Some(Self::StepCompleted),
            "late_evidence" => Some(Self::LateEvidence),
            "workflow_changed" => Some(Self::WorkflowChanged),
            _ => None,
        }
    }

    /// The topic an envelope belongs on.
    pub fn of(envelope: &Envelope) -> Option<Self> {
        Some(match envelope.body.as_ref()? {
            Body::StepReady(_) => Self::StepReady,
            Body::StepCompleted(_) => Self::StepCompleted,
            Body::LateEvidence(_) => Self::LateEvidence,
            Body::WorkflowChanged(_) => Self::WorkflowChanged,
        })
    }
}

/// Subject and stream names under one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    prefix: String,
}

impl Names {
    pub fn new(prefix: &str) -> Result<Self> {
        let ok = !prefix.is_empty()
            && prefix.len() <= 32
            && prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !ok {
            return Err(BusError::InvalidPrefix(prefix.to_owned()));
        }
        Ok(Self {
            prefix: prefix.to_owned(),
        })
    }

    pub fn subject(&self, topic: Topic) -> String {
        format!("{}.{}", self.prefix, topic.suffix())
    }

    /// The one stream that keeps every z29c hint under this prefix.
    pub fn stream(&self) -> String {
        format!(
            "{}_EVENTS",
            self.prefix.to_ascii_uppercase().replace('-', "_")
        )
    }

    /// The stream that keeps the gateway registry.
    pub fn registry_name(&self) -> String {
        format!("{}_REGISTRY", self.stream().trim_end_matches("_EVENTS"))
    }
}

/// Decodes an envelope, refusing anything that is not one (see `z29c_proto::envelope`).
pub fn decode(payload: &[u8]) -> Result<Envelope> {
    z29c_proto::envelope::decode(payload).map_err(BusError::Malformed)
}

/// Decodes an envelope that must belong on `topic`.
pub fn decode_on(payload: &[u8], topic: Topic) -> Result<Envelope> {
    let envelope = decode(payload)?;
    match Topic::of(&envelope) {
        Some(t) if t == topic => Ok(envelope),
        other => Err(BusError::Malformed(format!(
            "a {other:?} body on the {topic:?} subject"
        ))),
    }
}

/// The body of a max-deliveries advisory (the fields z29c records).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct MaxDeliveries {
    pub stream: String,
    pub consumer: String,
    pub stream_seq: u64,
    pub deliveries: u64,
}

/// Whether a publish was new or a duplicate JetStream dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    pub sequence: u64,
    pub duplicate: bool,
}

/// A message sent to the stream whose acknowledgement has not been awaited yet.
#[must_use = "a message is published only once its acknowledgement arrives"]
pub struct Sent(jetstream::context::PublishAckFuture);

impl std::fmt::Debug for Sent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sent(awaiting the stream's acknowledgement)")
    }
}

impl Sent {
    /// Waits for the stream's acknowledgement: the message is stored (or was a duplicate).
    pub async fn acked(self) -> Result<Published> {
        let ack = self.0.await.map_err(nats)?;
        Ok(Published {
            sequence: ack.sequence,
            duplicate: ack.duplicate,
        })
    }
}

/// A connection to z29c's stream.
#[derive(Debug, Clone)]
pub struct Bus {
    client: async_nats::Client,
    js: jetstream::Context,
    names: Names,
}

impl Bus {
    /// Connects and makes sure the stream exists (file storage, a de-duplication window that
    /// outlasts an outbox claim, bounded age).
    pub async fn connect(url: &str, prefix: &str) -> Result<Self> {
        Self::connect_with(url, prefix, &z29c_security::TlsConfig::default()).await
    }

    /// [`Bus::connect`] with TLS to NATS: the server's certificate checked against
    /// `tls.ca_file`, and this process's certificate presented (for servers that verify
    /// clients). Without files, TLS is still used for `tls://` URLs, with the system's roots.
    ///
    /// A server that is starting, briefly unreachable or slow to answer JetStream is retried
    /// with capped, jittered backoff for up to [`CONNECT_PATIENCE`], as PostgreSQL is, so
    /// services may start (and restart) in any order; a bad URL, credentials or TLS setup fail
    /// at once.
    pub async fn connect_with(
        url: &str,
        prefix: &str,
        tls: &z29c_security::TlsConfig,
    ) -> Result<Self> {
        Self::connect_as(url, prefix, tls, None, &auth::NatsAuth::default()).await
    }

    /// [`Bus::connect_with`] as the service `role`, proving itself with `auth`'s NKey: replies
    /// come to the role's own inbox ([`auth::inbox_prefix`]), as the server's permissions
    /// for that role expect.
    pub async fn connect_as(
        url: &str,
        prefix: &str,
        tls: &z29c_security::TlsConfig,
        role: Option<z29c_core::identity::ServiceRole>,
        auth: &auth::NatsAuth,
    ) -> Result<Self> {
        use backon::Retryable;
        let names = Names::new(prefix)?;
        let mut options = async_nats::ConnectOptions::new().name(match role {
            Some(r) => format!("z29c-{r}"),
            None => "z29c".to_owned(),
        });
        if let Some(role) = role {
            options = options.custom_inbox_prefix(auth::inbox_prefix(&names, role));
        }
        if let Some(seed) = auth.seed().map_err(nats)? {
            options = options.nkey(seed);
        }
        if tls.enabled().map_err(nats)? {
            if let Some(ca) = &tls.ca_file {
                options = options.add_root_certificates(ca.clone());
            }
            if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
                options = options.add_client_certificate(cert.clone(), key.clone());
            }
            options = options.require_tls(true);
        }
        let once = || async {
            let client = options
                .clone()
                .connect(url)
                .await
                .map_err(Connecting::Connect)?;
            let js = jetstream::new(client.clone());
            js.get_or_create_stream(stream::Config {
                name: names.stream(),
                subjects: Topic::ALL.iter().map(|t| names.subject(*t)).collect(),
                storage: stream::StorageType::File,
                duplicate_window: Duration::from_secs(120),
                max_age: Duration::from_secs(24 * 3600),
                ..Default::default()
            })
            .await
            .map_err(Connecting::Stream)?;
            Ok::<_, Connecting>((client, js))
        };
        let (client, js) = once
            .retry(z29c_core::policy::connect_backoff(CONNECT_PATIENCE))
            .sleep(tokio::time::sleep)
            .when(Connecting::transient)
            .notify(|e, wait| {
                tracing::warn!(error = %e, ?wait, "NATS not reachable yet; retrying");
            })
            .await
            .map_err(nats)?;
        Ok(Self { client, js, names })
    }

    pub fn names(&self) -> &Names {
        &self.names
    }

    /// Whether the NATS connection is up now (readiness).
    pub fn is_connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// Publishes an envelope on its topic with `Nats-Msg-Id = msg_id` and waits for the
    /// stream's acknowledgement.
    pub async fn publish(&self, envelope: &Envelope) -> Result<Published> {
        self.publish_traced(envelope, None).await
    }

    /// [`Bus::publish`], with a W3C `traceparent` header when one is given, so the consumer's
    /// span continues the publisher's trace.
    pub async fn publish_traced(
        &self,
        envelope: &Envelope,
        traceparent: Option<&str>,
    ) -> Result<Published> {
        self.send_traced(envelope, traceparent).await?.acked().await
    }

    /// The first half of [`Bus::publish_traced`]: sends the message and returns at once, before
    /// the stream's acknowledgement, so a batch of publishes can be sent back to back and their
    /// acknowledgements awaited after (JetStream keeps one connection's publishes in order).
    pub async fn send_traced(
        &self,
        envelope: &Envelope,
        traceparent: Option<&str>,
    ) -> Result<Sent> {
        let topic = Topic::of(envelope)
            .ok_or_else(|| BusError::Malformed("envelope without body".into()))?;
        let mut headers = HeaderMap::new();
        headers.insert(MSG_ID_HEADER, envelope.msg_id.as_str());
        if let Some(tp) = traceparent {
            headers.insert(TRACEPARENT_HEADER, tp);
        }
        let ack = self
            .js
            .publish_with_headers(
                self.names.subject(topic),
                headers,
                Bytes::from(envelope.encode_to_vec()),
            )
            .await
            .map_err(nats)?;
        Ok(Sent(ack))
    }

    /// A durable pull consumer on one topic, with explicit acks. A message not acked within
    /// `ack_wait` is redelivered, at most `max_deliver` times.
    pub async fn pull_consumer(
        &self,
        durable: &str,
        topic: Topic,
        ack_wait: Duration,
        max_deliver: i64,
    ) -> Result<consumer::PullConsumer> {
        let stream = self
            .js
            .get_stream(self.names.stream())
            .await
            .map_err(nats)?;
        stream
            .get_or_create_consumer(
                durable,
                consumer::pull::Config {
                    durable_name: Some(durable.to_owned()),
                    filter_subject: self.names.subject(topic),
                    ack_policy: consumer::AckPolicy::Explicit,
                    ack_wait,
                    max_deliver,
                    ..Default::default()
                },
            )
            .await
            .map_err(nats)
    }

    /// JetStream's advisories that a message of consumer `durable` reached its `max_deliver`
    /// and will not be delivered again (see [`MaxDeliveries`]).
    pub async fn max_delivery_advisories(&self, durable: &str) -> Result<async_nats::Subscriber> {
        self.client
            .subscribe(format!(
                "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{}.{durable}",
                self.names.stream()
            ))
            .await
            .map_err(nats)
    }

    /// Drops every message in the event stream (tests: lost hints).
    pub async fn purge(&self) -> Result<()> {
        self.js
            .get_stream(self.names.stream())
            .await
            .map_err(nats)?
            .purge()
            .await
            .map_err(nats)?;
        Ok(())
    }

    /// Deletes the streams and everything in them (tests and teardown).
    pub async fn delete_stream(&self) -> Result<()> {
        self.js
            .delete_stream(self.names.stream())
            .await
            .map_err(nats)?;
        // the registry exists only once a gateway registered or someone looked
        let _ = self.js.delete_stream(self.registry_name()).await;
        Ok(())
    }
}

/// What a gateway instance announces in the registry: where it listens and what it serves.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GatewayRecord {
    pub id: String,
    /// `http://host:port` of its gRPC server.
    pub endpoint: String,
    pub adapters: Vec<AdapterRecord>,
    /// The longest one call may run at this gateway (its `grpc.max_deadline_ms`), if it says:
    /// a step whose adapter timeout is longer is refused at submit, not cut short.
    #[serde(default)]
    pub max_call_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AdapterRecord {
    pub name: String,
    pub version: String,
    pub capability: z29c_core::AdapterCapability,
}

/// The executors' durable consumer of step hints.
pub const EXECUTOR_CONSUMER: &str = "executors";

/// How long a registration lives without being refreshed.
pub const REGISTRATION_TTL: Duration = Duration::from_secs(10);

// The registry is a stream keeping the last message per gateway subject for
// REGISTRATION_TTL: a key-value bucket built from plain stream features, which every
// JetStream server since 2.2 understands (async-nats' KV API does not parse NATS 2.9's answers).
impl Bus {
    fn registry_subject(&self, id: &str) -> String {
        format!("{}.registry.gateway.{id}", self.names.prefix)
    }

    fn registry_name(&self) -> String {
        self.names.registry_name()
    }

    async fn registry(&self) -> Result<stream::Stream> {
        self.js
            .get_or_create_stream(stream::Config {
                name: self.registry_name(),
                subjects: vec![format!("{}.registry.>", self.names.prefix)],
                max_messages_per_subject: 1,
                max_age: REGISTRATION_TTL,
                duplicate_window: Duration::from_secs(1),
                storage: stream::StorageType::Memory,
                ..Default::default()
            })
            .await
            .map_err(nats)
    }

    /// Registers (or refreshes) a gateway. Refresh more often than [`REGISTRATION_TTL`]: a
    /// gateway that stops refreshing disappears, so executors stop sending it work.
    pub async fn register_gateway(&self, record: &GatewayRecord) -> Result<()> {
        self.registry().await?;
        let value = serde_json::to_vec(record).map_err(|e| BusError::Malformed(e.to_string()))?;
        self.js
            .publish(self.registry_subject(&record.id), value.into())
            .await
            .map_err(nats)?
            .await
            .map_err(nats)?;
        Ok(())
    }

    /// Removes a gateway at shutdown, so nobody waits for its registration to expire: an
    /// empty record replaces its last one (a gateway may publish its registration, but no
    /// service may purge a stream).
    pub async fn deregister_gateway(&self, id: &str) -> Result<()> {
        self.registry().await?;
        self.js
            .publish(self.registry_subject(id), Bytes::new())
            .await
            .map_err(nats)?
            .await
            .map_err(nats)?;
        Ok(())
    }

    /// The gateways registered now: the last record of each gateway's subject, read with
    /// the stream's own message lookup (no consumer: a service may not create one on the
    /// registry, so none can point its deliveries at a subject it may not publish to).
    pub async fn gateways(&self) -> Result<Vec<GatewayRecord>> {
        use futures::TryStreamExt;
        let registry = self.registry().await?;
        let subjects: Vec<String> = registry
            .info_with_subjects(format!("{}.registry.gateway.>", self.names.prefix))
            .await
            .map_err(nats)?
            .map_ok(|(subject, _)| subject)
            .try_collect()
            .await
            .map_err(nats)?;
        let mut out = Vec::new();
        for subject in subjects {
            let msg = match registry.get_last_raw_message_by_subject(&subject).await {
                Ok(msg) => msg,
                // expired since the listing
                Err(e)
                    if e.kind()
                        == async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound =>
                {
                    continue;
                }
                Err(e) => return Err(nats(e)),
            };
            // an empty record is a gateway that went away
            if let Ok(record) = serde_json::from_slice::<GatewayRecord>(&msg.payload) {
                out.push(record);
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }
}

/// An envelope announcing that a step may be ready.
pub fn step_ready(msg_id: &str, workflow: &str, step: &str) -> Envelope {
    Envelope {
        msg_id: msg_id.to_owned(),
        created_at: None,
        body: Some(Body::StepReady(wire::StepReady {
            workflow_id: workflow.to_owned(),
            step_id: step.to_owned(),
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_stay_under_their_prefix() {
        let n = Names::new("z29c-t1").unwrap();
        assert_eq!(n.subject(Topic::StepReady), "z29c-t1.step.ready");
        assert_eq!(n.stream(), "Z29C_T1_EVENTS");
        for bad in ["", "a.b", "a b", "x>", &"a".repeat(33)] {
            assert!(Names::new(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn outbox_kinds_map_to_topics() {
        for (kind, topic) in [
            ("step_ready", Topic::StepReady),
            ("step_completed", Topic::StepCompleted),
            ("late_evidence", Topic::LateEvidence),
            ("workflow_changed", Topic::WorkflowChanged),
        ] {
            assert_eq!(Topic::from_outbox_kind(kind), Some(topic));
        }
        assert_eq!(Topic::from_outbox_kind("nope"), None);
    }

    #[test]
    fn envelopes_round_trip_and_garbage_is_refused() {
        let (wf, st) = (
            z29c_core::WorkflowId::new().to_string(),
            z29c_core::StepId::new().to_string(),
        );
        let e = step_ready("m-1", &wf, &st);
        assert_eq!(decode(&e.encode_to_vec()).unwrap(), e);
        assert_eq!(decode_on(&e.encode_to_vec(), Topic::StepReady).unwrap(), e);
        assert!(matches!(
            decode_on(&e.encode_to_vec(), Topic::WorkflowChanged),
            Err(BusError::Malformed(_))
        ));
        assert!(matches!(
            decode(&step_ready("m-1", "wf", "st").encode_to_vec()),
            Err(BusError::Malformed(_))
        ));
        assert!(matches!(
            decode(b"\xff\xff\xff"),
            Err(BusError::Malformed(_))
        ));
        assert!(matches!(decode(&[]), Err(BusError::Malformed(_))));
    }
}
