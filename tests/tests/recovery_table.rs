//! Each row of docs/design.md §5, reached by a real executor process that crashes (aborts) right
//! after a durable boundary, or stalls past its lease; recovery must take exactly the decision
//! the table gives, and the workflow must end as it should.

use std::time::Duration;

use anyhow::{Result, bail};
use sqlx::PgPool;
use z29c_proto::v1::{self as pb};
use z29c_scenarios::cluster::{Cluster, Topology, chain};
use z29c_store::faults::CrashPoint;

fn short(key: &str) -> pb::SubmitRequest {
    let mut req = chain(key, "table", 1);
    req.steps[0].policy = Some(pb::LeasePolicy {
        lease_ms: 1_500,
        renew_every_ms: 500,
        attempt_deadline_ms: 6_000,
        final_grace_ms: 500,
        adapter_timeout_ms: 800,
        ..Default::default()
    });
    req
}

async fn first_decision(pool: &PgPool) -> Result<(String, String)> {
    for _ in 0..400 {
        let d: Option<(String, String)> = sqlx::query_as(
            "SELECT category::text, decision::text FROM recovery_decisions ORDER BY decided_at LIMIT 1",
        )
        .fetch_optional(pool)
        .await?;
        if let Some(d) = d {
            return Ok(d);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("recovery decided nothing")
}

/// The process that reaches the point right after `checkpoint` aborts there (the gateway for
/// *invocation began*, which it commits with the call's permit; the executor otherwise);
/// then a healthy one takes over.
async fn crash_after(
    checkpoint: &str,
    capability: &'static str,
) -> Result<(Cluster, PgPool, String, (String, String))> {
    let point: CrashPoint = format!("after_{checkpoint}")
        .parse()
        .map_err(anyhow::Error::msg)?;
    let mut cluster = Cluster::start_with(Topology {
        executors: 0,
        gateways: usize::from(!point.in_gateway()),
        recoveries: 1,
        capability,
        ..Topology::default()
    })
    .await?;
    let pool = cluster.db.pool(2).await?;
    let crash = [("Z29C_FAULT_CRASH", point.to_string())];
    let crash: Vec<(&str, &str)> = crash.iter().map(|(k, v)| (*k, v.as_str())).collect();
    if point.in_gateway() {
        cluster.add_gateway_with(16, &crash).await?;
        cluster.add_executor().await?;
    } else {
        cluster.add_executor_with(&crash).await?;
    }
    let wf = cluster
        .client()
        .await?
        .submit(short(&format!("crash-{checkpoint}")))
        .await?
        .into_inner()
        .workflow
        .unwrap();
    if point.in_gateway() {
        // back at once, as a supervisor would restart it: recovery asks the gateway what the
        // adapter promises, and waits a few seconds for one that is restarting
        cluster
            .wait_exited("gateway-1", Duration::from_secs(20))
            .await?;
        cluster.restart("gateway-1", &["Z29C_FAULT_CRASH"]).await?;
    }
    let decision = first_decision(&pool).await?;
    if !point.in_gateway() {
        cluster.add_executor().await?;
    }
    cluster
        .wait_all_ended(std::slice::from_ref(&wf.id), Duration::from_secs(60))
        .await?;
    Ok((cluster, pool, wf.id, decision))
}

/// Effects the destination committed, counted in its own database, `ledger`.
async fn effects(ledger: &PgPool) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM destination.ledger")
            .fetch_one(ledger)
            .await?,
    )
}

async fn workflow_state(pool: &PgPool) -> Result<String> {
    Ok(sqlx::query_scalar("SELECT state::text FROM workflows")
        .fetch_one(pool)
        .await?)
}

