//! What the outside world recorded is the judge. Each scenario runs real processes against
//! the destination, whose records live in a database of its own, lets a person resolve what
//! went to review from those records, and ends with the checker counting effects per step
//! there: a step that may have had an effect never ends Failed or Cancelled without proof or
//! review, a completed step has exactly the one effect its receipt names, and an opaque
//! request reaches the destination once.
//!
//! Each scenario also runs on a deliberately broken build (`Z29C_FAULT_BREAK`), which the
//! checker must find guilty: a checker that passes everything would pass these too.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::json;
use sqlx::PgPool;
use z29c_core::AdapterCapability;
use z29c_proto::v1::{self as pb};
use z29c_scenarios::cluster::{Cluster, Topology, chain};
use z29c_scenarios::history::{Expect, History, Invariant, Violation};
use z29c_store::faults::Break;

fn policy(max_attempts: u32) -> pb::LeasePolicy {
    pb::LeasePolicy {
        lease_ms: 1_500,
        renew_every_ms: 500,
        attempt_deadline_ms: 8_000,
        final_grace_ms: 500,
        adapter_timeout_ms: 1_000,
        max_attempts,
        ..Default::default()
    }
}

/// A cluster whose every process runs as `broken` (none: the real build).
async fn start(mut t: Topology, broken: Option<Break>) -> Result<Cluster> {
    if let Some(b) = broken {
        t.env.push(("Z29C_FAULT_BREAK".into(), b.to_string()));
    }
    Cluster::start_with(t).await
}

async fn submit(cluster: &Cluster, mut req: pb::SubmitRequest) -> Result<String> {
    let mut client = cluster.client().await?;
    for s in &mut req.steps {
        s.adapter = "http".into();
    }
    Ok(client
        .submit(req)
        .await?
        .into_inner()
        .workflow
        .context("submit answered no workflow")?
        .id)
}

async fn count(pool: &PgPool, sql: &'static str) -> Result<i64> {
    Ok(sqlx::query_scalar(sql).fetch_one(pool).await?)
}

