//! The operator console (docs/design.md §7): one page that shows workflows in their product states
//! with live updates (filtered by state and name, searched by id or client key, a page at a
//! time), each step's input, result and the reason it failed or waits, its timeline with its
//! lease history, attempts, checkpoints, evidence and recovery decisions under technical
//! details, a cancel form, the review queue with its resolve form, and the four metric levels. It holds no state and no SQL: it reads the public gRPC
//! services (`WorkflowService` on the scheduler, `ReviewService` on recovery) and the services'
//! `/metrics`, and serves the page plus a JSON API (`/api/...`) the page polls.
//!
//! With operator authentication on, people sign in with their token and the console forwards
//! it, so the services decide what each person may do; forms are CSRF-protected
//! ([`session`]).
//!
//! With `https` configured it serves HTTPS only and every cookie it sets is `Secure`; without,
//! plain HTTP for loopback development, with a warning when it listens anywhere else.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use axum_extra::extract::cookie::CookieJar;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use z29c_core::{Action, ProductState};
use z29c_proto::v1 as pb;
use z29c_runtime::https::{HttpsConfig, Incoming};
use z29c_security::{Caller, TlsConfig};

use crate::session::{Refusal, Sessions};

pub mod metrics;
pub mod session;
pub mod view;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct ConsoleConfig {
    /// Where the page and its API are served.
    pub listen: SocketAddr,
    /// The certificate browsers are shown: with it the console serves HTTPS only and its
    /// cookies are `Secure`. A client certificate is asked for only with `client_ca_file`.
    pub https: HttpsConfig,
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
            https: HttpsConfig::default(),
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
        self.https
            .enabled()
            .map_err(|e| Invalid::new("https", e.to_string()))?;
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

/// The console's calls, through the client library, as the signed-in person.
type Clients = (z29c_client::Client, z29c_client::Reviews);

/// Each call the console makes on a person's behalf ends within this.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

impl App {
    /// Clients carrying the signed-in person's token, on the console's own channels.
    fn clients(&self, jar: &CookieJar) -> Result<Clients, ApiError> {
        let (_, bearer) = self.sessions.caller(jar)?;
        Ok((
            z29c_client::Client::on_channel(self.workflows.clone(), bearer.clone(), CALL_TIMEOUT),
            z29c_client::Reviews::on_channel(self.reviews.clone(), bearer, CALL_TIMEOUT),
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
    let acceptor = config.https.acceptor("https")?;
    let secure = acceptor.is_some();
    if !secure && !config.listen.ip().is_loopback() {
        tracing::warn!(
            listen = %config.listen,
            "console over plain HTTP on a non-loopback address: sign-in tokens cross the network \
             in the clear (set https)"
        );
    }
    let app = App {
        workflows,
        reviews,
        sessions: Sessions::new(verifier, secure),
        metrics: config.metrics.clone(),
        http: reqwest::Client::new(),
    };
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("listen on {}", config.listen))?;
    let addr = listener.local_addr()?;
    let scheme = if secure { "https" } else { "http" };
    tracing::info!(%addr, scheme, workflow_server = %config.workflow_server, review_server = %config.review_server, "console listening");
    let incoming = Incoming::spawn(listener, acceptor, "console", shutdown.clone())?;
    if let Some(ready) = ready {
        let _ = ready.send(addr);
    }
    axum::serve(incoming, router(app))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await?;
    Ok(())
}

fn router(app: App) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/login", get(login_page).post(login))
        .route("/logout", post(logout))
        .route("/api/me", get(me))
        .route("/api/workflows", get(list_workflows))
        .route("/api/workflows/{id}", get(workflow))
        .route("/api/workflows/{id}/cancel", post(cancel))
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
    let page = include_str!("../assets/index.html").replace("/*states*/[]", &states_json());
    (jar, Html(page)).into_response()
}

/// Every product state with its wording, for the page's filter: the page names states only as
/// `ProductState` does.
fn states_json() -> String {
    let states: Vec<(&str, &str)> = ProductState::ALL
        .iter()
        .map(|p| (p.as_str(), p.label()))
        .collect();
    // inside a <script>: no text of it may close the element
    serde_json::to_string(&states)
        .unwrap_or_else(|_| "[]".into())
        .replace('<', "\\u003c")
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

impl From<z29c_client::Error> for ApiError {
    fn from(e: z29c_client::Error) -> Self {
        // a server's refusal in its own words; otherwise (unreachable, a broken answer) the
        // client's account of what went wrong
        let said = match e.message() {
            "" => e.to_string(),
            message => message.to_owned(),
        };
        Self(tonic::Status::new(e.code(), said))
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
            "code": z29c_runtime::grpc_code_name(self.0.code()),
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

/// Who is signed in and what the page offers them. The services still decide every call:
/// this only spares a person a form they would be refused.
#[derive(Debug, Serialize)]
struct Me {
    subject: String,
    may_cancel: bool,
    may_resolve: bool,
}

async fn me(State(app): State<App>, jar: CookieJar) -> Result<Json<Me>, ApiError> {
    let (caller, _) = app.sessions.caller(&jar)?;
    let caller = caller.unwrap_or_else(Caller::unauthenticated_development);
    Ok(Json(Me {
        may_cancel: z29c_core::access::allowed(&caller.roles, Action::Cancel),
        may_resolve: z29c_core::access::allowed(&caller.roles, Action::Resolve),
        subject: caller.subject,
    }))
}

/// How many workflows a page shows unless it asks for another number.
const DEFAULT_PAGE_SIZE: u32 = 50;
/// The most the scheduler returns in one page.
const MAX_PAGE_SIZE: u32 = 500;

/// The workflow list's filter and page, from the query string: `state` (repeated, or
/// comma-separated), `name` (exact), `search` (a workflow id or client key, exact),
/// `page_token` (the previous page's `next_page_token`) and `page_size`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ListFilter {
    states: Vec<ProductState>,
    name: String,
    search: String,
    page_token: String,
    page_size: u32,
}

impl ListFilter {
    fn parse(query: &str) -> Result<Self, ApiError> {
        let mut f = Self {
            states: Vec::new(),
            name: String::new(),
            search: String::new(),
            page_token: String::new(),
            page_size: DEFAULT_PAGE_SIZE,
        };
        for (key, value) in url::form_urlencoded::parse(query.as_bytes()) {
            let value = value.trim();
            match &*key {
                "state" => {
                    for s in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                        let p = s.parse::<ProductState>().map_err(|_| {
                            let known: Vec<&str> =
                                ProductState::ALL.iter().map(|p| p.as_str()).collect();
                            invalid(
                                "state",
                                &format!("{s:?} is not one of {}", known.join(", ")),
                            )
                        })?;
                        if !f.states.contains(&p) {
                            f.states.push(p);
                        }
                    }
                }
                "name" => value.clone_into(&mut f.name),
                "search" => value.clone_into(&mut f.search),
                "page_token" => value.clone_into(&mut f.page_token),
                "page_size" if !value.is_empty() => {
                    f.page_size = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=MAX_PAGE_SIZE).contains(n))
                        .ok_or_else(|| {
                            invalid(
                                "page_size",
                                &format!("{value:?} is not a number from 1 to {MAX_PAGE_SIZE}"),
                            )
                        })?;
                }
                // anything else (a cache buster, say) does not narrow the list
                _ => {}
            }
        }
        Ok(f)
    }

