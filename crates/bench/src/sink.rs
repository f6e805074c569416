//! The benchmark's own HTTP sink: the one destination every system's steps POST to (z29c
//! through its gateway, each peer from its job or step). It answers every `POST` with `201`
//! and a JSON body naming a `reference`, and counts what it received, so a run's figures say
//! how many requests reached the outside world per step, by the outside world's count. It
//! de-duplicates nothing: a second request is a second count.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Result;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;

/// A running sink; it stops when dropped.
#[derive(Debug)]
pub struct Sink {
    url: String,
    received: Arc<AtomicU64>,
    server: tokio::task::JoinHandle<()>,
}

impl Sink {
    /// Listens on a free port of 127.0.0.1.
    pub async fn start() -> Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let received = Arc::new(AtomicU64::new(0));
        let app = Router::new()
            .fallback(accept)
            .with_state(Arc::clone(&received));
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self {
            url,
            received,
            server,
        })
    }

    /// The sink's base URL (`http://127.0.0.1:PORT`); any path under it is accepted.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Requests received since the start.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn accept(
    State(received): State<Arc<AtomicU64>>,
    method: axum::http::Method,
    _body: axum::body::Bytes,
) -> impl IntoResponse {
    if method != axum::http::Method::POST {
        return (StatusCode::METHOD_NOT_ALLOWED, String::new());
    }
    let n = received.fetch_add(1, Ordering::Relaxed) + 1;
    (
        StatusCode::CREATED,
        format!("{{\"reference\":\"sink-{n}\"}}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_post_is_counted_and_answered_with_a_reference() {
        let sink = Sink::start().await.unwrap();
        let http = reqwest::Client::new();
        let post = |path: &str| http.post(format!("{}{path}", sink.url())).body("{}").send();
        let first = post("/").await.unwrap();
        assert_eq!(first.status(), 201);
        assert_eq!(first.text().await.unwrap(), "{\"reference\":\"sink-1\"}");
        let second = post("/v1/bench").await.unwrap();
        assert_eq!(second.text().await.unwrap(), "{\"reference\":\"sink-2\"}");
        let get = http.get(sink.url()).send().await.unwrap();
        assert_eq!(get.status(), 405);
        assert_eq!(sink.received(), 2, "only the POSTs count");
    }
}
