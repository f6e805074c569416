//! Adapters declared for APIs of real shapes (served by [`z29c_scenarios::apis`], which keep
//! their own records): a payments API with its own key, idempotency header and reference field;
//! a carrier without idempotency keys that can be searched; an API with no way to ask; a status
//! route that does not exist. Judged by what the APIs received and did.

use std::time::Duration;

use anyhow::Result;
use serde_json::json;
use sqlx::PgPool;
use z29c_proto::v1 as pb;
use z29c_scenarios::apis::Apis;
use z29c_scenarios::cluster::{Cluster, Topology, z29c_binary};

const STRIPE_KEY: &str = "sk_test_z29c_4eC39HqLyjWDarjtT1zdp7dc";
const WRONG_KEY: &str = "sk_test_z29c_wrong_0000000000000000";

fn policy() -> pb::LeasePolicy {
    pb::LeasePolicy {
        lease_ms: 1_500,
        renew_every_ms: 500,
        attempt_deadline_ms: 8_000,
        final_grace_ms: 500,
        adapter_timeout_ms: 2_000,
        max_attempts: 3,
        ..Default::default()
    }
}

fn one_step(
    key: &str,
    adapter: &str,
    operation: &str,
    input: serde_json::Value,
) -> pb::SubmitRequest {
    pb::SubmitRequest {
        client_key: key.to_owned(),
        name: key.to_owned(),
        steps: vec![pb::StepDefinition {
            name: "call".into(),
            adapter: adapter.into(),
            operation: operation.into(),
            input_json: input.to_string(),
            depends_on: vec![],
            policy: Some(policy()),
        }],
        deadline: None,
    }
}

async fn submit(cluster: &Cluster, reqs: Vec<pb::SubmitRequest>) -> Result<Vec<String>> {
    let mut client = cluster.client().await?;
    let mut ids = Vec::new();
    for r in reqs {
        ids.push(client.submit(r).await?.into_inner().workflow.unwrap().id);
    }
    Ok(ids)
}

/// A payments adapter in Stripe's shape, its key read from `env`.
fn stripe(name: &str, url: &str, env: &str) -> String {
    format!(
        r#"
[[adapters]]
name = "{name}"
version = "stripe/2026-01"
base_url = "{url}/stripe"
capability = "idempotent"
default_limit = 4
safety_window_ms = 5000
[adapters.http]
path = "/v1/{{operation}}"
reference = "/id"
refusal_reason = "/error/message"
[adapters.http.headers]
Authorization = {{ env = "{env}", prefix = "Bearer " }}
"#
    )
}

/// The carrier, queryable by a search; `lookup` is the status route's path.
fn carrier(name: &str, url: &str, lookup: &str) -> String {
    format!(
        r#"
[[adapters]]
name = "{name}"
version = "carrier/v3"
base_url = "{url}/carrier"
capability = "queryable"
default_limit = 4
safety_window_ms = 5000
[adapters.http]
path = "/shipments"
idempotency_header = ""
identity_field = "customer_reference"
reference = "/id"
[adapters.http.query]
path = "{lookup}"
found = {{ status = [200], reference = "/data/0/id" }}
not_found = [{{ status = [200], empty = "/data" }}]
"#
    )
}

fn notify(url: &str) -> String {
    format!(
        r#"
[[adapters]]
name = "notify"
version = "notify/1"
base_url = "{url}/notify"
capability = "opaque"
default_limit = 4
safety_window_ms = 5000
[adapters.http]
path = "/messages"
idempotency_header = ""
reference = "/message_id"
"#
    )
}

/// Every log line the cluster's processes wrote.
fn all_logs(cluster: &Cluster) -> String {
    let mut out = String::new();
    for entry in std::fs::read_dir(cluster.dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        if entry.path().extension().is_some_and(|e| e == "log") {
            out.push_str(&std::fs::read_to_string(entry.path()).unwrap_or_default());
        }
    }
    out
}

