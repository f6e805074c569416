//! The client side: a token attached to every call of a client.

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

/// Adds `authorization: Bearer <token>` to each request (nothing without a token).
#[derive(Clone, Default)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl std::fmt::Debug for Bearer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Bearer(<token>)"
        } else {
            "Bearer(none)"
        })
    }
}

impl Bearer {
    /// A token that is not valid header text is refused here, not sent.
    pub fn new(token: Option<&str>) -> anyhow::Result<Self> {
        let Some(token) = token.map(str::trim).filter(|t| !t.is_empty()) else {
            return Ok(Self(None));
        };
        let mut value: MetadataValue<Ascii> = format!("Bearer {token}")
            .parse()
            .map_err(|_| anyhow::anyhow!("token: not valid header text"))?;
        value.set_sensitive(true);
        Ok(Self(Some(value)))
    }
}

impl Interceptor for Bearer {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            request.metadata_mut().insert("authorization", v.clone());
        }
        Ok(request)
    }
}

/// A channel whose calls carry a [`Bearer`] token.
pub type Authed = InterceptedService<Channel, Bearer>;
