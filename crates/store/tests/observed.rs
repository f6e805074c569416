//! *Response observed* recorded by the one that saw the answer first (the gateway), before
//! the answer travels on: under the attempt's lease it is the attempt's checkpoint, and the
//! worker's receipt follows from it; once the lease has moved on it is a late observation; and
//! a worker that never commits loses nothing, because recovery reconciles from the record.

mod common;

use common::*;
use sqlx::PgPool;
use z29c_core::{Checkpoint, RecoveryCategory, RecoveryDecision, StepId, classify};
use z29c_store::leases::Observation;
use z29c_store::{MIGRATOR, Store, StoreError};

async fn events(pool: &PgPool, step: StepId, checkpoint: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM step_events
         WHERE step_id = $1 AND kind = 'checkpoint' AND detail->>'checkpoint' = $2",
    )
    .bind(step.as_uuid())
    .bind(checkpoint)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_recorded_answer_is_the_attempts_and_the_receipt_follows_from_it(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "recorded", "worker-a").await;
    invoke(&store, &c).await;
    let observed = success(&c, "ref-1");
    assert_eq!(
        store.observe_response(&c.lease, &observed).await.unwrap(),
        Observation::Recorded
    );
    let (checkpoint, reference): (String, Option<String>) = sqlx::query_as(
        "SELECT checkpoint::text, observed_result->>'external_reference' FROM attempts
         WHERE id = $1",
    )
    .bind(c.lease.attempt.as_uuid())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (checkpoint.as_str(), reference.as_deref()),
        ("response_observed", Some("ref-1"))
    );
    // the worker's receipt under the same lease still commits, and says response_observed once
    let receipt = store.commit_receipt(&c.lease, &observed).await.unwrap();
    assert_eq!(receipt.external_reference.as_deref(), Some("ref-1"));
    assert_eq!(events(&pool, c.lease.step, "response_observed").await, 1);
    assert_eq!(events(&pool, c.lease.step, "receipt_committed").await, 1);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_worker_that_never_commits_loses_nothing_the_gateway_recorded(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "silent", "worker-a").await;
    invoke(&store, &c).await;
    store
        .observe_response(&c.lease, &success(&c, "ref-2"))
        .await
        .unwrap();
    // the worker pauses past its lease: recovery finds the recorded answer as evidence
    let rec = take_over(&store, &pool, &c).await;
    assert_eq!(rec.snapshot.checkpoint, Some(Checkpoint::ResponseObserved));
    let evidence = rec.snapshot.matching_observations();
    assert_eq!(evidence.len(), 1);
    assert_eq!(evidence[0].external_reference.as_deref(), Some("ref-2"));
    assert_eq!(evidence[0].outcome, "succeeded");
    let (category, decision) =
        classify(&rec.snapshot.evidence(z29c_core::AdapterCapability::Opaque));
    assert_eq!(
        (category, decision),
        (
            RecoveryCategory::ResultObserved,
            RecoveryDecision::Reconcile
        ),
        "even an opaque adapter's answer is known once it is recorded"
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn an_answer_recorded_after_the_lease_moved_on_is_late_evidence(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "late", "worker-a").await;
    invoke(&store, &c).await;
    let _rec = take_over(&store, &pool, &c).await;
    let observed = success(&c, "ref-3");
    let Observation::Late(id) = store.observe_response(&c.lease, &observed).await.unwrap() else {
        panic!("a fenced-out answer must be kept as a late observation");
    };
    let (attempt, reference): (uuid::Uuid, Option<String>) = sqlx::query_as(
        "SELECT attempt_id, external_reference FROM late_observations WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (attempt, reference.as_deref()),
        (c.lease.attempt.as_uuid(), Some("ref-3"))
    );
    // and the stale worker's own receipt is refused by the fence, as before
    assert!(matches!(
        store.commit_receipt(&c.lease, &observed).await,
        Err(StoreError::Fenced(_))
    ));
}
