//! The operator console against real processes. In headless Chromium (Debian's `chromium`):
//! it shows a completed, a recovering and a needs-review workflow in their product states,
//! the recovering step's lease history under technical details, what a workflow's name and
//! input hold as text (never markup), a failed step's reason, and a review form with no
//! outcome chosen in advance whose resolution completes its workflow. Screenshots are kept and
//! their paths printed. Through its API, signed in as different people: the workflow list
//! filtered by state and name, searched by id or client key, and paged; a cancel only an
//! operator may make; a step refused by the destination with the destination's reason.

#![allow(clippy::print_stdout)]

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use headless_chrome::protocol::cdp::Page::CaptureScreenshotFormatOption;
use headless_chrome::{Browser, LaunchOptions, Tab};
use reqwest::StatusCode;
use serde_json::{Value, json};
use z29c_core::Role;
use z29c_proto::v1 as pb;
use z29c_scenarios::apis::Apis;
use z29c_scenarios::cluster::{Cluster, Topology, chain};

fn chromium() -> Result<PathBuf> {
    for p in ["/usr/bin/chromium", "/usr/bin/chromium-browser"] {
        if std::path::Path::new(p).exists() {
            return Ok(p.into());
        }
    }
    bail!("no chromium: install Debian's `chromium` package (scripts/services does)")
}

/// Where screenshots go: `target/z29c-artifacts/`, kept by CI.
fn artifact(name: &str) -> Result<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/z29c-artifacts");
    std::fs::create_dir_all(&dir)?;
    Ok(dir.canonicalize()?.join(name))
}

fn screenshot(tab: &Tab, name: &str) -> Result<()> {
    let png = tab.capture_screenshot(CaptureScreenshotFormatOption::Png, None, None, true)?;
    let path = artifact(name)?;
    std::fs::write(&path, png)?;
    println!("console screenshot: {}", path.display());
    Ok(())
}

fn short_lease(key: &str, route: &str) -> pb::SubmitRequest {
    let mut req = chain(key, route, 1);
    req.steps[0].policy = Some(z29c_scenarios::matrix::policy());
    req
}

