//! The HTTP/JSON API against real processes, called as curl would: an order submitted, waited
//! for and found in the list; a cancellation; every bad input answered with a 4xx naming the
//! problem and nothing changed; and, on a secure cluster, the same certificates, tokens and
//! roles as the gRPC API (there through curl itself, which speaks mutual TLS).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use reqwest::{Client, StatusCode};
use serde_json::{Value, json};
use sqlx::PgPool;
use z29c_core::Role;
use z29c_core::identity::ServiceRole;
use z29c_scenarios::apis::Apis;
use z29c_scenarios::cluster::{Cluster, Topology};
use z29c_scenarios::{count_rows, order};

const SETTLED: [&str; 4] = ["completed", "failed", "cancelled", "needs_review"];

fn client() -> Result<Client> {
    Ok(Client::builder().timeout(Duration::from_secs(75)).build()?)
}

/// Status and JSON body of a response; a body that is not JSON is an error naming it.
async fn answer(response: reqwest::Response) -> Result<(StatusCode, Value)> {
    let status = response.status();
    let text = response.text().await?;
    let body = serde_json::from_str(&text)
        .with_context(|| format!("a {status} answer that is not JSON: {text:?}"))?;
    Ok((status, body))
}

/// `GET /v1/workflows/{id}?wait=…` until the workflow settles, for at most `within`.
async fn wait_settled(http: &Client, base: &str, id: &str, within: Duration) -> Result<Value> {
    let start = Instant::now();
    loop {
        let asked = Instant::now();
        let (status, wf) = answer(
            http.get(format!("{base}/v1/workflows/{id}?wait=20"))
                .send()
                .await?,
        )
        .await?;
        ensure!(status == StatusCode::OK, "{status}: {wf}");
        let state = wf["state"].as_str().context("a state")?;
        if SETTLED.contains(&state) {
            return Ok(wf);
        }
        // the server held the answer until the wait ran out, not less
        ensure!(
            asked.elapsed() >= Duration::from_secs(19),
            "answered {state} after {:?} without settling",
            asked.elapsed()
        );
        if start.elapsed() > within {
            bail!("workflow {id} did not settle within {within:?}: {wf}");
        }
    }
}

/// An error answer: its status, and the code and message of `{"error": {…}}`.
fn error_of(body: &Value) -> Result<(&str, &str)> {
    Ok((
        body["error"]["code"]
            .as_str()
            .with_context(|| format!("error.code in {body}"))?,
        body["error"]["message"]
            .as_str()
            .with_context(|| format!("error.message in {body}"))?,
    ))
}

