//! The HTTP/JSON API (`docs/openapi.yaml`), for callers without gRPC tooling. It is a second
//! door to the same `WorkflowService`: every request becomes a `tonic::Request` carrying the
//! caller's `Authorization` header and address, so tokens, roles, the submission rate, the
//! audit log and every check on a submission are the gRPC API's own, and the two cannot
//! drift apart.
//!
//! With `tls` configured the listener requires a client certificate from the deployment's CA,
//! as the gRPC port does: a process that reaches the port proves itself before it is heard,
//! and a certificate whose role may not call the workflow service is refused (403).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::body::Bytes;
use axum::extract::connect_info::{ConnectInfo, Connected};
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, FromRequestParts, Path, RawQuery, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::{IncomingStream, Listener};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::metadata::MetadataMap;
use tonic::transport::server::TcpConnectInfo;
use z29c_core::ProductState;
use z29c_core::identity::{Server, ServiceRole};
use z29c_proto::v1::workflow_service_server::WorkflowService;
use z29c_proto::v1::{self as pb};
use z29c_proto::workflow_file::WorkflowFile;
use z29c_runtime::https::{HttpsConfig, Incoming};
use z29c_security::TlsConfig;
use z29c_security::identity::peer_roles;

/// The longest `?wait=` a read holds its answer back for the workflow to end.
pub const MAX_WAIT: Duration = Duration::from_secs(60);

/// How often a waiting read looks at the workflow again.
const POLL: Duration = Duration::from_millis(250);

/// An error answer: the HTTP status, the gRPC code it stands for and what went wrong, as
/// `{"error": {"code": "INVALID_ARGUMENT", "message": "steps[0].adapter: …"}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    fn invalid(message: impl Into<String>) -> Self {
        Self::from(tonic::Status::invalid_argument(message.into()))
    }
}

/// The one mapping from the service's gRPC codes to HTTP statuses.
pub fn http_status(code: Code) -> StatusCode {
    match code {
        Code::Ok => StatusCode::OK,
        Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::FailedPrecondition | Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        // the caller went away; nobody reads this answer
        Code::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

pub use z29c_runtime::grpc_code_name as code_name;

impl From<tonic::Status> for ApiError {
    fn from(s: tonic::Status) -> Self {
        Self {
            status: http_status(s.code()),
            code: code_name(s.code()),
            message: s.message().to_owned(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "error": { "code": self.code, "message": self.message }
        });
        let mut response = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

type Answer = Result<Response, ApiError>;

/// The product state's stable name (`needs_review`), `unspecified` for none.
pub fn state_name(state: pb::ProductState) -> &'static str {
    product_state(state).map_or("unspecified", ProductState::as_str)
}

fn product_state(state: pb::ProductState) -> Option<ProductState> {
    Some(match state {
        pb::ProductState::Unspecified => return None,
        pb::ProductState::Preparing => ProductState::Preparing,
        pb::ProductState::WaitingOnExternalService => ProductState::WaitingOnExternalService,
        pb::ProductState::RecoveringExecution => ProductState::RecoveringExecution,
        pb::ProductState::NeedsReview => ProductState::NeedsReview,
        pb::ProductState::Completed => ProductState::Completed,
        pb::ProductState::Failed => ProductState::Failed,
        pb::ProductState::Cancelled => ProductState::Cancelled,
    })
}

/// Whether a waiting read answers now: the workflow has ended, or only a person can move it on.
fn settled(state: pb::ProductState) -> bool {
    matches!(
        product_state(state),
        Some(
            ProductState::Completed
                | ProductState::Failed
                | ProductState::Cancelled
                | ProductState::NeedsReview
        )
    )
}

fn verification_name(v: pb::Verification) -> &'static str {
    match v {
        pb::Verification::Unspecified => "unspecified",
        pb::Verification::Direct => "direct",
        pb::Verification::StatusQuery => "status_query",
        pb::Verification::LateEvidence => "late_evidence",
        pb::Verification::Manual => "manual",
    }
}

fn rfc3339(t: &prost_types::Timestamp) -> Option<String> {
    let nanos = u32::try_from(t.nanos).ok()?;
    chrono::DateTime::from_timestamp(t.seconds, nanos)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true))
}