    /// The filter as the client library takes it.
    fn for_client(&self) -> z29c_client::ListFilter {
        z29c_client::ListFilter {
            states: self.states.iter().map(|p| view::wire(*p)).collect(),
            name: Some(self.name.clone()).filter(|n| !n.is_empty()),
            search: Some(self.search.clone()).filter(|s| !s.is_empty()),
        }
    }

    #[cfg(test)]
    fn request(&self) -> pb::ListRequest {
        pb::ListRequest {
            page_size: self.page_size,
            page_token: self.page_token.clone(),
            states: self.states.iter().map(|p| view::wire(*p) as i32).collect(),
            name: self.name.clone(),
            search: self.search.clone(),
        }
    }

    /// Whether `row` is one the filter asks for. The scheduler filters; the console checks
    /// again so that a scheduler which predates filtering (and ignores it) never has the page
    /// show a workflow under a filter it does not match.
    fn admits(&self, row: &view::WorkflowRow) -> bool {
        (self.states.is_empty() || self.states.iter().any(|s| s.as_str() == row.state))
            && (self.name.is_empty() || row.name == self.name)
            && (self.search.is_empty()
                || row.client_key == self.search
                || row.id.eq_ignore_ascii_case(&self.search))
    }
}

/// One page of the workflow list; `next_page_token` is empty on the last.
#[derive(Debug, Serialize)]
struct WorkflowPage {
    workflows: Vec<view::WorkflowRow>,
    next_page_token: String,
}

async fn list_workflows(
    State(app): State<App>,
    jar: CookieJar,
    RawQuery(query): RawQuery,
) -> Result<Json<WorkflowPage>, ApiError> {
    let filter = ListFilter::parse(query.as_deref().unwrap_or(""))?;
    let (workflows, _) = app.clients(&jar)?;
    let page = workflows
        .list(
            &filter.for_client(),
            filter.page_size,
            Some(filter.page_token.as_str()).filter(|t| !t.is_empty()),
        )
        .await?;
    Ok(Json(WorkflowPage {
        workflows: page
            .workflows
            .iter()
            .map(view::row)
            .filter(|r| filter.admits(r))
            .collect(),
        next_page_token: page.next_page_token.unwrap_or_default(),
    }))
}

async fn workflow(
    State(app): State<App>,
    jar: CookieJar,
    Path(id): Path<String>,
) -> Result<Json<view::WorkflowView>, ApiError> {
    let (workflows, _) = app.clients(&jar)?;
    let w = workflows.get(&id).await?;
    Ok(Json(view::workflow(&w)))
}

/// The cancel form's fields.
#[derive(Debug, Deserialize)]
struct CancelForm {
    #[serde(default)]
    reason: String,
}

/// Cancels a workflow: the scheduler decides whether the signed-in person may (operators may)
/// and audits it; its steps not yet started never start.
async fn cancel(
    State(app): State<App>,
    jar: CookieJar,
    headers: HeaderMap,
    Path(id): Path<String>,
    Json(form): Json<CancelForm>,
) -> Result<Json<view::WorkflowView>, ApiError> {
    app.sessions.check_forgery(&jar, &headers)?;
    let (workflows, _) = app.clients(&jar)?;
    let reason = form.reason.trim();
    if reason.is_empty() {
        return Err(invalid(
            "reason",
            "say why the workflow is cancelled: the people who follow it read this",
        ));
    }
    let w = workflows.cancel(&id, reason).await?;
    Ok(Json(view::workflow(&w)))
}

/// The review items (open ones, or all with `include_resolved`), each with its workflow's
/// state and everything z29c holds about its step: what the console's queue and `z29c review`
/// both show.
pub async fn review_queue(
    workflows: &z29c_client::Client,
    reviews: &z29c_client::Reviews,
    include_resolved: bool,
) -> Result<Vec<view::ReviewView>, z29c_client::Error> {
    let items = reviews.list(include_resolved).await?;
    let mut out = Vec::with_capacity(items.len());
    for item in &items {
        let w = workflows.get(&item.workflow_id).await.ok();
        out.push(view::review(item, w.as_ref()));
    }
    Ok(out)
}

async fn open_review_items(
    State(app): State<App>,
    jar: CookieJar,
) -> Result<Json<Vec<view::ReviewView>>, ApiError> {
    let (workflows, reviews) = app.clients(&jar)?;
    Ok(Json(review_queue(&workflows, &reviews, false).await?))
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
    /// With `succeeded`, optionally: the result the person found, as JSON text.
    #[serde(default)]
    result_json: String,
}

impl ResolveForm {
    /// What the person decided, with the result they pasted, or which field to correct.
    /// Nothing is chosen for them: no outcome is no decision.
    fn decision(&self) -> Result<(pb::resolve_request::Resolution, String), ApiError> {
        use pb::resolve_request::Resolution;
        let resolution = match self.resolution.as_str() {
            "" => {
                return Err(invalid(
                    "resolution",
                    "choose what happened (the effect happened, it did not, or send again); \
                     nothing is chosen for you",
                ));
            }
            "succeeded" if self.external_reference.trim().is_empty() => {
                return Err(invalid(
                    "external_reference",
                    "say which external reference the effect has",
                ));
            }
            "succeeded" => {
                Resolution::SucceededExternalReference(self.external_reference.trim().into())
            }
            "failed" => Resolution::Failed(true),
            "retry_same_identity" => Resolution::RetrySameIdentity(true),
            other => {
                return Err(invalid(
                    "resolution",
                    &format!("{other:?} is not succeeded, failed or retry_same_identity"),
                ));
            }
        };
        let result = self.result_json.trim();
        if result.is_empty() {
            return Ok((resolution, String::new()));
        }
        if !matches!(resolution, Resolution::SucceededExternalReference(_)) {
            return Err(invalid(
                "result_json",
                "only an effect that happened has a result: choose that it happened, or leave \
                 the result empty",
            ));
        }
        // passed on as pasted (key order, number precision), once it is known to be JSON
        serde_json::from_str::<serde_json::Value>(result)
            .map_err(|e| invalid("result_json", &format!("the result is not JSON: {e}")))?;
        Ok((resolution, result.to_owned()))
    }
}

async fn resolve(
    State(app): State<App>,
    jar: CookieJar,
    headers: HeaderMap,
    Path(id): Path<String>,
    Json(form): Json<ResolveForm>,
) -> Result<Json<serde_json::Value>, ApiError> {
    app.sessions.check_forgery(&jar, &headers)?;
    let (_, reviews) = app.clients(&jar)?;
    let expected_version = form
        .expected_version
        .ok_or_else(|| invalid("expected_version", "required"))?;
    let (resolution, result_json) = form.decision()?;
    let resolution = match resolution {
        pb::resolve_request::Resolution::SucceededExternalReference(external_reference) => {
            z29c_client::Resolution::Succeeded {
                external_reference,
                result_json: Some(result_json).filter(|r| !r.is_empty()),
            }
        }
        pb::resolve_request::Resolution::Failed(_) => z29c_client::Resolution::Failed,
        pb::resolve_request::Resolution::RetrySameIdentity(_) => z29c_client::Resolution::Retry,
    };
    let item = reviews
        .resolve(&id, expected_version, resolution, &form.reason)
        .await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn form(resolution: &str, reference: &str, result: &str) -> ResolveForm {
        ResolveForm {
            expected_version: Some(1),
            reason: "checked".into(),
            resolution: resolution.into(),
            external_reference: reference.into(),
            result_json: result.into(),
        }
    }

    fn refusal(e: ApiError) -> String {
        assert_eq!(e.0.code(), tonic::Code::InvalidArgument);
        e.0.message().to_owned()
    }

    #[test]
    fn a_resolution_must_be_chosen_and_a_pasted_result_must_be_json() {
        use pb::resolve_request::Resolution;
        let none = refusal(form("", "", "").decision().unwrap_err());
        assert!(none.starts_with("resolution: choose"), "{none}");
        let (r, result) = form("succeeded", " ch_1 ", " {\"id\": \"ch_1\"} ")
            .decision()
            .unwrap();
        assert_eq!(r, Resolution::SucceededExternalReference("ch_1".into()));
        assert_eq!(result, "{\"id\": \"ch_1\"}", "passed on as pasted");
        let (_, result) = form("succeeded", "ch_1", "  ").decision().unwrap();
        assert_eq!(result, "", "a result is optional");
        let bad = refusal(form("succeeded", "ch_1", "{id: 1").decision().unwrap_err());
        assert!(
            bad.starts_with("result_json: the result is not JSON"),
            "{bad}"
        );
        let misplaced = refusal(form("failed", "", "{}").decision().unwrap_err());
        assert!(misplaced.starts_with("result_json:"), "{misplaced}");
        let unreferenced = refusal(form("succeeded", " ", "").decision().unwrap_err());
        assert!(
            unreferenced.starts_with("external_reference:"),
            "{unreferenced}"
        );
        assert_eq!(
            form("failed", "", "").decision().unwrap().0,
            Resolution::Failed(true)
        );
        assert_eq!(
            form("retry_same_identity", "", "").decision().unwrap().0,
            Resolution::RetrySameIdentity(true)
        );
        assert!(form("maybe", "", "").decision().is_err());
    }

    #[test]
    fn the_list_filter_reads_states_name_search_and_page() {
        let f = ListFilter::parse(
            "state=failed&state=needs_review,failed&name=order&search=%20key-1%20&page_token=t&page_size=10&_=1",
        )
        .unwrap();
        assert_eq!(
            f.states,
            [ProductState::Failed, ProductState::NeedsReview],
            "each state once"
        );
        assert_eq!((f.name.as_str(), f.search.as_str()), ("order", "key-1"));
        let req = f.request();
        assert_eq!(
            req.states,
            [
                pb::ProductState::Failed as i32,
                pb::ProductState::NeedsReview as i32
            ]
        );
        assert_eq!((req.page_token.as_str(), req.page_size), ("t", 10));
        let all = ListFilter::parse("").unwrap();
        assert!(all.states.is_empty() && all.search.is_empty());
        assert_eq!(all.page_size, DEFAULT_PAGE_SIZE);
        let bad = refusal(ListFilter::parse("state=done").unwrap_err());
        assert!(bad.contains("\"done\" is not one of preparing"), "{bad}");
        for size in ["0", "501", "x"] {
            assert!(ListFilter::parse(&format!("page_size={size}")).is_err());
        }
    }

    #[test]
    fn the_filter_admits_only_what_it_asks_for() {
        let row = |id: &str, key: &str, name: &str, state: &'static str| view::WorkflowRow {
            id: id.into(),
            name: name.into(),
            client_key: key.into(),
            state,
            label: "",
            created_at: None,
            steps: 1,
            steps_completed: 0,
        };
        let failed = row("0A", "key-1", "order", "failed");
        let done = row("0b", "key-2", "refund", "completed");
        let f = |q: &str| ListFilter::parse(q).unwrap();
        assert!(f("").admits(&failed) && f("").admits(&done));
        assert!(f("state=failed").admits(&failed) && !f("state=failed").admits(&done));
        assert!(f("state=failed,completed").admits(&done));
        assert!(f("name=order").admits(&failed) && !f("name=order").admits(&done));
        assert!(f("search=key-2").admits(&done) && !f("search=key-2").admits(&failed));
        assert!(f("search=0a").admits(&failed), "an id in either case");
        assert!(!f("search=key").admits(&failed), "exact, not a prefix");
    }

    #[test]
    fn the_page_gets_every_state_and_its_wording() {
        let states: Vec<(String, String)> = serde_json::from_str(&states_json()).unwrap();
        assert_eq!(states.len(), ProductState::ALL.len());
        assert!(states.contains(&("needs_review".into(), "Delivery status needs review".into())));
        assert!(include_str!("../assets/index.html").contains("/*states*/[]"));
    }
}