async fn wait_for(pool: &PgPool, sql: &'static str, what: &str, within: Duration) -> Result<()> {
    let start = Instant::now();
    while count(pool, sql).await? == 0 {
        if start.elapsed() > within {
            bail!("waited {within:?} for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// How a scenario ended.
#[derive(Debug)]
struct Ended {
    /// The workflow's state before anyone resolved a review item.
    before_review: pb::ProductState,
    /// After a person resolved what was in review, from the destination's records.
    after_review: pb::ProductState,
    violations: Vec<Violation>,
    cluster: Cluster,
}

impl Ended {
    fn broke(&self, invariant: Invariant) -> bool {
        self.violations.iter().any(|v| v.invariant == invariant)
    }
}

/// Waits for the workflow to end, lets a person resolve its review items, and judges the run
/// on both records, every step required to complete.
async fn judge(
    cluster: Cluster,
    id: &str,
    capability: AdapterCapability,
    steps: usize,
) -> Result<Ended> {
    judge_all(cluster, &[id.to_owned()], capability, steps, 16).await
}

/// [`judge`] over several workflows (the state reported is the first's), under the adapter's
/// `permit_limit`.
async fn judge_all(
    cluster: Cluster,
    ids: &[String],
    capability: AdapterCapability,
    steps: usize,
    permit_limit: i64,
) -> Result<Ended> {
    cluster.wait_all_ended(ids, Duration::from_secs(60)).await?;
    let before_review = cluster.product_state(&ids[0]).await?;
    if cluster.resolve_reviews_from_ledger().await? > 0 {
        cluster.wait_all_ended(ids, Duration::from_secs(60)).await?;
    }
    let after_review = cluster.product_state(&ids[0]).await?;
    let pool = cluster.db.pool(2).await?;
    let ledger = cluster.ledger_pool().await?;
    let history = History::load(&pool, &ledger).await?;
    let violations = history.check(&Expect {
        capabilities: [("http".to_owned(), capability)].into(),
        permit_limit,
        min_completed: steps,
    });
    pool.close().await;
    ledger.close().await;
    Ok(Ended {
        before_review,
        after_review,
        violations,
        cluster,
    })
}

/// A destination that answers `409 Conflict` to a same-key request while the first is still
/// being processed. The first request commits its effect after 2.5 s; the retries meet 409s
/// until then and a replay of the one effect after.
async fn conflict_in_flight(broken: Option<Break>) -> Result<Ended> {
    let cluster = start(
        Topology {
            recoveries: 1,
            ..Topology::default()
        },
        broken,
    )
    .await?;
    let ledger = cluster.ledger_pool().await?;
    cluster
        .set_faults(
            "charge",
            json!({ "delay_ms": 2_500, "conflict_in_flight": true }),
        )
        .await?;
    let mut req = chain("in-flight", "charge", 2);
    for s in &mut req.steps {
        s.policy = Some(policy(12));
    }
    let id = submit(&cluster, req).await?;
    wait_for(
        &ledger,
        "SELECT count(*) FROM destination.requests",
        "the first request",
        Duration::from_secs(20),
    )
    .await?;
    // only the first request is slow; the 409s come while it is in flight
    cluster
        .set_faults("charge", json!({ "conflict_in_flight": true }))
        .await?;
    // the first request's effect commits whatever z29c decided meanwhile
    wait_for(
        &ledger,
        "SELECT count(*) FROM destination.ledger",
        "the first request's effect",
        Duration::from_secs(20),
    )
    .await?;
    let conflicts = count(
        &ledger,
        "SELECT count(*) FROM destination.requests WHERE refused = 'in_flight'",
    )
    .await?;
    assert!(conflicts >= 1, "the destination never answered 409");
    ledger.close().await;
    judge(cluster, &id, AdapterCapability::Idempotent, 2).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_409_for_a_request_still_in_flight_is_unknown_not_a_refusal() -> Result<()> {
    let ended = conflict_in_flight(None).await?;
    assert_eq!(
        ended.before_review,
        pb::ProductState::Completed,
        "a 409 while in flight must not fail the step"
    );
    assert!(ended.violations.is_empty(), "{:#?}", ended.violations);
    ended.cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checker_catches_a_build_that_reads_a_409_as_a_refusal() -> Result<()> {
    let ended = conflict_in_flight(Some(Break::ConflictRefused)).await?;
    assert_eq!(ended.before_review, pb::ProductState::Failed);
    assert!(
        ended.broke(Invariant::EffectMatchesEnd),
        "{:#?}",
        ended.violations
    );
    ended.cluster.stop().await
}

/// Attempt 1 reaches the destination and its answer is lost; recovery retries with the same
/// key; attempt 2 dies right after its identity is persisted, with no attempts left. Attempt
/// 1's effect is in the ledger, so the step may not end Failed.
async fn later_attempt_dies_unsent(broken: Option<Break>) -> Result<Ended> {
    let mut cluster = start(
        Topology {
            executors: 0,
            recoveries: 1,
            ..Topology::default()
        },
        broken,
    )
    .await?;
    let pool = cluster.db.pool(2).await?;
    let ledger = cluster.ledger_pool().await?;
    cluster
        .set_faults("charge", json!({ "drop_response": true }))
        .await?;
    cluster
        .add_executor_with(&[("Z29C_WORKERS", "1"), ("Z29C_CLAIM_BATCH", "1")])
        .await?;
    let mut req = chain("forgotten", "charge", 1);
    req.steps[0].policy = Some(policy(2));
    let id = submit(&cluster, req).await?;
    wait_for(
        &ledger,
        "SELECT count(*) FROM destination.ledger",
        "attempt 1's effect",
        Duration::from_secs(20),
    )
    .await?;
    // attempt 1's worker dies holding the call; the next worker dies unsent
    cluster
        .process("executor-1")
        .context("executor-1")?
        .kill()
        .await?;
    cluster
        .add_executor_with(&[
            ("Z29C_FAULT_CRASH", "after_request_identity_persisted"),
            ("Z29C_WORKERS", "1"),
            ("Z29C_CLAIM_BATCH", "1"),
        ])
        .await?;
    cluster
        .wait_exited("executor-2", Duration::from_secs(30))
        .await?;
    cluster
        .wait_all_ended(std::slice::from_ref(&id), Duration::from_secs(60))
        .await?;
    let attempts = count(&pool, "SELECT count(*) FROM attempts").await?;
    assert_eq!(attempts, 2, "attempt 1 sent, attempt 2 died unsent");
    pool.close().await;
    ledger.close().await;
    judge(cluster, &id, AdapterCapability::Idempotent, 1).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_attempts_request_is_not_forgotten_when_a_later_attempt_dies_unsent()
-> Result<()> {
    let ended = later_attempt_dies_unsent(None).await?;
    assert_eq!(
        ended.before_review,
        pb::ProductState::NeedsReview,
        "attempt 1 may have had an effect: review, never Failed"
    );
    assert_eq!(ended.after_review, pb::ProductState::Completed);
    assert!(ended.violations.is_empty(), "{:#?}", ended.violations);
    ended.cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checker_catches_a_build_that_asks_only_the_current_attempt_before_failing()
-> Result<()> {
    let ended = later_attempt_dies_unsent(Some(Break::CurrentAttemptOnly)).await?;
    assert_eq!(ended.before_review, pb::ProductState::Failed);
    assert!(
        ended.broke(Invariant::EffectMatchesEnd),
        "{:#?}",
        ended.violations
    );
    ended.cluster.stop().await
}

/// With one permit, attempt 1's answer comes after the adapter timeout (unknown: its permit is
/// held for the safety window); later attempts find no permit and are released; the
/// workflow's deadline passes. Attempt 1's effect is in the ledger, so the step may not end
/// Cancelled.
async fn deadline_while_permit_held(broken: Option<Break>) -> Result<Ended> {
    let cluster = start(
        Topology {
            recoveries: 1,
            permit_limit: 1,
            ..Topology::default()
        },
        broken,
    )
    .await?;
    let pool = cluster.db.pool(2).await?;
    cluster
        .set_faults("charge", json!({ "answer_delay_ms": 3_000 }))
        .await?;
    let mut req = chain("deadline", "charge", 1);
    req.steps[0].policy = Some(policy(6));
    let deadline = chrono::Utc::now() + chrono::Duration::milliseconds(5_000);
    req.deadline = Some(prost_types::Timestamp {
        seconds: deadline.timestamp(),
        nanos: deadline.timestamp_subsec_nanos() as i32,
    });
    let id = submit(&cluster, req).await?;
    cluster
        .wait_all_ended(std::slice::from_ref(&id), Duration::from_secs(60))
        .await?;
    let unsent = count(
        &pool,
        "SELECT count(*) FROM attempts WHERE number > 1 AND state = 'released'",
    )
    .await?;
    assert!(
        unsent >= 1,
        "no later attempt was released without a permit"
    );
    pool.close().await;
    judge(cluster, &id, AdapterCapability::Idempotent, 1).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_does_not_cancel_a_step_whose_earlier_attempt_may_have_sent() -> Result<()> {
    let ended = deadline_while_permit_held(None).await?;
    assert_eq!(
        ended.before_review,
        pb::ProductState::NeedsReview,
        "attempt 1 may have had an effect: review, never Cancelled"
    );
    assert!(ended.violations.is_empty(), "{:#?}", ended.violations);
    ended.cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checker_catches_a_build_that_cancels_on_the_current_attempt_alone() -> Result<()> {
    let ended = deadline_while_permit_held(Some(Break::CurrentAttemptOnly)).await?;
    assert_eq!(ended.before_review, pb::ProductState::Cancelled);
    assert!(
        ended.broke(Invariant::EffectMatchesEnd),
        "{:#?}",
        ended.violations
    );
    ended.cluster.stop().await
}

/// The first request's answer is lost; the destination then answers normally. Recovery
/// retries an idempotent step under the same key, which the destination de-duplicates; an
/// opaque one goes to review.
async fn first_answer_lost(capability: &'static str, broken: Option<Break>) -> Result<Ended> {
    let cluster = start(
        Topology {
            recoveries: 1,
            capability,
            ..Topology::default()
        },
        broken,
    )
    .await?;
    let ledger = cluster.ledger_pool().await?;
    cluster
        .set_faults("charge", json!({ "drop_response": true }))
        .await?;
    let mut req = chain("lost", "charge", 1);
    req.steps[0].policy = Some(policy(4));
    let id = submit(&cluster, req).await?;
    wait_for(
        &ledger,
        "SELECT count(*) FROM destination.ledger",
        "the first effect",
        Duration::from_secs(20),
    )
    .await?;
    cluster.set_faults("charge", json!({})).await?;
    ledger.close().await;
    let capability = capability.parse().map_err(anyhow::Error::msg)?;
    judge(cluster, &id, capability, 1).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_answer_is_retried_under_the_same_key_or_reviewed() -> Result<()> {
    let idempotent = first_answer_lost("idempotent", None).await?;
    assert_eq!(idempotent.before_review, pb::ProductState::Completed);
    assert!(
        idempotent.violations.is_empty(),
        "{:#?}",
        idempotent.violations
    );
    idempotent.cluster.stop().await?;
    let opaque = first_answer_lost("opaque", None).await?;
    assert_eq!(opaque.before_review, pb::ProductState::NeedsReview);
    assert_eq!(opaque.after_review, pb::ProductState::Completed);
    assert!(opaque.violations.is_empty(), "{:#?}", opaque.violations);
    opaque.cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checker_catches_a_build_that_gives_each_retry_a_new_identity() -> Result<()> {
    let ended = first_answer_lost("idempotent", Some(Break::NewIdentityPerRetry)).await?;
    assert!(
        ended.broke(Invariant::EffectMatchesEnd),
        "{:#?}",
        ended.violations
    );
    ended.cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checker_catches_a_build_that_retries_an_opaque_request() -> Result<()> {
    let ended = first_answer_lost("opaque", Some(Break::OpaqueRetried)).await?;
    assert!(
        ended.broke(Invariant::OpaqueSentOnce),
        "{:#?}",
        ended.violations
    );
    ended.cluster.stop().await
}

/// The worker holding the call is stopped right after the gateway passed it the answer, and
/// stays stopped past its lease. The gateway recorded *response observed* before it replied,
/// so recovery completes the step from that record at expiry, whatever the capability, with
/// the reference the destination gave; the worker's own answer, when it wakes, is only
/// evidence that agrees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_whose_worker_is_stopped_is_recorded_by_the_gateway() -> Result<()> {
    for capability in ["idempotent", "queryable", "opaque"] {
        let mut cluster = start(
            Topology {
                executors: 0,
                recoveries: 1,
                capability,
                ..Topology::default()
            },
            None,
        )
        .await?;
        cluster
            .add_executor_with(&[("Z29C_FAULT_STALL_AFTER_RESPONSE_MS", "3000")])
            .await?;
        let mut req = chain("stopped", "charge", 1);
        req.steps[0].policy = Some(policy(4));
        let id = submit(&cluster, req).await?;
        cluster
            .wait_for_log(
                "executor-1",
                "fault: stalling after the response",
                Duration::from_secs(20),
            )
            .await
            .with_context(|| format!("{capability}: the worker never held an answer"))?;
        cluster
            .process("executor-1")
            .context("executor-1")?
            .pause()?;
        cluster
            .wait_all_ended(std::slice::from_ref(&id), Duration::from_secs(60))
            .await?;
        cluster
            .process("executor-1")
            .context("executor-1")?
            .resume()?;
        let pool = cluster.db.pool(2).await?;
        let ledger = cluster.ledger_pool().await?;
        let (verification, reference): (String, String) =
            sqlx::query_as("SELECT verification::text, external_reference FROM step_receipts")
                .fetch_one(&pool)
                .await?;
        let effect: String = sqlx::query_scalar("SELECT reference FROM destination.ledger")
            .fetch_one(&ledger)
            .await?;
        assert_eq!(
            (verification.as_str(), reference.as_str()),
            ("late_evidence", effect.as_str()),
            "{capability}: completed by recovery from the gateway's record of the answer"
        );
        pool.close().await;
        ledger.close().await;
        let capability = capability.parse().map_err(anyhow::Error::msg)?;
        let ended = judge(cluster, &id, capability, 1).await?;
        assert_eq!(ended.before_review, pb::ProductState::Completed);
        assert!(ended.violations.is_empty(), "{:#?}", ended.violations);
        ended.cluster.stop().await?;
    }
    Ok(())
}

/// A queryable destination holds the first request, received and unanswered, while the
/// executor that sent it is killed. Recovery's status query hears "still being processed"
/// (`202`), which is not a "no": it asks again each time its recovery lease expires, and
/// completes the step from the answer once the destination lets the request finish. Read as
/// "no such request", it would send the request a second time, and a queryable route never
/// de-duplicates.
async fn queried_while_in_progress(broken: Option<Break>) -> Result<Ended> {
    let mut cluster = start(
        Topology {
            recoveries: 1,
            capability: "queryable",
            env: vec![("Z29C_RECOVERY_LEASE_MS".into(), "1500".into())],
            ..Topology::default()
        },
        broken,
    )
    .await?;
    let pool = cluster.db.pool(2).await?;
    let ledger = cluster.ledger_pool().await?;
    cluster
        .set_faults("charge", json!({ "hold": true }))
        .await?;
    let mut req = chain("in-progress", "charge", 1);
    req.steps[0].policy = Some(policy(4));
    let id = submit(&cluster, req).await?;
    wait_for(
        &ledger,
        "SELECT count(*) FROM destination.requests",
        "the first request",
        Duration::from_secs(20),
    )
    .await?;
    cluster
        .process("executor-1")
        .context("executor-1")?
        .kill()
        .await?;
    cluster.add_executor().await?;
    // hold the request until recovery has asked twice, or (a broken build) sent it again
    let start = Instant::now();
    loop {
        let queries = count(
            &pool,
            "SELECT count(*) FROM recovery_decisions WHERE decision = 'status_query'",
        )
        .await?;
        let requests = count(&ledger, "SELECT count(*) FROM destination.requests").await?;
        if queries >= 2 || requests >= 2 {
            break;
        }
        if start.elapsed() > Duration::from_secs(60) {
            bail!("recovery asked {queries} times and the destination got {requests} requests");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cluster.set_faults("charge", json!({})).await?;
    // the first request's effect commits whatever z29c decided meanwhile
    wait_for(
        &ledger,
        "SELECT count(*) FROM destination.ledger
         WHERE request_id = (SELECT min(id) FROM destination.requests)",
        "the first request's effect",
        Duration::from_secs(20),
    )
    .await?;
    pool.close().await;
    ledger.close().await;
    judge(cluster, &id, AdapterCapability::Queryable, 1).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_still_in_progress_is_asked_about_again_never_sent_again() -> Result<()> {
    let ended = queried_while_in_progress(None).await?;
    assert_eq!(ended.before_review, pb::ProductState::Completed);
    assert!(ended.violations.is_empty(), "{:#?}", ended.violations);
    let pool = ended.cluster.db.pool(2).await?;
    let (unanswered, verification): (i64, String) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM recovery_decisions WHERE decision = 'status_query'),
                (SELECT verification::text FROM step_receipts)",
    )
    .fetch_one(&pool)
    .await?;
    assert!(
        unanswered >= 2,
        "the first status query came while the request was in progress: {unanswered} queries"
    );
    assert_eq!(verification, "status_query");
    let ledger = ended.cluster.ledger_pool().await?;
    let requests = count(
        &ledger,
        "SELECT count(*) FROM destination.requests WHERE refused IS NULL",
    )
    .await?;
    assert_eq!(requests, 1, "the request reached the destination once");
    pool.close().await;
    ledger.close().await;
    ended.cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checker_catches_a_build_that_takes_in_progress_for_never_received() -> Result<()> {
    let ended = queried_while_in_progress(Some(Break::InProgressAsNotFound)).await?;
    assert!(
        ended.broke(Invariant::EffectMatchesEnd),
        "{:#?}",
        ended.violations
    );
    ended.cluster.stop().await
}

/// An opaque call whose answer is lost: recovery cannot ask, so the step goes to review, and
/// the review item shows everything z29c holds for a person to decide from: the attempt that
/// may have sent (with its request identity, which the destination's records name) and
/// recovery's decision with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_review_item_shows_every_attempt_and_decision_z29c_holds() -> Result<()> {
    let cluster = start(
        Topology {
            recoveries: 1,
            capability: "opaque",
            ..Topology::default()
        },
        None,
    )
    .await?;
    let pool = cluster.db.pool(2).await?;
    cluster
        .set_faults("charge", json!({ "drop_response": true }))
        .await?;
    let mut req = chain("evidence", "charge", 1);
    req.steps[0].policy = Some(policy(4));
    let id = submit(&cluster, req).await?;
    wait_for(
        &pool,
        "SELECT count(*) FROM review_items",
        "the review item",
        Duration::from_secs(30),
    )
    .await?;
    cluster.set_faults("charge", json!({})).await?;
    let items = cluster
        .reviews(None)
        .await?
        .list(pb::ListReviewsRequest::default())
        .await?
        .into_inner()
        .items;
    assert_eq!(items.len(), 1, "the opaque step is in review");
    let item = &items[0];
    let evidence = &item.evidence;
    let sent: Vec<_> = evidence
        .iter()
        .filter(|e| e.kind == "attempt" && e.may_have_sent)
        .collect();
    assert_eq!(sent.len(), 1, "one attempt may have sent: {evidence:#?}");
    assert_eq!(sent[0].attempt, 1);
    assert_eq!(sent[0].request_identity, item.request_identity);
    assert!(
        evidence.iter().any(|e| e.kind == "recovery_decision"
            && e.summary.contains("human_review")
            && e.summary.contains("cannot say")),
        "recovery's decision and its reason: {evidence:#?}"
    );
    // oldest first
    let times: Vec<_> = evidence
        .iter()
        .map(|e| e.at.as_ref().map(|t| (t.seconds, t.nanos)))
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    pool.close().await;
    let ended = judge(cluster, &id, AdapterCapability::Opaque, 1).await?;
    assert_eq!(ended.before_review, pb::ProductState::NeedsReview);
    assert_eq!(ended.after_review, pb::ProductState::Completed);
    assert!(ended.violations.is_empty(), "{:#?}", ended.violations);
    ended.cluster.stop().await
}

/// The adapter allows two calls at once. Two executors, each with workers to spare, run
/// twelve steps whose requests the destination takes 400 ms to process; the destination,
/// which records when each request arrived and when it was done with it, must never have
/// been processing more than two at once.
async fn permit_limit_under_load(broken: Option<Break>) -> Result<Ended> {
    let cluster = start(
        Topology {
            executors: 2,
            recoveries: 1,
            permit_limit: 2,
            ..Topology::default()
        },
        broken,
    )
    .await?;
    cluster
        .set_faults("charge", json!({ "delay_ms": 400 }))
        .await?;
    let mut ids = Vec::new();
    for i in 0..12 {
        ids.push(submit(&cluster, chain(&format!("limit-{i}"), "charge", 1)).await?);
    }
    judge_all(cluster, &ids, AdapterCapability::Idempotent, 12, 2).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_destination_never_processes_more_calls_at_once_than_the_permit_limit() -> Result<()> {
    let ended = permit_limit_under_load(None).await?;
    assert!(ended.violations.is_empty(), "{:#?}", ended.violations);
    ended.cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checker_catches_a_build_that_ignores_the_permit_limit() -> Result<()> {
    let ended = permit_limit_under_load(Some(Break::PermitLimitIgnored)).await?;
    assert!(
        ended
            .violations
            .iter()
            .any(|v| v.invariant == Invariant::PermitLimitHeld
                && v.detail.contains("the destination")),
        "the destination's own count: {:#?}",
        ended.violations
    );
    ended.cluster.stop().await
}

/// What became of an answer that arrived after its attempt's lease had moved on.
struct LateAnswer {
    ended: Ended,
    /// The effect's reference, as the destination's ledger has it.
    effect: String,
    /// The references among the step's late observations.
    kept: Vec<String>,
    /// The references the step's review items showed, if it had any.
    shown: Vec<String>,
}

/// A call longer than its lease, whose worker stops renewing. The destination takes 6 s to
/// process the request; the worker is stopped (SIGSTOP) once the request has arrived, so its
/// 1.5 s lease runs out and recovery has the step long before the answer comes. The gateway
/// still holds the call: it keeps the answer, with the effect's reference, as a late
/// observation, and recovery, which waits while the gateway holds the call's permit, completes
/// the step from it, whatever the adapter's capability: no person is asked, and nothing is
/// sent again.
async fn answer_after_the_lease(
    capability: &'static str,
    broken: Option<Break>,
) -> Result<LateAnswer> {
    let mut cluster = start(
        Topology {
            executors: 0,
            recoveries: 1,
            capability,
            env: vec![("Z29C_RECOVERY_LEASE_MS".into(), "1500".into())],
            ..Topology::default()
        },
        broken,
    )
    .await?;
    cluster.add_executor_with(&[]).await?;
    cluster
        .set_faults("charge", json!({ "delay_ms": 6_000 }))
        .await?;
    let pool = cluster.db.pool(2).await?;
    let ledger = cluster.ledger_pool().await?;
    let mut req = chain("after-lease", "charge", 1);
    req.steps[0].policy = Some(pb::LeasePolicy {
        adapter_timeout_ms: 10_000,
        attempt_deadline_ms: 14_000,
        ..policy(4)
    });
    let id = submit(&cluster, req).await?;
    wait_for(
        &ledger,
        "SELECT count(*) FROM destination.requests",
        "the request to arrive",
        Duration::from_secs(20),
    )
    .await?;
    let worker = cluster.process("executor-1").context("executor-1")?;
    worker.pause()?;
    // the answer is due 6 s after the request arrived; the gateway keeps it late
    let kept_by = Instant::now() + Duration::from_secs(20);
    let mut kept: Vec<String> = Vec::new();
    while kept.is_empty() && Instant::now() < kept_by {
        tokio::time::sleep(Duration::from_millis(100)).await;
        kept = sqlx::query_scalar(
            "SELECT external_reference FROM late_observations WHERE external_reference IS NOT NULL",
        )
        .fetch_all(&pool)
        .await?;
    }
    let effect: String = sqlx::query_scalar("SELECT reference FROM destination.ledger")
        .fetch_one(&ledger)
        .await?;
    // a retry, if recovery decided one, is another worker's to send
    cluster.add_executor_with(&[]).await?;
    cluster
        .wait_all_ended(std::slice::from_ref(&id), Duration::from_secs(60))
        .await?;
    let shown = cluster
        .reviews(None)
        .await?
        .list(pb::ListReviewsRequest::default())
        .await?
        .into_inner()
        .items
        .iter()
        .flat_map(|i| &i.evidence)
        .filter(|e| !e.external_reference.is_empty())
        .map(|e| e.external_reference.clone())
        .collect();
    pool.close().await;
    ledger.close().await;
    let capability_parsed = capability.parse().map_err(anyhow::Error::msg)?;
    let mut ended = judge(cluster, &id, capability_parsed, 1).await?;
    ended
        .cluster
        .process("executor-1")
        .context("executor-1")?
        .resume()?;
    Ok(LateAnswer {
        ended,
        effect,
        kept,
        shown,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_after_the_lease_moved_on_is_kept_with_its_reference() -> Result<()> {
    for capability in ["opaque", "idempotent", "queryable"] {
        let late = answer_after_the_lease(capability, None).await?;
        let ended = &late.ended;
        assert!(
            ended.violations.is_empty(),
            "{capability}: {:#?}",
            ended.violations
        );
        assert_eq!(
            late.kept,
            vec![late.effect.clone()],
            "{capability}: the gateway kept the late answer with the effect's reference"
        );
        assert_eq!(
            ended.before_review,
            pb::ProductState::Completed,
            "{capability}: completed from the late answer, without a person"
        );
        assert!(late.shown.is_empty(), "{capability}: no review item");
        late.ended.cluster.stop().await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scenario_catches_a_build_that_drops_a_late_answer() -> Result<()> {
    let late = answer_after_the_lease("opaque", Some(Break::LateResultDropped)).await?;
    assert_eq!(
        late.ended.before_review,
        pb::ProductState::NeedsReview,
        "with the answer dropped, only a person can say what happened"
    );
    assert!(
        late.kept.is_empty(),
        "the broken build kept {:?}",
        late.kept
    );
    assert!(
        !late.shown.contains(&late.effect),
        "the review item cannot show what was dropped: {:?}",
        late.shown
    );
    late.ended.cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scenario_catches_a_build_that_opens_review_while_the_call_is_in_flight() -> Result<()>
{
    let late = answer_after_the_lease("opaque", Some(Break::ReviewDuringCall)).await?;
    assert_eq!(
        late.ended.before_review,
        pb::ProductState::NeedsReview,
        "the broken build asked a person before the call had answered"
    );
    late.ended.cluster.stop().await
}