fn text(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

/// JSON text as a JSON value; none for empty text. Text that does not parse (which z29c never
/// stores) is kept as a string rather than lost.
fn json_value(s: &str) -> Option<Value> {
    if s.is_empty() {
        return None;
    }
    Some(serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.to_owned())))
}

/// The answer to a submission.
#[derive(Debug, Serialize)]
pub struct SubmittedJson {
    /// False when `client_key` named an earlier, identical submission.
    pub created: bool,
    pub workflow: WorkflowJson,
}

/// One page of a list; `next_page_token` is none on the last.
#[derive(Debug, Serialize)]
pub struct ListJson {
    pub workflows: Vec<WorkflowJson>,
    pub next_page_token: Option<String>,
}

/// A workflow as the HTTP API answers it.
#[derive(Debug, Serialize)]
pub struct WorkflowJson {
    pub id: String,
    pub client_key: String,
    pub name: String,
    pub state: &'static str,
    pub state_label: String,
    pub reason: Option<String>,
    pub created_at: Option<String>,
    pub deadline: Option<String>,
    pub steps: Vec<StepJson>,
}

#[derive(Debug, Serialize)]
pub struct StepJson {
    pub id: String,
    pub name: String,
    pub adapter: String,
    pub operation: String,
    pub state: &'static str,
    pub state_label: String,
    pub depends_on: Vec<String>,
    pub input: Value,
    pub result: Option<Value>,
    pub reason: Option<String>,
    /// While the step waits for its turn: when it may next be claimed.
    pub next_attempt_at: Option<String>,
    pub receipt: Option<ReceiptJson>,
    pub technical: Option<TechnicalJson>,
}

