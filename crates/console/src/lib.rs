//! The operator console (docs/design.md §7): one page that shows workflows in their product states
//! with live updates, each step's timeline with its lease history, attempts, checkpoints,
//! evidence and recovery decisions under technical details, the review queue with its resolve
//! form, and the four metric levels. It holds no state and no SQL: it reads the public gRPC
//! services (`WorkflowService` on the scheduler, `ReviewService` on recovery) and the services'
//! `/metrics`, and serves the page plus a JSON API (`/api/...`) the page polls.
//!
//! With operator authentication on, people sign in with their token and the console forwards
//! it, so the services decide what each person may do; forms are CSRF-protected
//! ([`session`]).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use axum_extra::extract::cookie::CookieJar;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use z29c_proto::v1 as pb;
use z29c_proto::v1::review_service_client::ReviewServiceClient;
use z29c_proto::v1::workflow_service_client::WorkflowServiceClient;
use z29c_security::{Authed, Bearer, TlsConfig};

use crate::session::{Refusal, Sessions};

pub mod metrics;
pub mod session;
pub mod view;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct ConsoleConfig {
    /// Where the page and its API are served.
    pub listen: SocketAddr,
    /// The scheduler's `WorkflowService`.
    pub workflow_server: String,
    /// A recovery instance's `ReviewService`.
    pub review_server: String,
    /// `/metrics` URLs of the services, summed in the overview.
    pub metrics: Vec<String>,
    /// Client certificate and CA for the services' mutual TLS.
    pub tls: TlsConfig,
    /// Operator tokens: with `auth.enabled`, people sign in and their token is forwarded.
    pub auth: z29c_security::AuthConfig,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8088)),
            workflow_server: "http://127.0.0.1:50051".into(),
            review_server: "http://127.0.0.1:50053".into(),
            metrics: Vec::new(),
            tls: TlsConfig::default(),
            auth: z29c_security::AuthConfig::default(),
        }
    }
}

impl z29c_runtime::Validate for ConsoleConfig {
    fn validate(&self) -> Result<(), z29c_runtime::config::Invalid> {
        use z29c_runtime::config::Invalid;
        for (field, url) in [
            ("workflow_server", &self.workflow_server),
            ("review_server", &self.review_server),
        ] {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(Invalid::new(
                    field,
                    format!("{url:?} is not an http:// or https:// address"),
                ));
            }
        }
        Ok(())
    }
}

#[derive(Clone)]
struct App {
    workflows: Channel,
    reviews: Channel,
    sessions: Sessions,
    metrics: Vec<String>,
    http: reqwest::Client,
}

type Clients = (WorkflowServiceClient<Authed>, ReviewServiceClient<Authed>);

impl App {
    /// Clients carrying the signed-in person's token.
    fn clients(&self, jar: &CookieJar) -> Result<Clients, ApiError> {
        let (_, bearer) = self.sessions.caller(jar)?;
        Ok((
            WorkflowServiceClient::with_interceptor(self.workflows.clone(), bearer.clone()),
            ReviewServiceClient::with_interceptor(self.reviews.clone(), bearer),
        ))
    }
}

fn channels(
    workflow_server: &str,
    review_server: &str,
    tls: &TlsConfig,
) -> anyhow::Result<(Channel, Channel)> {
    let lazy = |url: &str, what: &str| -> anyhow::Result<Channel> {
        Ok(tls
            .endpoint(url)
            .with_context(|| format!("{what}: bad URL {url:?}"))?
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(5))
            .connect_lazy())
    };
    Ok((
        lazy(workflow_server, "workflow_server")?,
        lazy(review_server, "review_server")?,
    ))
}

/// The gRPC clients the console and `z29c review` read through, carrying `bearer`.
/// Connections are lazy: the console starts while a service is still down and says so per
/// request.
pub fn clients(
    workflow_server: &str,
    review_server: &str,
    tls: &TlsConfig,
    bearer: Bearer,
) -> anyhow::Result<Clients> {
    let (w, r) = channels(workflow_server, review_server, tls)?;
    Ok((
        WorkflowServiceClient::with_interceptor(w, bearer.clone()),
        ReviewServiceClient::with_interceptor(r, bearer),
    ))
}

