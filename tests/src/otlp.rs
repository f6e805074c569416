//! An OTLP/gRPC trace receiver inside the test process: services export their spans to it
//! (`OTEL_EXPORTER_OTLP_ENDPOINT`), and a test reads them back to check that one workflow is
//! one trace with the right parent links.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use anyhow::Result;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use tonic::{Request, Response, Status};

/// One span as received.
#[derive(Debug, Clone)]
pub struct CollectedSpan {
    /// The exporting process's `service.name`.
    pub service: String,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    pub attributes: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default)]
pub struct Collector {
    spans: Arc<Mutex<Vec<CollectedSpan>>>,
}

fn text(kv: &[KeyValue]) -> BTreeMap<String, String> {
    kv.iter()
        .filter_map(|k| {
            let v = match k.value.as_ref()?.value.as_ref()? {
                AnyValue::StringValue(s) => s.clone(),
                AnyValue::IntValue(i) => i.to_string(),
                AnyValue::BoolValue(b) => b.to_string(),
                AnyValue::DoubleValue(d) => d.to_string(),
                _ => return None,
            };
            Some((k.key.clone(), v))
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut got = Vec::new();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| text(&r.attributes).remove("service.name"))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    got.push(CollectedSpan {
                        service: service.clone(),
                        name: s.name,
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent_span_id: hex(&s.parent_span_id),
                        attributes: text(&s.attributes),
                    });
                }
            }
        }
        self.spans
            .lock()
            .map_err(|_| Status::internal("poisoned"))?
            .extend(got);
        Ok(Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Collector {
    /// Listens on a free loopback port; returns the collector and its `http://` endpoint.
    pub async fn start() -> Result<(Self, String)> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let c = Self::default();
        let server = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(c.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
        tokio::spawn(server);
        Ok((c, endpoint))
    }

    pub fn spans(&self) -> Vec<CollectedSpan> {
        self.spans.lock().map(|s| s.clone()).unwrap_or_default()
    }
}
