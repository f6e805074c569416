//! The destination: a synthetic external system that plays "the world" in the demo and the
//! tests. It commits independently of z29c and keeps its own durable ledger of every request
//! it accepted, in its own schema with its own SQL, as a real outside service would. Checking
//! z29c's receipts against this ledger is how the tests know what really happened.
//!
//! HTTP API:
//! - `POST /v1/{route}` with a JSON body and an optional `Idempotency-Key` header: `201` with
//!   `{"reference": …}` for a new effect; `200` with the same reference when the key was seen
//!   with the same body; `422` when the key was seen with a different body.
//! - `GET /v1/requests/{key}`: the status of a key (`200`, `404`), or `501` when queries are
//!   switched off.
//! - `PUT /admin/faults/{route}`: switch faults for a route (delay, commit then drop the
//!   response, 429 with `Retry-After`, 5xx, idempotency off, query off); a request's
//!   `X-Destination-Faults` header (the same JSON) overrides its route's for that request.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::PgPool;

/// Faults switched on for one route. All off by default.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Faults {
    /// Wait this long before handling a request.
    pub delay_ms: u64,
    /// Commit the effect, then never answer: the caller cannot know it happened.
    pub drop_response: bool,
    /// Refuse with 429 and this `Retry-After` (milliseconds, rounded up to seconds).
    pub rate_limit_ms: Option<u64>,
    /// Refuse with this 5xx status, committing nothing.
    pub server_error: Option<u16>,
    /// Ignore idempotency keys: every request is a new effect.
    pub idempotency_off: bool,
    /// Refuse status queries with 501.
    pub query_off: bool,
    /// Answer status queries with this reference instead of the ledger's (a destination that
    /// contradicts itself, for integrity-conflict tests).
    pub query_reference: Option<String>,
    /// Wait this long before answering a status query.
    pub query_delay_ms: u64,
    /// Commit the effect, then wait this long before answering (a late response).
    pub answer_delay_ms: u64,
    /// Pad the answer with this many bytes (an oversized reply).
    pub oversized_bytes: usize,
    /// Answer with a fresh reference and keep no ledger entry: no-op work, for benchmarks
    /// that should measure the caller and not this destination's own commits.
    pub ledger_off: bool,
}

/// The destination's state: its ledger and its fault switches.
#[derive(Debug, Clone)]
pub struct Destination {
    pool: PgPool,
    faults: Arc<RwLock<HashMap<String, Faults>>>,
}

/// One accepted request, as the ledger keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
pub struct LedgerEntry {
    pub reference: String,
    pub route: String,
    pub idempotency_key: Option<String>,
    pub body: Value,
}

#[derive(Debug, thiserror::Error)]
pub enum DestinationError {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
}

impl Destination {
    /// Creates the destination's own schema if needed (idempotent, under an advisory lock).
    pub async fn install(pool: PgPool) -> Result<Self, DestinationError> {
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('z29c-destination-schema'))")
            .execute(&mut *tx)
            .await?;
        sqlx::query("CREATE SCHEMA IF NOT EXISTS destination")
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS destination.ledger (
                 reference       text PRIMARY KEY,
                 route           text NOT NULL,
                 idempotency_key text,
                 body            jsonb NOT NULL,
                 received_at     timestamptz NOT NULL DEFAULT clock_timestamp()
             )",
        )
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "CREATE INDEX IF NOT EXISTS ledger_key ON destination.ledger (idempotency_key)",
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Self {
            pool,
            faults: Arc::default(),
        })
    }

    /// The HTTP service.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/v1/requests/{key}", get(status))
            .route("/v1/{route}", post(accept))
            .route("/admin/faults/{route}", put(set_faults))
            .with_state(self.clone())
    }

    pub fn set_faults(&self, route: &str, faults: Faults) {
        self.faults
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(route.to_owned(), faults);
    }

    fn faults(&self, route: &str) -> Faults {
        self.faults
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(route)
            .cloned()
            .unwrap_or_default()
    }

    /// Every accepted request, oldest first: the ground truth tests check receipts against.
    pub async fn ledger(&self) -> Result<Vec<LedgerEntry>, DestinationError> {
        Ok(sqlx::query_as(
            "SELECT reference, route, idempotency_key, body FROM destination.ledger
             ORDER BY received_at, reference",
        )
        .fetch_all(&self.pool)
        .await?)
    }
}

fn error(status: StatusCode, msg: impl Into<String>) -> Response {
    (status, Json(json!({ "error": msg.into() }))).into_response()
}

