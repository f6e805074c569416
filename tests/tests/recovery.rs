//! Recovery across real processes: a lost response makes the outcome unknown, and recovery
//! decides from evidence and the adapter's capability — retry with the same key, ask the
//! destination, or put it in front of a person — never blind repetition.

use std::time::Duration;

use anyhow::{Result, bail};
use serde_json::json;
use sqlx::PgPool;
use z29c_proto::v1::{self as pb};
use z29c_scenarios::cluster::{Cluster, Topology, flaky_workflow};

async fn start(capability: &'static str) -> Result<(Cluster, PgPool, String)> {
    let cluster = Cluster::start_with(Topology {
        recoveries: 2,
        capability,
        ..Topology::default()
    })
    .await?;
    let pool = cluster.db.pool(2).await?;
    cluster
        .set_faults("flaky", json!({ "drop_response": true }))
        .await?;
    let mut client = cluster.client().await?;
    let wf = client
        .submit(flaky_workflow("flaky-1"))
        .await?
        .into_inner()
        .workflow
        .unwrap();
    Ok((cluster, pool, wf.id))
}

async fn wait_for(pool: &PgPool, sql: &'static str, what: &str) -> Result<()> {
    for _ in 0..400 {
        let n: i64 = sqlx::query_scalar(sql).fetch_one(pool).await?;
        if n > 0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("timed out waiting for {what}")
}

/// Every recovery lease version decided by one owner only: two recovery instances never both
/// acted on the same expiry.
async fn decisions_taken_once(pool: &PgPool) -> Result<()> {
    let doubled: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT step_id, lease_version FROM recovery_decisions
                               GROUP BY step_id, lease_version HAVING count(DISTINCT owner) > 1) d",
    )
    .fetch_one(pool)
    .await?;
    assert_eq!(doubled, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_at_an_idempotent_adapter_is_retried_with_the_same_key() -> Result<()> {
    let (cluster, pool, id) = start("idempotent").await?;
    let ledger = cluster.ledger_pool().await?;
    wait_for(
        &pool,
        "SELECT count(*) FROM recovery_decisions WHERE decision = 'retry_same_identity'",
        "a retry decision",
    )
    .await?;
    cluster.set_faults("flaky", json!({})).await?;
    cluster
        .wait_all_ended(std::slice::from_ref(&id), Duration::from_secs(60))
        .await?;

    let (reference, identity, verification): (String, String, String) = sqlx::query_as(
        "SELECT external_reference, request_identity, verification::text FROM step_receipts",
    )
    .fetch_one(&pool)
    .await?;
    assert_eq!(verification, "direct");
    let effects: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT reference, idempotency_key FROM destination.ledger")
            .fetch_all(&ledger)
            .await?;
    assert_eq!(
        effects.len(),
        1,
        "one effect, however many attempts: {effects:?}"
    );
    assert_eq!(effects[0], (reference, Some(identity.clone())));
    let identities: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT request_identity FROM attempts WHERE request_identity IS NOT NULL",
    )
    .fetch_all(&pool)
    .await?;
    assert_eq!(identities, [identity], "every attempt carried the same key");
    let attempts: i64 = sqlx::query_scalar("SELECT count(*) FROM attempts")
        .fetch_one(&pool)
        .await?;
    assert!(attempts >= 2);
    let category: String = sqlx::query_scalar(
        "SELECT category::text FROM recovery_decisions ORDER BY decided_at LIMIT 1",
    )
    .fetch_one(&pool)
    .await?;
    assert_eq!(category, "invoked_idempotent");
    decisions_taken_once(&pool).await?;
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_at_a_queryable_adapter_is_settled_by_a_status_query() -> Result<()> {
    let (cluster, pool, id) = start("queryable").await?;
    let ledger = cluster.ledger_pool().await?;
    cluster
        .wait_all_ended(std::slice::from_ref(&id), Duration::from_secs(60))
        .await?;
    let (reference, verification): (String, String) =
        sqlx::query_as("SELECT external_reference, verification::text FROM step_receipts")
            .fetch_one(&pool)
            .await?;
    assert_eq!(verification, "status_query");
    let effects: Vec<String> = sqlx::query_scalar("SELECT reference FROM destination.ledger")
        .fetch_all(&ledger)
        .await?;
    assert_eq!(
        effects,
        [reference],
        "the effect the destination committed, found, not repeated"
    );
    let attempts: i64 = sqlx::query_scalar("SELECT count(*) FROM attempts")
        .fetch_one(&pool)
        .await?;
    assert_eq!(attempts, 1, "nothing was sent twice");
    // the query took a permit of its own class, for the step's identity, and gave it back
    let queries: Vec<(String, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT p.state, p.release_reason, a.request_identity FROM adapter_permits p
         LEFT JOIN attempts a ON a.request_identity = p.request_identity
         WHERE p.operation_class = 'status_query'",
    )
    .fetch_all(&pool)
    .await?;
    assert!(!queries.is_empty(), "a status query took no permit");
    for (state, reason, identity) in &queries {
        assert_eq!(
            (state.as_str(), reason.as_deref()),
            ("released", Some("queried"))
        );
        assert!(
            identity.is_some(),
            "a query permit names the step's request identity"
        );
    }
    decisions_taken_once(&pool).await?;
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_at_an_opaque_adapter_waits_for_a_person() -> Result<()> {
    let (cluster, pool, id) = start("opaque").await?;
    let ledger = cluster.ledger_pool().await?;
    cluster
        .wait_all_ended(std::slice::from_ref(&id), Duration::from_secs(60))
        .await?;
    let wf = cluster
        .client()
        .await?
        .get(pb::GetRequest { workflow_id: id })
        .await?
        .into_inner();
    assert_eq!(wf.state(), pb::ProductState::NeedsReview);
    assert_eq!(wf.state_label, "Delivery status needs review");
    // it stays there: nothing is retried automatically
    tokio::time::sleep(Duration::from_secs(3)).await;
    let attempts: i64 = sqlx::query_scalar("SELECT count(*) FROM attempts")
        .fetch_one(&pool)
        .await?;
    assert_eq!(attempts, 1);
    let open: i64 = sqlx::query_scalar("SELECT count(*) FROM review_items WHERE state = 'open'")
        .fetch_one(&pool)
        .await?;
    assert_eq!(open, 1);
    let receipts: i64 = sqlx::query_scalar("SELECT count(*) FROM step_receipts")
        .fetch_one(&pool)
        .await?;
    assert_eq!(receipts, 0, "unknown is not a receipt");
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM destination.ledger")
        .fetch_one(&ledger)
        .await?;
    assert_eq!(
        effects, 1,
        "the destination did commit the effect nobody heard about"
    );
    decisions_taken_once(&pool).await?;
    resolve_through_review_service(&cluster, &pool, &ledger).await?;
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

/// A person looks at the destination, finds the effect, and says so: the workflow completes
/// with a receipt verified `manual`, and the resolution is audited. Stale versions and missing
/// reasons are refused without changing anything.
async fn resolve_through_review_service(
    cluster: &Cluster,
    pool: &PgPool,
    ledger: &PgPool,
) -> Result<()> {
    use pb::resolve_request::Resolution;
    use z29c_proto::v1::review_service_client::ReviewServiceClient;
    let mut reviews = ReviewServiceClient::connect(cluster.review_url.clone()).await?;
    let items = reviews
        .list(pb::ListReviewsRequest::default())
        .await?
        .into_inner()
        .items;
    assert_eq!(items.len(), 1);
    let item = &items[0];
    let reference: String = sqlx::query_scalar("SELECT reference FROM destination.ledger")
        .fetch_one(ledger)
        .await?;
    let resolve = |version: i64, reason: &str| {
        let mut req = tonic::Request::new(pb::ResolveRequest {
            item_id: item.id.clone(),
            expected_version: version,
            reason: reason.into(),
            resolution: Some(Resolution::SucceededExternalReference(reference.clone())),
            result_json: String::new(),
        });
        req.metadata_mut()
            .insert("x-z29c-operator", "alice".parse().unwrap());
        req
    };
    let missing_reason = reviews
        .resolve(resolve(item.version, " "))
        .await
        .unwrap_err();
    assert_eq!(missing_reason.code(), tonic::Code::InvalidArgument);
    let stale = reviews
        .resolve(resolve(item.version + 1, "found it in the destination"))
        .await
        .unwrap_err();
    assert_eq!(stale.code(), tonic::Code::FailedPrecondition);
    let resolved = reviews
        .resolve(resolve(item.version, "found it in the destination"))
        .await?
        .into_inner();
    assert_eq!(resolved.state, "resolved");
    let again = reviews
        .resolve(resolve(resolved.version, "twice"))
        .await
        .unwrap_err();
    assert_eq!(
        again.code(),
        tonic::Code::FailedPrecondition,
        "not open any more"
    );

    let (verification, external): (String, String) =
        sqlx::query_as("SELECT verification::text, external_reference FROM step_receipts")
            .fetch_one(pool)
            .await?;
    assert_eq!(
        (verification.as_str(), external.as_str()),
        ("manual", reference.as_str())
    );
    let wf: String = sqlx::query_scalar("SELECT state::text FROM workflows")
        .fetch_one(pool)
        .await?;
    assert_eq!(wf, "completed");
    let audit: Vec<(String, String, String)> =
        sqlx::query_as("SELECT resolved_by, resolution, reason FROM review_resolutions")
            .fetch_all(pool)
            .await?;
    assert_eq!(
        audit,
        [(
            "alice".into(),
            "succeeded".into(),
            "found it in the destination".into()
        )]
    );
    let still_unknown: i64 =
        sqlx::query_scalar("SELECT count(*) FROM adapter_permits WHERE state = 'unknown'")
            .fetch_one(pool)
            .await?;
    assert_eq!(
        still_unknown, 0,
        "the permit held for the unknown outcome was released"
    );
    Ok(())
}

/// The essay's stale worker: worker A gets the destination's answer but stalls before
/// committing; its lease expires; recovery commits the receipt; then A wakes and tries to
/// commit. A is fenced, its observation is kept as late evidence, and the evidence converges
/// (same reference). The gateway recorded the answer (*response observed*) before it replied,
/// so recovery commits from that record and asks the destination nothing: a status query that
/// would contradict the answer is never consulted.
async fn stale_worker(query_reference: Option<&str>) -> Result<(Cluster, PgPool)> {
    let cluster = Cluster::start_with(Topology {
        recoveries: 1,
        capability: "queryable",
        executor_stall_ms: 4_000,
        ..Topology::default()
    })
    .await?;
    let pool = cluster.db.pool(2).await?;
    if let Some(r) = query_reference {
        cluster
            .set_faults("flaky", json!({ "query_reference": r }))
            .await?;
    }
    let mut client = cluster.client().await?;
    let mut req = flaky_workflow("stale-1");
    req.steps[0].policy = Some(pb::LeasePolicy {
        lease_ms: 1_500,
        renew_every_ms: 500,
        attempt_deadline_ms: 10_000,
        final_grace_ms: 500,
        adapter_timeout_ms: 800,
        ..Default::default()
    });
    client.submit(req).await?;
    wait_for(
        &pool,
        "SELECT count(*) FROM late_observations",
        "the stale worker's late result",
    )
    .await?;
    Ok((cluster, pool))
}

/// Both stale-worker runs end the same way, whatever a status query would have said: one
/// effect, a receipt from the gateway's record of the answer, and the stale worker's late
/// observation agreeing with it.
async fn converges(cluster: Cluster, pool: PgPool) -> Result<()> {
    let ledger = cluster.ledger_pool().await?;
    let (reference, verification): (String, String) =
        sqlx::query_as("SELECT external_reference, verification::text FROM step_receipts")
            .fetch_one(&pool)
            .await?;
    assert_eq!(
        verification, "late_evidence",
        "recovery, not the stale worker, committed, from the gateway's record"
    );
    let effect: String = sqlx::query_scalar("SELECT reference FROM destination.ledger")
        .fetch_one(&ledger)
        .await?;
    assert_eq!(reference, effect, "the receipt names the one effect");
    let (late_reference, reason): (String, serde_json::Value) =
        sqlx::query_as("SELECT external_reference, fence_reason FROM late_observations")
            .fetch_one(&pool)
            .await?;
    assert_eq!(late_reference, reference, "the evidence converges");
    assert_eq!(reason["reason"], "receipt_exists");
    let (conflicts, queries): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM integrity_conflicts),
                (SELECT count(*) FROM recovery_decisions WHERE decision = 'status_query')",
    )
    .fetch_one(&pool)
    .await?;
    assert_eq!(
        (conflicts, queries),
        (0, 0),
        "nothing to ask, nothing to contradict"
    );
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_workers_late_success_converges_with_recovery() -> Result<()> {
    let (cluster, pool) = stale_worker(None).await?;
    converges(cluster, pool).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_answer_is_not_second_guessed_by_a_contradicting_status_query() -> Result<()> {
    let (cluster, pool) = stale_worker(Some("dst-someone-else")).await?;
    converges(cluster, pool).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_worker_killed_mid_decision_leaves_nothing_half_done() -> Result<()> {
    let mut cluster = Cluster::start_with(Topology {
        recoveries: 0,
        capability: "queryable",
        ..Topology::default()
    })
    .await?;
    let pool = cluster.db.pool(2).await?;
    let ledger = cluster.ledger_pool().await?;
    // the response is lost, and the status query hangs long enough to kill recovery inside it
    cluster
        .set_faults(
            "flaky",
            json!({ "drop_response": true, "query_delay_ms": 60_000 }),
        )
        .await?;
    let wf = cluster
        .client()
        .await?
        .submit(flaky_workflow("killed-recovery"))
        .await?
        .into_inner()
        .workflow
        .unwrap();
    cluster
        .add_recovery_with(&[("Z29C_RECOVERY_LEASE_MS", "2000")])
        .await?;
    wait_for(
        &pool,
        "SELECT count(*) FROM recovery_decisions WHERE decision = 'status_query'",
        "the first status query",
    )
    .await?;
    cluster
        .process("recovery-1")
        .expect("recovery-1")
        .kill()
        .await?;
    // what the killed worker left: a recorded decision and a recovery lease that will expire
    let (state, owner): (String, Option<String>) =
        sqlx::query_as("SELECT state::text, lease_owner FROM steps")
            .fetch_one(&pool)
            .await?;
    assert_eq!(
        (state.as_str(), owner.as_deref()),
        ("recovering", Some("recovery-1"))
    );
    cluster.set_faults("flaky", json!({})).await?;
    cluster
        .add_recovery_with(&[("Z29C_RECOVERY_LEASE_MS", "2000")])
        .await?;
    cluster
        .wait_all_ended(std::slice::from_ref(&wf.id), Duration::from_secs(60))
        .await?;
    let decisions: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT owner, decision::text, lease_version FROM recovery_decisions ORDER BY decided_at",
    )
    .fetch_all(&pool)
    .await?;
    assert_eq!(decisions[0].0, "recovery-1");
    assert!(
        decisions[1..]
            .iter()
            .all(|d| d.0 == "recovery-2" && d.2 > decisions[0].2),
        "the second worker decided under a newer lease: {decisions:?}"
    );
    let (verification, receipts): (String, i64) =
        sqlx::query_as("SELECT min(verification::text), count(*) FROM step_receipts")
            .fetch_one(&pool)
            .await?;
    assert_eq!((verification.as_str(), receipts), ("status_query", 1));
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM destination.ledger")
        .fetch_one(&ledger)
        .await?;
    assert_eq!(effects, 1);
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}