#[derive(Debug, Serialize)]
pub struct ReceiptJson {
    pub request_identity: String,
    pub external_reference: Option<String>,
    pub outcome: String,
    pub verification: &'static str,
    pub input_digest: String,
    pub adapter: String,
    pub adapter_version: String,
    pub committed_at: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct TechnicalJson {
    pub step_state: String,
    pub lease_version: i64,
    pub lease_owner: Option<String>,
    pub lease_expires_at: Option<String>,
    pub checkpoint: Option<String>,
    /// Attempts whose call began and was not given back.
    pub attempts: u32,
    /// Claims given back without an attempt, and of those the waits (rate limited, no
    /// permit, no gateway).
    pub given_back: u32,
    pub waits: u32,
    pub events: Vec<EventJson>,
}

#[derive(Debug, Serialize)]
pub struct EventJson {
    pub kind: String,
    pub at: Option<String>,
    pub lease_version: i64,
    pub attempt_id: Option<String>,
    pub owner: Option<String>,
    pub detail: Option<Value>,
}

impl From<&pb::Workflow> for WorkflowJson {
    fn from(w: &pb::Workflow) -> Self {
        Self {
            id: w.id.clone(),
            client_key: w.client_key.clone(),
            name: w.name.clone(),
            state: state_name(w.state()),
            state_label: w.state_label.clone(),
            reason: text(&w.reason),
            created_at: w.created_at.as_ref().and_then(rfc3339),
            deadline: w.deadline.as_ref().and_then(rfc3339),
            steps: w.steps.iter().map(StepJson::from).collect(),
        }
    }
}

impl From<&pb::Step> for StepJson {
    fn from(s: &pb::Step) -> Self {
        Self {
            id: s.id.clone(),
            name: s.name.clone(),
            adapter: s.adapter.clone(),
            operation: s.operation.clone(),
            state: state_name(s.state()),
            state_label: s.state_label.clone(),
            depends_on: s.depends_on.clone(),
            input: json_value(&s.input_json).unwrap_or(Value::Null),
            result: json_value(&s.result_json),
            reason: text(&s.reason),
            next_attempt_at: s.next_attempt_at.as_ref().and_then(rfc3339),
            receipt: s.receipt.as_ref().map(|r| ReceiptJson {
                request_identity: r.request_identity.clone(),
                external_reference: text(&r.external_reference),
                outcome: r.outcome.clone(),
                verification: verification_name(r.verification()),
                input_digest: r.input_digest.clone(),
                adapter: r.adapter.clone(),
                adapter_version: r.adapter_version.clone(),
                committed_at: r.committed_at.as_ref().and_then(rfc3339),
            }),
            technical: s.technical.as_ref().map(|t| TechnicalJson {
                step_state: t.step_state.clone(),
                lease_version: t.lease_version,
                lease_owner: text(&t.lease_owner),
                lease_expires_at: t.lease_expires_at.as_ref().and_then(rfc3339),
                checkpoint: text(&t.checkpoint),
                attempts: t.attempts,
                given_back: t.given_back,
                waits: t.waits,
                events: t
                    .events
                    .iter()
                    .map(|e| EventJson {
                        kind: e.kind.clone(),
                        at: e.at.as_ref().and_then(rfc3339),
                        lease_version: e.lease_version,
                        attempt_id: text(&e.attempt_id),
                        owner: text(&e.owner),
                        detail: json_value(&e.detail_json),
                    })
                    .collect(),
            }),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CancelBody {
    #[serde(default)]
    reason: String,
}

/// Reads a JSON body into `T`, naming where it went wrong ("body: steps[0]: missing field
/// `name`"). An empty body reads as `empty` where one is given, and is refused otherwise.
fn read_body<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
    empty: Option<T>,
) -> Result<T, ApiError> {
    let body = body.map_err(|r| ApiError {
        status: r.status(),
        code: if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            "OUT_OF_RANGE"
        } else {
            "INVALID_ARGUMENT"
        },
        message: format!("body: {}", r.body_text()),
    })?;
    if body.iter().all(u8::is_ascii_whitespace) {
        return empty.ok_or_else(|| ApiError::invalid("body: empty; send a JSON object"));
    }
    let de = &mut serde_json::Deserializer::from_slice(&body);
    let value: T = serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        // text that is not JSON has no field to name: its line and column say where
        if path == "." || e.inner().is_syntax() || e.inner().is_eof() {
            ApiError::invalid(format!("body: {}", e.inner()))
        } else {
            ApiError::invalid(format!("body: {path}: {}", e.inner()))
        }
    })?;
    Ok(value)
}

/// Who is calling, as the guard reads it from a gRPC request: the `Authorization` header, and
/// the address (the submission rate without tokens, the audit's peer). Trace context
/// (`traceparent`, `tracestate`) comes along, so a caller's trace continues into z29c.
#[derive(Debug, Clone)]
struct Credentials {
    metadata: MetadataMap,
    peer: Option<SocketAddr>,
}

impl<S: Send + Sync> FromRequestParts<S> for Credentials {
    type Rejection = ApiError;

    /// Refuses a TLS caller whose certificate names no role the workflow service accepts, as
    /// the gRPC server does.
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let peer = parts.extensions.get::<ConnectInfo<Peer>>().map(|c| &c.0);
        if let Some(roles) = peer.and_then(|p| p.roles.as_deref()) {
            z29c_security::identity::admit(Server::Workflows, roles)?;
        }
        let mut headers = HeaderMap::new();
        for name in [header::AUTHORIZATION.as_str(), "traceparent", "tracestate"] {
            if let Some(value) = parts.headers.get(name) {
                headers.insert(name, value.clone());
            }
        }
        Ok(Self {
            metadata: MetadataMap::from_headers(headers),
            peer: peer.map(|p| p.addr),
        })
    }
}

