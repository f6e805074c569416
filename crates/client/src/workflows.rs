//! The scheduler's `WorkflowService`: submit, get, watch, wait for the end, cancel, list.

use std::time::Duration;

use backon::Retryable;
use futures::stream::{BoxStream, StreamExt, TryStreamExt};
use tonic::Code;
use tonic::transport::Channel;
use z29c_proto::v1::workflow_service_client::WorkflowServiceClient;
use z29c_proto::v1::{self as pb, ProductState};
use z29c_proto::workflow_file::WorkflowFile;
use z29c_security::{Authed, Bearer};

use crate::{Access, Error, Result};

/// The largest page the scheduler hands out; [`Client::list_all`] asks for it.
const LARGEST_PAGE: u32 = 500;

/// How long [`Client::await_end`] keeps trying when the scheduler goes away while it waits
/// (a restart, a rolling update), counting only the pauses between tries.
const AWAIT_PATIENCE: Duration = Duration::from_secs(30);

/// A connection to the scheduler's `WorkflowService`. Cheap to clone; clones share the
/// connection.
#[derive(Debug, Clone)]
pub struct Client {
    inner: WorkflowServiceClient<Authed>,
    timeout: Duration,
}

/// What a submission returned.
#[derive(Debug, Clone, PartialEq)]
pub struct Submitted {
    pub workflow: pb::Workflow,
    /// False when the client key named an existing, identical submission: submitting again
    /// is safe, and answers the workflow the first submission made.
    pub created: bool,
}

/// How a workflow ended, as far as waiting is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum End {
    Completed,
    Failed,
    Cancelled,
    /// Not an end for the workflow, which stays open, but nothing moves until a person
    /// resolves its review item, so waiting stops here.
    NeedsReview,
}

impl End {
    /// The end a product state is, if any.
    pub fn of(state: ProductState) -> Option<Self> {
        match state {
            ProductState::Completed => Some(Self::Completed),
            ProductState::Failed => Some(Self::Failed),
            ProductState::Cancelled => Some(Self::Cancelled),
            ProductState::NeedsReview => Some(Self::NeedsReview),
            ProductState::Unspecified
            | ProductState::Preparing
            | ProductState::WaitingOnExternalService
            | ProductState::RecoveringExecution => None,
        }
    }

    pub fn state(self) -> ProductState {
        match self {
            Self::Completed => ProductState::Completed,
            Self::Failed => ProductState::Failed,
            Self::Cancelled => ProductState::Cancelled,
            Self::NeedsReview => ProductState::NeedsReview,
        }
    }
}

/// A workflow at its end, with every step's receipt, result and reason.
#[derive(Debug, Clone, PartialEq)]
pub struct Ended {
    pub end: End,
    pub workflow: pb::Workflow,
}

impl Ended {
    /// The step called `name`.
    pub fn step(&self, name: &str) -> Option<&pb::Step> {
        self.workflow.steps.iter().find(|s| s.name == name)
    }
}

/// Which workflows [`Client::list`] returns; the default is every workflow.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListFilter {
    /// Only workflows in one of these product states (empty: any).
    pub states: Vec<ProductState>,
    /// Only workflows of this name, exactly.
    pub name: Option<String>,
    /// Only the workflow with this id or this client key, exactly.
    pub search: Option<String>,
}

impl ListFilter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a product state to those listed.
    #[must_use]
    pub fn state(mut self, state: ProductState) -> Self {
        self.states.push(state);
        self
    }

    #[must_use]
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    #[must_use]
    pub fn search(mut self, id_or_client_key: impl Into<String>) -> Self {
        self.search = Some(id_or_client_key.into());
        self
    }
}

/// One page of a listing, newest first.
#[derive(Debug, Clone, PartialEq)]
pub struct Page {
    pub workflows: Vec<pb::Workflow>,
    /// Where the next page starts; `None` on the last page.
    pub next_page_token: Option<String>,
}

/// A stream of a workflow's user-facing changes, ending when the workflow ends.
pub type Events = BoxStream<'static, Result<pb::WorkflowEvent>>;

impl Client {
    /// Connects to the scheduler at `url` (`http://host:port`; `https://` with TLS) at once,
    /// so an address nobody answers at is [`Error::Unreachable`] here rather than at the first
    /// call. A connection lost later is made again by the next call.
    pub async fn connect(url: &str, access: &Access) -> Result<Self> {
        let (channel, bearer) = access.channel(url).await?;
        Ok(Self {
            inner: WorkflowServiceClient::with_interceptor(channel, bearer),
            timeout: access.call_timeout,
        })
    }

    /// A client on a channel its caller keeps, carrying `bearer`: for a server that calls the
    /// scheduler on behalf of many people, each with their own token (the console keeps one
    /// channel and makes a client per request). Calls are bounded by `call_timeout`.
    pub fn on_channel(channel: Channel, bearer: Bearer, call_timeout: Duration) -> Self {
        Self {
            inner: WorkflowServiceClient::with_interceptor(channel, bearer),
            timeout: call_timeout,
        }
    }