async fn step_state(pool: &PgPool, workflow_key: &str) -> Result<String> {
    Ok(sqlx::query_scalar(
        "SELECT s.state::text FROM steps s JOIN workflows w ON w.id = s.workflow_id
         WHERE w.client_key = $1",
    )
    .bind(workflow_key)
    .fetch_one(pool)
    .await?)
}

/// A payments API that needs its key, de-duplicates by its own header and names its charge in
/// `id`: the step completes with the API's reference, one charge made; with the wrong key the
/// step fails at once with the API's reason, sent once; no key appears in any log or in the
/// configuration the gateway prints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payments_api_is_called_with_its_key_and_its_reference_read_from_id() -> Result<()> {
    let apis = Apis::start(STRIPE_KEY).await?;
    let mut cluster = Cluster::start_with(Topology {
        gateways: 0,
        ..Topology::default()
    })
    .await?;
    let adapters = stripe("stripe", &apis.url, "Z29C_TEST_STRIPE_KEY")
        + &stripe("stripe-wrong-key", &apis.url, "Z29C_TEST_WRONG_KEY");
    let env = [
        ("Z29C_TEST_STRIPE_KEY", STRIPE_KEY),
        ("Z29C_TEST_WRONG_KEY", WRONG_KEY),
    ];
    cluster.add_gateway_serving(&adapters, &env).await?;
    let pool = cluster.db.pool(2).await?;
    let ids = submit(
        &cluster,
        vec![
            one_step(
                "paid",
                "stripe",
                "charges",
                json!({ "amount": 1200, "currency": "eur" }),
            ),
            one_step(
                "unauthorized",
                "stripe-wrong-key",
                "charges",
                json!({ "amount": 900 }),
            ),
        ],
    )
    .await?;
    cluster
        .wait_all_ended(&ids, Duration::from_secs(60))
        .await?;

    let receipts: Vec<(String, String, Option<String>, String, serde_json::Value)> =
        sqlx::query_as(
            "SELECT w.client_key, r.outcome::text, r.external_reference, r.request_identity,
                    r.observed_result
             FROM step_receipts r JOIN steps s ON s.id = r.step_id
             JOIN workflows w ON w.id = s.workflow_id ORDER BY w.client_key",
        )
        .fetch_all(&pool)
        .await?;
    assert_eq!(receipts.len(), 2, "{receipts:?}");
    let (_, outcome, reference, identity, _) = &receipts[0];
    assert_eq!(
        (outcome.as_str(), reference.as_deref()),
        ("succeeded", Some("ch_1"))
    );
    let charges = apis.effects("stripe");
    assert_eq!(charges.len(), 1, "one charge: {charges:?}");
    assert_eq!(charges[0].key.as_deref(), Some(identity.as_str()));

    let (_, outcome, _, _, result) = &receipts[1];
    assert_eq!(outcome, "failed");
    assert_eq!(result["status"], 401, "{result}");
    assert_eq!(result["reason"], "Invalid API Key provided", "{result}");
    let refused: Vec<_> = apis
        .received("stripe")
        .into_iter()
        .filter(|r| !r.authorized)
        .collect();
    assert_eq!(refused.len(), 1, "a refusal is not sent again: {refused:?}");
    assert_eq!(step_state(&pool, "unauthorized").await?, "failed");
    // the API says why, in words, and what the charge answered
    let mut client = cluster.client().await?;
    let failed = client
        .get(pb::GetRequest {
            workflow_id: ids[1].clone(),
        })
        .await?
        .into_inner();
    let why = "refused: 401 Unauthorized from stripe-wrong-key: Invalid API Key provided";
    assert_eq!(failed.steps[0].reason, why);
    assert_eq!(failed.reason, format!("step call: {why}"));
    let paid = client
        .get(pb::GetRequest {
            workflow_id: ids[0].clone(),
        })
        .await?
        .into_inner();
    assert_eq!(paid.steps[0].reason, "");
    let result: serde_json::Value = serde_json::from_str(&paid.steps[0].result_json)?;
    assert_eq!(result["id"], "ch_1", "{result}");
    let input: serde_json::Value = serde_json::from_str(&paid.steps[0].input_json)?;
    assert_eq!(input, json!({ "amount": 1200, "currency": "eur" }));

    // the keys are nowhere a person or a log collector would read them
    let logs = all_logs(&cluster);
    for key in [STRIPE_KEY, WRONG_KEY] {
        assert!(!logs.contains(key), "a key in the logs");
    }
    let file = cluster.dir().join("gateway-1.toml");
    let dumped = tokio::process::Command::new(z29c_binary()?)
        .args([
            "gateway",
            "--config",
            &file.to_string_lossy(),
            "--dump-config",
        ])
        .envs(env)
        .output()
        .await?;
    let printed = String::from_utf8_lossy(&dumped.stdout);
    assert!(
        dumped.status.success(),
        "{}",
        String::from_utf8_lossy(&dumped.stderr)
    );
    assert!(printed.contains("Z29C_TEST_STRIPE_KEY"), "{printed}");
    for key in [STRIPE_KEY, WRONG_KEY] {
        assert!(!printed.contains(key), "a key in the printed configuration");
    }
    // a charge slower than the call's time: its answer is unknown, and recovery sends it again
    // under the same key while the first is still being processed; the API answers 409, read
    // as "ask again later", until the first is done and its replay names the one charge
    apis.slow_charges(6_000);
    cluster
        .add_recovery_with(&[("Z29C_RECOVERY_LEASE_MS", "1500")])
        .await?;
    let mut slow_paid = one_step("slow-paid", "stripe", "charges", json!({ "amount": 700 }));
    if let Some(p) = slow_paid.steps[0].policy.as_mut() {
        p.max_attempts = 5;
    }
    let slow = submit(&cluster, vec![slow_paid]).await?;
    cluster
        .wait_all_ended(&slow, Duration::from_secs(60))
        .await?;
    let (reference, identity): (String, String) = sqlx::query_as(
        "SELECT r.external_reference, r.request_identity FROM step_receipts r
         JOIN steps s ON s.id = r.step_id JOIN workflows w ON w.id = s.workflow_id
         WHERE w.client_key = 'slow-paid' AND r.outcome = 'succeeded'",
    )
    .fetch_one(&pool)
    .await?;
    let made: Vec<_> = apis
        .effects("stripe")
        .into_iter()
        .filter(|c| c.key.as_deref() == Some(identity.as_str()))
        .collect();
    assert_eq!(made.len(), 1, "one charge for the key: {made:?}");
    assert_eq!(made[0].id, reference);
    assert!(
        apis.conflicts() > 0,
        "a retry met the first request in flight"
    );
    pool.close().await;
    cluster.stop().await
}