/// Waits until `expr` (JavaScript) evaluates to `want` in the page.
fn wait_js(tab: &Tab, expr: &str, want: &Value) -> Result<()> {
    let mut last = None;
    for _ in 0..200 {
        last = tab.evaluate(expr, false)?.value;
        if last.as_ref() == Some(want) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("{expr} is {last:?}, never {want}")
}

/// The `data-` attribute `attr` of every workflow row the page shows, in order.
fn rows(attr: &str) -> String {
    format!("[...document.querySelectorAll('tr.workflow')].map((r) => r.dataset.{attr}).join(' ')")
}

async fn wait_state(cluster: &Cluster, id: &str, want: pb::ProductState) -> Result<()> {
    for _ in 0..300 {
        if cluster.product_state(id).await? == want {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("workflow {id} never reached {want:?}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_shows_product_states_and_a_resolution_in_the_page_completes_the_workflow()
-> Result<()> {
    let chromium = chromium()?;
    let mut cluster = Cluster::start_with(Topology {
        recoveries: 1,
        capability: "opaque",
        ..Topology::default()
    })
    .await?;
    let pool = cluster.db.pool(2).await?;
    let ledger = cluster.ledger_pool().await?;
    let console = cluster
        .add_console(&[cluster.recovery_metrics_url.clone()])
        .await?;
    let client = cluster.client().await?;
    let submit = |req: pb::SubmitRequest| {
        let mut c = client.clone();
        async move {
            anyhow::Ok(
                c.submit(req)
                    .await?
                    .into_inner()
                    .workflow
                    .context("no workflow")?
                    .id,
            )
        }
    };

    // completed, its name and input holding what would be markup, were they not text
    let mut marked = chain("console-done", "ok", 2);
    marked.name = "done <b>not bold</b>".into();
    let mut input: Value = serde_json::from_str(&marked.steps[0].input_json)?;
    input["note"] = json!("</pre><i>kept as text</i>");
    marked.steps[0].input_json = input.to_string();
    let done = submit(marked).await?;
    wait_state(&cluster, &done, pb::ProductState::Completed).await?;
    // failed: the destination refuses the request outright
    cluster
        .set_faults("refusing", json!({ "refuse_status": 400 }))
        .await?;
    let failed = submit(chain("console-failed", "refusing", 1)).await?;
    wait_state(&cluster, &failed, pb::ProductState::Failed).await?;
    // needs review: the destination commits but its answer is lost, at an opaque adapter
    cluster
        .set_faults("flaky", json!({ "drop_response": true }))
        .await?;
    let review = submit(short_lease("console-review", "flaky")).await?;
    wait_state(&cluster, &review, pb::ProductState::NeedsReview).await?;
    // recovering: the worker freezes mid-call and recovery is not there yet to decide
    cluster.process("recovery-1").context("recovery")?.pause()?;
    cluster
        .set_faults("slow", json!({ "answer_delay_ms": 5000 }))
        .await?;
    let recovering = submit(short_lease("console-recovering", "slow")).await?;
    for i in 0.. {
        let began: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM attempts WHERE workflow_id = $1::text::uuid
             AND checkpoint >= 'invocation_began'",
        )
        .bind(&recovering)
        .fetch_one(&pool)
        .await?;
        if began > 0 {
            break;
        }
        if i > 200 {
            bail!("the slow call never began");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cluster.process("executor-1").context("executor")?.pause()?;
    wait_state(&cluster, &recovering, pb::ProductState::RecoveringExecution).await?;

    let page = {
        let (console, done, review, recovering, failed) = (
            console.clone(),
            done.clone(),
            review.clone(),
            recovering.clone(),
            failed.clone(),
        );
        tokio::task::spawn_blocking(move || -> Result<(Browser, std::sync::Arc<Tab>)> {
            let browser = Browser::new(
                LaunchOptions::default_builder()
                    .path(Some(chromium))
                    .headless(true)
                    .sandbox(false)
                    .window_size(Some((1280, 1000)))
                    .idle_browser_timeout(Duration::from_secs(120))
                    .build()?,
            )?;
            let tab = browser.new_tab()?;
            tab.set_default_timeout(Duration::from_secs(20));
            tab.navigate_to(&format!("{console}/"))?
                .wait_until_navigated()?;
            for (id, state, label) in [
                (&done, "completed", "Completed"),
                (&review, "needs_review", "Delivery status needs review"),
                (&recovering, "recovering_execution", "Recovering execution"),
                (&failed, "failed", "Failed"),
            ] {
                let row = tab
                    .wait_for_element(&format!(
                        r#"tr.workflow[data-id="{id}"][data-state="{state}"]"#
                    ))
                    .with_context(|| format!("no {state} row for {id}"))?;
                let text = row.get_inner_text()?;
                assert!(
                    text.contains(label),
                    "row of {id} says {text:?}, not {label:?}"
                );
            }
            let name = tab
                .find_element(&format!(r#"tr.workflow[data-id="{done}"] a"#))?
                .get_inner_text()?;
            assert_eq!(name, "done <b>not bold</b>", "a name is text");
            assert!(
                tab.find_element(&format!(r#"tr.workflow[data-id="{done}"] a b"#))
                    .is_err()
            );
            // the four metric levels
            for level in ["workflow", "step", "attempt", "lease"] {
                tab.wait_for_element(&format!(r#".level[data-level="{level}"]"#))?;
            }
            screenshot(&tab, "console-workflows.png")?;

            // the filter: failed ones only, then one found by its client key
            tab.wait_for_element(r#"form.filter input[name="state"][value="failed"]"#)?
                .click()?;
            tab.wait_for_element("form.filter button")?.click()?;
            wait_js(&tab, &rows("id"), &json!(failed))?;
            assert_eq!(
                tab.evaluate("location.hash", false)?.value,
                Some(json!("#/?state=failed"))
            );
            screenshot(&tab, "console-filtered.png")?;
            tab.wait_for_element(r#"form.filter input[name="state"][value="failed"]"#)?
                .click()?;
            tab.wait_for_element(r#"form.filter input[name="search"]"#)?
                .click()?
                .type_into("console-review")?;
            tab.press_key("Enter")?;
            wait_js(&tab, &rows("id"), &json!(review))?;
            tab.wait_for_element(r#"form.filter a[data-page="clear"]"#)?
                .click()?;
            wait_js(
                &tab,
                &format!("{}.split(' ').length", rows("id")),
                &json!(4),
            )?;

            // the recovering workflow: one step, its takeover only under technical details
            tab.evaluate(&format!("location.hash = '#/workflow/{recovering}'"), false)?;
            let step = r#".step[data-state="recovering_execution"]"#;
            let timeline = tab
                .wait_for_element(&format!("{step} ol.timeline"))?
                .get_inner_text()?;
            assert!(
                timeline.contains("Waiting on an external service"),
                "{timeline}"
            );
            assert!(timeline.contains("Recovering execution"), "{timeline}");
            assert_eq!(tab.find_elements(".step")?.len(), 1, "one step, one item");
            tab.wait_for_element(&format!("{step} details.technical summary"))?
                .click()?;
            let technical = tab
                .wait_for_element(&format!("{step} details.technical[open]"))?
                .get_inner_text()?;
            for want in [
                "Lease history",
                "lease_acquired",
                "executor-1",
                "invocation_began",
            ] {
                assert!(
                    technical.contains(want),
                    "technical details lack {want:?}: {technical}"
                );
            }
            screenshot(&tab, "console-recovering-workflow.png")?;
            Ok((browser, tab))
        })
        .await??
    };
    let (browser, tab) = page;

    // the person checks the destination, finds the effect, and says so in the page
    cluster
        .process("recovery-1")
        .context("recovery")?
        .resume()?;
    let reference: String = sqlx::query_scalar(
        "SELECT reference FROM destination.ledger WHERE idempotency_key LIKE '%' || $1 || '%'",
    )
    .bind(&review)
    .fetch_one(&ledger)
    .await?;
    {
        let (review, reference, tab) = (review.clone(), reference.clone(), tab.clone());
        tokio::task::spawn_blocking(move || -> Result<()> {
            tab.evaluate("location.hash = '#/review'", false)?;
            let at = format!(r#".review-item[data-workflow="{review}"]"#);
            let item = tab.wait_for_element(&at)?;
            // nothing is chosen for the person: no outcome checked, no option selected
            assert_eq!(
                item.find_elements(r#"input[name="resolution"]"#)?.len(),
                3
            );
            wait_js(
                &tab,
                &format!(
                    r#"document.querySelectorAll('{at} input:checked, {at} option').length"#
                ),
                &json!(0),
            )?;
            let reason = item.find_element(r#"input[name="reason"]"#)?;
            reason
                .click()?
                .type_into("found it in the destination's ledger")?;
            // Enter submits the form the focused field is in, wherever the page has scrolled
            tab.press_key("Enter")?;
            let error = format!("{at} .result.error");
            wait_js(
                &tab,
                &format!("document.querySelector('{error}')?.textContent.startsWith('Choose what happened')"),
                &json!(true),
            )
            .context("a form without an outcome is refused, saying so")?;
            item.find_element(r#"input[name="resolution"][value="succeeded"]"#)?
                .click()?;
            item.find_element(r#"input[name="external_reference"]"#)?
                .click()?
                .type_into(&reference)?;
            let found = json!({ "reference": reference, "seen": "in the ledger" }).to_string();
            let result = format!(r#"{at} textarea[name="result_json"]"#);
            item.find_element(r#"textarea[name="result_json"]"#)?
                .click()?
                .type_into(&found[..found.len() - 1])?;
            reason.click()?;
            tab.press_key("Enter")?;
            wait_js(
                &tab,
                &format!("document.querySelector('{error}')?.textContent.startsWith('The result is not JSON')"),
                &json!(true),
            )
            .context("a result that is not JSON is refused, saying so")?;
            tab.evaluate(&format!("document.querySelector('{result}').value += '}}'"), false)?;
            screenshot(&tab, "console-review-form.png")?;
            reason.click()?;
            tab.press_key("Enter")?;
            tab.wait_for_element(".review-item .result.ok")
                .context("the page did not confirm the resolution")?;
            tab.evaluate("location.hash = '#/'", false)?;
            tab.wait_for_element(&format!(
                r#"tr.workflow[data-id="{review}"][data-state="completed"]"#
            ))
            .context("the resolved workflow is not shown completed")?;
            // recovery answers again: its takeovers and the manual receipt show by level
            tab.wait_for_element(r#"[data-metric="z29c_lease_recoveries_total"]"#)?;
            tab.wait_for_element(
                r#"[data-metric="z29c_step_receipts_total{verification=manual}"]"#,
            )?;
            screenshot(&tab, "console-resolved.png")?;
            Ok(())
        })
        .await??;
    }

    // and it is so, durably: a manual receipt naming the reference, the workflow completed
    let wf = cluster
        .client()
        .await?
        .get(pb::GetRequest {
            workflow_id: review.clone(),
        })
        .await?
        .into_inner();
    assert_eq!(wf.state(), pb::ProductState::Completed);
    let receipt = wf.steps[0].receipt.as_ref().context("no receipt")?;
    assert_eq!(receipt.verification(), pb::Verification::Manual);
    assert_eq!(receipt.external_reference, reference);
    let resolutions: i64 = sqlx::query_scalar("SELECT count(*) FROM review_resolutions")
        .fetch_one(&pool)
        .await?;
    assert_eq!(resolutions, 1, "the resolution is audited once");

    // what each step sent and why one failed, from what the scheduler tells
    tokio::task::spawn_blocking(move || -> Result<()> {
        tab.evaluate(&format!("location.hash = '#/workflow/{failed}'"), false)?;
        let why = tab
            .wait_for_element(r#".step[data-state="failed"] .reason.attention"#)
            .context("a failed step says why, first")?
            .get_inner_text()?;
        assert!(
            why.starts_with("Why it failed:") && why.len() > "Why it failed:".len() + 3,
            "{why}"
        );
        screenshot(&tab, "console-failed-workflow.png")?;
        tab.evaluate(&format!("location.hash = '#/workflow/{done}'"), false)?;
        let sent = tab
            .wait_for_element(r#".step[data-name="s0"] pre.step-input"#)
            .context("a step shows its input")?
            .get_inner_text()?;
        assert!(
            sent.contains(r#""note": "</pre><i>kept as text</i>""#),
            "{sent}"
        );
        assert!(
            tab.find_element("pre.step-input i").is_err(),
            "input is text"
        );
        tab.wait_for_element(r#".step[data-name="s0"] pre.step-result"#)
            .context("a completed step shows its result")?;
        Ok(())
    })
    .await??;
    drop(browser);
    // the result the person pasted is the step's result
    let result: Value = serde_json::from_str(&wf.steps[0].result_json)
        .with_context(|| format!("result_json {:?}", wf.steps[0].result_json))?;
    assert_eq!(result["reference"], json!(reference));
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

const STRIPE_KEY: &str = "sk_test_z29c_4eC39HqLyjWDarjtT1zdp7dc";
const WRONG_KEY: &str = "sk_test_z29c_wrong_0000000000000000";

/// A payments adapter in Stripe's shape whose key the API does not know.
fn payments_with_a_wrong_key(url: &str) -> String {
    format!(
        r#"
[[adapters]]
name = "payments"
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
Authorization = {{ env = "Z29C_TEST_PAYMENTS_KEY", prefix = "Bearer " }}
"#
    )
}

/// `name=value` of each cookie a response sets.
fn cookies(r: &reqwest::Response) -> Vec<String> {
    r.headers()
        .get_all(reqwest::header::SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok()?.split(';').next().map(str::to_owned))
        .collect()
}

/// A person signed in to the console, as their browser holds it: the session cookie and the
/// CSRF token that goes with it.
struct Person {
    http: reqwest::Client,
    console: String,
    cookie: String,
    csrf: String,
}

impl Person {
    async fn sign_in(console: &str, token: &str) -> Result<Self> {
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
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
            .context("the sign-in form carries a CSRF token")?;
        let r = http
            .post(format!("{console}/login"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!("token={token}&csrf={csrf}"))
            .send()
            .await?;
        ensure!(r.status().is_redirection(), "sign-in: {}", r.status());
        let set = cookies(&r);
        let csrf = set
            .iter()
            .find_map(|c| c.strip_prefix("z29c_csrf="))
            .context("a CSRF cookie for the session")?
            .to_owned();
        Ok(Self {
            http,
            console: console.to_owned(),
            cookie: set.join("; "),
            csrf,
        })
    }

    async fn answer(r: reqwest::RequestBuilder) -> Result<(StatusCode, Value)> {
        let r = r.send().await?;
        let status = r.status();
        let text = r.text().await?;
        let body = serde_json::from_str(&text).with_context(|| format!("{status}: {text}"))?;
        Ok((status, body))
    }

    async fn get(&self, path: &str) -> Result<(StatusCode, Value)> {
        Self::answer(
            self.http
                .get(format!("{}{path}", self.console))
                .header("cookie", &self.cookie),
        )
        .await
    }

    /// A form's POST as the page sends it, with the session's CSRF token.
    async fn post(&self, path: &str, body: &Value) -> Result<(StatusCode, Value)> {
        Self::answer(
            self.http
                .post(format!("{}{path}", self.console))
                .header("cookie", &self.cookie)
                .header("x-csrf-token", &self.csrf)
                .json(body),
        )
        .await
    }

    /// The client keys of the workflows `/api/workflows?{query}` lists, sorted.
    async fn listed(&self, query: &str) -> Result<Vec<String>> {
        let (status, page) = self.get(&format!("/api/workflows?{query}")).await?;
        ensure!(status == StatusCode::OK, "{query}: {status} {page}");
        let mut keys: Vec<String> = page["workflows"]
            .as_array()
            .context("workflows")?
            .iter()
            .map(|w| w["client_key"].as_str().unwrap_or_default().to_owned())
            .collect();
        keys.sort();
        Ok(keys)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_filters_searches_and_pages_workflows_cancels_for_operators_only_and_says_why_a_step_failed()
-> Result<()> {
    let apis = Apis::start(STRIPE_KEY).await?;
    let (mut cluster, pool) = Cluster::start_secure("idempotent", &[]).await?;
    cluster
        .add_gateway_serving(
            &payments_with_a_wrong_key(&apis.url),
            &[("Z29C_TEST_PAYMENTS_KEY", WRONG_KEY)],
        )
        .await?;
    let console = cluster.add_console(&[]).await?;
    let mut client = cluster.client().await?;
    // the destination keeps the waiting step's requests coming back "not now": nothing sent
    cluster
        .set_faults("busy", json!({ "rate_limit_ms": 60_000 }))
        .await?;
    let mut refused = chain("refused", "charges", 1);
    refused.name = "charge".into();
    refused.steps[0].adapter = "payments".into();
    refused.steps[0].input_json = json!({ "amount": 900, "currency": "eur" }).to_string();
    let mut ids = std::collections::HashMap::new();
    for req in [
        chain("done-1", "ok", 1),
        chain("done-2", "ok", 1),
        refused,
        chain("waiting", "busy", 2),
    ] {
        let key = req.client_key.clone();
        let w = client
            .submit(req)
            .await?
            .into_inner()
            .workflow
            .context("workflow")?;
        ids.insert(key, w.id);
    }
    for (key, want) in [
        ("done-1", pb::ProductState::Completed),
        ("done-2", pb::ProductState::Completed),
        ("refused", pb::ProductState::Failed),
        ("waiting", pb::ProductState::WaitingOnExternalService),
    ] {
        wait_state(&cluster, &ids[key], want).await?;
    }

    let viewer = Person::sign_in(&console, &cluster.token("vic", &[Role::Viewer])?).await?;
    let operator = Person::sign_in(&console, &cluster.token("olga", &[Role::Operator])?).await?;

    // filtered by state (one, or several), by name, searched by client key or id
    assert_eq!(viewer.listed("state=failed").await?, ["refused"]);
    assert_eq!(
        viewer.listed("state=completed&state=failed").await?,
        ["done-1", "done-2", "refused"]
    );
    assert_eq!(
        viewer
            .listed("state=waiting_on_external_service,failed")
            .await?,
        ["refused", "waiting"]
    );
    assert_eq!(viewer.listed("name=scenario%20done-1").await?, ["done-1"]);
    assert_eq!(viewer.listed("search=done-2").await?, ["done-2"]);
    assert_eq!(
        viewer.listed(&format!("search={}", ids["done-1"])).await?,
        ["done-1"]
    );
    assert!(
        viewer.listed("search=done").await?.is_empty(),
        "exact, not a prefix"
    );
    assert_eq!(viewer.listed("").await?.len(), 4);
    let (status, body) = viewer.get("/api/workflows?state=done").await?;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("state:")),
        "{body}"
    );

    // a page at a time: every workflow once, the last page saying so
    let mut seen = Vec::new();
    let mut token = String::new();
    for _ in 0..10 {
        let (status, page) = viewer
            .get(&format!("/api/workflows?page_size=1&page_token={token}"))
            .await?;
        assert_eq!(status, StatusCode::OK, "{page}");
        let rows = page["workflows"].as_array().context("workflows")?;
        assert!(rows.len() <= 1, "{page}");
        seen.extend(
            rows.iter()
                .map(|w| w["client_key"].as_str().unwrap_or("").to_owned()),
        );
        token = page["next_page_token"].as_str().unwrap_or("").to_owned();
        if token.is_empty() {
            break;
        }
    }
    seen.sort();
    assert_eq!(seen, ["done-1", "done-2", "refused", "waiting"]);

    // cancelling: offered to an operator, refused to a viewer by the scheduler, with a reason
    let (_, me) = viewer.get("/api/me").await?;
    assert_eq!(
        (me["subject"].as_str(), me["may_cancel"].as_bool()),
        (Some("vic"), Some(false))
    );
    let (_, me) = operator.get("/api/me").await?;
    assert_eq!(
        (me["may_cancel"].as_bool(), me["may_resolve"].as_bool()),
        (Some(true), Some(false))
    );
    let cancel = format!("/api/workflows/{}/cancel", ids["waiting"]);
    let why = json!({ "reason": "the customer withdrew the order" });
    let (status, body) = viewer.post(&cancel, &why).await?;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert!(
        body["code"] == "PERMISSION_DENIED"
            && body["error"]
                .as_str()
                .is_some_and(|e| e.contains("operator")),
        "{body}"
    );
    assert_eq!(
        cluster.product_state(&ids["waiting"]).await?,
        pb::ProductState::WaitingOnExternalService,
        "a viewer's cancel changes nothing"
    );
    let forged = operator
        .http
        .post(format!("{console}{cancel}"))
        .header("cookie", &operator.cookie)
        .json(&why)
        .send()
        .await?;
    assert_eq!(forged.status(), StatusCode::FORBIDDEN, "no CSRF token");
    let (status, body) = operator.post(&cancel, &json!({ "reason": "  " })).await?;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("reason:")),
        "{body}"
    );
    let (status, body) = operator.post(&cancel, &why).await?;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        (body["state"].as_str(), body["cancellable"].as_bool()),
        (Some("cancelled"), Some(false))
    );
    assert_eq!(
        cluster.product_state(&ids["waiting"]).await?,
        pb::ProductState::Cancelled
    );
    let (status, body) = operator
        .post(&format!("/api/workflows/{}/cancel", ids["done-1"]), &why)
        .await?;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "a completed workflow stays so: {body}"
    );
    // the scheduler decided, and audited both: the viewer's refusal, the operator's cancel
    let wanted = [
        ("permission_denied".to_owned(), Some("vic".to_owned())),
        ("allowed".to_owned(), Some("olga".to_owned())),
    ];
    let mut audited: Vec<(String, Option<String>)> = Vec::new();
    for _ in 0..100 {
        audited = sqlx::query_as(
            "SELECT outcome, subject FROM audit_log WHERE method = 'Cancel' ORDER BY id",
        )
        .fetch_all(&pool)
        .await?;
        if audited.len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(audited.get(..2), Some(&wanted[..]), "{audited:?}");
    assert_eq!(viewer.listed("state=cancelled").await?, ["waiting"]);

    // a resolution the person did not choose, or whose result is not JSON, is refused
    let resolve = format!("/api/reviews/{}/resolve", ids["refused"]);
    let (status, body) = operator
        .post(
            &resolve,
            &json!({ "expected_version": 1, "reason": "checked" }),
        )
        .await?;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("resolution: choose")),
        "{body}"
    );
    let (status, body) = operator
        .post(
            &resolve,
            &json!({ "expected_version": 1, "reason": "checked", "resolution": "succeeded",
                     "external_reference": "ch_9", "result_json": "{\"id\": " }),
        )
        .await?;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("not JSON")),
        "{body}"
    );

    // the refused charge: sent once, failed, and the page says why in the API's words
    let (status, w) = viewer
        .get(&format!("/api/workflows/{}", ids["refused"]))
        .await?;
    assert_eq!(status, StatusCode::OK, "{w}");
    let step = &w["step_views"][0];
    assert_eq!(step["state"], "failed", "{step}");
    assert_eq!(
        apis.received("stripe").len(),
        1,
        "a refusal is not sent again"
    );
    assert!(apis.effects("stripe").is_empty());
    assert!(
        step["reason"]
            .as_str()
            .is_some_and(|r| r.contains("Invalid API Key provided")),
        "the API's reason: {step}"
    );
    assert_eq!(step["attention"], true, "{step}");
    assert!(
        step["input"]
            .as_str()
            .is_some_and(|i| i.contains("\"amount\": 900")),
        "the input, indented: {step}"
    );
    let (_, w) = viewer
        .get(&format!("/api/workflows/{}", ids["waiting"]))
        .await?;
    assert!(
        w["reason"]
            .as_str()
            .is_some_and(|r| r.contains("the customer withdrew the order")),
        "the operator's reason: {w}"
    );
    pool.close().await;
    cluster.stop().await
}