async fn accept(
    State(d): State<Destination>,
    Path(route): Path<String>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    // a request may carry its own faults, overriding its route's
    let faults = match headers
        .get("x-destination-faults")
        .map(|v| v.to_str().map(serde_json::from_str::<Faults>))
    {
        Some(Ok(Ok(f))) => f,
        Some(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "x-destination-faults: not a faults object",
            );
        }
        None => d.faults(&route),
    };
    if faults.delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(faults.delay_ms)).await;
    }
    if let Some(ms) = faults.rate_limit_ms {
        let secs = ms.div_ceil(1000).max(1);
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, secs.to_string())],
            Json(json!({ "error": "rate limited" })),
        )
            .into_response();
    }
    if let Some(code) = faults.server_error {
        let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return error(status, "injected server error");
    }
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let honour_key = key.is_some() && !faults.idempotency_off;
    if faults.ledger_off {
        // time-ordered, as the ledger's references are: a receipt's reference index then
        // grows at its right edge instead of taking a random leaf per call
        let reference = format!("noop-{}", uuid::Uuid::now_v7().simple());
        return (StatusCode::CREATED, Json(json!({ "reference": reference }))).into_response();
    }
    let result = commit(&d.pool, &route, key.as_deref(), honour_key, &body).await;
    let (status, reference) = match result {
        Ok(Committed::New(r)) => (StatusCode::CREATED, r),
        Ok(Committed::Replayed(r)) => (StatusCode::OK, r),
        Ok(Committed::KeyReused) => {
            return error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency key was used with a different body",
            );
        }
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    };
    if faults.drop_response {
        // the effect is committed; the caller never hears of it and must give up
        std::future::pending::<()>().await;
    }
    if faults.answer_delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(faults.answer_delay_ms)).await;
    }
    if faults.oversized_bytes > 0 {
        let padding = "x".repeat(faults.oversized_bytes);
        return (
            status,
            Json(json!({ "reference": reference, "padding": padding })),
        )
            .into_response();
    }
    (status, Json(json!({ "reference": reference }))).into_response()
}

enum Committed {
    New(String),
    Replayed(String),
    KeyReused,
}

async fn commit(
    pool: &PgPool,
    route: &str,
    key: Option<&str>,
    honour_key: bool,
    body: &Value,
) -> Result<Committed, sqlx::Error> {
    // BEGIN in a task of its own: a handler dropped during the BEGIN round trip (its caller
    // went away) must not leave the pooled session inside a transaction (sqlx 0.9.0,
    // transact-rs/sqlx#4393; z29c_store::Store::begin explains)
    let mut tx = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.begin().await })
            .await
            .map_err(|e| sqlx::Error::Protocol(format!("BEGIN task: {e}")))??
    };
    if honour_key && let Some(key) = key {
        // one effect per key, even when the same key arrives twice at once
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(key)
            .execute(&mut *tx)
            .await?;
        let seen: Option<(String, Value)> = sqlx::query_as(
            "SELECT reference, body FROM destination.ledger WHERE idempotency_key = $1
             ORDER BY received_at LIMIT 1",
        )
        .bind(key)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some((reference, seen_body)) = seen {
            return Ok(if &seen_body == body {
                Committed::Replayed(reference)
            } else {
                Committed::KeyReused
            });
        }
    }
    let reference = format!("dst-{}", uuid::Uuid::now_v7().simple());
    sqlx::query(
        "INSERT INTO destination.ledger (reference, route, idempotency_key, body)
         VALUES ($1, $2, $3, $4)",
    )
    .bind(&reference)
    .bind(route)
    .bind(key)
    .bind(body)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Committed::New(reference))
}

async fn status(State(d): State<Destination>, Path(key): Path<String>) -> Response {
    let route: Option<String> = sqlx::query_scalar(
        "SELECT route FROM destination.ledger WHERE idempotency_key = $1 LIMIT 1",
    )
    .bind(&key)
    .fetch_optional(&d.pool)
    .await
    .ok()
    .flatten();
    let faults = route.as_deref().map(|r| d.faults(r)).unwrap_or_default();
    if faults.query_delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(faults.query_delay_ms)).await;
    }
    if faults.query_off {
        return error(
            StatusCode::NOT_IMPLEMENTED,
            "status queries are switched off",
        );
    }
    if let Some(reference) = faults.query_reference {
        return Json(json!({ "reference": reference, "references": [reference] })).into_response();
    }
    let found: Result<Vec<String>, _> = sqlx::query_scalar(
        "SELECT reference FROM destination.ledger WHERE idempotency_key = $1
         ORDER BY received_at",
    )
    .bind(&key)
    .fetch_all(&d.pool)
    .await;
    match found {
        Ok(refs) if refs.is_empty() => error(StatusCode::NOT_FOUND, "no request with that key"),
        Ok(refs) => Json(json!({ "reference": refs[0], "references": refs })).into_response(),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn set_faults(
    State(d): State<Destination>,
    Path(route): Path<String>,
    Json(faults): Json<Faults>,
) -> StatusCode {
    d.set_faults(&route, faults);
    StatusCode::NO_CONTENT
}
