//! The operator console in headless Chromium (Debian's `chromium`), against real processes:
//! it shows a completed, a recovering and a needs-review workflow in their product states,
//! the recovering step's lease history under technical details, and a review item resolved
//! in the page completes its workflow. Screenshots are kept and their paths printed.

#![allow(clippy::print_stdout)]

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use headless_chrome::protocol::cdp::Page::CaptureScreenshotFormatOption;
use headless_chrome::{Browser, LaunchOptions, Tab};
use serde_json::json;
use z29c_proto::v1 as pb;
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

    // completed
    let done = submit(chain("console-done", "ok", 2)).await?;
    wait_state(&cluster, &done, pb::ProductState::Completed).await?;
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
        let (console, done, review, recovering) = (
            console.clone(),
            done.clone(),
            review.clone(),
            recovering.clone(),
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
            // the four metric levels
            for level in ["workflow", "step", "attempt", "lease"] {
                tab.wait_for_element(&format!(r#".level[data-level="{level}"]"#))?;
            }
            screenshot(&tab, "console-workflows.png")?;

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
            let item =
                tab.wait_for_element(&format!(r#".review-item[data-workflow="{review}"]"#))?;
            item.find_element(r#"input[name="external_reference"]"#)?
                .click()?
                .type_into(&reference)?;
            item.find_element(r#"input[name="reason"]"#)?
                .click()?
                .type_into("found it in the destination's ledger")?;
            screenshot(&tab, "console-review-form.png")?;
            // Enter submits the form the focused field is in, wherever the page has scrolled
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
    drop(browser);

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
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}
