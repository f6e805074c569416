//! The fencing rules of docs/design.md §1, pinned against real PostgreSQL. Each test is named after
//! the rule it holds; each gets a fresh database.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;
use sqlx::PgPool;
use z29c_core::{
    Checkpoint, FenceReason, RecoveryCategory, RecoveryDecision, StepState, Verification,
    WorkflowState,
};
use z29c_store::leases::CommitOutcome;
use z29c_store::recovery::DecisionRecord;
use z29c_store::{MIGRATOR, Store, StoreError};

fn fenced(r: Result<impl std::fmt::Debug, StoreError>) -> FenceReason {
    match r {
        Err(StoreError::Fenced(reason)) => reason,
        other => panic!("expected a fenced refusal, got {other:?}"),
    }
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn expired_lease_cannot_record_a_checkpoint(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "k1", "worker-a").await;
    expire(&pool, c.lease.step).await;
    let r = store.begin_invocation(&c.lease).await;
    assert_eq!(fenced(r), FenceReason::Expired);
    let stored: (String, Option<chrono::DateTime<chrono::Utc>>) =
        sqlx::query_as("SELECT checkpoint::text, invocation_began_at FROM attempts WHERE id = $1")
            .bind(c.lease.attempt.as_uuid())
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        stored,
        ("request_identity_persisted".into(), None),
        "a fenced write leaves nothing behind"
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn lease_expires_by_database_time(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let mut wf = workflow("real-time", vec![step("only", &[])]);
    wf.steps[0].policy = short_policy();
    submit(&store, &wf).await;
    let c = store.claim(&owner("worker-a"), 1).await.unwrap().remove(0);
    assert_eq!(
        (c.expires_at - c.leased_at).num_milliseconds(),
        1_000,
        "expiry is PostgreSQL's now() plus the policy's lease"
    );
    assert!(store.scan_expired(10).await.unwrap().is_empty());
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let expired = store.scan_expired(10).await.unwrap();
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0].step, c.lease.step);
    assert_eq!(
        fenced(store.begin_invocation(&c.lease).await),
        FenceReason::Expired
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn superseded_lease_cannot_commit_receipt_and_its_result_is_kept_as_late_evidence(
    pool: PgPool,
) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "k1", "worker-a").await;
    invoke(&store, &c).await;
    let rec = take_over(&store, &pool, &c).await;
    assert_eq!(rec.lease.version, c.lease.version.next());
    assert_eq!(rec.snapshot.checkpoint, Some(Checkpoint::InvocationBegan));

    let observed = success(&c, "dest-123");
    let r = store.commit_receipt(&c.lease, &observed).await;
    assert!(matches!(fenced(r), FenceReason::Superseded { .. }));

    match store
        .commit_or_keep_late(&c.lease, &observed)
        .await
        .unwrap()
    {
        CommitOutcome::Late { reason, .. } => assert_eq!(reason["reason"], "superseded"),
        other => panic!("expected late evidence, got {other:?}"),
    }
    let late = store.late_observations(c.lease.step).await.unwrap();
    assert_eq!(late.len(), 1);
    assert_eq!(late[0].external_reference.as_deref(), Some("dest-123"));
    assert_eq!(late[0].lease_version, c.lease.version.get());
    assert_eq!(late[0].request_identity, c.request_identity.as_str());
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM step_receipts WHERE step_id = $1",
            c.lease.step
        )
        .await,
        0,
        "a stale worker never produces a receipt"
    );
    let detail = store.workflow(c.workflow).await.unwrap();
    assert_eq!(detail.steps[0].state, StepState::Recovering);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn expired_lease_cannot_renew_or_commit(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "k1", "worker-a").await;
    invoke(&store, &c).await;
    // two checkpoints so far (versions 1 and 2): the current lease renews with the latest
    store.renew(&c.lease, 2).await.unwrap();
    expire(&pool, c.lease.step).await;
    assert_eq!(fenced(store.renew(&c.lease, 2).await), FenceReason::Expired);
    assert_eq!(
        fenced(store.commit_receipt(&c.lease, &success(&c, "r")).await),
        FenceReason::Expired
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn renewal_carries_the_latest_checkpoint_version(pool: PgPool) {
    let store = Store::from_pool(pool);
    let c = claimed_single(&store, "k1", "worker-a").await;
    let v1 = c.checkpoint_version;
    let renewed = store.renew(&c.lease, v1).await.unwrap();
    assert!(renewed.expires_at > renewed.db_now);
    let v2 = store.begin_invocation(&c.lease).await.unwrap();
    assert!(v2 > v1);
    assert_eq!(
        fenced(store.renew(&c.lease, v1).await),
        FenceReason::StaleCheckpoint {
            presented: v1,
            durable: v2
        }
    );
    store.renew(&c.lease, v2).await.unwrap();
}

/// A claim commits without waiting for the disk, so a server crash can lose it after its
/// executor has read it. The crash leaves the step as it was before the claim; the same
/// executor may then claim it again and get the same lease version. The lost lease must still
/// be refused everywhere, as an expired one is: the fence names the attempt, whose id no claim
/// repeats.
#[sqlx::test(migrator = "MIGRATOR")]
async fn a_claim_lost_in_a_crash_fences_like_an_expired_lease(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    submit(&store, &workflow("lost", vec![step("only", &[])])).await;
    let before: serde_json::Value = sqlx::query_scalar("SELECT to_jsonb(s) FROM steps s")
        .fetch_one(&pool)
        .await
        .unwrap();
    let lost = store.claim(&owner("worker-a"), 1).await.unwrap().remove(0);
    // what recovery from the log leaves when the claim's commit never reached the disk
    let mut tx = pool.begin().await.unwrap();
    // a crash is not a DELETE: the append-only guards (triggers) stay out of it
    sqlx::query("SET LOCAL session_replication_role = replica")
        .execute(&mut *tx)
        .await
        .unwrap();
    for sql in [
        "DELETE FROM step_events WHERE attempt_id = $1",
        "DELETE FROM attempts WHERE id = $1",
    ] {
        sqlx::query(sql)
            .bind(lost.lease.attempt.as_uuid())
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    let restored = sqlx::query(
        "UPDATE steps s SET (state, lease_owner, lease_version, leased_at, expires_at,
                 attempt_deadline, current_attempt_id, attempts_made, request_identity,
                 checkpoint_version, updated_at)
             = (b.state, b.lease_owner, b.lease_version, b.leased_at, b.expires_at,
                b.attempt_deadline, b.current_attempt_id, b.attempts_made, b.request_identity,
                b.checkpoint_version, b.updated_at)
         FROM jsonb_populate_record(NULL::steps, $1) b WHERE s.id = b.id",
    )
    .bind(&before)
    .execute(&mut *tx)
    .await
    .unwrap();
    assert_eq!(restored.rows_affected(), 1);
    tx.commit().await.unwrap();

    let again = store.claim(&owner("worker-a"), 1).await.unwrap().remove(0);
    assert_eq!(
        (again.lease.step, again.lease.version, &again.lease.owner),
        (lost.lease.step, lost.lease.version, &lost.lease.owner),
        "the same step, version and owner: only the attempt tells the two leases apart"
    );
    assert_ne!(again.lease.attempt, lost.lease.attempt);
    assert_eq!(
        fenced(store.begin_invocation(&lost.lease).await),
        FenceReason::NotCurrentAttempt
    );
    assert_eq!(
        fenced(store.renew(&lost.lease, lost.checkpoint_version).await),
        FenceReason::NotCurrentAttempt
    );
    // the current lease is untouched by the refusals and goes on
    store.begin_invocation(&again.lease).await.unwrap();
    let commit = store
        .commit_receipt(&lost.lease, &success(&lost, "from-the-lost-lease"))
        .await;
    assert_eq!(fenced(commit), FenceReason::NotCurrentAttempt);
    store
        .commit_receipt(&again.lease, &success(&again, "r"))
        .await
        .unwrap();
    let receipts: Vec<String> = sqlx::query_scalar("SELECT external_reference FROM step_receipts")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(receipts, vec!["r".to_owned()]);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn another_owner_cannot_write_under_a_lease(pool: PgPool) {
    let store = Store::from_pool(pool);
    let c = claimed_single(&store, "k1", "worker-a").await;
    let mut forged = c.lease.clone();
    forged.owner = owner("worker-b");
    assert_eq!(fenced(store.renew(&forged, 0).await), FenceReason::NotOwner);
    assert_eq!(
        fenced(store.begin_invocation(&forged).await),
        FenceReason::NotOwner
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn renewal_stops_being_granted_before_the_attempt_deadline(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let mut wf = workflow("deadline", vec![step("only", &[])]);
    wf.steps[0].policy = short_policy(); // lease 1 s, attempt deadline 2 s, grace 0.6 s
    submit(&store, &wf).await;
    let c = store.claim(&owner("worker-a"), 1).await.unwrap().remove(0);
    let v = c.checkpoint_version;
    let renewed = store.renew(&c.lease, v).await.unwrap();
    assert!(
        renewed.expires_at <= c.attempt_deadline,
        "a granted expiry never passes the attempt deadline"
    );
    // the attempt deadline comes inside the final grace while the lease has seconds left,
    // set on PostgreSQL's clock, so no load on the machine moves either
    sqlx::query(
        "UPDATE steps SET attempt_deadline = now() + interval '300 milliseconds',
                          expires_at = now() + interval '30 seconds'
         WHERE id = $1",
    )
    .bind(c.lease.step.as_uuid())
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(
        fenced(store.renew(&c.lease, v).await),
        FenceReason::AttemptDeadlineReached
    );
    // the worker can still record its final observation while the lease lasts
    store.begin_invocation(&c.lease).await.unwrap();
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn renewal_expiry_is_capped_at_the_attempt_deadline(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "k1", "worker-a").await;
    // move the attempt deadline close: 5 s away, lease 15 s, grace 2 s
    sqlx::query("UPDATE steps SET attempt_deadline = now() + interval '5 seconds' WHERE id = $1")
        .bind(c.lease.step.as_uuid())
        .execute(&pool)
        .await
        .unwrap();
    let deadline: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT attempt_deadline FROM steps WHERE id = $1")
            .bind(c.lease.step.as_uuid())
            .fetch_one(&pool)
            .await
            .unwrap();
    let renewed = store.renew(&c.lease, c.checkpoint_version).await.unwrap();
    assert_eq!(renewed.expires_at, deadline);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn cancellation_refuses_renewal_and_new_work_but_keeps_an_outcome_in_flight(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    submit(
        &store,
        &workflow("two", vec![step("a", &[]), step("b", &[])]),
    )
    .await;
    let claimed = store.claim(&owner("worker-a"), 2).await.unwrap();
    assert_eq!(claimed.len(), 2);
    let (before, during) = (&claimed[0], &claimed[1]);
    invoke(&store, during).await;

    store
        .cancel_workflow(before.workflow, "operator asked")
        .await
        .unwrap();

    assert!(matches!(
        fenced(store.renew(&during.lease, 2).await),
        FenceReason::WorkflowForbids {
            workflow: WorkflowState::Cancelled
        }
    ));
    // the step that had not begun stops at its safe boundary
    assert!(matches!(
        fenced(store.begin_invocation(&before.lease).await),
        FenceReason::WorkflowForbids { .. }
    ));
    store.release_unbegun(&before.lease).await.unwrap();
    // the invocation already begun still gets its outcome recorded
    let receipt = store
        .commit_receipt(&during.lease, &success(during, "dest-9"))
        .await
        .unwrap();
    assert_eq!(receipt.verification, Verification::Direct);

    let wf = store.workflow(before.workflow).await.unwrap();
    assert_eq!(wf.state, WorkflowState::Cancelled);
    let state = |id| wf.steps.iter().find(|s| s.id == id).unwrap().state;
    assert_eq!(state(before.lease.step), StepState::Cancelled);
    assert_eq!(state(during.lease.step), StepState::Completed);
    assert!(
        store
            .claim(&owner("worker-b"), 10)
            .await
            .unwrap()
            .is_empty()
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn receipt_is_unique_per_step_and_a_second_commit_is_a_conflict(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "k1", "worker-a").await;
    invoke(&store, &c).await;
    let receipt = store
        .commit_receipt(&c.lease, &success(&c, "dest-1"))
        .await
        .unwrap();
    assert_eq!(receipt.verification, Verification::Direct);
    assert_eq!(receipt.external_reference.as_deref(), Some("dest-1"));
    assert_eq!(receipt.request_identity, c.request_identity.as_str());
    assert_eq!(receipt.input_digest, c.input_digest.as_str());
    assert_eq!(receipt.adapter_version, "http/1");

    let again = store.commit_receipt(&c.lease, &success(&c, "dest-2")).await;
    assert!(matches!(again, Err(StoreError::Conflict(_))), "{again:?}");
    // and the database itself refuses a second receipt row
    let raw = sqlx::query(
        "INSERT INTO step_receipts (id, step_id, workflow_id, lease_version, input_digest,
             adapter, adapter_version, request_identity, external_reference, outcome,
             observed_result, verification)
         SELECT gen_random_uuid(), step_id, workflow_id, lease_version, input_digest, adapter,
             adapter_version, request_identity, 'other', outcome, observed_result, verification
         FROM step_receipts WHERE step_id = $1",
    )
    .bind(c.lease.step.as_uuid())
    .execute(&pool)
    .await;
    assert!(matches!(
        raw.map_err(StoreError::from),
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM step_receipts WHERE step_id = $1",
            c.lease.step
        )
        .await,
        1
    );
    // the conflicting observation is still kept, as evidence
    match store
        .commit_or_keep_late(&c.lease, &success(&c, "dest-2"))
        .await
        .unwrap()
    {
        CommitOutcome::Late { reason, .. } => assert_eq!(reason["reason"], "receipt_exists"),
        other => panic!("{other:?}"),
    }
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn receipt_commits_atomically_with_its_outbox_event(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "k1", "worker-a").await;
    invoke(&store, &c).await;
    let completed = |pool: PgPool| async move {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM outbox WHERE kind = 'step_completed' AND step_id = $1",
        )
        .bind(c.lease.step.as_uuid())
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    // a refused commit writes neither the receipt nor the event
    let mut bad = success(&c, "dest-1");
    bad.input_digest = z29c_core::InputDigest::of_json(&json!({"other": true}));
    assert!(matches!(
        store.commit_receipt(&c.lease, &bad).await,
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(completed(pool.clone()).await, 0);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM step_receipts WHERE step_id = $1",
            c.lease.step
        )
        .await,
        0
    );
    let receipt = store
        .commit_receipt(&c.lease, &success(&c, "dest-1"))
        .await
        .unwrap();
    assert_eq!(completed(pool.clone()).await, 1);
    let relay = owner("relay-1");
    let batch = store
        .claim_outbox(&relay, 100, Duration::from_secs(30))
        .await
        .unwrap();
    let kinds: Vec<&str> = batch.iter().map(|m| m.kind.as_str()).collect();
    assert!(
        kinds.contains(&"step_completed") && kinds.contains(&"workflow_changed"),
        "{kinds:?}"
    );
    assert_eq!(
        store.workflow(c.workflow).await.unwrap().state,
        WorkflowState::Completed
    );
    let _ = receipt;
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn receipt_needs_an_invocation_that_began(pool: PgPool) {
    let store = Store::from_pool(pool);
    let c = claimed_single(&store, "k1", "worker-a").await;
    let r = store.commit_receipt(&c.lease, &success(&c, "x")).await;
    assert!(
        matches!(r, Err(StoreError::Invalid { ref field, .. }) if field == "checkpoint"),
        "{r:?}"
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn checkpoints_only_move_forward(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "k1", "worker-a").await;
    invoke(&store, &c).await;
    let state = || async {
        sqlx::query_as::<_, (i64, Option<chrono::DateTime<chrono::Utc>>, i64)>(
            "SELECT s.checkpoint_version, a.invocation_began_at,
                    (SELECT count(*) FROM step_events e
                     WHERE e.step_id = s.id AND e.detail->>'checkpoint' = 'invocation_began')
             FROM steps s JOIN attempts a ON a.id = s.current_attempt_id WHERE s.id = $1",
        )
        .bind(c.lease.step.as_uuid())
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let before = state().await;
    assert_eq!(before.2, 1, "one invocation_began event");
    // The lease matches, so the fenced statement writes the attempt's checkpoint and its event
    // before core's rule refuses the order: the refusal rolls all of it back.
    assert_eq!(
        fenced(store.begin_invocation(&c.lease).await),
        FenceReason::CheckpointNotForward {
            durable: Checkpoint::InvocationBegan
        }
    );
    assert_eq!(
        state().await,
        before,
        "a refused checkpoint leaves nothing behind"
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn invocation_began_is_one_statement_with_its_attempt_and_event(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "k1", "worker-a").await;
    let version = store.begin_invocation(&c.lease).await.unwrap();
    assert_eq!(version, c.checkpoint_version + 1);
    let (checkpoint, began, step_version, same_xact): (String, bool, i64, bool) = sqlx::query_as(
        "SELECT a.checkpoint::text, a.invocation_began_at IS NOT NULL, s.checkpoint_version,
                s.xmin = a.xmin AND a.xmin = e.xmin
         FROM steps s JOIN attempts a ON a.id = s.current_attempt_id
         JOIN step_events e ON e.step_id = s.id AND e.detail->>'checkpoint' = 'invocation_began'
         WHERE s.id = $1",
    )
    .bind(c.lease.step.as_uuid())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(checkpoint, "invocation_began");
    assert!(began);
    assert_eq!(step_version, version);
    assert!(
        same_xact,
        "step, attempt and event were written by one transaction"
    );
    let detail: serde_json::Value = sqlx::query_scalar(
        "SELECT detail FROM step_events
         WHERE step_id = $1 AND kind = 'checkpoint' AND attempt_id = $2 AND owner = 'worker-a'
           AND lease_version = $3 AND detail->>'checkpoint' = 'invocation_began'",
    )
    .bind(c.lease.step.as_uuid())
    .bind(c.lease.attempt.as_uuid())
    .bind(c.lease.version.get())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        detail,
        json!({ "checkpoint": "invocation_began", "checkpoint_version": version })
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_direct_receipt_ends_its_attempt_step_and_workflow_in_one_statement_in_order(
    pool: PgPool,
) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "k1", "worker-a").await;
    invoke(&store, &c).await;
    let receipt = store
        .commit_receipt(&c.lease, &success(&c, "dest-1"))
        .await
        .unwrap();
    // the attempt's end, as the receipt records it
    let (checkpoint, state, observed_at, result, adapter_version): (
        String,
        String,
        bool,
        serde_json::Value,
        Option<String>,
    ) = sqlx::query_as(
        "SELECT checkpoint::text, state::text, response_observed_at IS NOT NULL,
                observed_result, adapter_version
         FROM attempts WHERE id = $1",
    )
    .bind(c.lease.attempt.as_uuid())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (checkpoint.as_str(), state.as_str(), observed_at),
        ("receipt_committed", "succeeded", true)
    );
    assert_eq!(result, json!({ "status": 201 }));
    assert_eq!(adapter_version.as_deref(), Some("http/1"));
    // the step's last events, in their order
    let events: Vec<(String, serde_json::Value)> = sqlx::query_as(
        "SELECT kind, detail FROM step_events WHERE step_id = $1 ORDER BY id DESC LIMIT 3",
    )
    .bind(c.lease.step.as_uuid())
    .fetch_all(&pool)
    .await
    .unwrap();
    // invocation began advanced the claim's version by one, the receipt by one more
    let version = c.checkpoint_version + 2;
    assert_eq!(
        events.into_iter().rev().collect::<Vec<_>>(),
        vec![
            (
                "checkpoint".to_owned(),
                json!({ "checkpoint": "response_observed", "checkpoint_version": version })
            ),
            (
                "checkpoint".to_owned(),
                json!({ "checkpoint": "receipt_committed", "checkpoint_version": version })
            ),
            (
                "lease_released".to_owned(),
                json!({ "receipt": receipt.id, "verification": "direct" })
            ),
        ]
    );
    // its messages, in their order, and the workflow's end
    let kinds: Vec<String> = sqlx::query_scalar(
        "SELECT kind FROM outbox WHERE workflow_id = $1 AND kind <> 'step_ready' ORDER BY id",
    )
    .bind(c.workflow.as_uuid())
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(kinds, ["step_completed", "workflow_changed"]);
    assert_eq!(
        store.workflow(c.workflow).await.unwrap().state,
        WorkflowState::Completed
    );
    // all of it one transaction
    let xacts: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT x) FROM (
             SELECT xmin::text AS x FROM step_receipts WHERE step_id = $1
             UNION ALL SELECT xmin::text FROM attempts WHERE id = $2
             UNION ALL SELECT xmin::text FROM steps WHERE id = $1
             UNION ALL SELECT xmin::text FROM workflows WHERE id = $3
             UNION ALL SELECT xmin::text FROM outbox WHERE workflow_id = $3
                                                      AND kind <> 'step_ready'
             UNION ALL (SELECT xmin::text FROM step_events WHERE step_id = $1
                        ORDER BY id DESC LIMIT 3)) t",
    )
    .bind(c.lease.step.as_uuid())
    .bind(c.lease.attempt.as_uuid())
    .bind(c.workflow.as_uuid())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        xacts, 1,
        "the receipt and everything it ends commit together"
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn claim_persists_the_steps_stable_request_identity(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "k1", "worker-a").await;
    // the claim's transaction created the attempt with its identity: `for_step`'s, spelled in
    // SQL by the claim, and the same on the step, the attempt and the checkpoint event
    assert_eq!(
        c.request_identity,
        z29c_core::RequestIdentity::for_step(c.workflow, &c.name)
    );
    let (on_step, on_attempt, checkpoint): (String, String, String) = sqlx::query_as(
        "SELECT s.request_identity, a.request_identity, a.checkpoint::text
         FROM steps s JOIN attempts a ON a.id = s.current_attempt_id WHERE s.id = $1",
    )
    .bind(c.lease.step.as_uuid())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (on_step.as_str(), on_attempt.as_str(), checkpoint.as_str()),
        (
            c.request_identity.as_str(),
            c.request_identity.as_str(),
            "request_identity_persisted"
        )
    );
    let events: Vec<String> = sqlx::query_scalar(
        "SELECT kind || coalesce(':' || (detail->>'checkpoint'), '') FROM step_events
         WHERE attempt_id = $1 ORDER BY id",
    )
    .bind(c.lease.attempt.as_uuid())
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        events,
        ["lease_acquired", "checkpoint:request_identity_persisted"]
    );
    store.begin_invocation(&c.lease).await.unwrap();
    // the database refuses an attempt past identity without one
    let raw = sqlx::query("UPDATE attempts SET request_identity = NULL WHERE id = $1")
        .bind(c.lease.attempt.as_uuid())
        .execute(&pool)
        .await;
    assert!(matches!(
        raw.map_err(StoreError::from),
        Err(StoreError::Invalid { .. })
    ));

    // recovery decides to retry with the same key; the next attempt sees the same identity
    let rec = take_over(&store, &pool, &c).await;
    store
        .record_decision(
            &rec.lease,
            &DecisionRecord {
                category: RecoveryCategory::InvokedIdempotent,
                decision: RecoveryDecision::RetrySameIdentity,
                capability: z29c_core::AdapterCapability::Idempotent,
                detail: json!({}),
            },
        )
        .await
        .unwrap();
    // the retry waits its backoff (capped, jittered) before anyone may claim it
    assert!(store.claim(&owner("worker-b"), 1).await.unwrap().is_empty());
    let wait: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM next_eligible_at - now())::float8 FROM steps WHERE id = $1",
    )
    .bind(c.lease.step.as_uuid())
    .fetch_one(&pool)
    .await
    .unwrap();
    let base = z29c_core::retry::DEFAULT_INITIAL_BACKOFF.as_secs_f64();
    assert!(
        wait > base * 0.5 && wait <= 2.0 * base,
        "first retry backoff {wait} s, base {base} s"
    );
    let again = loop {
        let mut got = store.claim(&owner("worker-b"), 1).await.unwrap();
        if let Some(s) = got.pop() {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(again.request_identity, c.request_identity);
    assert_eq!(again.attempt_number, 2);
    assert!(again.lease.version > rec.lease.version);
    let identities: Vec<String> =
        sqlx::query_scalar("SELECT request_identity FROM attempts WHERE step_id = $1")
            .bind(c.lease.step.as_uuid())
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(identities, [c.request_identity.as_str(); 2]);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn worker_clock_skew_does_not_matter(pool: PgPool) {
    // The store takes no time from its callers, so a worker whose wall clock is minutes off
    // cannot extend or shorten its authority. Here the worker believes, from its own skewed
    // clock, the opposite of the truth each time; PostgreSQL decides regardless.
    let store = Store::from_pool(pool.clone());
    for skew_minutes in [-10i64, 10] {
        let c = claimed_single(&store, &format!("skew{skew_minutes}"), "worker-a").await;
        let local_now = chrono::Utc::now() + chrono::Duration::minutes(skew_minutes);
        let locally_expired = local_now >= c.expires_at;
        assert_eq!(
            locally_expired,
            skew_minutes > 0,
            "the worker's own view is wrong"
        );
        // the lease is valid by PostgreSQL time: the write succeeds whatever the worker thinks
        store.renew(&c.lease, c.checkpoint_version).await.unwrap();
        // expired by PostgreSQL time: refused whatever the worker thinks
        expire(&pool, c.lease.step).await;
        assert_eq!(
            fenced(store.begin_invocation(&c.lease).await),
            FenceReason::Expired
        );
    }
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn append_only_tables_reject_update_and_delete(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "k1", "worker-a").await;
    invoke(&store, &c).await;
    let rec = take_over(&store, &pool, &c).await;
    store
        .commit_or_keep_late(&c.lease, &success(&c, "dest-1"))
        .await
        .unwrap();
    store
        .record_decision(
            &rec.lease,
            &DecisionRecord {
                category: RecoveryCategory::ResultObserved,
                decision: RecoveryDecision::Reconcile,
                capability: z29c_core::AdapterCapability::Queryable,
                detail: json!({}),
            },
        )
        .await
        .unwrap();
    let mut observed = success(&c, "dest-1");
    observed.adapter_version = "http/1".into();
    store
        .commit_recovered_receipt(&rec.lease, &observed, Verification::LateEvidence)
        .await
        .unwrap();
    store
        .record_integrity_conflict(
            c.lease.step,
            c.request_identity.as_str(),
            Some("a"),
            Some("b"),
            "test",
        )
        .await
        .unwrap();
    for table in [
        "step_receipts",
        "late_observations",
        "recovery_decisions",
        "integrity_conflicts",
        "step_events",
    ] {
        let rows: i64 =
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
                .fetch_one(&pool)
                .await
                .unwrap();
        assert!(rows > 0, "{table} has a row to protect");
        for stmt in [
            format!("UPDATE {table} SET step_id = step_id"),
            format!("DELETE FROM {table}"),
            format!("TRUNCATE {table} CASCADE"),
        ] {
            let r = sqlx::query(sqlx::AssertSqlSafe(stmt.clone()))
                .execute(&pool)
                .await;
            assert!(
                matches!(r.map_err(StoreError::from), Err(StoreError::AppendOnly(_))),
                "{stmt} must be refused"
            );
        }
    }
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn rate_limited_step_holds_no_lease_while_it_waits(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "k1", "worker-a").await;
    invoke(&store, &c).await;
    store
        .release_rate_limited(&c.lease, Duration::from_secs(60), "rate_limited")
        .await
        .unwrap();
    let wf = store.workflow(c.workflow).await.unwrap();
    let s = &wf.steps[0];
    assert_eq!(s.state, StepState::Ready);
    assert!(s.lease_owner.is_none() && s.lease_expires_at.is_none());
    assert!(s.waiting_for_eligibility);
    assert_eq!(
        s.product_state(),
        z29c_core::ProductState::WaitingOnExternalService
    );
    assert!(
        store
            .claim(&owner("worker-b"), 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        store.scan_expired(10).await.unwrap().is_empty(),
        "nothing for recovery"
    );
    // the old holder lost its authority with the release
    assert!(matches!(
        fenced(store.renew(&c.lease, 2).await),
        FenceReason::NotLeased { .. }
    ));
    // once eligible (moved here instead of waiting a minute) it is claimed again
    sqlx::query("UPDATE steps SET next_eligible_at = now() WHERE id = $1")
        .bind(c.lease.step.as_uuid())
        .execute(&pool)
        .await
        .unwrap();
    let again = store.claim(&owner("worker-b"), 10).await.unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].lease.version, c.lease.version.next());
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn release_after_invocation_began_is_refused(pool: PgPool) {
    let store = Store::from_pool(pool);
    let c = claimed_single(&store, "k1", "worker-a").await;
    invoke(&store, &c).await;
    assert!(matches!(
        store.release_unbegun(&c.lease).await,
        Err(StoreError::Conflict(_))
    ));
    store
        .surrender(&c.lease, "adapter answered unknown")
        .await
        .unwrap();
    assert_eq!(store.scan_expired(10).await.unwrap().len(), 1);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn two_recovery_workers_take_one_lease(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "k1", "worker-a").await;
    invoke(&store, &c).await;
    expire(&pool, c.lease.step).await;
    let hold = Duration::from_secs(30);
    let (r1, r2) = (owner("recovery-1"), owner("recovery-2"));
    let (a, b) = tokio::join!(
        store.take_recovery_lease(c.lease.step, c.lease.version, &r1, hold),
        store.take_recovery_lease(c.lease.step, c.lease.version, &r2, hold),
    );
    assert_eq!(
        a.is_ok() as u8 + b.is_ok() as u8,
        1,
        "exactly one wins: {a:?} {b:?}"
    );
    let loser = if a.is_ok() { b } else { a };
    assert!(matches!(fenced(loser), FenceReason::Superseded { .. }));
    // a lease that has not expired cannot be taken at all
    let fresh = claimed_single(&store, "k2", "worker-a").await;
    assert_eq!(
        fenced(
            store
                .take_recovery_lease(
                    fresh.lease.step,
                    fresh.lease.version,
                    &owner("recovery-1"),
                    hold
                )
                .await
        ),
        FenceReason::Changed
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn recovery_never_sends_a_fresh_request_after_invocation(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "k1", "worker-a").await;
    invoke(&store, &c).await;
    let rec = take_over(&store, &pool, &c).await;
    let evidence = rec.snapshot.evidence(z29c_core::AdapterCapability::Opaque);
    let (category, decision) = z29c_core::classify(&evidence);
    assert_eq!(decision, RecoveryDecision::HumanReview);
    for wrong in [RecoveryDecision::MakeReady, RecoveryDecision::Retry] {
        let r = store
            .record_decision(
                &rec.lease,
                &DecisionRecord {
                    category,
                    decision: wrong,
                    capability: evidence.capability,
                    detail: json!({}),
                },
            )
            .await;
        assert!(matches!(r, Err(StoreError::Conflict(_))), "{wrong}: {r:?}");
    }
    store
        .record_decision(
            &rec.lease,
            &DecisionRecord {
                category,
                decision,
                capability: evidence.capability,
                detail: json!({}),
            },
        )
        .await
        .unwrap();
    let wf = store.workflow(c.workflow).await.unwrap();
    assert_eq!(wf.steps[0].state, StepState::NeedsReview);
    assert_eq!(wf.product_state(), z29c_core::ProductState::NeedsReview);
    let decisions = store.recovery_decisions(c.lease.step).await.unwrap();
    assert_eq!(decisions.len(), 1);
    assert_eq!(decisions[0].category, "invoked_opaque");
    assert_eq!(decisions[0].checkpoint.as_deref(), Some("invocation_began"));
    let open: i64 = sqlx::query_scalar("SELECT count(*) FROM review_items WHERE state = 'open'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(open, 1);
    assert!(
        store
            .claim(&owner("worker-b"), 10)
            .await
            .unwrap()
            .is_empty()
    );
    // the recovery lease was released with the decision
    assert!(matches!(
        fenced(
            store
                .record_decision(
                    &rec.lease,
                    &DecisionRecord {
                        category,
                        decision,
                        capability: evidence.capability,
                        detail: json!({})
                    }
                )
                .await
        ),
        FenceReason::NotLeased { .. }
    ));
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn lease_history_is_recorded_as_step_events(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "k1", "worker-a").await;
    invoke(&store, &c).await;
    store.renew(&c.lease, 2).await.unwrap();
    take_over(&store, &pool, &c).await;
    let kinds = |events: Vec<z29c_store::events::StepEvent>| -> Vec<String> {
        events.into_iter().map(|e| e.kind).collect()
    };
    let of_step = kinds(store.step_events(c.lease.step).await.unwrap());
    let expected = [
        "lease_acquired",
        "checkpoint",
        "checkpoint",
        "lease_renewed",
        "lease_expired",
        "recovery_lease_acquired",
    ];
    assert_eq!(of_step, expected);
    // the step had one attempt, and the recovery lease names the attempt it took over, so the
    // attempt's events are all of them; another step's claim adds none
    claimed_single(&store, "k2", "worker-b").await;
    let of_attempt = kinds(store.attempt_events(c.lease.attempt).await.unwrap());
    assert_eq!(of_attempt, expected);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_receipt_found_under_an_expired_lease_is_only_acknowledged(pool: PgPool) {
    // Unreachable through the protocol (a receipt ends its lease in the same transaction), so
    // the state is forced here: if it ever arises, recovery acknowledges and never re-executes.
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "k1", "worker-a").await;
    invoke(&store, &c).await;
    store
        .commit_receipt(&c.lease, &success(&c, "dest-1"))
        .await
        .unwrap();
    sqlx::query(
        "UPDATE steps SET state = 'leased', lease_owner = 'worker-a',
             leased_at = now() - interval '1 hour', expires_at = now() - interval '1 second'
         WHERE id = $1",
    )
    .bind(c.lease.step.as_uuid())
    .execute(&pool)
    .await
    .unwrap();
    let rec = store
        .take_recovery_lease(
            c.lease.step,
            c.lease.version,
            &owner("recovery-1"),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    let (category, decision) =
        z29c_core::classify(&rec.snapshot.evidence(z29c_core::AdapterCapability::Opaque));
    assert_eq!(
        (category, decision),
        (
            RecoveryCategory::ReceiptExists,
            RecoveryDecision::AcknowledgeOnly
        )
    );
    store
        .record_decision(
            &rec.lease,
            &DecisionRecord {
                category,
                decision,
                capability: z29c_core::AdapterCapability::Opaque,
                detail: json!({}),
            },
        )
        .await
        .unwrap();
    let wf = store.workflow(c.workflow).await.unwrap();
    assert_eq!(wf.steps[0].state, StepState::Completed);
    assert!(
        store
            .claim(&owner("worker-b"), 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM attempts WHERE step_id = $1",
            c.lease.step
        )
        .await,
        1,
        "nothing was executed again"
    );
}