impl Credentials {
    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut extensions = tonic::Extensions::new();
        extensions.insert(TcpConnectInfo {
            local_addr: None,
            remote_addr: self.peer,
        });
        tonic::Request::from_parts(self.metadata.clone(), extensions, message)
    }
}

/// The service the API calls, and the process's shutdown, which ends a waiting read early.
struct Api<S> {
    service: Arc<S>,
    shutdown: CancellationToken,
}

impl<S> Clone for Api<S> {
    fn clone(&self) -> Self {
        Self {
            service: self.service.clone(),
            shutdown: self.shutdown.clone(),
        }
    }
}

/// The API's routes over `service`, bodies up to `max_body` bytes.
pub fn router<S: WorkflowService>(
    service: Arc<S>,
    max_body: usize,
    shutdown: CancellationToken,
) -> Router {
    Router::new()
        .route("/v1/workflows", post(submit::<S>).get(list::<S>))
        .route("/v1/workflows/{id}", get(read::<S>))
        .route("/v1/workflows/{id}/cancel", post(cancel::<S>))
        .fallback(no_route)
        .method_not_allowed_fallback(no_method)
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(Api { service, shutdown })
}

async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError::from(tonic::Status::not_found(format!(
        "no route {method} {}; the API is described in docs/openapi.yaml",
        uri.path()
    )))
}

async fn no_method(method: Method, uri: Uri) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        code: "UNIMPLEMENTED",
        message: format!("{} does not take {method}", uri.path()),
    }
}

/// The query's pairs, each name checked against `known`.
fn query(raw: Option<&str>, known: &[&str]) -> Result<Vec<(String, String)>, ApiError> {
    let pairs: Vec<(String, String)> = url::form_urlencoded::parse(raw.unwrap_or("").as_bytes())
        .into_owned()
        .collect();
    if let Some((name, _)) = pairs.iter().find(|(k, _)| !known.contains(&k.as_str())) {
        return Err(ApiError::invalid(format!(
            "{name}: unknown query parameter (known: {})",
            known.join(", ")
        )));
    }
    Ok(pairs)
}

/// `?wait=SECONDS`: how long a read may wait for the workflow to settle, at most [`MAX_WAIT`].
fn wait_of(pairs: &[(String, String)]) -> Result<Duration, ApiError> {
    let Some((_, v)) = pairs.iter().rev().find(|(k, _)| k == "wait") else {
        return Ok(Duration::ZERO);
    };
    let seconds: f64 = v
        .parse()
        .ok()
        .filter(|s: &f64| s.is_finite() && *s >= 0.0)
        .ok_or_else(|| {
            ApiError::invalid(format!(
                "wait: {v:?} is not a number of seconds (0 to {})",
                MAX_WAIT.as_secs()
            ))
        })?;
    Ok(Duration::from_secs_f64(seconds).min(MAX_WAIT))
}