/// Answers lost after the effect. A carrier without idempotency keys, searchable by the
/// client reference z29c puts in the body: recovery asks, finds the shipment and completes the
/// step from it, never shipping twice. The same carrier with a status route that does not
/// exist (404 for everything): the 404 is not "never arrived", so nothing is sent again and
/// a person decides. An API with no way to ask: a person decides, nothing sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_answers_are_asked_about_by_each_apis_own_rules_and_never_sent_again() -> Result<()> {
    let apis = Apis::start(STRIPE_KEY).await?;
    let mut cluster = Cluster::start_with(Topology {
        gateways: 0,
        recoveries: 1,
        env: vec![("Z29C_RECOVERY_LEASE_MS".into(), "1500".into())],
        ..Topology::default()
    })
    .await?;
    let adapters = carrier(
        "carrier",
        &apis.url,
        "/shipments?customer_reference={identity}",
    ) + &carrier(
        "carrier-misrouted",
        &apis.url,
        "/shipments/lookup/{identity}",
    ) + &notify(&apis.url);
    cluster.add_gateway_serving(&adapters, &[]).await?;
    let pool = cluster.db.pool(2).await?;
    apis.lose_answers("carrier", 2);
    apis.lose_answers("notify", 1);
    let parcel = json!({ "to": "Rue de la Paix 1, Paris", "weight_g": 800 });
    let ids = submit(
        &cluster,
        vec![
            one_step("shipped", "carrier", "ship", parcel.clone()),
            one_step("misrouted", "carrier-misrouted", "ship", parcel),
            one_step("notified", "notify", "send", json!({ "text": "shipped" })),
        ],
    )
    .await?;
    // the searchable one completes; the other two wait for a person
    cluster
        .wait_all_ended(&ids[..1], Duration::from_secs(60))
        .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let reviewing: i64 =
            sqlx::query_scalar("SELECT count(*) FROM steps WHERE state = 'needs_review'")
                .fetch_one(&pool)
                .await?;
        if reviewing == 2 {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{reviewing} steps in review, expected 2\n{}",
            cluster.log_warnings()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let (reference, verification): (String, String) = sqlx::query_as(
        "SELECT r.external_reference, r.verification::text FROM step_receipts r
         JOIN steps s ON s.id = r.step_id JOIN workflows w ON w.id = s.workflow_id
         WHERE w.client_key = 'shipped'",
    )
    .fetch_one(&pool)
    .await?;
    assert_eq!(verification, "status_query");
    let shipments = apis.effects("carrier");
    assert_eq!(shipments.len(), 2, "one shipment per step: {shipments:?}");
    assert!(
        shipments.iter().any(|s| s.id == reference),
        "{shipments:?} {reference}"
    );
    let posts = apis
        .received("carrier")
        .into_iter()
        .filter(|r| r.method == "POST")
        .count();
    assert_eq!(posts, 2, "no shipment sent twice");
    assert_eq!(apis.received("notify").len(), 1, "no message sent twice");
    // a 404 from the wrong route never counted as "not found"
    let not_found: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM recovery_decisions d JOIN workflows w ON w.id = d.workflow_id
         WHERE w.client_key = 'misrouted' AND d.detail->>'reason' LIKE '%no such request%'",
    )
    .fetch_one(&pool)
    .await?;
    assert_eq!(not_found, 0);
    assert_eq!(step_state(&pool, "misrouted").await?, "needs_review");
    assert_eq!(step_state(&pool, "notified").await?, "needs_review");
    pool.close().await;
    cluster.stop().await
}