async fn workflows(pool: &PgPool) -> Result<i64> {
    count_rows(pool, "workflows").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_over_http_completes_is_listed_and_bad_input_changes_nothing() -> Result<()> {
    let apis = Apis::start(order::KEY).await?;
    let mut cluster = Cluster::start_with(Topology {
        gateways: 0,
        ..Default::default()
    })
    .await?;
    cluster
        .add_gateway_serving(
            &order::gateway_toml(&apis.url),
            &[(order::KEY_ENV, order::KEY)],
        )
        .await?;
    let pool = cluster.db.pool(2).await?;
    let http = client()?;
    let base = cluster.http_url.clone();

    // submit: 201 with the workflow and where to find it; the same again is 200, not created
    let document = order::document("http-order-1", "SKU-HTTP-1");
    let response = http
        .post(format!("{base}/v1/workflows"))
        .json(&document)
        .send()
        .await?;
    let location = response
        .headers()
        .get("location")
        .and_then(|l| l.to_str().ok())
        .map(str::to_owned);
    let (status, submitted) = answer(response).await?;
    assert_eq!(status, StatusCode::CREATED, "{submitted}");
    assert_eq!(submitted["created"], true);
    let id = submitted["workflow"]["id"]
        .as_str()
        .context("workflow.id")?
        .to_owned();
    assert_eq!(location, Some(format!("/v1/workflows/{id}")));
    assert_eq!(submitted["workflow"]["name"], "order");
    assert_eq!(submitted["workflow"]["client_key"], "http-order-1");
    let steps = submitted["workflow"]["steps"].as_array().context("steps")?;
    assert_eq!(
        steps.iter().map(|s| &s["name"]).collect::<Vec<_>>(),
        ["reserve", "charge", "ship"]
    );
    let (status, again) = answer(
        http.post(format!("{base}/v1/workflows"))
            .json(&document)
            .send()
            .await?,
    )
    .await?;
    assert_eq!(status, StatusCode::OK, "{again}");
    assert_eq!(again["created"], false);
    assert_eq!(again["workflow"]["id"], id.as_str());

    // waited for until it ends: completed, each step with its receipt
    let done = wait_settled(&http, &base, &id, Duration::from_secs(120)).await?;
    assert_eq!(done["state"], "completed", "{done:#}");
    assert!(
        chrono::DateTime::parse_from_rfc3339(done["created_at"].as_str().context("created_at")?)
            .is_ok(),
        "{}",
        done["created_at"]
    );
    for step in done["steps"].as_array().context("steps")? {
        assert_eq!(step["state"], "completed", "{step:#}");
        assert_eq!(step["receipt"]["outcome"], "succeeded", "{step:#}");
        assert!(
            step["receipt"]["external_reference"].is_string(),
            "{step:#}"
        );
    }

    // cancelled before anything of it runs (the executor paused): 200, cancelled, and a
    // second cancel answers the same
    cluster
        .process("executor-1")
        .context("executor-1")?
        .pause()?;
    let (status, pending) = answer(
        http.post(format!("{base}/v1/workflows"))
            .json(&order::document("http-order-2", "SKU-HTTP-2"))
            .send()
            .await?,
    )
    .await?;
    assert_eq!(status, StatusCode::CREATED, "{pending}");
    let pending_id = pending["workflow"]["id"]
        .as_str()
        .context("workflow.id")?
        .to_owned();
    let cancel = || {
        http.post(format!("{base}/v1/workflows/{pending_id}/cancel"))
            .json(&json!({ "reason": "the customer changed their mind" }))
            .send()
    };
    let (status, cancelled) = answer(cancel().await?).await?;
    cluster
        .process("executor-1")
        .context("executor-1")?
        .resume()?;
    assert_eq!(status, StatusCode::OK, "{cancelled}");
    assert_eq!(cancelled["state"], "cancelled", "{cancelled:#}");
    let (status, again) = answer(cancel().await?).await?;
    assert_eq!(
        (status, &again["state"]),
        (StatusCode::OK, &json!("cancelled"))
    );
    // a waiting read of an ended workflow answers at once
    let asked = Instant::now();
    let (status, read) = answer(
        http.get(format!("{base}/v1/workflows/{pending_id}?wait=30"))
            .send()
            .await?,
    )
    .await?;
    assert_eq!(
        (status, &read["state"]),
        (StatusCode::OK, &json!("cancelled"))
    );
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "{:?}",
        asked.elapsed()
    );

    // the list: all, and paged (filtered by state, name and search below)
    let list = |query: &str| {
        let url = format!("{base}/v1/workflows?{query}");
        let http = http.clone();
        async move {
            let (status, body) = answer(http.get(url).send().await?).await?;
            ensure!(status == StatusCode::OK, "{status}: {body}");
            let ids: Vec<String> = body["workflows"]
                .as_array()
                .context("workflows")?
                .iter()
                .filter_map(|w| w["id"].as_str().map(str::to_owned))
                .collect();
            Ok::<_, anyhow::Error>((ids, body["next_page_token"].clone()))
        }
    };
    let (all, next) = list("").await?;
    assert_eq!(all.len(), 2, "{all:?}");
    assert_eq!(next, Value::Null);
    let (first_page, token) = list("page_size=1").await?;
    assert_eq!(first_page.len(), 1);
    let token = token.as_str().context("a next page")?.to_owned();
    let (second_page, _) = list(&format!("page_size=1&page_token={token}")).await?;
    assert_eq!(second_page.len(), 1);
    assert_ne!(first_page, second_page);

    bad_input_changes_nothing(&http, &base, &pool, &document).await?;

    // what each step sent and got, and why a workflow ended, as the API shows them
    assert_eq!(done["steps"][0]["input"]["sku"], "SKU-HTTP-1", "{done:#}");
    assert_eq!(
        done["steps"][1]["depends_on"],
        json!(["reserve"]),
        "{done:#}"
    );
    for step in done["steps"].as_array().context("steps")? {
        assert!(step["result"].is_object(), "a result for {step:#}");
        assert_eq!(step["reason"], Value::Null, "{step:#}");
    }
    assert_eq!(done["steps"][0]["result"]["sku"], "SKU-HTTP-1", "{done:#}");
    assert!(
        cancelled["reason"]
            .as_str()
            .is_some_and(|r| r.contains("the customer changed their mind")),
        "{cancelled:#}"
    );
    order::check_carried(&apis, "SKU-HTTP-1")?;
    assert_eq!(list("state=completed").await?.0, [id.as_str()]);
    assert_eq!(
        list("state=failed&state=cancelled").await?.0,
        [pending_id.as_str()]
    );
    assert_eq!(
        list("state=failed,needs_review").await?.0,
        Vec::<String>::new()
    );
    assert_eq!(list("search=http-order-1").await?.0, [id.as_str()]);
    assert_eq!(
        list(&format!("search={pending_id}")).await?.0,
        [pending_id.as_str()]
    );
    assert_eq!(list("name=order&state=completed").await?.0, [id.as_str()]);
    assert!(list("name=other").await?.0.is_empty());

    cluster.stop().await
}