/// The list request a query asks for: `state` (repeated, or separated by commas), `name`,
/// `search`, `page_size`, `page_token`.
fn list_request(pairs: &[(String, String)]) -> Result<pb::ListRequest, ApiError> {
    let mut req = pb::ListRequest::default();
    for (k, v) in pairs {
        match k.as_str() {
            "state" => {
                for s in v.split(',') {
                    let state: ProductState = s.trim().parse().map_err(|_| {
                        ApiError::invalid(format!(
                            "state: {s:?} is not a product state (one of: {})",
                            ProductState::ALL
                                .iter()
                                .map(|s| s.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ))
                    })?;
                    req.states
                        .push(crate::service::product_to_wire(state) as i32);
                }
            }
            "name" => req.name = v.clone(),
            "search" => req.search = v.clone(),
            "page_size" => {
                req.page_size = v.parse().map_err(|_| {
                    ApiError::invalid(format!("page_size: {v:?} is not a whole number"))
                })?
            }
            "page_token" => req.page_token = v.clone(),
            _ => {}
        }
    }
    Ok(req)
}

fn workflow_answer(status: StatusCode, w: &pb::Workflow) -> Response {
    (status, axum::Json(WorkflowJson::from(w))).into_response()
}

fn id_of(id: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    id.map(|Path(id)| id)
        .map_err(|r| ApiError::invalid(format!("id: {}", r.body_text())))
}

async fn submit<S: WorkflowService>(
    State(api): State<Api<S>>,
    who: Credentials,
    RawQuery(raw): RawQuery,
    body: Result<Bytes, BytesRejection>,
) -> Answer {
    query(raw.as_deref(), &[])?;
    // the body is a workflow file, as `z29c submit` reads it
    let mut file: WorkflowFile = read_body(body, None)?;
    file.client_key
        .get_or_insert_with(|| format!("http-{}", uuid::Uuid::now_v7()));
    let req = file
        .into_request()
        .map_err(|e| ApiError::invalid(format!("body: {e}")))?;
    let answer = api.service.submit(who.request(req)).await?.into_inner();
    let workflow = answer
        .workflow
        .ok_or_else(|| tonic::Status::internal("the submission answered no workflow"))?;
    let status = if answer.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let mut response = (
        status,
        axum::Json(SubmittedJson {
            created: answer.created,
            workflow: WorkflowJson::from(&workflow),
        }),
    )
        .into_response();
    if let Ok(location) = HeaderValue::try_from(format!("/v1/workflows/{}", workflow.id)) {
        response.headers_mut().insert(header::LOCATION, location);
    }
    Ok(response)
}

async fn read<S: WorkflowService>(
    State(api): State<Api<S>>,
    who: Credentials,
    id: Result<Path<String>, PathRejection>,
    RawQuery(raw): RawQuery,
) -> Answer {
    let id = id_of(id)?;
    let wait = wait_of(&query(raw.as_deref(), &["wait"])?)?;
    let until = tokio::time::Instant::now() + wait;
    loop {
        let workflow = api
            .service
            .get(who.request(pb::GetRequest {
                workflow_id: id.clone(),
            }))
            .await?
            .into_inner();
        let now = tokio::time::Instant::now();
        if settled(workflow.state()) || now >= until || api.shutdown.is_cancelled() {
            return Ok(workflow_answer(StatusCode::OK, &workflow));
        }
        tokio::select! {
            _ = tokio::time::sleep(POLL.min(until - now)) => {}
            _ = api.shutdown.cancelled() => {}
        }
    }
}

async fn list<S: WorkflowService>(
    State(api): State<Api<S>>,
    who: Credentials,
    RawQuery(raw): RawQuery,
) -> Answer {
    let pairs = query(
        raw.as_deref(),
        &["state", "name", "search", "page_size", "page_token"],
    )?;
    let answer = api
        .service
        .list(who.request(list_request(&pairs)?))
        .await?
        .into_inner();
    Ok(axum::Json(ListJson {
        workflows: answer.workflows.iter().map(WorkflowJson::from).collect(),
        next_page_token: text(&answer.next_page_token),
    })
    .into_response())
}

async fn cancel<S: WorkflowService>(
    State(api): State<Api<S>>,
    who: Credentials,
    id: Result<Path<String>, PathRejection>,
    RawQuery(raw): RawQuery,
    body: Result<Bytes, BytesRejection>,
) -> Answer {
    let id = id_of(id)?;
    query(raw.as_deref(), &[])?;
    let body: CancelBody = read_body(body, Some(CancelBody::default()))?;
    let workflow = api
        .service
        .cancel(who.request(pb::CancelRequest {
            workflow_id: id,
            reason: body.reason,
        }))
        .await?
        .into_inner();
    Ok(workflow_answer(StatusCode::OK, &workflow))
}

/// Who is on the other end of a connection: its address, and over TLS the roles its
/// certificate names; the address is kept for the guard.
#[derive(Debug, Clone)]
struct Peer {
    addr: SocketAddr,
    roles: Option<Vec<ServiceRole>>,
}

impl Connected<IncomingStream<'_, Incoming>> for Peer {
    fn connect_info(stream: IncomingStream<'_, Incoming>) -> Self {
        let roles = match stream.io() {
            Either::Left(_) => None,
            Either::Right(tls) => Some(
                tls.get_ref()
                    .1
                    .peer_certificates()
                    .map(peer_roles)
                    .unwrap_or_default(),
            ),
        };
        Peer {
            addr: *stream.remote_addr(),
            roles,
        }
    }
}