/// The row "no request identity" is no longer reachable through the protocol: the claim
/// creates the attempt with its identity in one transaction (docs/design.md §4 steps 1 and 2), so
/// a crash right after the claim already finds the identity and retries with it. (The row
/// stays in `core::recovery::classify` for attempts written by an older build.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_right_after_the_claim_finds_the_identity_already_persisted() -> Result<()> {
    let (cluster, pool, _, decision) = crash_after("attempt_created", "opaque").await?;
    let ledger = cluster.ledger_pool().await?;
    assert_eq!(decision, ("identity_not_invoked".into(), "retry".into()));
    assert_eq!(
        workflow_state(&pool).await?,
        "completed",
        "nothing was sent: safe to run again, even when opaque"
    );
    assert_eq!(effects(&ledger).await?, 1);
    let missing: i64 =
        sqlx::query_scalar("SELECT count(*) FROM attempts WHERE request_identity IS NULL")
            .fetch_one(&pool)
            .await?;
    assert_eq!(missing, 0, "no attempt ever existed without its identity");
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_the_identity_but_before_invocation_retries_with_it() -> Result<()> {
    let (cluster, pool, _, decision) = crash_after("request_identity_persisted", "opaque").await?;
    let ledger = cluster.ledger_pool().await?;
    assert_eq!(decision, ("identity_not_invoked".into(), "retry".into()));
    assert_eq!(workflow_state(&pool).await?, "completed");
    assert_eq!(effects(&ledger).await?, 1);
    let identities: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT request_identity) FROM attempts")
            .fetch_one(&pool)
            .await?;
    assert_eq!(identities, 1, "the retry carried the same identity");
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_invocation_began_depends_on_the_adapter() -> Result<()> {
    // idempotent: the same key may be sent again
    let (cluster, pool, _, decision) = crash_after("invocation_began", "idempotent").await?;
    let ledger = cluster.ledger_pool().await?;
    assert_eq!(
        decision,
        ("invoked_idempotent".into(), "retry_same_identity".into())
    );
    assert_eq!(workflow_state(&pool).await?, "completed");
    assert_eq!(effects(&ledger).await?, 1);
    pool.close().await;
    ledger.close().await;
    cluster.stop().await?;

    // queryable: ask first; the destination never saw it, so the same identity goes again
    let (cluster, pool, _, decision) = crash_after("invocation_began", "queryable").await?;
    let ledger = cluster.ledger_pool().await?;
    assert_eq!(
        decision,
        ("invoked_queryable".into(), "status_query".into())
    );
    let decisions: Vec<String> =
        sqlx::query_scalar("SELECT decision::text FROM recovery_decisions ORDER BY decided_at")
            .fetch_all(&pool)
            .await?;
    assert_eq!(decisions, ["status_query", "retry_same_identity"]);
    assert_eq!(workflow_state(&pool).await?, "completed");
    assert_eq!(effects(&ledger).await?, 1);
    pool.close().await;
    ledger.close().await;
    cluster.stop().await?;

    // opaque: nobody can say whether the request left, so a person decides; it did not leave
    // here (the crash came first), which is exactly what z29c cannot know: unknown, not absent
    let (cluster, pool, id, decision) = crash_after("invocation_began", "opaque").await?;
    let ledger = cluster.ledger_pool().await?;
    assert_eq!(decision, ("invoked_opaque".into(), "human_review".into()));
    let wf = cluster
        .client()
        .await?
        .get(pb::GetRequest { workflow_id: id })
        .await?
        .into_inner();
    assert_eq!(wf.state(), pb::ProductState::NeedsReview);
    assert_eq!(effects(&ledger).await?, 0);
    let attempts: i64 = sqlx::query_scalar("SELECT count(*) FROM attempts")
        .fetch_one(&pool)
        .await?;
    assert_eq!(attempts, 1, "never retried automatically");
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_observed_without_a_receipt_is_reconciled_from_the_evidence() -> Result<()> {
    // the worker sees the answer, stalls past its lease, and keeps what it saw as late
    // evidence; recovery (started afterwards) reconciles the receipt from it
    let mut cluster = Cluster::start_with(Topology {
        recoveries: 0,
        capability: "opaque",
        executor_stall_ms: 3_000,
        ..Topology::default()
    })
    .await?;
    let pool = cluster.db.pool(2).await?;
    let ledger = cluster.ledger_pool().await?;
    let wf = cluster
        .client()
        .await?
        .submit(short("observed"))
        .await?
        .into_inner()
        .workflow
        .unwrap();
    for i in 0.. {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM late_observations")
            .fetch_one(&pool)
            .await?;
        if n > 0 {
            break;
        }
        if i > 400 {
            bail!("no late observation");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cluster.add_recovery().await?;
    cluster
        .wait_all_ended(std::slice::from_ref(&wf.id), Duration::from_secs(60))
        .await?;
    let decision = first_decision(&pool).await?;
    assert_eq!(decision, ("result_observed".into(), "reconcile".into()));
    let (verification, reference): (String, String) =
        sqlx::query_as("SELECT verification::text, external_reference FROM step_receipts")
            .fetch_one(&pool)
            .await?;
    assert_eq!(verification, "late_evidence");
    let in_ledger: String = sqlx::query_scalar("SELECT reference FROM destination.ledger")
        .fetch_one(&ledger)
        .await?;
    assert_eq!(reference, in_ledger);
    assert_eq!(workflow_state(&pool).await?, "completed");
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}