/// A gateway refuses to start with a capability its adapter's contract cannot support, naming
/// the adapter's field: idempotent without an idempotency header, queryable without a rule
/// for "not found"; and with a secret it cannot read, naming where it was to come from.
#[tokio::test]
async fn a_gateway_refuses_a_capability_its_adapter_cannot_support() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("z29c-adapters-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir)?;
    for (toml, field) in [
        (
            "[[adapters]]\nname = \"pay\"\ncapability = \"idempotent\"\n[adapters.http]\nidempotency_header = \"\"\n",
            "adapters[0].http.idempotency_header",
        ),
        (
            "[[adapters]]\nname = \"ship\"\ncapability = \"queryable\"\n[adapters.http.query]\nnot_found = []\n",
            "adapters[0].http.query.not_found",
        ),
        (
            "[[adapters]]\nname = \"pay\"\n[adapters.http.headers]\nAuthorization = { env = \"Z29C_TEST_SURELY_UNSET_KEY\", prefix = \"Bearer \" }\n",
            "adapters[0].http.headers.Authorization: environment variable Z29C_TEST_SURELY_UNSET_KEY is not set",
        ),
    ] {
        let file = dir.join("gateway.toml");
        std::fs::write(&file, toml)?;
        let out = tokio::process::Command::new(z29c_binary()?)
            .args([
                "gateway",
                "--config",
                &file.to_string_lossy(),
                "--dump-config",
            ])
            .output()
            .await?;
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{toml}");
        assert!(said.contains(field), "{field}: {said}");
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// An adapter arrives with the gateway that serves it. Work for it is refused, naming it,
/// while no gateway serves it; accepted and run once one does. With that gateway gone, a step
/// for its adapter waits (Waiting on an external service) without spending its attempts, and
/// runs once the gateway is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_gateway_adds_its_adapter_and_without_it_steps_wait() -> Result<()> {
    let apis = Apis::start(STRIPE_KEY).await?;
    let mut cluster = Cluster::start_with(Topology {
        gateways: 0,
        recoveries: 1,
        env: vec![
            ("Z29C_RECOVERY_LEASE_MS".into(), "1500".into()),
            // an adapter gone from the registry counts as served for this long after
            ("Z29C_ADAPTER_GRACE_MS".into(), "3000".into()),
        ],
        ..Topology::default()
    })
    .await?;
    let mut client = cluster.client().await?;
    let refused = client
        .submit(one_step(
            "early",
            "payments",
            "charges",
            json!({ "amount": 100 }),
        ))
        .await
        .expect_err("no gateway serves payments yet");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(
        refused.message().starts_with("steps[0].adapter:")
            && refused.message().contains("\"payments\"")
            && refused.message().contains("no gateway is registered"),
        "{}",
        refused.message()
    );
    // with another adapter served, the refusal says which ones are
    cluster.add_gateway(16).await?;
    let refused = client
        .submit(one_step("early", "payments", "charges", json!({})))
        .await
        .expect_err("no gateway serves payments yet");
    assert!(
        refused.message().contains("served: http, http-idempotent"),
        "{}",
        refused.message()
    );

    let env = [("Z29C_TEST_STRIPE_KEY", STRIPE_KEY)];
    cluster
        .add_gateway_serving(&stripe("payments", &apis.url, "Z29C_TEST_STRIPE_KEY"), &env)
        .await?;
    // accepted once the new gateway has registered
    let paid = client
        .submit(one_step(
            "paid",
            "payments",
            "charges",
            json!({ "amount": 200 }),
        ))
        .await?
        .into_inner()
        .workflow
        .expect("workflow")
        .id;
    cluster
        .wait_all_ended(std::slice::from_ref(&paid), Duration::from_secs(60))
        .await?;
    assert_eq!(
        cluster.product_state(&paid).await?,
        pb::ProductState::Completed
    );

    // the gateway goes (its registration outlives it for a while); the next step waits
    cluster
        .process("gateway-2")
        .expect("gateway-2")
        .kill()
        .await?;
    let waiting_request = one_step("waiting", "payments", "charges", json!({ "amount": 300 }));
    let waiting = submit(&cluster, vec![waiting_request.clone()]).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while cluster.product_state(&waiting[0]).await? != pb::ProductState::WaitingOnExternalService {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the step did not wait for a gateway\n{}",
            cluster.log_warnings()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // long enough to spend its three attempts several times over, were waits attempts
    tokio::time::sleep(Duration::from_secs(8)).await;
    let pool = cluster.db.pool(2).await?;
    let spent: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM attempts a JOIN workflows w ON w.id = a.workflow_id
         WHERE w.client_key = 'waiting' AND a.state NOT IN ('released', 'active')",
    )
    .fetch_one(&pool)
    .await?;
    assert_eq!(spent, 0, "waiting for a gateway spent attempts");
    let state = step_state(&pool, "waiting").await?;
    assert!(state == "ready" || state == "leased", "{state}");
    // once its registration has run out, new work for the adapter is refused; a retried
    // submit of the waiting workflow is answered with it
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while cluster
        .registered_gateways()
        .await?
        .contains(&"gateway-2".to_owned())
    {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "a killed gateway's registration did not run out"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // past the scheduler's grace for an adapter gone from the registry (a read of it is at
    // most REFRESH old)
    tokio::time::sleep(Duration::from_millis(3_000) + z29c_bus::gateways::REFRESH).await;
    let late = client
        .submit(one_step("late", "payments", "charges", json!({})))
        .await
        .expect_err("work for an adapter no longer served");
    assert_eq!(late.code(), tonic::Code::FailedPrecondition, "{late}");
    let again = client.submit(waiting_request).await?.into_inner();
    assert!(!again.created);
    assert_eq!(again.workflow.expect("workflow").id, waiting[0]);
    cluster.restart("gateway-2", &[]).await?;
    cluster
        .wait_all_ended(&waiting, Duration::from_secs(60))
        .await?;
    assert_eq!(
        cluster.product_state(&waiting[0]).await?,
        pb::ProductState::Completed
    );
    assert_eq!(apis.effects("stripe").len(), 2, "one charge per step");
    pool.close().await;
    cluster.stop().await
}
