//! Recovery's `ReviewService`: the steps whose outcome only a person can establish.

use std::time::Duration;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;
use z29c_proto::v1::review_service_client::ReviewServiceClient;
use z29c_proto::v1::{self as pb, resolve_request};
use z29c_security::{Authed, Bearer};

use crate::{Access, Error, Result};

/// Who resolved an item, where the service does not take it from the caller's token.
const OPERATOR_HEADER: &str = "x-z29c-operator";

/// A connection to a recovery service's `ReviewService`. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Reviews {
    inner: ReviewServiceClient<Authed>,
    timeout: Duration,
    operator: Option<MetadataValue<Ascii>>,
}

/// What a person established about a step in review.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// The effect happened: the external system's reference for it and, if the person found
    /// it, the result as JSON text, which dependent steps may refer to like an answer's.
    Succeeded {
        external_reference: String,
        result_json: Option<String>,
    },
    /// The effect did not happen and will not be tried again.
    Failed,
    /// Send again, under the same request identity.
    Retry,
}

impl Reviews {
    /// Connects to the review service at `url` (a recovery instance's).
    pub async fn connect(url: &str, access: &Access) -> Result<Self> {
        let (channel, bearer) = access.channel(url).await?;
        Ok(Self {
            inner: ReviewServiceClient::with_interceptor(channel, bearer),
            timeout: access.call_timeout,
            operator: None,
        })
    }

    /// A client on a channel its caller keeps, carrying `bearer` (see
    /// [`crate::Client::on_channel`]).
    pub fn on_channel(channel: Channel, bearer: Bearer, call_timeout: Duration) -> Self {
        Self {
            inner: ReviewServiceClient::with_interceptor(channel, bearer),
            timeout: call_timeout,
            operator: None,
        }
    }

    /// The name recorded on resolutions when the service runs without operator tokens (with
    /// tokens, the token's subject is recorded).
    pub fn with_operator(mut self, name: &str) -> Result<Self> {
        let value = name.parse().map_err(|_| {
            Error::Config(format!(
                "operator '{}': not valid header text",
                name.escape_debug()
            ))
        })?;
        self.operator = Some(value);
        Ok(self)
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(self.timeout);
        request
    }

    /// The open items, oldest first; with `include_resolved`, resolved ones too.
    pub async fn list(&self, include_resolved: bool) -> Result<Vec<pb::ReviewItem>> {
        let mut items = Vec::new();
        let mut page_token = String::new();
        loop {
            let page = self
                .inner
                .clone()
                .list(self.request(pb::ListReviewsRequest {
                    include_resolved,
                    page_size: 500,
                    page_token: page_token.clone(),
                }))
                .await?
                .into_inner();
            items.extend(page.items);
            if page.next_page_token.is_empty() {
                return Ok(items);
            }
            if page.next_page_token == page_token {
                return Err(Error::Protocol("a page named itself as the next one"));
            }
            page_token = page.next_page_token;
        }
    }

    /// Resolves an item at the version last seen (compare-and-set: an item changed since is
    /// refused, and must be looked at again), with a reason that is kept in the audit log.
    pub async fn resolve(
        &self,
        item_id: &str,
        expected_version: i64,
        resolution: Resolution,
        reason: &str,
    ) -> Result<pb::ReviewItem> {
        let (resolution, result_json) = match resolution {
            Resolution::Succeeded {
                external_reference,
                result_json,
            } => (
                resolve_request::Resolution::SucceededExternalReference(external_reference),
                result_json.unwrap_or_default(),
            ),
            Resolution::Failed => (resolve_request::Resolution::Failed(true), String::new()),
            Resolution::Retry => (
                resolve_request::Resolution::RetrySameIdentity(true),
                String::new(),
            ),
        };
        let mut request = self.request(pb::ResolveRequest {
            item_id: item_id.to_owned(),
            expected_version,
            reason: reason.to_owned(),
            resolution: Some(resolution),
            result_json,
        });
        if let Some(operator) = &self.operator {
            request
                .metadata_mut()
                .insert(OPERATOR_HEADER, operator.clone());
        }
        Ok(self.inner.clone().resolve(request).await?.into_inner())
    }
}