/// Every bad request answers a 4xx naming the problem, and no workflow is added.
async fn bad_input_changes_nothing(
    http: &Client,
    base: &str,
    pool: &PgPool,
    document: &Value,
) -> Result<()> {
    let before = workflows(pool).await?;
    let post = |body: String| {
        http.post(format!("{base}/v1/workflows"))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let mut without_name = document.clone();
    without_name["client_key"] = json!("http-bad-1");
    without_name
        .as_object_mut()
        .context("object")?
        .remove("name");
    let mut unknown_adapter = document.clone();
    unknown_adapter["client_key"] = json!("http-bad-2");
    unknown_adapter["steps"][0]["adapter"] = json!("teleport");
    let mut wrong_type = document.clone();
    wrong_type["client_key"] = json!("http-bad-3");
    wrong_type["steps"][1]["depends_on"] = json!("reserve");
    let mut unknown_field = document.clone();
    unknown_field["client_key"] = json!("http-bad-4");
    unknown_field["steps"][2]["retries"] = json!(3);
    let mut bad_policy = document.clone();
    bad_policy["client_key"] = json!("http-bad-5");
    bad_policy["steps"][0]["policy"] = json!({ "lease_ms": "long" });
    let mut other_payload = document.clone();
    other_payload["steps"][0]["input"]["quantity"] = json!(2);
    let cases: Vec<(&str, String, StatusCode, &str, &str)> = vec![
        (
            "malformed JSON",
            "{\"name\": \"order\", \"steps\": [".into(),
            StatusCode::BAD_REQUEST,
            "INVALID_ARGUMENT",
            "body: ",
        ),
        (
            "an empty body",
            String::new(),
            StatusCode::BAD_REQUEST,
            "INVALID_ARGUMENT",
            "body: empty",
        ),
        (
            "no name",
            without_name.to_string(),
            StatusCode::BAD_REQUEST,
            "INVALID_ARGUMENT",
            "missing field `name`",
        ),
        (
            "an adapter no gateway serves",
            unknown_adapter.to_string(),
            StatusCode::CONFLICT,
            "FAILED_PRECONDITION",
            "steps[0].adapter",
        ),
        (
            "a list where a string was due",
            wrong_type.to_string(),
            StatusCode::BAD_REQUEST,
            "INVALID_ARGUMENT",
            "body: steps[1].depends_on: invalid type",
        ),
        (
            "an unknown field",
            unknown_field.to_string(),
            StatusCode::BAD_REQUEST,
            "INVALID_ARGUMENT",
            "unknown field `retries`",
        ),
        (
            "a policy field of the wrong type",
            bad_policy.to_string(),
            StatusCode::BAD_REQUEST,
            "INVALID_ARGUMENT",
            "steps[0].policy.lease_ms",
        ),
        (
            "the same key with another payload",
            other_payload.to_string(),
            StatusCode::CONFLICT,
            "FAILED_PRECONDITION",
            "",
        ),
    ];
    for (what, body, status, code, names) in cases {
        let (got, answer_body) = answer(post(body).await?).await?;
        let (got_code, message) = error_of(&answer_body)?;
        assert_eq!((got, got_code), (status, code), "{what}: {answer_body}");
        assert!(
            message.contains(names),
            "{what}: {message:?} names {names:?}"
        );
    }

    let unknown = uuid::Uuid::now_v7();
    let requests: Vec<(&str, reqwest::RequestBuilder, StatusCode, &str)> = vec![
        (
            "a bad id",
            http.get(format!("{base}/v1/workflows/not-an-id")),
            StatusCode::BAD_REQUEST,
            "workflow_id",
        ),
        (
            "a bad id to cancel",
            http.post(format!("{base}/v1/workflows/not-an-id/cancel")),
            StatusCode::BAD_REQUEST,
            "workflow_id",
        ),
        (
            "an unknown workflow",
            http.get(format!("{base}/v1/workflows/{unknown}")),
            StatusCode::NOT_FOUND,
            "not found",
        ),
        (
            "an unknown workflow to cancel",
            http.post(format!("{base}/v1/workflows/{unknown}/cancel"))
                .json(&json!({ "reason": "test" })),
            StatusCode::NOT_FOUND,
            "not found",
        ),
        (
            "a cancel body of the wrong shape",
            http.post(format!("{base}/v1/workflows/{unknown}/cancel"))
                .json(&json!({ "why": "test" })),
            StatusCode::BAD_REQUEST,
            "unknown field `why`",
        ),
        (
            "a wait that is not a number",
            http.get(format!("{base}/v1/workflows/{unknown}?wait=soon")),
            StatusCode::BAD_REQUEST,
            "wait:",
        ),
        (
            "an unknown query parameter",
            http.get(format!("{base}/v1/workflows?stat=failed")),
            StatusCode::BAD_REQUEST,
            "stat: unknown query parameter",
        ),
        (
            "an unknown state",
            http.get(format!("{base}/v1/workflows?state=done")),
            StatusCode::BAD_REQUEST,
            "state: \"done\"",
        ),
        (
            "a bad page token",
            http.get(format!("{base}/v1/workflows?page_token=zzz")),
            StatusCode::BAD_REQUEST,
            "page_token",
        ),
        (
            "a page size that is not a number",
            http.get(format!("{base}/v1/workflows?page_size=all")),
            StatusCode::BAD_REQUEST,
            "page_size",
        ),
        (
            "an unknown route",
            http.get(format!("{base}/v2/workflows")),
            StatusCode::NOT_FOUND,
            "no route GET /v2/workflows",
        ),
        (
            "a method the route does not take",
            http.delete(format!("{base}/v1/workflows/{unknown}")),
            StatusCode::METHOD_NOT_ALLOWED,
            "DELETE",
        ),
    ];
    for (what, request, status, names) in requests {
        let (got, body) = answer(request.send().await?).await?;
        let (_, message) = error_of(&body)?;
        assert_eq!(got, status, "{what}: {body}");
        assert!(
            message.contains(names),
            "{what}: {message:?} names {names:?}"
        );
    }
    assert_eq!(
        workflows(pool).await?,
        before,
        "a refused request added a workflow"
    );
    Ok(())
}

/// curl against a secure cluster's HTTP API with the operator's certificate (or none) and a
/// token (or none): the status and the body.
async fn curl(
    cluster: &Cluster,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
    certificate: bool,
) -> Result<(u16, String)> {
    let role = certificate.then_some(ServiceRole::Operator);
    curl_as(cluster, role, method, path, token, body).await
}

/// [`curl`] with the certificate of `role` (or none).
async fn curl_as(
    cluster: &Cluster,
    role: Option<ServiceRole>,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> Result<(u16, String)> {
    let tls = cluster.role_tls(role.unwrap_or(ServiceRole::Operator));
    let mut cmd = tokio::process::Command::new("curl");
    cmd.args([
        "-sS",
        "--max-time",
        "30",
        "-X",
        method,
        "-w",
        "\n%{http_code}",
    ]);
    cmd.arg("--cacert").arg(tls.ca_file.context("ca")?);
    if role.is_some() {
        cmd.arg("--cert").arg(tls.cert_file.context("cert")?);
        cmd.arg("--key").arg(tls.key_file.context("key")?);
    }
    if let Some(token) = token {
        cmd.args(["-H", &format!("Authorization: Bearer {token}")]);
    }
    if let Some(body) = body {
        cmd.args(["-H", "Content-Type: application/json", "--data-binary"]);
        cmd.arg(body.to_string());
    }
    cmd.arg(format!("{}{path}", cluster.http_url));
    let out = cmd.output().await.context("run curl")?;
    ensure!(
        out.status.success(),
        "curl {method} {path}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    let (body, status) = text.rsplit_once('\n').context("a status line")?;
    Ok((status.trim().parse()?, body.to_owned()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secure_cluster_asks_the_http_caller_for_its_certificate_its_token_and_its_role()
-> Result<()> {
    let cluster = Cluster::start_with(Topology {
        secure: true,
        ..Default::default()
    })
    .await?;
    ensure!(
        cluster.http_url.starts_with("https://"),
        "{}",
        cluster.http_url
    );
    let pool = cluster.db.pool(2).await?;
    let operator = cluster.token("olga", &[Role::Operator])?;
    let viewer = cluster.token("vic", &[Role::Viewer])?;
    let document = json!({
        "client_key": "http-secure-1",
        "name": "secure",
        "steps": [{ "name": "s0", "adapter": "http", "operation": "ok", "input": { "n": 0 } }]
    });
    let before = workflows(&pool).await?;

    // plain HTTP to the TLS port is no way in
    let plain = client()?
        .get(cluster.http_url.replace("https://", "http://") + "/v1/workflows")
        .send()
        .await;
    assert!(
        plain.is_err() || plain.as_ref().is_ok_and(|r| !r.status().is_success()),
        "{plain:?}"
    );
    // no client certificate: the handshake fails before any request is read
    let tls = cluster.operator_tls();
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "--max-time", "10", "--cacert"])
        .arg(tls.ca_file.context("ca")?)
        .args(["-H", &format!("Authorization: Bearer {operator}")])
        .arg(format!("{}/v1/workflows", cluster.http_url))
        .output()
        .await?;
    assert!(!out.status.success(), "{out:?}");

    // no token: 401 with the gRPC API's words
    let (status, body) = curl(&cluster, "GET", "/v1/workflows", None, None, true).await?;
    assert_eq!(status, 401, "{body}");
    let body: Value = serde_json::from_str(&body)?;
    let (code, message) = error_of(&body)?;
    assert_eq!(code, "UNAUTHENTICATED");
    assert!(message.contains("Bearer"), "{message}");
    let (status, body) = curl(
        &cluster,
        "POST",
        "/v1/workflows",
        None,
        Some(&document),
        true,
    )
    .await?;
    assert_eq!(status, 401, "{body}");
    // a service's certificate is not a caller's, whatever its token: 403 naming its role
    let (status, body) = curl_as(
        &cluster,
        Some(ServiceRole::Executor),
        "GET",
        "/v1/workflows",
        Some(&operator),
        None,
    )
    .await?;
    assert_eq!(status, 403, "{body}");
    let body: Value = serde_json::from_str(&body)?;
    let (code, message) = error_of(&body)?;
    assert_eq!(code, "PERMISSION_DENIED");
    assert!(message.contains("names the role executor"), "{message}");
    // an application's certificate is one
    let (status, body) = curl_as(
        &cluster,
        Some(ServiceRole::Application),
        "GET",
        "/v1/workflows",
        Some(&operator),
        None,
    )
    .await?;
    assert_eq!(status, 200, "{body}");
    // a viewer may read but not submit: 403 naming the role it needs
    let (status, body) = curl(&cluster, "GET", "/v1/workflows", Some(&viewer), None, true).await?;
    assert_eq!(status, 200, "{body}");
    let (status, body) = curl(
        &cluster,
        "POST",
        "/v1/workflows",
        Some(&viewer),
        Some(&document),
        true,
    )
    .await?;
    assert_eq!(status, 403, "{body}");
    let body: Value = serde_json::from_str(&body)?;
    let (code, message) = error_of(&body)?;
    assert_eq!(code, "PERMISSION_DENIED");
    assert!(message.contains("operator"), "{message}");
    assert_eq!(
        workflows(&pool).await?,
        before,
        "a refused submission added a workflow"
    );

    // the operator submits and waits for the end
    let (status, body) = curl(
        &cluster,
        "POST",
        "/v1/workflows",
        Some(&operator),
        Some(&document),
        true,
    )
    .await?;
    assert_eq!(status, 201, "{body}");
    let body: Value = serde_json::from_str(&body)?;
    let id = body["workflow"]["id"].as_str().context("workflow.id")?;
    let start = Instant::now();
    let done = loop {
        let (status, body) = curl(
            &cluster,
            "GET",
            &format!("/v1/workflows/{id}?wait=20"),
            Some(&viewer),
            None,
            true,
        )
        .await?;
        assert_eq!(status, 200, "{body}");
        let wf: Value = serde_json::from_str(&body)?;
        if SETTLED.contains(&wf["state"].as_str().unwrap_or_default()) {
            break wf;
        }
        ensure!(
            start.elapsed() < Duration::from_secs(90),
            "not settled: {wf}"
        );
    };
    assert_eq!(done["state"], "completed", "{done:#}");

    // the refusals are in the audit log, as the gRPC API's are
    let start = Instant::now();
    loop {
        let refused: Vec<(String, Option<String>)> = sqlx::query_as(
            "SELECT outcome, subject FROM audit_log WHERE outcome <> 'allowed' ORDER BY id",
        )
        .fetch_all(&pool)
        .await?;
        let has = |outcome: &str, subject: Option<&str>| {
            refused
                .iter()
                .any(|(o, s)| o == outcome && s.as_deref() == subject)
        };
        if has("unauthenticated", None) && has("permission_denied", Some("vic")) {
            break;
        }
        ensure!(
            start.elapsed() < Duration::from_secs(10),
            "refusals not audited: {refused:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.stop().await
}