/// Serves the console until `shutdown`; sends the bound address on `ready`.
pub async fn run(
    config: ConsoleConfig,
    shutdown: CancellationToken,
    ready: Option<tokio::sync::oneshot::Sender<SocketAddr>>,
) -> anyhow::Result<()> {
    let (workflows, reviews) =
        channels(&config.workflow_server, &config.review_server, &config.tls)?;
    let verifier = z29c_security::Verifier::from_config(&config.auth)?;
    if !verifier.enabled() {
        tracing::warn!("console sign-in is off: anyone who reaches it may act (set auth.enabled)");
    }
    let app = App {
        workflows,
        reviews,
        sessions: Sessions::new(verifier),
        metrics: config.metrics.clone(),
        http: reqwest::Client::new(),
    };
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("listen on {}", config.listen))?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, workflow_server = %config.workflow_server, review_server = %config.review_server, "console listening");
    if let Some(ready) = ready {
        let _ = ready.send(addr);
    }
    axum::serve(listener, router(app))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await?;
    Ok(())
}

fn router(app: App) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/login", get(login_page).post(login))
        .route("/logout", post(logout))
        .route("/api/workflows", get(list_workflows))
        .route("/api/workflows/{id}", get(workflow))
        .route("/api/reviews", get(open_review_items))
        .route("/api/reviews/{id}/resolve", post(resolve))
        .route("/api/metrics", get(metrics_overview))
        .with_state(app)
}

/// The page, with the CSRF cookie its forms send back; without a session, the sign-in page.
async fn page(State(app): State<App>, jar: CookieJar) -> Response {
    if app.sessions.caller(&jar).is_err() {
        return Redirect::to("/login").into_response();
    }
    let session = jar
        .get(session::SESSION_COOKIE)
        .map(|c| c.value().to_owned());
    let jar = jar.add(app.sessions.csrf_cookie(session.as_deref()));
    (jar, Html(include_str!("../assets/index.html"))).into_response()
}

const LOGIN_PAGE: &str = include_str!("../assets/login.html");

fn login_html(sessions: &Sessions, message: &str) -> Html<String> {
    Html(
        LOGIN_PAGE
            .replace("{{message}}", message)
            .replace("{{csrf}}", &sessions.csrf_for(None)),
    )
}

async fn login_page(State(app): State<App>) -> Html<String> {
    login_html(&app.sessions, "")
}

#[derive(Debug, Deserialize)]
struct LoginForm {
    token: String,
    #[serde(default)]
    csrf: String,
}

/// Signs in with a pasted token. The form carries the pre-session CSRF token, so another site
/// cannot sign a person in as someone else (login CSRF).
async fn login(
    State(app): State<App>,
    jar: CookieJar,
    mut headers: HeaderMap,
    axum::Form(form): axum::Form<LoginForm>,
) -> Response {
    let retry = |status: StatusCode, msg: &str| {
        let msg = msg
            .replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;");
        let message = format!("<p class=\"error\">{msg}</p>");
        (status, login_html(&app.sessions, &message)).into_response()
    };
    if let Ok(v) = form.csrf.parse() {
        headers.insert(session::CSRF_HEADER, v);
    }
    let anonymous = jar.clone().remove(session::SESSION_COOKIE);
    if let Err(Refusal::Forgery(why)) = app.sessions.check_forgery(&anonymous, &headers) {
        return retry(StatusCode::FORBIDDEN, why);
    }
    if !app.sessions.enabled() {
        return Redirect::to("/").into_response();
    }
    match app.sessions.sign_in(jar, &form.token) {
        Ok((jar, caller)) => {
            tracing::info!(subject = %caller.subject, "console sign-in");
            (jar, Redirect::to("/")).into_response()
        }
        Err(Refusal::SignIn(why)) => {
            retry(StatusCode::UNAUTHORIZED, &format!("sign-in refused: {why}"))
        }
        Err(Refusal::Forgery(why)) => retry(StatusCode::FORBIDDEN, why),
    }
}

async fn logout(State(app): State<App>, jar: CookieJar, headers: HeaderMap) -> Response {
    if let Err(e) = app.sessions.check_forgery(&jar, &headers) {
        return ApiError::from(e).into_response();
    }
    (app.sessions.sign_out(jar), Redirect::to("/login")).into_response()
}

/// A failed call, as the page shows it: the gRPC status's code and reason.
#[derive(Debug)]
struct ApiError(tonic::Status);

impl From<tonic::Status> for ApiError {
    fn from(s: tonic::Status) -> Self {
        Self(s)
    }
}

