//! The destination: a synthetic external system that plays "the world" in the demo and the
//! tests. It commits independently of z29c and keeps its own durable records, in its own
//! schema with its own SQL, as a real outside service would: every request it received
//! (`requests`: arrival time, key, body digest, whether it was refused before any effect) and
//! every effect it committed (`ledger`). Give it a database of its own and its records never
//! roll back with z29c's. Counting effects here is how the tests know what really happened.
//!
//! Each route behaves as the adapter capability in front of it declares ([`Mode`]), chosen by
//! the path's first segment:
//! - `/idempotent/v1/…` (and plain `/v1/…`): one effect per `Idempotency-Key`; status queries;
//! - `/queryable/v1/…`: every request is a new effect, keys or not; status queries;
//! - `/opaque/v1/…`: every request is a new effect; no status queries (`501`).
//!
//! HTTP API, under each prefix:
//! - `POST /v1/{route}` with a JSON body and an optional `Idempotency-Key` header: `201` with
//!   `{"reference": …}` for a new effect; where keys de-duplicate, `200` with the same reference
//!   when the key was seen with the same body, `422` when it was seen with a different body,
//!   and, with the `conflict_in_flight` switch, `409` while a request with the same key is
//!   still being processed (the IETF Idempotency-Key draft's answer, and Stripe's).
//! - `GET /v1/requests/{key}`: the status of a key: `200` with its effect, `202` while a request
//!   with that key is still being processed (a status endpoint that answers for every request
//!   it received, as a queryable API must), `404` when none was received, or `501` where the
//!   route answers no status queries.
//! - `PUT /admin/faults/{route}`: switch faults for a route (delay, hold until released,
//!   commit then drop the response, 429 with `Retry-After`, 5xx, idempotency off, query off, 409 in flight); a
//!   request's `X-Destination-Faults` header (the same JSON) overrides its route's for that
//!   request.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use sqlx::PgPool;

/// How a route treats a repeated request: what the adapter capability in front of it claims,
/// and no more. An opaque route never de-duplicates, so a second request is a second effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Keys de-duplicate; status queries answer.
    Idempotent,
    /// Status queries answer; every request is a new effect.
    Queryable,
    /// Neither: every request is a new effect and nobody can ask about it.
    Opaque,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Idempotent, Mode::Queryable, Mode::Opaque];

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Idempotent => "idempotent",
            Mode::Queryable => "queryable",
            Mode::Opaque => "opaque",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.as_str() == s)
    }

    fn deduplicates(self) -> bool {
        self == Mode::Idempotent
    }

    fn answers_queries(self) -> bool {
        self != Mode::Opaque
    }
}

/// Faults switched on for one route. All off by default.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Faults {
    /// Wait this long before handling a request.
    pub delay_ms: u64,
    /// Hold every request of the route, received and unanswered, until the route's faults
    /// no longer say so (a request still being processed, for as long as a test needs).
    pub hold: bool,
    /// Commit the effect, then never answer: the caller cannot know it happened.
    pub drop_response: bool,
    /// Refuse with 429 and this `Retry-After` (milliseconds, rounded up to seconds).
    pub rate_limit_ms: Option<u64>,
    /// Refuse with this 5xx status, committing nothing.
    pub server_error: Option<u16>,
    /// Refuse outright with this 4xx status (`408`, `425`, `400`, …), committing nothing.
    pub refuse_status: Option<u16>,
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
    /// Answer `409 Conflict` to a keyed request while another request with the same key is
    /// still being processed (from its arrival until its effect commits). Only where keys
    /// de-duplicate.
    pub conflict_in_flight: bool,
    /// Answer with a fresh reference and keep no ledger entry: no-op work, for benchmarks
    /// that should measure the caller and not this destination's own commits.
    pub ledger_off: bool,
}

/// The destination's state: its ledger and its fault switches.
#[derive(Debug, Clone)]
pub struct Destination {
    pool: PgPool,
    faults: Arc<RwLock<HashMap<String, Faults>>>,
    /// Keys whose request is being processed, for `conflict_in_flight`.
    in_flight: Arc<Mutex<HashSet<String>>>,
    /// Requests being processed, by mode and key: a status query about one answers `202`.
    processing: Arc<Mutex<HashMap<(Mode, String), usize>>>,
}