    /// A unary call's request, bounded by the call timeout (streams are not: they last as
    /// long as the workflow).
    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(self.timeout);
        request
    }

    /// Submits a workflow. Idempotent on its client key: the same key and steps answer the
    /// same workflow (`created: false`); the same key with other steps is refused
    /// (`FAILED_PRECONDITION`).
    pub async fn submit(&self, submission: pb::SubmitRequest) -> Result<Submitted> {
        let answer = self
            .inner
            .clone()
            .submit(self.request(submission))
            .await?
            .into_inner();
        Ok(Submitted {
            workflow: answer.workflow.ok_or(Error::Protocol(
                "a submission answered without its workflow",
            ))?,
            created: answer.created,
        })
    }

    /// Submits a workflow file's document: parsed from YAML with
    /// [`workflow_file::parse`](crate::workflow_file::parse), or deserialized from JSON.
    pub async fn submit_file(&self, file: WorkflowFile) -> Result<Submitted> {
        self.submit(file.into_request()?).await
    }

    /// The workflow now: product states, receipts, results, and each step's history.
    pub async fn get(&self, workflow_id: &str) -> Result<pb::Workflow> {
        Ok(self
            .inner
            .clone()
            .get(self.request(pb::GetRequest {
                workflow_id: workflow_id.to_owned(),
            }))
            .await?
            .into_inner())
    }

    /// Follows a workflow: first its current state, then one event per change. The stream
    /// ends after Completed, Failed or Cancelled; a workflow that needs review stays open
    /// (a person may let it go on), so a caller that only waits stops there.
    pub async fn watch(&self, workflow_id: &str) -> Result<Events> {
        let stream = self
            .inner
            .clone()
            .watch(pb::WatchRequest {
                workflow_id: workflow_id.to_owned(),
            })
            .await?
            .into_inner();
        Ok(stream.map_err(Error::from).boxed())
    }

    /// Waits until the workflow completes, fails, is cancelled or needs review, and returns
    /// it then. A scheduler that goes away meanwhile is asked again, with backoff, for
    /// a while.
    pub async fn await_end(&self, workflow_id: &str) -> Result<Ended> {
        (|| self.follow_to_end(workflow_id))
            .retry(
                backon::ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(200))
                    .with_max_delay(Duration::from_secs(2))
                    .with_jitter()
                    .with_total_delay(Some(AWAIT_PATIENCE))
                    .without_max_times(),
            )
            .when(|e| e.code() == Code::Unavailable)
            .await
    }

    async fn follow_to_end(&self, workflow_id: &str) -> Result<Ended> {
        let mut events = self.watch(workflow_id).await?;
        while let Some(event) = events.try_next().await? {
            if End::of(event.state()).is_some() {
                break;
            }
        }
        let workflow = self.get(workflow_id).await?;
        match End::of(workflow.state()) {
            Some(end) => Ok(Ended { end, workflow }),
            // the stream was cut (the scheduler stopping), or a person resolved the review
            // between the event and the read: follow again
            None => Err(Error::Status {
                code: Code::Unavailable,
                message: "the watch ended before the workflow did".into(),
            }),
        }
    }

    /// Cancels a workflow, with a reason people will read. A step that may already have had
    /// its effect is not cancelled: it ends in a receipt or in review (docs/design.md §1.8).
    pub async fn cancel(&self, workflow_id: &str, reason: &str) -> Result<pb::Workflow> {
        Ok(self
            .inner
            .clone()
            .cancel(self.request(pb::CancelRequest {
                workflow_id: workflow_id.to_owned(),
                reason: reason.to_owned(),
            }))
            .await?
            .into_inner())
    }

    /// One page of the workflows `filter` selects, newest first. `page_size` 0 is the
    /// scheduler's default; `page_token` is a previous page's `next_page_token`.
    pub async fn list(
        &self,
        filter: &ListFilter,
        page_size: u32,
        page_token: Option<&str>,
    ) -> Result<Page> {
        let answer = self
            .inner
            .clone()
            .list(self.request(pb::ListRequest {
                page_size,
                page_token: page_token.unwrap_or_default().to_owned(),
                states: filter.states.iter().map(|s| *s as i32).collect(),
                name: filter.name.clone().unwrap_or_default(),
                search: filter.search.clone().unwrap_or_default(),
            }))
            .await?
            .into_inner();
        Ok(Page {
            workflows: answer.workflows,
            next_page_token: Some(answer.next_page_token).filter(|t| !t.is_empty()),
        })
    }

    /// Every workflow `filter` selects, newest first, walking all pages.
    pub async fn list_all(&self, filter: &ListFilter) -> Result<Vec<pb::Workflow>> {
        let mut all = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let page = self.list(filter, LARGEST_PAGE, token.as_deref()).await?;
            all.extend(page.workflows);
            match page.next_page_token {
                Some(next) if token.as_ref() == Some(&next) => {
                    return Err(Error::Protocol("a page named itself as the next one"));
                }
                Some(next) => token = Some(next),
                None => return Ok(all),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_product_state_is_an_end_or_not_and_ends_round_trip() {
        for state in [
            ProductState::Unspecified,
            ProductState::Preparing,
            ProductState::WaitingOnExternalService,
            ProductState::RecoveringExecution,
            ProductState::NeedsReview,
            ProductState::Completed,
            ProductState::Failed,
            ProductState::Cancelled,
        ] {
            if let Some(end) = End::of(state) {
                assert_eq!(end.state(), state);
            }
        }
        assert_eq!(End::of(ProductState::RecoveringExecution), None);
        assert_eq!(End::of(ProductState::NeedsReview), Some(End::NeedsReview));
    }

    #[test]
    fn a_filter_is_built_by_adding() {
        let f = ListFilter::new()
            .state(ProductState::Failed)
            .state(ProductState::NeedsReview)
            .name("order")
            .search("key-1");
        assert_eq!(f.states, [ProductState::Failed, ProductState::NeedsReview]);
        assert_eq!(f.name.as_deref(), Some("order"));
        assert_eq!(f.search.as_deref(), Some("key-1"));
    }
}
