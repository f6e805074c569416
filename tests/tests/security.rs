//! Security and bad input against a secure cluster (mutual TLS between every process, operator
//! tokens required), as real processes: who may call what, and a clear answer for everything
//! malformed, with nothing changed by a refusal.

use std::time::{Duration, Instant};

use anyhow::Result;
use serde_json::json;
use sqlx::PgPool;
use tonic::Code;
use z29c_core::Role;
use z29c_core::identity::ServiceRole;
use z29c_proto::v1::adapter_gateway_client::AdapterGatewayClient;
use z29c_proto::v1::{self as pb};
use z29c_scenarios::cluster::{Cluster, chain, flaky_workflow};
use z29c_security::TlsConfig;

async fn secure(capability: &'static str, env: &[(&str, &str)]) -> Result<(Cluster, PgPool)> {
    Cluster::start_secure(capability, env).await
}

async fn count(pool: &PgPool, table: &str) -> Result<i64> {
    z29c_scenarios::count_rows(pool, table).await
}

/// The audit log's outcomes, oldest first, once `n` rows are there (written in the background).
async fn audit_outcomes(pool: &PgPool, n: usize) -> Result<Vec<(String, String, Option<String>)>> {
    let start = Instant::now();
    loop {
        let rows: Vec<(String, String, Option<String>)> =
            sqlx::query_as("SELECT method, outcome, subject FROM audit_log ORDER BY id")
                .fetch_all(pool)
                .await?;
        if rows.len() >= n || start.elapsed() > Duration::from_secs(10) {
            return Ok(rows);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_and_roles_decide_who_may_do_what_and_every_refusal_is_audited() -> Result<()> {
    let (cluster, pool) = secure("idempotent", &[]).await?;
    let tls = cluster.operator_tls();
    let operator = cluster.token("olga", &[Role::Operator])?;
    let viewer = cluster.token("vic", &[Role::Viewer])?;
    let stranger = z29c_security::token::mint(
        &z29c_security::token::random_secret(),
        "z29c",
        "mallory",
        Role::ALL,
        Duration::from_secs(60),
    )?;
    let expired = z29c_security::token::mint(
        &cluster.security.as_ref().unwrap().secret,
        "z29c",
        "olga",
        &[Role::Operator],
        Duration::ZERO,
    )?;
    // the token's expiry is in the past beyond the 5 s leeway
    tokio::time::sleep(Duration::from_millis(6_100)).await;

    // an operator submits over mutual TLS; the executor calls the gateway over mutual TLS
    let mut olga = cluster.client_with(&tls, Some(&operator)).await?;
    let wf = olga.submit(chain("sec-1", "ok", 2)).await?.into_inner();
    let id = wf.workflow.unwrap().id;
    cluster
        .wait_all_ended(std::slice::from_ref(&id), Duration::from_secs(60))
        .await?;
    let done = olga
        .get(pb::GetRequest {
            workflow_id: id.clone(),
        })
        .await?
        .into_inner();
    assert_eq!(done.state(), pb::ProductState::Completed);

    let workflows = count(&pool, "workflows").await?;
    for (token, code, why) in [
        (None, Code::Unauthenticated, "no credentials"),
        (
            Some(expired.as_str()),
            Code::Unauthenticated,
            "the token has expired",
        ),
        (
            Some(stranger.as_str()),
            Code::Unauthenticated,
            "does not verify",
        ),
        (
            Some(viewer.as_str()),
            Code::PermissionDenied,
            "needs the role operator",
        ),
    ] {
        let mut c = cluster.client_with(&tls, token).await?;
        let e = c.submit(chain("sec-2", "ok", 1)).await.unwrap_err();
        assert_eq!(e.code(), code, "{}", e.message());
        assert!(e.message().contains(why), "{why}: {}", e.message());
    }
    assert_eq!(
        count(&pool, "workflows").await?,
        workflows,
        "a refusal changes nothing"
    );
    // a viewer reads; it may not cancel
    let mut vic = cluster.client_with(&tls, Some(&viewer)).await?;
    vic.get(pb::GetRequest {
        workflow_id: id.clone(),
    })
    .await?;
    let e = vic
        .cancel(pb::CancelRequest {
            workflow_id: id.clone(),
            reason: "no".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);

    let audit = audit_outcomes(&pool, 6).await?;
    let expected = [
        ("Submit", "allowed", Some("olga")),
        ("Submit", "unauthenticated", None),
        ("Submit", "unauthenticated", None),
        ("Submit", "unauthenticated", None),
        ("Submit", "permission_denied", Some("vic")),
        ("Cancel", "permission_denied", Some("vic")),
    ];
    let got: Vec<(&str, &str, Option<&str>)> = audit
        .iter()
        .map(|(m, o, s)| (m.as_str(), o.as_str(), s.as_deref()))
        .collect();
    assert_eq!(got, expected);
    pool.close().await;
    cluster.stop().await
}

/// Whether a server answers its gRPC health check over `channel`.
async fn answers(channel: tonic::transport::Channel) -> bool {
    tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_certificate_from_the_ca_no_service_can_be_called() -> Result<()> {
    let (cluster, pool) = secure("idempotent", &[]).await?;
    let token = cluster.token("olga", Role::ALL)?;
    let security = cluster.security.clone().unwrap();
    let ca_pem = std::fs::read(security.pki.dir.join("ca.pem"))?;
    // the impostor's certificate is signed by another CA, but it trusts the right CA
    let impostor = TlsConfig {
        ca_file: security.pki.tls("operator").ca_file,
        ..security.foreign.tls("impostor")
    };
    let gateway = cluster.gateway_urls[0].clone();
    for url in [&cluster.scheduler_url, &cluster.review_url, &gateway] {
        // plaintext to a TLS port
        let plain = url.replacen("https://", "http://", 1);
        let refused = async |tls: &TlsConfig, url: &str| -> bool {
            let Ok(channel) = cluster.channel(url, tls).await else {
                return true;
            };
            !answers(channel).await
        };
        assert!(
            refused(&TlsConfig::default(), &plain).await,
            "plaintext to {url}"
        );
        // TLS that trusts the CA but presents no client certificate
        let no_cert = async {
            let endpoint = tonic::transport::Endpoint::from_shared(url.clone())?.tls_config(
                tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(&ca_pem)),
            )?;
            let Ok(channel) = endpoint.connect().await else {
                return Ok::<bool, anyhow::Error>(true);
            };
            Ok(!answers(channel).await)
        };
        assert!(no_cert.await?, "no client certificate to {url}");
        assert!(refused(&impostor, url).await, "impostor to {url}");
    }
    // and the CA's certificates work, on every service: the positive control
    for url in [&cluster.scheduler_url, &cluster.review_url, &gateway] {
        let channel = cluster.channel(url, &security.pki.tls("operator")).await?;
        assert!(answers(channel).await, "{url}");
    }
    let channel = cluster
        .channel(&gateway, &cluster.role_tls(ServiceRole::Executor))
        .await?;
    let described = AdapterGatewayClient::new(channel)
        .describe(pb::DescribeRequest {})
        .await?
        .into_inner();
    assert!(!described.gateway_id.is_empty());
    // an impostor cannot reach WorkflowService even with a valid token
    let e = match cluster.client_with(&impostor, Some(&token)).await {
        Err(_) => None,
        Ok(mut c) => c.list(pb::ListRequest::default()).await.err(),
    };
    assert!(e.is_none() || e.unwrap().code() != Code::Ok);
    assert_eq!(
        count(&pool, "audit_log").await?,
        0,
        "nothing got as far as the door"
    );
    // a probe port answers health alone, in plaintext, for kubelet: nothing else is there
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let health = format!("127.0.0.1:{port}");
    let mut cluster = cluster;
    cluster
        .add_gateway_with(16, &[("Z29C_HEALTH_LISTEN", health.as_str())])
        .await?;
    let probe_url = format!("http://{health}");
    let mut serving = false;
    for _ in 0..50 {
        if let Ok(channel) = cluster.channel(&probe_url, &TlsConfig::default()).await
            && answers(channel).await
        {
            serving = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(serving, "the plaintext health port answers");
    let channel = cluster.channel(&probe_url, &TlsConfig::default()).await?;
    let e = AdapterGatewayClient::new(channel)
        .describe(pb::DescribeRequest {})
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        Code::Unimplemented,
        "only health is served in plaintext"
    );
    pool.close().await;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_resolver_resolves_and_the_record_names_the_token_not_a_header() -> Result<()> {
    use pb::resolve_request::Resolution;
    let (cluster, pool) = secure("opaque", &[]).await?;
    cluster
        .set_faults("flaky", json!({ "drop_response": true }))
        .await?;
    let req = flaky_workflow("review-1");
    let id = cluster
        .client()
        .await?
        .submit(req)
        .await?
        .into_inner()
        .workflow
        .unwrap()
        .id;
    cluster
        .wait_all_ended(std::slice::from_ref(&id), Duration::from_secs(60))
        .await?;
    let viewer = cluster.token("vic", &[Role::Viewer])?;
    let operator = cluster.token("olga", &[Role::Operator])?;
    let resolver = cluster.token("rita", &[Role::Resolver])?;
    let items = cluster
        .reviews(Some(&viewer))
        .await?
        .list(pb::ListReviewsRequest::default())
        .await?
        .into_inner()
        .items;
    assert_eq!(items.len(), 1, "the unknown outcome waits for a person");
    let item = items[0].clone();
    let resolve = |version: i64, reason: &str, forged: bool| {
        let mut r = tonic::Request::new(pb::ResolveRequest {
            item_id: item.id.clone(),
            expected_version: version,
            reason: reason.into(),
            resolution: Some(Resolution::Failed(true)),
            result_json: String::new(),
        });
        if forged {
            r.metadata_mut()
                .insert("x-z29c-operator", "someone-else".parse().unwrap());
        }
        r
    };
    for (token, code) in [
        (None, Code::Unauthenticated),
        (Some(&viewer), Code::PermissionDenied),
        (Some(&operator), Code::PermissionDenied),
    ] {
        let e = cluster
            .reviews(token.map(String::as_str))
            .await?
            .resolve(resolve(item.version, "checked the destination", false))
            .await
            .unwrap_err();
        assert_eq!(e.code(), code, "{}", e.message());
    }
    let mut rita = cluster.reviews(Some(&resolver)).await?;
    let e = rita
        .resolve(resolve(item.version, "  ", false))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "a missing reason");
    let e = rita
        .resolve(resolve(item.version + 1, "checked", false))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "a stale version");
    assert_eq!(
        count(&pool, "review_resolutions").await?,
        0,
        "refusals change nothing"
    );
    let done = rita
        .resolve(resolve(
            item.version,
            "checked the destination: nothing there",
            true,
        ))
        .await?
        .into_inner();
    assert_eq!(done.state, "resolved");
    let e = rita
        .resolve(resolve(done.version, "again", false))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "not open any more");
    let by: String = sqlx::query_scalar("SELECT resolved_by FROM review_resolutions")
        .fetch_one(&pool)
        .await?;
    assert_eq!(
        by, "rita",
        "the token's subject, not a header anyone can set"
    );
    let audit = audit_outcomes(&pool, 5).await?;
    let resolve_rows: Vec<(&str, Option<&str>)> = audit
        .iter()
        .filter(|(m, _, _)| m == "Resolve")
        .map(|(_, o, s)| (o.as_str(), s.as_deref()))
        .collect();
    assert_eq!(
        resolve_rows[..4],
        [
            ("unauthenticated", None),
            ("permission_denied", Some("vic")),
            ("permission_denied", Some("olga")),
            ("allowed", Some("rita")),
        ]
    );
    pool.close().await;
    cluster.stop().await
}

/// `name=value` of each cookie a response sets.
fn cookies(r: &reqwest::Response) -> Vec<String> {
    r.headers()
        .get_all(reqwest::header::SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok()?.split(';').next().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_asks_for_sign_in_and_refuses_forged_forms() -> Result<()> {
    let (mut cluster, pool) = secure("idempotent", &[]).await?;
    let console = cluster.add_console(&[]).await?;
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()?;
    // not signed in: the API refuses, the page sends you to sign in
    let r = http.get(format!("{console}/api/workflows")).send().await?;
    assert_eq!(r.status(), 401);
    let r = http.get(format!("{console}/")).send().await?;
    assert!(r.status().is_redirection());
    assert_eq!(r.headers()["location"], "/login");
    let page = http
        .get(format!("{console}/login"))
        .send()
        .await?
        .text()
        .await?;
    let csrf = page
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("the sign-in form carries a CSRF token")
        .to_owned();
    let sign_in = |token: &str, csrf: &str| {
        http.post(format!("{console}/login"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!("token={token}&csrf={csrf}"))
            .send()
    };
    let viewer = cluster.token("vic", &[Role::Viewer])?;
    let r = sign_in("not-a-token", &csrf).await?;
    assert_eq!(r.status(), 401);
    assert!(r.text().await?.contains("sign-in refused"));
    let r = sign_in(&viewer, "forged").await?;
    assert_eq!(r.status(), 403, "a sign-in form from another site");
    let r = sign_in(&viewer, &csrf).await?;
    assert!(r.status().is_redirection());
    let set = cookies(&r);
    assert!(
        set.iter().any(|c| c.starts_with("z29c_session=")),
        "{set:?}"
    );
    let session_csrf = set
        .iter()
        .find_map(|c| c.strip_prefix("z29c_csrf="))
        .expect("a CSRF cookie for the session")
        .to_owned();
    let cookie = set.join("; ");
    let r = http
        .get(format!("{console}/api/workflows"))
        .header("cookie", &cookie)
        .send()
        .await?;
    assert_eq!(r.status(), 200, "{}", r.text().await?);
    // a resolve without the CSRF header, from another origin, or by a viewer: refused
    let resolve = |csrf: Option<&str>, origin: Option<&str>| {
        let mut req = http
            .post(format!(
                "{console}/api/reviews/{}/resolve",
                uuid::Uuid::new_v4()
            ))
            .header("cookie", &cookie)
            .json(&json!({
                "expected_version": 1,
                "resolution": "failed",
                "reason": "checked",
            }));
        if let Some(c) = csrf {
            req = req.header("x-csrf-token", c);
        }
        if let Some(o) = origin {
            req = req.header("origin", o);
        }
        req.send()
    };
    let r = resolve(None, None).await?;
    assert_eq!(r.status(), 403);
    assert!(r.text().await?.contains("x-csrf-token"));
    let r = resolve(Some(&session_csrf), Some("http://evil.example")).await?;
    assert_eq!(r.status(), 403);
    assert!(r.text().await?.contains("another origin"));
    let r = resolve(Some(&session_csrf), None).await?;
    assert_eq!(r.status(), 403);
    let body = r.text().await?;
    assert!(
        body.contains("PERMISSION_DENIED") && body.contains("resolver"),
        "{body}"
    );
    // the service, not the console, decided: it audited the viewer's attempt
    let audit = audit_outcomes(&pool, 1).await?;
    assert!(
        audit.iter().any(|(m, o, s)| m == "Resolve"
            && o == "permission_denied"
            && s.as_deref() == Some("vic")),
        "{audit:?}"
    );
    pool.close().await;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_mints_a_token_and_reaches_a_secure_cluster_only_with_it() -> Result<()> {
    let (cluster, pool) = secure("idempotent", &[]).await?;
    let id = cluster
        .client()
        .await?
        .submit(chain("cli-1", "ok", 1))
        .await?
        .into_inner()
        .workflow
        .unwrap()
        .id;
    let secret_file = cluster.dir().join("token-secret");
    std::fs::write(&secret_file, &cluster.security.as_ref().unwrap().secret)?;
    let bin = z29c_scenarios::cluster::z29c_binary()?;
    let tls = cluster.operator_tls();
    let z29c = |args: Vec<String>, token: Option<String>| {
        let mut cmd = tokio::process::Command::new(&bin);
        cmd.args(args)
            .env("Z29C_SERVER", &cluster.scheduler_url)
            .env("Z29C_TLS__CA_FILE", tls.ca_file.clone().unwrap())
            .env("Z29C_TLS__CERT_FILE", tls.cert_file.clone().unwrap())
            .env("Z29C_TLS__KEY_FILE", tls.key_file.clone().unwrap())
            .env("RUST_LOG", "warn")
            .env_remove("Z29C_TOKEN");
        if let Some(t) = token {
            cmd.env("Z29C_TOKEN", t);
        }
        cmd.output()
    };
    let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let secret = secret_file.to_string_lossy().into_owned();
    let minted = z29c(
        args(&[
            "token",
            "--subject",
            "cli-user",
            "--role",
            "viewer",
            "--ttl",
            "5m",
            "--secret-file",
            &secret,
        ]),
        None,
    )
    .await?;
    assert!(minted.status.success(), "{minted:?}");
    let token = String::from_utf8(minted.stdout)?.trim().to_owned();
    let ok = z29c(args(&["--output", "json", "status", &id]), Some(token)).await?;
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(String::from_utf8_lossy(&ok.stdout).contains(&id));
    let refused = z29c(args(&["status", &id]), None).await?;
    assert_eq!(refused.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("unauthenticated: no credentials"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    let bad_role = z29c(
        args(&[
            "token",
            "--subject",
            "x",
            "--role",
            "admin",
            "--secret-file",
            &secret,
        ]),
        None,
    )
    .await?;
    assert_eq!(bad_role.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad_role.stderr).contains("not a role"));
    pool.close().await;
    cluster.stop().await
}