/// One effect, as the ledger keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
pub struct LedgerEntry {
    pub reference: String,
    pub mode: String,
    pub route: String,
    pub idempotency_key: Option<String>,
    pub body: Value,
    /// The request that made it (`requests.id`).
    pub request_id: i64,
}

/// One request received, effect or not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
pub struct RequestEntry {
    pub id: i64,
    pub received_at: chrono::DateTime<chrono::Utc>,
    pub mode: String,
    pub route: String,
    pub idempotency_key: Option<String>,
    /// SHA-256 of the body's JSON text, hex.
    pub body_digest: String,
    pub body: Value,
    /// Why it was refused before anything was done (`rate_limited`, `server_error`, `refused`,
    /// `in_flight` for a 409), or none.
    pub refused: Option<String>,
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
            "CREATE TABLE IF NOT EXISTS destination.requests (
                 id              bigserial PRIMARY KEY,
                 received_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
                 mode            text NOT NULL,
                 route           text NOT NULL,
                 idempotency_key text,
                 body_digest     text NOT NULL,
                 body            jsonb NOT NULL,
                 refused         text,
                 finished_at     timestamptz
             )",
        )
        .execute(&mut *tx)
        .await?;
        // a ledger made before requests recorded their end
        sqlx::query(
            "ALTER TABLE destination.requests ADD COLUMN IF NOT EXISTS finished_at timestamptz",
        )
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS destination.ledger (
                 reference       text PRIMARY KEY,
                 mode            text NOT NULL,
                 route           text NOT NULL,
                 idempotency_key text,
                 body            jsonb NOT NULL,
                 request_id      bigint NOT NULL REFERENCES destination.requests (id),
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
            in_flight: Arc::default(),
            processing: Arc::default(),
        })
    }

    /// The HTTP service.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/v1/requests/{key}", get(status_default))
            .route("/v1/{route}", post(accept_default))
            .route("/{mode}/v1/requests/{key}", get(status))
            .route("/{mode}/v1/{route}", post(accept))
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

    /// Every effect, oldest first: the ground truth tests check receipts against.
    pub async fn ledger(&self) -> Result<Vec<LedgerEntry>, DestinationError> {
        ledger(&self.pool).await
    }

    /// Every request received, effect or not, in arrival order.
    pub async fn requests(&self) -> Result<Vec<RequestEntry>, DestinationError> {
        requests(&self.pool).await
    }
}

/// The effects a destination recorded in `pool`'s database, oldest first: for a checker that
/// reads the destination's database without running one.
pub async fn ledger(pool: &PgPool) -> Result<Vec<LedgerEntry>, DestinationError> {
    Ok(sqlx::query_as(
        "SELECT reference, mode, route, idempotency_key, body, request_id
         FROM destination.ledger ORDER BY request_id, reference",
    )
    .fetch_all(pool)
    .await?)
}

/// The requests a destination received in `pool`'s database, in arrival order.
pub async fn requests(pool: &PgPool) -> Result<Vec<RequestEntry>, DestinationError> {
    Ok(sqlx::query_as(
        "SELECT id, received_at, mode, route, idempotency_key, body_digest, body, refused
         FROM destination.requests ORDER BY id",
    )
    .fetch_all(pool)
    .await?)
}

/// Removes `key` from the keys in flight when the request's processing ends, however it ends
/// (its caller may go away mid-request).
struct InFlight {
    keys: Arc<Mutex<HashSet<String>>>,
    key: Option<String>,
}

impl InFlight {
    fn end(&mut self) {
        if let Some(key) = self.key.take() {
            self.keys
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&key);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.end();
    }
}

/// Counts a keyed request as being processed until its effect is committed or its processing
/// ends otherwise (its caller may go away mid-request).
struct Processing {
    requests: Arc<Mutex<HashMap<(Mode, String), usize>>>,
    entry: (Mode, String),
}

impl Processing {
    fn start(d: &Destination, mode: Mode, key: &str) -> Self {
        let entry = (mode, key.to_owned());
        *d.processing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(entry.clone())
            .or_default() += 1;
        Self {
            requests: d.processing.clone(),
            entry,
        }
    }

