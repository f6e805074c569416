//! The operator console (DESIGN.md §8): one page that shows workflows in their product states
//! with live updates, each step's timeline with its lease history, attempts, checkpoints,
//! evidence and recovery decisions under technical details, the review queue with its resolve
//! form, and the four metric levels. It holds no state and no SQL: it reads the public gRPC
//! services (`WorkflowService` on the scheduler, `ReviewService` on recovery) and the services'
//! `/metrics`, and serves the page plus a JSON API (`/api/...`) the page polls.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use z29c_proto::v1 as pb;
use z29c_proto::v1::review_service_client::ReviewServiceClient;
use z29c_proto::v1::workflow_service_client::WorkflowServiceClient;

pub mod metrics;
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
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8088)),
            workflow_server: "http://127.0.0.1:50051".into(),
            review_server: "http://127.0.0.1:50053".into(),
            metrics: Vec::new(),
        }
    }
}

#[derive(Clone)]
struct App {
    workflows: WorkflowServiceClient<Channel>,
    reviews: ReviewServiceClient<Channel>,
    metrics: Vec<String>,
    http: reqwest::Client,
}

/// The gRPC clients the console and `z29c review` read through. Connections are lazy: the
/// console starts while a service is still down and says so per request.
pub fn clients(
    workflow_server: &str,
    review_server: &str,
) -> anyhow::Result<(WorkflowServiceClient<Channel>, ReviewServiceClient<Channel>)> {
    let lazy = |url: &str, what: &str| -> anyhow::Result<Channel> {
        Ok(Channel::from_shared(url.to_owned())
            .with_context(|| format!("{what}: bad URL {url:?}"))?
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(5))
            .connect_lazy())
    };
    Ok((
        WorkflowServiceClient::new(lazy(workflow_server, "workflow_server")?),
        ReviewServiceClient::new(lazy(review_server, "review_server")?),
    ))
}

/// Serves the console until `shutdown`; sends the bound address on `ready`.
pub async fn run(
    config: ConsoleConfig,
    shutdown: CancellationToken,
    ready: Option<tokio::sync::oneshot::Sender<SocketAddr>>,
) -> anyhow::Result<()> {
    let (workflows, reviews) = clients(&config.workflow_server, &config.review_server)?;
    let app = App {
        workflows,
        reviews,
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
        .route("/api/workflows", get(list_workflows))
        .route("/api/workflows/{id}", get(workflow))
        .route("/api/reviews", get(open_review_items))
        .route("/api/reviews/{id}/resolve", post(resolve))
        .route("/api/metrics", get(metrics_overview))
        .with_state(app)
}

async fn page() -> Html<&'static str> {
    Html(include_str!("../assets/index.html"))
}

/// A failed call, as the page shows it: the gRPC status's code and reason.
#[derive(Debug)]
struct ApiError(tonic::Status);

impl From<tonic::Status> for ApiError {
    fn from(s: tonic::Status) -> Self {
        Self(s)
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
    State(mut app): State<App>,
) -> Result<Json<Vec<view::WorkflowRow>>, ApiError> {
    let list = app
        .workflows
        .list(pb::ListRequest {
            page_size: 100,
            page_token: String::new(),
        })
        .await?
        .into_inner();
    Ok(Json(list.workflows.iter().map(view::row).collect()))
}

async fn workflow(
    State(mut app): State<App>,
    Path(id): Path<String>,
) -> Result<Json<view::WorkflowView>, ApiError> {
    let w = app
        .workflows
        .get(pb::GetRequest { workflow_id: id })
        .await?
        .into_inner();
    Ok(Json(view::workflow(&w)))
}

/// The review items (open ones, or all with `include_resolved`), each with its workflow's
/// state and its step's evidence and decisions: what the console's queue and `z29c review`
/// both show.
pub async fn review_queue(
    workflows: &mut WorkflowServiceClient<Channel>,
    reviews: &mut ReviewServiceClient<Channel>,
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
    State(mut app): State<App>,
) -> Result<Json<Vec<view::ReviewView>>, ApiError> {
    Ok(Json(
        review_queue(&mut app.workflows, &mut app.reviews, false).await?,
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
    State(mut app): State<App>,
    Path(id): Path<String>,
    Json(form): Json<ResolveForm>,
) -> Result<Json<serde_json::Value>, ApiError> {
    use pb::resolve_request::Resolution;
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
    let item = app
        .reviews
        .resolve(pb::ResolveRequest {
            item_id: id,
            expected_version,
            reason: form.reason,
            resolution: Some(resolution),
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

async fn metrics_overview(State(app): State<App>) -> Json<metrics::Overview> {
    Json(metrics::overview(&app.http, &app.metrics).await)
}
