//! Mock APIs of real shapes, served in a test's own process, each keeping its own records (never
//! z29c's database): what they received and what they did is the outside world's account.
//!
//! - `/stripe`: a payments API in Stripe's shape. `POST /stripe/v1/charges` needs
//!   `Authorization: Bearer <key>`, de-duplicates by `Idempotency-Key` (the same charge again;
//!   `409` while the first is still being processed), names its charge in `id`, and refuses in
//!   `{"error": {"message": …}}`.
//! - `/carrier`: a carrier API without idempotency keys. `POST /carrier/shipments` makes a new
//!   shipment every time and records the body's `customer_reference`; `GET
//!   /carrier/shipments?customer_reference=…` searches them (`{"data": [...]}`).
//! - `/notify`: an API with no way to ask: `POST /notify/messages` sends a message, every time.
//! - `/inventory`: a stock API. `POST /inventory/reservations` reserves the body's `sku`,
//!   de-duplicated by `Idempotency-Key`, and names the reservation in `id`.
//!
//! Every route can be told to lose its next answers: the effect happens, the answer never comes
//! (the caller's time runs out first).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

/// One request as an API received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    pub api: &'static str,
    pub method: &'static str,
    /// The `Idempotency-Key`, if sent.
    pub key: Option<String>,
    /// Whether it carried the right credentials (where any are needed).
    pub authorized: bool,
}

/// One effect, as the API that made it records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Effect {
    pub api: &'static str,
    /// The API's own name for it (`ch_1`, `shp_1`, `msg_1`).
    pub id: String,
    /// The idempotency key or client reference it was made under.
    pub key: Option<String>,
    /// The body of the request that made it.
    pub body: Value,
}

#[derive(Debug, Default)]
struct Books {
    received: Vec<Received>,
    effects: Vec<Effect>,
    /// Stripe: the answer given for each key, and keys still being processed.
    answers: HashMap<String, Value>,
    in_flight: std::collections::HashSet<String>,
    /// Answers to lose next, per API.
    lose: HashMap<&'static str, usize>,
    /// How long a charge takes to process, its key in flight meanwhile.
    charge_ms: u64,
    /// Requests answered `409` because their key was in flight.
    conflicts: usize,
}

#[derive(Clone)]
struct Shared {
    books: Arc<Mutex<Books>>,
    stripe_key: String,
}

/// The mock APIs, listening until dropped.
#[derive(Debug)]
pub struct Apis {
    pub url: String,
    books: Arc<Mutex<Books>>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Apis {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// How long a lost answer keeps its caller waiting: longer than any call's budget in the tests.
const LOST_FOR: Duration = Duration::from_secs(60);

impl Apis {
    /// Serves the APIs on a free loopback port; the Stripe-like one takes `stripe_key` alone.
    pub async fn start(stripe_key: &str) -> anyhow::Result<Self> {
        let books: Arc<Mutex<Books>> = Arc::default();
        let shared = Shared {
            books: books.clone(),
            stripe_key: stripe_key.to_owned(),
        };
        let app = axum::Router::new()
            .route("/stripe/v1/charges", post(charge))
            .route("/carrier/shipments", post(ship).get(search))
            .route("/notify/messages", post(notify))
            .route("/inventory/reservations", post(reserve))
            .with_state(shared);
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let url = format!("http://{}", listener.local_addr()?);
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { url, books, server })
    }

    /// The next `n` answers of `api` (`stripe`, `carrier`, `notify`) are lost after the effect.
    pub fn lose_answers(&self, api: &'static str, n: usize) {
        self.books.lock().expect("books").lose.insert(api, n);
    }

    /// Charges take this long to process from now on; a request with the same key meanwhile
    /// is answered `409 Conflict`.
    pub fn slow_charges(&self, ms: u64) {
        self.books.lock().expect("books").charge_ms = ms;
    }

    /// Requests answered `409` because a request with their key was still being processed.
    pub fn conflicts(&self) -> usize {
        self.books.lock().expect("books").conflicts
    }

    pub fn received(&self, api: &str) -> Vec<Received> {
        let books = self.books.lock().expect("books");
        books
            .received
            .iter()
            .filter(|r| r.api == api)
            .cloned()
            .collect()
    }

    pub fn effects(&self, api: &str) -> Vec<Effect> {
        let books = self.books.lock().expect("books");
        books
            .effects
            .iter()
            .filter(|e| e.api == api)
            .cloned()
            .collect()
    }
}

impl Shared {
    fn record(&self, r: Received) {
        self.books.lock().expect("books").received.push(r);
    }