    fn is_processing(d: &Destination, mode: Mode, key: &str) -> bool {
        d.processing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(&(mode, key.to_owned()))
    }
}

impl Drop for Processing {
    fn drop(&mut self) {
        let mut requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = requests.get_mut(&self.entry) {
            *n -= 1;
            if *n == 0 {
                requests.remove(&self.entry);
            }
        }
    }
}

fn digest(body: &Value) -> String {
    hex::encode(Sha256::digest(body.to_string().as_bytes()))
}

fn error(status: StatusCode, msg: impl Into<String>) -> Response {
    (status, Json(json!({ "error": msg.into() }))).into_response()
}

async fn accept_default(
    State(d): State<Destination>,
    Path(route): Path<String>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    handle(d, Mode::Idempotent, route, headers, body).await
}

async fn accept(
    State(d): State<Destination>,
    Path((mode, route)): Path<(String, String)>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let Some(mode) = Mode::parse(&mode) else {
        return error(StatusCode::NOT_FOUND, format!("no such mode {mode:?}"));
    };
    handle(d, mode, route, headers, body).await
}

/// Handles the request in a task of its own: a real service goes on with a request whose
/// caller hung up (timed out, crashed), so the effect still commits after the caller gave up.
async fn handle(
    d: Destination,
    mode: Mode,
    route: String,
    headers: HeaderMap,
    body: Value,
) -> Response {
    match tokio::spawn(process(d, mode, route, headers, body)).await {
        // the effect is committed; the caller never hears of it and must give up
        Ok(answer) if answer.extensions().get::<NoAnswer>().is_some() => {
            std::future::pending().await
        }
        Ok(answer) => answer,
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// Marks the answer of a request whose caller must never hear back (`drop_response`).
#[derive(Debug, Clone, Copy)]
struct NoAnswer;

/// Records the request's arrival (a statement of its own, so it is kept whatever follows),
/// then answers as the route's mode and faults say.
async fn process(
    d: Destination,
    mode: Mode,
    route: String,
    headers: HeaderMap,
    body: Value,
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
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let honour_key = key.is_some() && mode.deduplicates() && !faults.idempotency_off;
    let mut refused = if faults.rate_limit_ms.is_some() {
        Some("rate_limited")
    } else if faults.server_error.is_some() {
        Some("server_error")
    } else if faults.refuse_status.is_some() {
        Some("refused")
    } else {
        None
    };
    let mut in_flight = InFlight {
        keys: d.in_flight.clone(),
        key: None,
    };
    if honour_key
        && faults.conflict_in_flight
        && refused.is_none()
        && let Some(key) = &key
    {
        let fresh = d
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.clone());
        if fresh {
            in_flight.key = Some(key.clone());
        } else {
            refused = Some("in_flight");
        }
    }
    // counted as being processed from its arrival: a status query never hears "no such
    // request" about a request this destination has received and not finished
    let processing = match (&key, refused) {
        (Some(key), None) => Some(Processing::start(&d, mode, key)),
        _ => None,
    };
    let request_id = if faults.ledger_off {
        0
    } else {
        match record_request(&d.pool, mode, &route, key.as_deref(), &body, refused).await {
            Ok(id) => id,
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        }
    };
    let answer = respond(
        &d,
        Received {
            mode,
            route,
            key,
            honour_key,
            body,
            refused,
            faults,
            request_id,
            in_flight,
            processing,
        },
    )
    .await;
    if request_id != 0
        && let Err(e) = sqlx::query(
            "UPDATE destination.requests SET finished_at = clock_timestamp() WHERE id = $1",
        )
        .bind(request_id)
        .execute(&d.pool)
        .await
    {
        tracing::warn!(error = %e, request_id, "recording the request's end failed");
    }
    answer
}

/// A request as recorded, with what its answer depends on.
struct Received {
    mode: Mode,
    route: String,
    key: Option<String>,
    honour_key: bool,
    body: Value,
    refused: Option<&'static str>,
    faults: Faults,
    request_id: i64,
    in_flight: InFlight,
    processing: Option<Processing>,
}

/// What the destination does with a recorded request, as its mode and faults say; the
/// request counts as being processed until this returns.
async fn respond(d: &Destination, r: Received) -> Response {
    let Received {
        mode,
        route,
        key,
        honour_key,
        body,
        refused,
        faults,
        request_id,
        mut in_flight,
        processing,
    } = r;
    if refused == Some("in_flight") {
        return error(
            StatusCode::CONFLICT,
            "a request with this idempotency key is still in flight",
        );
    }
    if faults.delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(faults.delay_ms)).await;
    }
    if faults.hold {
        while d.faults(&route).hold {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
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
    if let Some(code) = faults.refuse_status {
        let status = StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_REQUEST);
        return error(status, "injected refusal");
    }
    if faults.ledger_off {
        // time-ordered, as the ledger's references are: a receipt's reference index then
        // grows at its right edge instead of taking a random leaf per call
        let reference = format!("noop-{}", uuid::Uuid::now_v7().simple());
        return (StatusCode::CREATED, Json(json!({ "reference": reference }))).into_response();
    }
    let result = commit(
        &d.pool,
        Effect {
            mode,
            route: &route,
            key: key.as_deref(),
            honour_key,
            body: &body,
            request_id,
        },
    )
    .await;
    // processed: a same-key request now replays the effect instead of meeting a conflict, and
    // a status query finds the effect
    in_flight.end();
    drop(processing);
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
        let mut silence = StatusCode::NO_CONTENT.into_response();
        silence.extensions_mut().insert(NoAnswer);
        return silence;
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

async fn record_request(
    pool: &PgPool,
    mode: Mode,
    route: &str,
    key: Option<&str>,
    body: &Value,
    refused: Option<&str>,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "INSERT INTO destination.requests (mode, route, idempotency_key, body_digest, body, refused)
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING id",
    )
    .bind(mode.as_str())
    .bind(route)
    .bind(key)
    .bind(digest(body))
    .bind(body)
    .bind(refused)
    .fetch_one(pool)
    .await
}

