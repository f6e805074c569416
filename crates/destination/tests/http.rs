//! The destination over real HTTP with its ledger in a fresh PostgreSQL database.

use std::time::Duration;

use serde_json::{Value, json};
use sqlx::PgPool;
use z29c_destination::{Destination, Faults};

async fn serve(pool: PgPool) -> (Destination, String) {
    let d = Destination::install(pool).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = d.router();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    (d, format!("http://{addr}"))
}

async fn post(base: &str, route: &str, key: Option<&str>, body: Value) -> reqwest::Response {
    let mut req = reqwest::Client::new()
        .post(format!("{base}/v1/{route}"))
        .json(&body)
        .timeout(Duration::from_millis(800));
    if let Some(key) = key {
        req = req.header("Idempotency-Key", key);
    }
    req.send().await.unwrap()
}

#[sqlx::test]
async fn an_idempotency_key_yields_one_effect(pool: PgPool) {
    let (d, base) = serve(pool).await;
    let first = post(&base, "deliveries", Some("k-1"), json!({"n": 1})).await;
    assert_eq!(first.status(), 201);
    let r1: Value = first.json().await.unwrap();
    let again = post(&base, "deliveries", Some("k-1"), json!({"n": 1})).await;
    assert_eq!(again.status(), 200);
    let r2: Value = again.json().await.unwrap();
    assert_eq!(r1["reference"], r2["reference"]);
    let reused = post(&base, "deliveries", Some("k-1"), json!({"n": 2})).await;
    assert_eq!(reused.status(), 422);
    assert_eq!(d.ledger().await.unwrap().len(), 1);
    let q: Value = reqwest::get(format!("{base}/v1/requests/k-1"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(q["reference"], r1["reference"]);
    assert_eq!(
        reqwest::get(format!("{base}/v1/requests/none"))
            .await
            .unwrap()
            .status(),
        404
    );
}

#[sqlx::test]
async fn faults_are_switchable_per_route(pool: PgPool) {
    let (d, base) = serve(pool).await;
    d.set_faults(
        "limited",
        Faults {
            rate_limit_ms: Some(1500),
            ..Faults::default()
        },
    );
    let r = post(&base, "limited", Some("a"), json!({})).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "2");
    d.set_faults(
        "broken",
        Faults {
            server_error: Some(503),
            ..Faults::default()
        },
    );
    assert_eq!(
        post(&base, "broken", Some("b"), json!({})).await.status(),
        503
    );
    assert!(
        d.ledger().await.unwrap().is_empty(),
        "refusals commit nothing"
    );

    d.set_faults(
        "careless",
        Faults {
            idempotency_off: true,
            query_off: true,
            ..Faults::default()
        },
    );
    post(&base, "careless", Some("c"), json!({})).await;
    post(&base, "careless", Some("c"), json!({})).await;
    assert_eq!(
        d.ledger().await.unwrap().len(),
        2,
        "idempotency off: two effects"
    );
    assert_eq!(
        reqwest::get(format!("{base}/v1/requests/c"))
            .await
            .unwrap()
            .status(),
        501
    );

    // commit, then never answer: the caller times out, the ledger has the effect
    d.set_faults(
        "silent",
        Faults {
            drop_response: true,
            ..Faults::default()
        },
    );
    let lost = reqwest::Client::new()
        .post(format!("{base}/v1/silent"))
        .header("Idempotency-Key", "d")
        .json(&json!({}))
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(lost.unwrap_err().is_timeout());
    let ledger = d.ledger().await.unwrap();
    assert!(
        ledger
            .iter()
            .any(|e| e.idempotency_key.as_deref() == Some("d"))
    );
    // the admin endpoint switches faults too
    let put = reqwest::Client::new()
        .put(format!("{base}/admin/faults/silent"))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 204);
    assert_eq!(
        post(&base, "silent", Some("e"), json!({})).await.status(),
        201
    );
}
