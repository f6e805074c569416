//! Group commit on real PostgreSQL: writes of many attempts share transactions, each is still
//! fenced on its own, a refused one changes nothing while the others commit, and a fan-out's
//! last receipt still completes its workflow.

mod common;

use std::time::Duration;

use common::*;
use sqlx::PgPool;
use z29c_core::RequestIdentity;
use z29c_store::batch::GroupCommit;
use z29c_store::leases::CommitOutcome;
use z29c_store::permits::PermitRequest;
use z29c_store::{MIGRATOR, Store, StoreError};

const STEPS: usize = 40;

#[sqlx::test(migrator = "MIGRATOR")]
async fn concurrent_attempts_share_commits_and_a_stale_one_writes_nothing(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let names: Vec<String> = (0..STEPS).map(|i| format!("s{i}")).collect();
    submit(
        &store,
        &workflow("fan", names.iter().map(|n| step(n, &[])).collect()),
    )
    .await;
    let claimed = store.claim(&owner("worker-a"), STEPS as i64).await.unwrap();
    assert_eq!(claimed.len(), STEPS);
    // one of them lost its lease to recovery before it wrote anything
    let stale = claimed[7].clone();
    let _recovery = take_over(&store, &pool, &stale).await;

    let commits = GroupCommit::start(&store, 2, 16);
    let commits_before: i64 = sqlx::query_scalar(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    for c in claimed {
        let (store, commits) = (store.clone(), commits.clone());
        tasks.spawn(async move {
            let wrote = async {
                commits.begin_invocation(&c.lease).await?;
                commits
                    .commit_or_keep_late(
                        &store,
                        c.workflow.as_uuid(),
                        &c.lease,
                        &success(&c, &format!("dest-{}", c.lease.step)),
                    )
                    .await
            }
            .await;
            (c.lease.step, wrote)
        });
    }
    let mut committed = 0;
    while let Some(r) = tasks.join_next().await {
        let (step, wrote) = r.unwrap();
        match wrote {
            Ok(CommitOutcome::Committed(receipt)) => {
                assert_eq!(receipt.step, step);
                committed += 1;
            }
            Err(StoreError::Fenced(_)) => assert_eq!(step, stale.lease.step, "only the stale one"),
            other => panic!("{step}: {other:?}"),
        }
    }
    assert_eq!(committed, STEPS - 1);
    let receipts: i64 = sqlx::query_scalar("SELECT count(*) FROM step_receipts")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        receipts,
        (STEPS - 1) as i64,
        "the stale attempt wrote nothing"
    );
    let stale_attempt: (String, Option<chrono::DateTime<chrono::Utc>>) =
        sqlx::query_as("SELECT checkpoint::text, invocation_began_at FROM attempts WHERE id = $1")
            .bind(stale.lease.attempt.as_uuid())
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        stale_attempt,
        ("request_identity_persisted".into(), None),
        "its savepoint was rolled back: no checkpoint past the claim"
    );
    // two writes per attempt, far fewer transactions
    let commits_after: i64 = sqlx::query_scalar(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        commits_after - commits_before < (2 * STEPS) as i64,
        "{} commits for {} writes",
        commits_after - commits_before,
        2 * STEPS
    );
    // the step recovery holds is the only one left unfinished
    let unfinished: i64 =
        sqlx::query_scalar("SELECT count(*) FROM steps WHERE state <> 'completed'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(unfinished, 1);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_fan_out_completes_its_workflow_through_group_commit(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let names: Vec<String> = (0..STEPS).map(|i| format!("s{i}")).collect();
    submit(
        &store,
        &workflow("fan", names.iter().map(|n| step(n, &[])).collect()),
    )
    .await;
    let claimed = store.claim(&owner("worker-a"), STEPS as i64).await.unwrap();
    let commits = GroupCommit::start(&store, 3, 8);
    let mut tasks = tokio::task::JoinSet::new();
    for c in claimed {
        let (store, commits) = (store.clone(), commits.clone());
        tasks.spawn(async move {
            commits.begin_invocation(&c.lease).await?;
            commits
                .commit_or_keep_late(&store, c.workflow.as_uuid(), &c.lease, &success(&c, "d"))
                .await
        });
    }
    while let Some(r) = tasks.join_next().await {
        assert!(matches!(r.unwrap(), Ok(CommitOutcome::Committed(_))));
    }
    // Groups on different committers commit side by side, so each may have seen the others'
    // steps still open: then the relay that publishes their `step_completed` messages ends
    // the workflow, as it does in the running system.
    let relay = owner("relay-a");
    let mut completions = 0;
    loop {
        let batch = store
            .claim_outbox(&relay, 1_000, Duration::from_secs(30))
            .await
            .unwrap();
        if batch.is_empty() {
            break;
        }
        completions += batch
            .iter()
            .filter(|m| m.kind == "workflow_changed" && m.payload["state"] == "completed")
            .count();
        let ids: Vec<i64> = batch.iter().map(|m| m.id).collect();
        store.mark_outbox_sent(&ids).await.unwrap();
    }
    let state: String = sqlx::query_scalar("SELECT state::text FROM workflows")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(state, "completed");
    assert_eq!(
        completions, 1,
        "completed once, by a receipt or by the relay"
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn permits_taken_in_one_group_never_exceed_the_limit(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    store.set_permit_limit("http", "deliver", 5).await.unwrap();
    let commits = GroupCommit::start(&store, 2, 32);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..30 {
        let commits = commits.clone();
        tasks.spawn(async move {
            let identity = RequestIdentity::parse(format!("req-{i}")).unwrap();
            commits
                .acquire_permit(&PermitRequest {
                    adapter: "http",
                    operation_class: "deliver",
                    attempt: None,
                    request_identity: &identity,
                    gateway: "gateway-1",
                    hold: Duration::from_secs(60),
                })
                .await
        });
    }
    let (mut granted, mut refused) = (0, 0);
    while let Some(r) = tasks.join_next().await {
        match r.unwrap() {
            Ok(_) => granted += 1,
            Err(StoreError::PermitsExhausted { limit: 5, .. }) => refused += 1,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((granted, refused), (5, 25));
    let held: i64 =
        sqlx::query_scalar("SELECT count(*) FROM adapter_permits WHERE state <> 'released'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(held, 5);
}