struct Effect<'a> {
    mode: Mode,
    route: &'a str,
    key: Option<&'a str>,
    honour_key: bool,
    body: &'a Value,
    request_id: i64,
}

async fn commit(pool: &PgPool, e: Effect<'_>) -> Result<Committed, sqlx::Error> {
    let Effect {
        mode,
        route,
        key,
        honour_key,
        body,
        request_id,
    } = e;
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
            "SELECT reference, body FROM destination.ledger
             WHERE idempotency_key = $1 AND mode = $2
             ORDER BY received_at LIMIT 1",
        )
        .bind(key)
        .bind(mode.as_str())
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
        "INSERT INTO destination.ledger (reference, mode, route, idempotency_key, body, request_id)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(&reference)
    .bind(mode.as_str())
    .bind(route)
    .bind(key)
    .bind(body)
    .bind(request_id)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Committed::New(reference))
}

async fn status_default(State(d): State<Destination>, Path(key): Path<String>) -> Response {
    answer_status(d, Mode::Idempotent, key).await
}

async fn status(
    State(d): State<Destination>,
    Path((mode, key)): Path<(String, String)>,
) -> Response {
    let Some(mode) = Mode::parse(&mode) else {
        return error(StatusCode::NOT_FOUND, format!("no such mode {mode:?}"));
    };
    answer_status(d, mode, key).await
}

async fn answer_status(d: Destination, mode: Mode, key: String) -> Response {
    if !mode.answers_queries() {
        return error(
            StatusCode::NOT_IMPLEMENTED,
            "this route answers no status queries",
        );
    }
    let route: Option<String> = sqlx::query_scalar(
        "SELECT route FROM destination.ledger WHERE idempotency_key = $1 AND mode = $2 LIMIT 1",
    )
    .bind(&key)
    .bind(mode.as_str())
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
    // asked before the ledger is read: a request that commits in between is then found,
    // never missed by both
    let processing = Processing::is_processing(&d, mode, &key);
    let found: Result<Vec<String>, _> = sqlx::query_scalar(
        "SELECT reference FROM destination.ledger WHERE idempotency_key = $1 AND mode = $2
         ORDER BY received_at",
    )
    .bind(&key)
    .bind(mode.as_str())
    .fetch_all(&d.pool)
    .await;
    match found {
        Ok(refs) if refs.is_empty() && processing => {
            (StatusCode::ACCEPTED, Json(json!({ "state": "processing" }))).into_response()
        }
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
