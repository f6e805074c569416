//! `ReviewService`: the review queue over gRPC. A resolution needs a reason and the item's
//! current version; both failures are refused before anything changes.

use tonic::{Request, Response, Status};
use uuid::Uuid;
use z29c_core::Action;
use z29c_core::ExternalReference;
use z29c_proto::v1::review_service_server::ReviewService;
use z29c_proto::v1::{self as pb, resolve_request};
use z29c_runtime::{Guard, status_from_store};
use z29c_store::Store;
use z29c_store::review::{Resolution, ReviewItem};

/// Metadata naming the operator when operator authentication is off (development); with it
/// on, the resolver is the token's subject and this header is ignored.
pub const OPERATOR_HEADER: &str = "x-z29c-operator";

#[derive(Debug, Clone)]
pub struct Reviews {
    store: Store,
    guard: Guard,
}

impl Reviews {
    pub fn new(store: Store, guard: Guard) -> Self {
        Self { store, guard }
    }
}

fn to_wire(i: ReviewItem) -> pb::ReviewItem {
    pb::ReviewItem {
        id: i.id.to_string(),
        workflow_id: i.workflow_id.to_string(),
        step_id: i.step_id.to_string(),
        step_name: i.step_name,
        request_identity: i.request_identity.unwrap_or_default(),
        reason: i.reason,
        state: i.state,
        version: i.version,
        created_at: Some(prost_types_timestamp(i.created_at)),
        evidence: i
            .evidence
            .into_iter()
            .map(|e| pb::ReviewEvidence {
                at: Some(prost_types_timestamp(e.at)),
                kind: e.kind,
                attempt: e.attempt.map_or(0, |n| n.max(0) as u32),
                request_identity: e.request_identity.unwrap_or_default(),
                may_have_sent: e.may_have_sent.unwrap_or(false),
                outcome: e.outcome.unwrap_or_default(),
                external_reference: e.external_reference.unwrap_or_default(),
                summary: e.summary,
            })
            .collect(),
    }
}

fn prost_types_timestamp(t: chrono::DateTime<chrono::Utc>) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: t.timestamp(),
        nanos: t.timestamp_subsec_nanos() as i32,
    }
}

#[tonic::async_trait]
impl ReviewService for Reviews {
    async fn list(
        &self,
        request: Request<pb::ListReviewsRequest>,
    ) -> Result<Response<pb::ListReviewsResponse>, Status> {
        self.guard.admit(&request, "List", Action::Read).await?;
        let req = request.into_inner();
        let size = if req.page_size == 0 {
            100
        } else {
            req.page_size.min(500)
        };
        let after = if req.page_token.is_empty() {
            None
        } else {
            Some(Uuid::parse_str(&req.page_token).map_err(|_| {
                Status::invalid_argument(format!(
                    "page_token: {:?} is not a token this service gave out",
                    req.page_token
                ))
            })?)
        };
        let page = self
            .store
            .review_page(req.include_resolved, i64::from(size), after)
            .await
            .map_err(status_from_store)?;
        Ok(Response::new(pb::ListReviewsResponse {
            items: page.items.into_iter().map(to_wire).collect(),
            next_page_token: page.next.map(|id| id.to_string()).unwrap_or_default(),
        }))
    }

    async fn resolve(
        &self,
        request: Request<pb::ResolveRequest>,
    ) -> Result<Response<pb::ReviewItem>, Status> {
        let (caller, audit) = self
            .guard
            .admit_change(&request, "Resolve", Action::Resolve)
            .await?;
        let who = if self.guard.verifier().enabled() {
            caller.subject
        } else {
            request
                .metadata()
                .get(OPERATOR_HEADER)
                .and_then(|v| v.to_str().ok())
                .filter(|v| !v.trim().is_empty())
                .unwrap_or("operator")
                .to_owned()
        };
        let req = request.into_inner();
        let item: Uuid = req
            .item_id
            .parse()
            .map_err(|e| Status::invalid_argument(format!("item_id: {e}")))?;
        if req.reason.trim().is_empty() {
            return Err(Status::invalid_argument(
                "reason: a resolution needs a reason",
            ));
        }
        let resolution = match req.resolution {
            Some(resolve_request::Resolution::SucceededExternalReference(r)) => {
                Resolution::Succeeded(ExternalReference::parse(r).map_err(|e| {
                    Status::invalid_argument(format!("succeeded_external_reference: {}", e.reason))
                })?)
            }
            Some(resolve_request::Resolution::Failed(true)) => Resolution::Failed,
            Some(resolve_request::Resolution::RetrySameIdentity(true)) => {
                Resolution::RetrySameIdentity
            }
            _ => {
                return Err(Status::invalid_argument(
                    "resolution: one of succeeded_external_reference, failed or retry_same_identity",
                ));
            }
        };
        let found = match req.result_json.trim() {
            "" => None,
            text => Some(
                serde_json::from_str(text)
                    .map_err(|e| Status::invalid_argument(format!("result_json: not JSON: {e}")))?,
            ),
        };
        let resolved = self
            .store
            .resolve_review_audited(
                item,
                req.expected_version,
                &who,
                &req.reason,
                &resolution,
                found,
                audit.entry(),
            )
            .await
            .map_err(status_from_store)?;
        // the call's audit row committed with the resolution
        audit.written();
        let (kind, outcome) = match &resolution {
            Resolution::Succeeded(_) => ("succeeded", Some("succeeded")),
            Resolution::Failed => ("failed", Some("failed")),
            Resolution::RetrySameIdentity => ("retry_same_identity", None),
        };
        z29c_telemetry::review_resolved(
            kind,
            outcome,
            (chrono::Utc::now() - resolved.created_at)
                .to_std()
                .unwrap_or_default(),
        );
        tracing::info!(%item, %who, resolution = ?resolution, "review item resolved");
        Ok(Response::new(to_wire(resolved)))
    }
}