impl From<Refusal> for ApiError {
    fn from(r: Refusal) -> Self {
        Self(match r {
            Refusal::SignIn(why) => tonic::Status::unauthenticated(why),
            Refusal::Forgery(why) => tonic::Status::permission_denied(why),
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        use tonic::Code;
        let status = match self.0.code() {
            Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::FailedPrecondition | Code::Aborted | Code::AlreadyExists => StatusCode::CONFLICT,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::Unavailable | Code::DeadlineExceeded => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::BAD_GATEWAY,
        };
        let body = serde_json::json!({
            "code": format!("{:?}", self.0.code()),
            "error": self.0.message(),
        });
        (status, Json(body)).into_response()
    }
}

fn invalid(field: &str, reason: &str) -> ApiError {
    ApiError(tonic::Status::invalid_argument(format!(
        "{field}: {reason}"
    )))
}

async fn list_workflows(
    State(app): State<App>,
    jar: CookieJar,
) -> Result<Json<Vec<view::WorkflowRow>>, ApiError> {
    let (mut workflows, _) = app.clients(&jar)?;
    let list = workflows
        .list(pb::ListRequest {
            page_size: 100,
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok(Json(list.workflows.iter().map(view::row).collect()))
}

async fn workflow(
    State(app): State<App>,
    jar: CookieJar,
    Path(id): Path<String>,
) -> Result<Json<view::WorkflowView>, ApiError> {
    let (mut workflows, _) = app.clients(&jar)?;
    let w = workflows
        .get(pb::GetRequest { workflow_id: id })
        .await?
        .into_inner();
    Ok(Json(view::workflow(&w)))
}

/// The review items (open ones, or all with `include_resolved`), each with its workflow's
/// state and everything z29c holds about its step: what the console's queue and `z29c review`
/// both show.
pub async fn review_queue(
    workflows: &mut WorkflowServiceClient<Authed>,
    reviews: &mut ReviewServiceClient<Authed>,
    include_resolved: bool,
) -> Result<Vec<view::ReviewView>, tonic::Status> {
    let items = reviews
        .list(pb::ListReviewsRequest {
            include_resolved,
            page_size: 500,
            page_token: String::new(),
        })
        .await?
        .into_inner()
        .items;
    let mut out = Vec::with_capacity(items.len());
    for item in &items {
        let w = workflows
            .get(pb::GetRequest {
                workflow_id: item.workflow_id.clone(),
            })
            .await
            .ok()
            .map(tonic::Response::into_inner);
        out.push(view::review(item, w.as_ref()));
    }
    Ok(out)
}

async fn open_review_items(
    State(app): State<App>,
    jar: CookieJar,
) -> Result<Json<Vec<view::ReviewView>>, ApiError> {
    let (mut workflows, mut reviews) = app.clients(&jar)?;
    Ok(Json(
        review_queue(&mut workflows, &mut reviews, false).await?,
    ))
}

/// The resolve form's fields.
#[derive(Debug, Deserialize)]
struct ResolveForm {
    expected_version: Option<i64>,
    #[serde(default)]
    reason: String,
    /// `succeeded`, `failed` or `retry_same_identity`.
    #[serde(default)]
    resolution: String,
    #[serde(default)]
    external_reference: String,
}

async fn resolve(
    State(app): State<App>,
    jar: CookieJar,
    headers: HeaderMap,
    Path(id): Path<String>,
    Json(form): Json<ResolveForm>,
) -> Result<Json<serde_json::Value>, ApiError> {
    use pb::resolve_request::Resolution;
    app.sessions.check_forgery(&jar, &headers)?;
    let (_, mut reviews) = app.clients(&jar)?;
    let expected_version = form
        .expected_version
        .ok_or_else(|| invalid("expected_version", "required"))?;
    let resolution = match form.resolution.as_str() {
        "succeeded" if form.external_reference.trim().is_empty() => {
            return Err(invalid(
                "external_reference",
                "say which external reference the effect has",
            ));
        }
        "succeeded" => {
            Resolution::SucceededExternalReference(form.external_reference.trim().into())
        }
        "failed" => Resolution::Failed(true),
        "retry_same_identity" => Resolution::RetrySameIdentity(true),
        _ => {
            return Err(invalid(
                "resolution",
                "choose succeeded, failed or retry_same_identity",
            ));
        }
    };
    let item = reviews
        .resolve(pb::ResolveRequest {
            item_id: id,
            expected_version,
            reason: form.reason,
            resolution: Some(resolution),
            result_json: String::new(),
        })
        .await?
        .into_inner();
    Ok(Json(serde_json::json!({
        "id": item.id,
        "state": item.state,
        "version": item.version,
        "workflow_id": item.workflow_id,
    })))
}

async fn metrics_overview(
    State(app): State<App>,
    jar: CookieJar,
) -> Result<Json<metrics::Overview>, ApiError> {
    app.sessions.caller(&jar)?;
    Ok(Json(metrics::overview(&app.http, &app.metrics).await))
}
