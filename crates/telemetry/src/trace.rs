//! Tracing for every service: `tracing` spans, logs to stderr (JSON with the trace id when
//! `Z29C_LOG_JSON=1`), and OpenTelemetry export over OTLP/gRPC when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set (the standard `OTEL_*` variables tune it).
//!
//! One workflow run is one trace. Context travels as a W3C `traceparent`: in gRPC metadata
//! between services, in NATS message headers, and — because executors and recovery find their
//! work in PostgreSQL, not in a request — stored with the workflow at submission, so the spans
//! of an attempt or a recovery decision are children of the submission.

use std::collections::HashMap;
use std::io::IsTerminal;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The W3C header name, in gRPC metadata and NATS headers alike.
pub const TRACEPARENT: &str = "traceparent";

/// Flushes and shuts the exporter down when dropped: keep it alive for the process.
#[must_use = "dropping the guard stops trace export"]
#[derive(Debug)]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.force_flush();
            let _ = p.shutdown();
        }
    }
}

/// Installs the global subscriber for `service` (its OpenTelemetry `service.name`). Call it
/// inside the Tokio runtime: the exporter runs on it. A second call changes nothing.
pub fn init(service: &str) -> TelemetryGuard {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("Z29C_LOG_JSON").is_ok_and(|v| v == "1");
    let fmt = if json {
        tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .boxed()
    } else {
        // colours only for a person at a terminal: a log file or collector gets plain text
        // (escape codes in files were also 3-4 % of a busy scheduler's CPU)
        tracing_subscriber::fmt::layer()
            .with_ansi(std::io::stderr().is_terminal())
            .with_writer(std::io::stderr)
            .boxed()
    };
    let provider = Some(tracer_provider(service));
    let otel = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("z29c"))
            .with_error_records_to_exceptions(true)
    });
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init();
    TelemetryGuard { provider }
}

/// Trace ids exist whether or not anything is exported, so logs name their trace and context
/// still travels between services: without `OTEL_EXPORTER_OTLP_ENDPOINT` spans are not
/// sampled (cheap: nothing is recorded), with it they are exported over OTLP/gRPC.
fn tracer_provider(service: &str) -> SdkTracerProvider {
    use opentelemetry_sdk::trace::Sampler;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service.to_owned())
        .build();
    let builder = SdkTracerProvider::builder().with_resource(resource);
    let endpoint = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
        .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        .ok()
        .filter(|e| !e.is_empty());
    let exporter = endpoint.and_then(|endpoint| {
        match opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()
        {
            Ok(e) => Some(e),
            Err(e) => {
                tracing::warn!(error = %e, %endpoint, "OTLP exporter not built; traces stay local");
                None
            }
        }
    });
    let provider = match exporter {
        Some(exporter) => {
            let processor =
                opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
                    exporter,
                    opentelemetry_sdk::runtime::Tokio,
                )
                .build();
            builder.with_span_processor(processor).build()
        }
        None => builder.with_sampler(Sampler::AlwaysOff).build(),
    };
    opentelemetry::global::set_tracer_provider(provider.clone());
    provider
}

struct MapCarrier<'a>(&'a mut HashMap<String, String>);

impl Injector for MapCarrier<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_owned(), value);
    }
}

struct OneHeader<'a>(Option<&'a str>);

impl Extractor for OneHeader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        if key == TRACEPARENT { self.0 } else { None }
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT]
    }
}

/// The `traceparent` of `span`, if it is being traced.
pub fn traceparent_of(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut map = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut MapCarrier(&mut map));
    map.remove(TRACEPARENT)
}

/// The `traceparent` of the current span.
pub fn current_traceparent() -> Option<String> {
    traceparent_of(&tracing::Span::current())
}

/// Makes `span` a child of the remote span `traceparent` names (nothing if absent or bad).
///
/// Either way, a span that declares a `trace_id` field gets its trace id recorded, so every
/// log line inside it (JSON logs show the current span's fields) names the trace.
pub fn set_parent(span: &tracing::Span, traceparent: Option<&str>) {
    if let Some(tp) = traceparent {
        let cx = TraceContextPropagator::new().extract(&OneHeader(Some(tp)));
        if cx.span().span_context().is_valid() {
            let _ = span.set_parent(cx);
        }
    }
    if let Some(id) = trace_id_of(span) {
        span.record("trace_id", id);
    }
}

/// The trace id of `span` as 32 hex digits, for logs.
pub fn trace_id_of(span: &tracing::Span) -> Option<String> {
    let sc = span.context().span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

/// Adds the current span's `traceparent` to outgoing gRPC metadata.
pub fn inject_grpc<T>(request: &mut tonic::Request<T>) {
    if let Some(tp) = current_traceparent()
        && let Ok(v) = tp.parse()
    {
        request.metadata_mut().insert(TRACEPARENT, v);
    }
}

/// The `traceparent` an incoming gRPC request carries.
pub fn grpc_traceparent<T>(request: &tonic::Request<T>) -> Option<String> {
    request
        .metadata()
        .get(TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_traceparent_is_ignored_and_none_is_reported_for_an_untraced_span() {
        let span = tracing::info_span!("x");
        set_parent(&span, Some("not-a-traceparent"));
        set_parent(&span, None);
        assert_eq!(traceparent_of(&span), None);
        assert_eq!(trace_id_of(&span), None);
    }
}