    /// Makes an effect, and says whether its answer is to be lost.
    fn effect(&self, api: &'static str, key: Option<String>, body: Value) -> (String, bool) {
        let mut books = self.books.lock().expect("books");
        let prefix = match api {
            "stripe" => "ch",
            "carrier" => "shp",
            "inventory" => "res",
            _ => "msg",
        };
        let id = format!(
            "{prefix}_{}",
            books.effects.iter().filter(|e| e.api == api).count() + 1
        );
        books.effects.push(Effect {
            api,
            id: id.clone(),
            key,
            body,
        });
        let lose = books
            .lose
            .get_mut(api)
            .filter(|n| **n > 0)
            .map(|n| *n -= 1)
            .is_some();
        (id, lose)
    }
}

fn key_of(headers: &HeaderMap) -> Option<String> {
    headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

async fn lost() -> Response {
    tokio::time::sleep(LOST_FOR).await;
    StatusCode::GATEWAY_TIMEOUT.into_response()
}

async fn charge(State(s): State<Shared>, headers: HeaderMap, Json(body): Json<Value>) -> Response {
    let key = key_of(&headers);
    let authorized = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == format!("Bearer {}", s.stripe_key));
    s.record(Received {
        api: "stripe",
        method: "POST",
        key: key.clone(),
        authorized,
    });
    if !authorized {
        return (
            StatusCode::UNAUTHORIZED,
            Json(json!({ "error": { "type": "invalid_request_error",
                                    "message": "Invalid API Key provided" } })),
        )
            .into_response();
    }
    if let Some(k) = &key {
        let mut books = s.books.lock().expect("books");
        if let Some(answer) = books.answers.get(k) {
            return (StatusCode::OK, Json(answer.clone())).into_response();
        }
        if !books.in_flight.insert(k.clone()) {
            books.conflicts += 1;
            return (
                StatusCode::CONFLICT,
                Json(json!({ "error": { "type": "idempotency_error",
                    "message": "There is currently another in-progress request using this Idempotent Key" } })),
            )
                .into_response();
        }
    }
    // the charge is processed to its end whether or not its caller still waits, as a real
    // API's would be
    let processing = s.books.lock().expect("books").charge_ms;
    let (books, amount) = (s.clone(), body.get("amount").cloned());
    let key_for_task = key.clone();
    let done = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(processing)).await;
        let (id, lose) = books.effect("stripe", key_for_task.clone(), body);
        let answer = json!({ "id": id, "object": "charge", "amount": amount,
                             "status": "succeeded" });
        if let Some(k) = &key_for_task {
            let mut b = books.books.lock().expect("books");
            b.in_flight.remove(k);
            b.answers.insert(k.clone(), answer.clone());
        }
        (answer, lose)
    });
    let Ok((answer, lose)) = done.await else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    if lose {
        return lost().await;
    }
    (StatusCode::OK, Json(answer)).into_response()
}

async fn ship(State(s): State<Shared>, headers: HeaderMap, Json(body): Json<Value>) -> Response {
    s.record(Received {
        api: "carrier",
        method: "POST",
        key: key_of(&headers),
        authorized: true,
    });
    let reference = body
        .get("customer_reference")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let (id, lose) = s.effect("carrier", reference.clone(), body);
    if lose {
        return lost().await;
    }
    (
        StatusCode::CREATED,
        Json(json!({ "id": id, "status": "label_created", "customer_reference": reference })),
    )
        .into_response()
}

async fn search(State(s): State<Shared>, Query(q): Query<HashMap<String, String>>) -> Response {
    s.record(Received {
        api: "carrier",
        method: "GET",
        key: None,
        authorized: true,
    });
    let wanted = q.get("customer_reference");
    let books = s.books.lock().expect("books");
    let data: Vec<Value> = books
        .effects
        .iter()
        .filter(|e| e.api == "carrier" && e.key.as_ref() == wanted)
        .map(|e| json!({ "id": e.id, "customer_reference": e.key }))
        .collect();
    (StatusCode::OK, Json(json!({ "data": data }))).into_response()
}

async fn reserve(State(s): State<Shared>, headers: HeaderMap, Json(body): Json<Value>) -> Response {
    let key = key_of(&headers);
    s.record(Received {
        api: "inventory",
        method: "POST",
        key: key.clone(),
        authorized: true,
    });
    if let Some(k) = &key
        && let Some(answer) = s.books.lock().expect("books").answers.get(k)
    {
        return (StatusCode::OK, Json(answer.clone())).into_response();
    }
    let sku = body.get("sku").cloned();
    let (id, lose) = s.effect("inventory", key.clone(), body);
    let answer = json!({ "id": id, "sku": sku, "status": "reserved" });
    if let Some(k) = key {
        s.books
            .lock()
            .expect("books")
            .answers
            .insert(k, answer.clone());
    }
    if lose {
        return lost().await;
    }
    (StatusCode::OK, Json(answer)).into_response()
}

async fn notify(State(s): State<Shared>, headers: HeaderMap) -> Response {
    s.record(Received {
        api: "notify",
        method: "POST",
        key: key_of(&headers),
        authorized: true,
    });
    let (id, lose) = s.effect("notify", None, Value::Null);
    if lose {
        return lost().await;
    }
    (StatusCode::ACCEPTED, Json(json!({ "message_id": id }))).into_response()
}