/// Serves the API over `service` on `addr` until `shutdown`, with `tls` when it is configured.
/// Returns the bound address and the server's task, which ends once in-flight requests have
/// been answered (a waiting read answers at once on shutdown).
pub async fn serve<S: WorkflowService>(
    addr: SocketAddr,
    tls: &TlsConfig,
    max_body: usize,
    service: Arc<S>,
    shutdown: CancellationToken,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let acceptor = HttpsConfig::mutual(tls)?.acceptor("tls")?;
    if acceptor.is_none() {
        tracing::warn!(
            "HTTP API without TLS: any process that reaches this port may call it (set tls)"
        );
    }
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("bind http_listen {addr}"))?;
    let incoming = Incoming::spawn(listener, acceptor, "http api", shutdown.clone())?;
    let local = incoming.local_addr()?;
    let app = router(service, max_body, shutdown.clone());
    tracing::info!(addr = %local, "HTTP API listening");
    let server = tokio::spawn(async move {
        let served = axum::serve(incoming, app.into_make_service_with_connect_info::<Peer>())
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "http api stopped");
        }
    });
    Ok((local, server))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(q: &str) -> Vec<(String, String)> {
        query(
            Some(q),
            &["state", "name", "search", "page_size", "page_token", "wait"],
        )
        .unwrap()
    }

    #[test]
    fn every_product_state_has_its_stable_name_and_parses_back() {
        for state in ProductState::ALL {
            let wire = crate::service::product_to_wire(*state);
            assert_eq!(state_name(wire), state.as_str());
            let req = list_request(&pairs(&format!("state={}", state.as_str()))).unwrap();
            assert_eq!(req.states, [wire as i32]);
        }
        assert_eq!(state_name(pb::ProductState::Unspecified), "unspecified");
    }

    #[test]
    fn grpc_codes_map_to_the_http_statuses_clients_expect() {
        for (code, status, name) in [
            (Code::InvalidArgument, 400, "INVALID_ARGUMENT"),
            (Code::Unauthenticated, 401, "UNAUTHENTICATED"),
            (Code::PermissionDenied, 403, "PERMISSION_DENIED"),
            (Code::NotFound, 404, "NOT_FOUND"),
            (Code::FailedPrecondition, 409, "FAILED_PRECONDITION"),
            (Code::ResourceExhausted, 429, "RESOURCE_EXHAUSTED"),
            (Code::Unavailable, 503, "UNAVAILABLE"),
            (Code::Internal, 500, "INTERNAL"),
        ] {
            let e = ApiError::from(tonic::Status::new(code, "why"));
            assert_eq!((e.status.as_u16(), e.code), (status, name), "{code:?}");
            assert_eq!(e.message, "why");
        }
    }

    #[test]
    fn a_list_query_takes_repeated_or_joined_states_and_names_what_it_cannot_read() {
        let req = list_request(&pairs(
            "state=failed&state=needs_review,completed&name=order&page_size=5",
        ))
        .unwrap();
        assert_eq!(
            req.states,
            [
                pb::ProductState::Failed as i32,
                pb::ProductState::NeedsReview as i32,
                pb::ProductState::Completed as i32
            ]
        );
        assert_eq!((req.name.as_str(), req.page_size), ("order", 5));
        let e = list_request(&pairs("state=done")).unwrap_err();
        assert!(e.message.starts_with("state: \"done\""), "{}", e.message);
        let e = list_request(&pairs("page_size=many")).unwrap_err();
        assert!(e.message.starts_with("page_size:"), "{}", e.message);
        let e = query(Some("stat=failed"), &["state"]).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(
            e.message.starts_with("stat: unknown query parameter"),
            "{}",
            e.message
        );
    }

    #[test]
    fn a_wait_is_capped_and_a_bad_one_named() {
        assert_eq!(wait_of(&pairs("")).unwrap(), Duration::ZERO);
        assert_eq!(
            wait_of(&pairs("wait=1.5")).unwrap(),
            Duration::from_millis(1_500)
        );
        assert_eq!(wait_of(&pairs("wait=3600")).unwrap(), MAX_WAIT);
        for bad in ["wait=-1", "wait=soon", "wait=NaN", "wait=inf"] {
            let e = wait_of(&pairs(bad)).unwrap_err();
            assert!(e.message.starts_with("wait:"), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn a_body_error_names_the_field_and_its_place() {
        let body = |s: &'static str| Ok(Bytes::from_static(s.as_bytes()));
        let e = read_body::<WorkflowFile>(body(r#"{"steps": []}"#), None).unwrap_err();
        assert!(e.message.contains("missing field `name`"), "{}", e.message);
        let e = read_body::<WorkflowFile>(
            body(r#"{"name": "x", "steps": [{"name": "a", "adapter": 1, "operation": "o"}]}"#),
            None,
        )
        .unwrap_err();
        assert!(
            e.message.starts_with("body: steps[0].adapter:"),
            "{}",
            e.message
        );
        let e = read_body::<WorkflowFile>(body("{"), None).unwrap_err();
        assert!(e.message.starts_with("body: EOF"), "{}", e.message);
        let e = read_body::<WorkflowFile>(body(""), None).unwrap_err();
        assert!(e.message.starts_with("body: empty"), "{}", e.message);
        let e = read_body::<WorkflowFile>(body(r#"{"name": "x", "steps": [], "stepz": 1}"#), None)
            .unwrap_err();
        assert!(e.message.contains("stepz"), "{}", e.message);
        let c: CancelBody = read_body(body(""), Some(CancelBody::default())).unwrap();
        assert_eq!(c.reason, "");
    }

    #[test]
    fn a_workflow_answers_with_parsed_json_rfc3339_times_and_nulls_for_what_is_absent() {
        let w = pb::Workflow {
            id: "w1".into(),
            client_key: "k".into(),
            name: "order".into(),
            state: pb::ProductState::Completed as i32,
            state_label: "Completed".into(),
            created_at: Some(prost_types::Timestamp {
                seconds: 1_767_225_600,
                nanos: 500_000_000,
            }),
            steps: vec![pb::Step {
                name: "reserve".into(),
                state: pb::ProductState::Completed as i32,
                input_json: r#"{"sku":"A-1"}"#.into(),
                result_json: r#"{"id":"res_1"}"#.into(),
                receipt: Some(pb::Receipt {
                    verification: pb::Verification::StatusQuery as i32,
                    external_reference: "res_1".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        };
        let json = serde_json::to_value(WorkflowJson::from(&w)).unwrap();
        assert_eq!(json["state"], "completed");
        assert_eq!(json["created_at"], "2026-01-01T00:00:00.500Z");
        assert_eq!(json["deadline"], Value::Null);
        assert_eq!(json["reason"], Value::Null);
        let step = &json["steps"][0];
        assert_eq!(step["input"]["sku"], "A-1");
        assert_eq!(step["result"]["id"], "res_1");
        assert_eq!(step["reason"], Value::Null);
        assert_eq!(step["receipt"]["verification"], "status_query");
        assert_eq!(step["receipt"]["external_reference"], "res_1");
        assert_eq!(step["technical"], Value::Null);
    }
}
