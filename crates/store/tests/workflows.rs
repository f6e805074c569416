//! Submission, dependency release, projection, outbox and permits against real PostgreSQL.

mod common;

use std::time::Duration;

use common::*;
use sqlx::PgPool;
use uuid::Uuid;
use z29c_core::{ProductState, RequestIdentity, StepState, WorkflowState};
use z29c_store::permits::PermitRequest;
use z29c_store::workflows::SubmitLimits;
use z29c_store::{MIGRATOR, Store, StoreError};

#[sqlx::test(migrator = "MIGRATOR")]
async fn submit_is_idempotent_on_the_client_key(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let wf = workflow("order-1", vec![step("a", &[]), step("b", &["a"])]);
    let first = submit(&store, &wf).await;
    assert!(first.created);
    let again = submit(&store, &wf).await;
    assert_eq!(again.workflow, first.workflow);
    assert!(!again.created);
    let mut different = wf.clone();
    different.steps[0].input = serde_json::json!({ "amount": 43 });
    let r = store
        .submit_workflow(&different, &SubmitLimits::default())
        .await;
    assert!(matches!(r, Err(StoreError::Conflict(_))), "{r:?}");
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM workflows")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 1);
}

/// A new workflow is written in one transaction and answered without a read: the answer must
/// be exactly what a read returns, and every row (workflow, steps, dependencies, the ready
/// step's message) must carry that one transaction's id.
#[sqlx::test(migrator = "MIGRATOR")]
async fn a_submission_is_one_transaction_and_its_answer_is_what_a_read_returns(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let mut wf = workflow(
        "diamond-1",
        vec![
            step("a", &[]),
            step("b", &["a"]),
            step("c", &["a"]),
            step("d", &["b", "c"]),
        ],
    );
    wf.trace_context = Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into());
    let submitted = submit(&store, &wf).await;
    assert!(submitted.created);
    let answered = submitted.detail.expect("a new workflow is answered");
    let read = store.workflow(submitted.workflow).await.unwrap();
    assert_eq!(
        serde_json::to_value(&answered).unwrap(),
        serde_json::to_value(&read).unwrap(),
        "the answer built from the submission differs from the stored workflow"
    );
    let states: Vec<StepState> = read.steps.iter().map(|s| s.state).collect();
    assert_eq!(
        states,
        [
            StepState::Ready,
            StepState::Blocked,
            StepState::Blocked,
            StepState::Blocked
        ]
    );

    let transactions: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT x) FROM (
             SELECT xmin::text AS x FROM workflows
             UNION ALL SELECT xmin::text FROM steps
             UNION ALL SELECT xmin::text FROM step_dependencies
             UNION ALL SELECT xmin::text FROM outbox) rows",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        transactions, 1,
        "the submission took more than one transaction"
    );
    let dependencies: Vec<(String, String)> = sqlx::query_as(
        "SELECT s.name::text, d.name::text FROM step_dependencies sd
         JOIN steps s ON s.id = sd.step_id JOIN steps d ON d.id = sd.depends_on
         ORDER BY 1, 2",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let pair = |a: &str, b: &str| (a.to_owned(), b.to_owned());
    assert_eq!(
        dependencies,
        [
            pair("b", "a"),
            pair("c", "a"),
            pair("d", "b"),
            pair("d", "c")
        ]
    );
    let pending: Vec<i32> = sqlx::query_scalar("SELECT pending_deps FROM steps ORDER BY position")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(pending, [0, 1, 1, 2]);
    let messages: Vec<(String, Uuid, Option<String>)> =
        sqlx::query_as("SELECT kind, step_id, trace_context::text FROM outbox ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        messages,
        [(
            "step_ready".to_owned(),
            read.steps[0].id.as_uuid(),
            wf.trace_context.clone()
        )],
        "one step.ready message, for the step without dependencies, in the workflow's trace"
    );

    let again = submit(&store, &wf).await;
    assert!(!again.created);
    assert!(
        again.detail.is_none(),
        "an earlier submission is read, not rebuilt"
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn sql_looking_keys_and_names_are_stored_verbatim(pool: PgPool) {
    let store = Store::from_pool(pool);
    let key = "x'); DROP TABLE steps; --";
    let mut wf = workflow(key, vec![step("a", &[])]);
    wf.name = "Robert'); DELETE FROM workflows; --".into();
    let s = submit(&store, &wf).await;
    let got = store.workflow(s.workflow).await.unwrap();
    assert_eq!(got.client_key, key);
    assert_eq!(got.name, wf.name);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn invalid_submissions_name_the_field_and_store_nothing(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let limits = SubmitLimits {
        max_input_bytes: 64,
        ..SubmitLimits::default()
    };
    let mut big = step("a", &[]);
    big.input = serde_json::json!({ "blob": "x".repeat(100) });
    let mut short_lease = step("a", &[]);
    short_lease.policy.lease = Duration::from_millis(10);
    let cases = vec![
        (
            workflow("c1", vec![step("a", &["b"]), step("b", &["a"])]),
            "steps",
        ),
        (
            workflow("c2", vec![step("a", &["missing"])]),
            "steps[0].depends_on[0]",
        ),
        (workflow("c3", vec![big]), "steps[0].input"),
        (
            workflow("c4", vec![short_lease]),
            "steps[0].policy.lease_ms",
        ),
        (workflow("c5", vec![]), "steps"),
    ];
    for (wf, field) in cases {
        match store.submit_workflow(&wf, &limits).await {
            Err(StoreError::Invalid { field: f, .. }) => assert_eq!(f, field),
            other => panic!("expected invalid {field}, got {other:?}"),
        }
    }
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM workflows")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 0);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_receipt_releases_dependents_and_the_last_one_completes_the_workflow(pool: PgPool) {
    let store = Store::from_pool(pool);
    let s = submit(
        &store,
        &workflow(
            "dag",
            vec![step("a", &[]), step("b", &["a"]), step("c", &["a", "b"])],
        ),
    )
    .await;
    let worker = owner("worker-a");
    for expected in ["a", "b", "c"] {
        let mut batch = store.claim(&worker, 10).await.unwrap();
        assert_eq!(batch.len(), 1, "only {expected} is ready");
        let c = batch.pop().unwrap();
        assert_eq!(c.name.as_str(), expected);
        let wf = store.workflow(s.workflow).await.unwrap();
        assert_eq!(wf.state, WorkflowState::Running);
        assert_eq!(wf.product_state(), ProductState::Preparing);
        invoke(&store, &c).await;
        let wf = store.workflow(s.workflow).await.unwrap();
        assert_eq!(wf.product_state(), ProductState::WaitingOnExternalService);
        store
            .commit_receipt(&c.lease, &success(&c, &format!("ref-{expected}")))
            .await
            .unwrap();
    }
    let wf = store.workflow(s.workflow).await.unwrap();
    assert_eq!(wf.state, WorkflowState::Completed);
    assert_eq!(wf.product_state(), ProductState::Completed);
    assert!(
        wf.steps
            .iter()
            .all(|s| s.state == StepState::Completed && s.receipt.is_some())
    );
}

/// Siblings of a fan-out commit their receipts without waiting for each other: here both take
/// their snapshot while the other is still open (a trigger holds each INSERT until both are
/// in), so neither can see that it is the last. The workflow is then completed by the relay
/// that publishes their `step_completed` messages, once, after their COMMITs.
#[sqlx::test(migrator = "MIGRATOR")]
async fn siblings_finishing_at_once_leave_the_workflow_to_the_relay(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let s = submit(
        &store,
        &workflow("fan-out", vec![step("a", &[]), step("b", &[])]),
    )
    .await;
    let claimed = store.claim(&owner("worker-a"), 10).await.unwrap();
    assert_eq!(claimed.len(), 2);
    for c in &claimed {
        invoke(&store, c).await;
    }
    sqlx::raw_sql(
        "CREATE FUNCTION test_gate() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_advisory_lock_shared(4242); PERFORM pg_advisory_unlock_shared(4242);
               RETURN NEW; END $$;
         CREATE TRIGGER test_gate AFTER INSERT ON step_receipts
             FOR EACH ROW EXECUTE FUNCTION test_gate();",
    )
    .execute(&pool)
    .await
    .unwrap();
    let mut gate = pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(4242)")
        .execute(&mut *gate)
        .await
        .unwrap();
    let commits: Vec<_> = claimed
        .iter()
        .map(|c| {
            let (store, c) = (store.clone(), c.clone());
            tokio::spawn(async move { store.commit_receipt(&c.lease, &success(&c, "ref")).await })
        })
        .collect();
    // both receipts are inside their statement, each with a snapshot where the other is open
    let mut waiting = 0;
    for _ in 0..200 {
        waiting = sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if waiting == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(waiting, 2, "both receipts should wait at the gate together");
    sqlx::query("SELECT pg_advisory_unlock(4242)")
        .execute(&mut *gate)
        .await
        .unwrap();
    for t in commits {
        t.await.unwrap().unwrap();
    }
    let wf = store.workflow(s.workflow).await.unwrap();
    assert!(wf.steps.iter().all(|s| s.state == StepState::Completed));
    assert_eq!(
        wf.state,
        WorkflowState::Running,
        "neither sibling could know it was the last"
    );

    let relay = owner("relay-a");
    let batch = store
        .claim_outbox(&relay, 100, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(
        batch.iter().filter(|m| m.kind == "step_completed").count(),
        2
    );
    let ids: Vec<i64> = batch.iter().map(|m| m.id).collect();
    assert_eq!(
        store.mark_outbox_sent(&ids).await.unwrap(),
        ids.len() as u64
    );
    let wf = store.workflow(s.workflow).await.unwrap();
    assert_eq!(wf.state, WorkflowState::Completed);
    let announced = store
        .claim_outbox(&relay, 100, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(announced.len(), 1, "{announced:?}");
    assert_eq!(announced[0].kind, "workflow_changed");
    assert_eq!(announced[0].payload["state"], "completed");
    // marking again completes nothing twice
    let again: Vec<i64> = announced.iter().map(|m| m.id).collect();
    store.mark_outbox_sent(&again).await.unwrap();
    assert!(
        store
            .claim_outbox(&relay, 100, Duration::from_secs(30))
            .await
            .unwrap()
            .is_empty()
    );
}

/// A sibling that fails while others are open still ends the workflow at once, and the
/// relay's later pass over the successes' messages does not complete it.
#[sqlx::test(migrator = "MIGRATOR")]
async fn the_relay_never_completes_a_workflow_a_sibling_failed(pool: PgPool) {
    let store = Store::from_pool(pool);
    let s = submit(
        &store,
        &workflow("fan-out-fail", vec![step("a", &[]), step("b", &[])]),
    )
    .await;
    let claimed = store.claim(&owner("worker-a"), 10).await.unwrap();
    for c in &claimed {
        invoke(&store, c).await;
    }
    store
        .commit_receipt(&claimed[0].lease, &success(&claimed[0], "ref-a"))
        .await
        .unwrap();
    let mut rejected = success(&claimed[1], "x");
    rejected.outcome = z29c_core::Outcome::Failed;
    rejected.external_reference = None;
    store
        .commit_receipt(&claimed[1].lease, &rejected)
        .await
        .unwrap();
    let relay = owner("relay-a");
    let batch = store
        .claim_outbox(&relay, 100, Duration::from_secs(30))
        .await
        .unwrap();
    store
        .mark_outbox_sent(&batch.iter().map(|m| m.id).collect::<Vec<_>>())
        .await
        .unwrap();
    assert_eq!(
        store.workflow(s.workflow).await.unwrap().state,
        WorkflowState::Failed
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_failed_receipt_fails_the_workflow_and_stops_the_rest(pool: PgPool) {
    let store = Store::from_pool(pool);
    let s = submit(
        &store,
        &workflow("fail", vec![step("a", &[]), step("b", &["a"])]),
    )
    .await;
    let c = store.claim(&owner("worker-a"), 10).await.unwrap().remove(0);
    invoke(&store, &c).await;
    let mut rejected = success(&c, "x");
    rejected.outcome = z29c_core::Outcome::Failed;
    rejected.external_reference = None;
    store.commit_receipt(&c.lease, &rejected).await.unwrap();
    let wf = store.workflow(s.workflow).await.unwrap();
    assert_eq!(wf.state, WorkflowState::Failed);
    assert_eq!(wf.steps[1].state, StepState::Cancelled);
    assert_eq!(wf.product_state(), ProductState::Failed);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn outbox_relays_claim_disjoint_batches_and_mark_them_sent(pool: PgPool) {
    let store = Store::from_pool(pool);
    for i in 0..10 {
        submit(&store, &workflow(&format!("o{i}"), vec![step("a", &[])])).await;
    }
    assert_eq!(store.outbox_backlog().await.unwrap(), 10);
    let hold = Duration::from_secs(30);
    let (r1, r2) = (owner("relay-1"), owner("relay-2"));
    let (a, b) = tokio::join!(
        store.claim_outbox(&r1, 6, hold),
        store.claim_outbox(&r2, 6, hold)
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.len() + b.len(), 10);
    assert!(
        a.iter().all(|m| b.iter().all(|n| n.id != m.id)),
        "disjoint claims"
    );
    assert!(
        a.iter()
            .all(|m| m.kind == "step_ready" && m.msg_id.starts_with("step_ready-"))
    );
    let ids: Vec<i64> = a.iter().chain(&b).map(|m| m.id).collect();
    assert_eq!(store.mark_outbox_sent(&ids).await.unwrap(), 10);
    assert_eq!(
        store.mark_outbox_sent(&ids).await.unwrap(),
        0,
        "marking twice changes nothing"
    );
    assert_eq!(store.outbox_backlog().await.unwrap(), 0);
    // an unfinished claim expires and the message is published again under the same msg_id
    submit(&store, &workflow("late", vec![step("a", &[])])).await;
    let first = store
        .claim_outbox(&r1, 10, Duration::from_millis(1))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let second = store.claim_outbox(&r2, 10, hold).await.unwrap();
    assert_eq!(first.len(), 1);
    assert_eq!(second.len(), 1);
    assert_eq!(first[0].msg_id, second[0].msg_id);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn permits_never_exceed_the_limit_under_concurrency(pool: PgPool) {
    let store = Store::from_pool(pool);
    store.set_permit_limit("http", "create", 3).await.unwrap();
    let id = RequestIdentity::parse("req").unwrap();
    let mut tasks = Vec::new();
    for g in 0..12 {
        let (store, id) = (store.clone(), id.clone());
        tasks.push(tokio::spawn(async move {
            let gateway = format!("gw-{g}");
            store
                .acquire_permit(&PermitRequest {
                    adapter: "http",
                    operation_class: "create",
                    attempt: None,
                    request_identity: &id,
                    gateway: &gateway,
                    hold: Duration::from_secs(30),
                })
                .await
        }));
    }
    let mut granted = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Ok(p) => granted.push(p),
            Err(StoreError::PermitsExhausted { limit, .. }) => assert_eq!(limit, 3),
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(granted.len(), 3);
    // an unknown outcome keeps its capacity; a known one frees it
    store
        .hold_permit_unknown(granted[0].id, Duration::from_secs(60))
        .await
        .unwrap();
    store
        .release_permit(granted[1].id, "succeeded")
        .await
        .unwrap();
    let req = PermitRequest {
        adapter: "http",
        operation_class: "create",
        attempt: None,
        request_identity: &id,
        gateway: "gw-x",
        hold: Duration::from_secs(30),
    };
    store.acquire_permit(&req).await.unwrap();
    assert!(matches!(
        store.acquire_permit(&req).await,
        Err(StoreError::PermitsExhausted { .. })
    ));
    let history = store.permit_history("http", "create").await.unwrap();
    assert_eq!(history.len(), 4);
    assert_eq!(history.iter().filter(|p| p.state == "unknown").count(), 1);
    assert!(matches!(
        store
            .acquire_permit(&PermitRequest {
                adapter: "nope",
                ..req
            })
            .await,
        Err(StoreError::NotFound { .. })
    ));
}

fn permit_request<'a>(id: &'a RequestIdentity, hold: Duration) -> PermitRequest<'a> {
    PermitRequest {
        adapter: "http",
        operation_class: "create",
        attempt: None,
        request_identity: id,
        gateway: "gw-a",
        hold,
    }
}

/// A permit whose holder never released it stops counting when its hold runs out: its slot
/// goes to the next caller, and the old holder's late release frees nothing of the new one's.
#[sqlx::test(migrator = "MIGRATOR")]
async fn an_expired_permits_slot_is_taken_again_and_its_late_release_frees_nothing(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    store.set_permit_limit("http", "create", 1).await.unwrap();
    let id = RequestIdentity::parse("req").unwrap();
    // a hold long enough that the refusal below comes before it runs out on a loaded machine
    // (100 ms did not, once, with the whole suite running)
    let old = store
        .acquire_permit(&permit_request(&id, Duration::from_secs(1)))
        .await
        .unwrap();
    let long = permit_request(&id, Duration::from_secs(30));
    assert!(matches!(
        store.acquire_permit(&long).await,
        Err(StoreError::PermitsExhausted { limit: 1, .. })
    ));
    // until the hold has run out by the database's clock
    sqlx::query(
        "SELECT pg_sleep(extract(epoch FROM expires_at - clock_timestamp())::float8 + 0.05)
         FROM adapter_permits WHERE id = $1",
    )
    .bind(old.id)
    .execute(&pool)
    .await
    .unwrap();
    let new = store.acquire_permit(&long).await.unwrap();
    store.release_permit(old.id, "late").await.unwrap();
    assert!(
        matches!(
            store.acquire_permit(&long).await,
            Err(StoreError::PermitsExhausted { .. })
        ),
        "the new holder still counts"
    );
    store.release_permit(new.id, "succeeded").await.unwrap();
    store.acquire_permit(&long).await.unwrap();
}

/// A permit names its limit without locking the limit's row (every gateway's every call would
/// share that lock through a MultiXact), and a limit, which permits name, cannot be removed.
#[sqlx::test(migrator = "MIGRATOR")]
async fn a_permit_takes_no_lock_on_its_limit_and_a_limit_is_never_removed(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    store.set_permit_limit("http", "create", 2).await.unwrap();
    // a row lock leaves its taker in the tuple's xmax (making the slots, which reference the
    // limit, left the limit's own transaction there)
    let xmax = || async {
        sqlx::query_scalar::<_, String>("SELECT xmax::text FROM adapter_limits")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let before = xmax().await;
    let id = RequestIdentity::parse("req").unwrap();
    let permit = store
        .acquire_permit(&permit_request(&id, Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(xmax().await, before, "a permit locked its limit's row");
    let named: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM adapter_permits p JOIN adapter_limits l USING (adapter, operation_class)
         WHERE p.id = $1",
    )
    .bind(permit.id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(named, 1, "the permit names its limit");
    for removal in [
        "DELETE FROM adapter_limits",
        "TRUNCATE adapter_limits CASCADE",
    ] {
        let refused = sqlx::query(removal).execute(&pool).await.unwrap_err();
        assert!(
            matches!(StoreError::from(refused), StoreError::AppendOnly(ref m) if m.contains("never removed")),
            "{removal} was not refused as a removal"
        );
    }
    let limits: i64 = sqlx::query_scalar("SELECT count(*) FROM adapter_limits")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(limits, 1);
}

/// Permits spread over their class's slots instead of reusing its first ones (whose row
/// versions pile up while a snapshot is open), and the search still wraps around: every slot
/// below the limit is found, whichever slot it starts from, and none above it.
#[sqlx::test(migrator = "MIGRATOR")]
async fn permits_spread_over_the_slots_and_fill_every_one(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    store.set_permit_limit("http", "create", 64).await.unwrap();
    let id = RequestIdentity::parse("req").unwrap();
    let req = permit_request(&id, Duration::from_secs(30));
    for _ in 0..100 {
        let p = store.acquire_permit(&req).await.unwrap();
        store.release_permit(p.id, "succeeded").await.unwrap();
    }
    let (distinct, highest): (i64, i32) =
        sqlx::query_as("SELECT count(DISTINCT slot), max(slot) FROM adapter_permits")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        distinct >= 16,
        "100 permits one after another used only {distinct} of 64 slots"
    );
    assert!(highest < 64, "slot {highest} is above the limit");
    let mut held = Vec::new();
    for _ in 0..64 {
        held.push(store.acquire_permit(&req).await.unwrap());
    }
    assert!(matches!(
        store.acquire_permit(&req).await,
        Err(StoreError::PermitsExhausted { limit: 64, .. })
    ));
    let taken: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT slot) FROM adapter_permit_slots WHERE permit_id IS NOT NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(taken, 64, "64 held permits occupy 64 distinct slots");
    store
        .release_permit(held[17].id, "succeeded")
        .await
        .unwrap();
    let again = store.acquire_permit(&req).await.unwrap();
    let slot: i32 = sqlx::query_scalar("SELECT slot FROM adapter_permits WHERE id = $1")
        .bind(again.id)
        .fetch_one(&pool)
        .await
        .unwrap();
    let freed: i32 = sqlx::query_scalar("SELECT slot FROM adapter_permits WHERE id = $1")
        .bind(held[17].id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(slot, freed, "the one free slot is found from any start");
}

/// A raised limit adds slots at once; a lowered one grants nothing above it, and the permits
/// above it end as they are released.
#[sqlx::test(migrator = "MIGRATOR")]
async fn a_changed_limit_is_obeyed_by_the_next_permit(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let id = RequestIdentity::parse("req").unwrap();
    let req = permit_request(&id, Duration::from_secs(30));
    store.set_permit_limit("http", "create", 1).await.unwrap();
    let first = store.acquire_permit(&req).await.unwrap();
    store.set_permit_limit("http", "create", 3).await.unwrap();
    let second = store.acquire_permit(&req).await.unwrap();
    let third = store.acquire_permit(&req).await.unwrap();
    assert!(matches!(
        store.acquire_permit(&req).await,
        Err(StoreError::PermitsExhausted { limit: 3, .. })
    ));
    store.set_permit_limit("http", "create", 1).await.unwrap();
    store.release_permit(second.id, "succeeded").await.unwrap();
    store.release_permit(third.id, "succeeded").await.unwrap();
    assert!(matches!(
        store.acquire_permit(&req).await,
        Err(StoreError::PermitsExhausted { limit: 1, .. })
    ));
    store.release_permit(first.id, "succeeded").await.unwrap();
    store.acquire_permit(&req).await.unwrap();
    assert!(matches!(
        store.acquire_permit(&req).await,
        Err(StoreError::PermitsExhausted { limit: 1, .. })
    ));
    store.set_permit_limit("http", "create", 1).await.unwrap();
    let slots: i64 = sqlx::query_scalar("SELECT count(*) FROM adapter_permit_slots")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(slots, 1, "the freed slots above the limit are gone");
}

/// A configuration error is not retried: bad credentials fail at once, while an unreachable
/// or starting server would be retried for `CONNECT_PATIENCE`.
#[tokio::test]
async fn bad_credentials_fail_at_once_instead_of_being_retried() {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let mut bad: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    bad = bad.username("z29c_no_such_user").password("wrong");
    let start = std::time::Instant::now();
    let r = z29c_store::Store::connect(sqlx::ConnectOptions::to_url_lossy(&bad).as_ref(), 1).await;
    assert!(r.is_err(), "a user that does not exist connected");
    // well under CONNECT_PATIENCE (30 s): the refusal was final, not retried
    assert!(
        start.elapsed() < std::time::Duration::from_secs(20),
        "a configuration error was retried for {:?}",
        start.elapsed()
    );
}

/// The gateway's one transaction before a call: *invocation began* under the lease and the
/// call's permit, with the permits of calls that ended released first. All of it or none.
#[sqlx::test(migrator = "MIGRATOR")]
async fn invocation_began_and_its_permit_commit_together_or_not_at_all(pool: PgPool) {
    use z29c_store::permits::EndedPermit;
    let store = Store::from_pool(pool.clone());
    store.set_permit_limit("http", "create", 1).await.unwrap();
    submit(
        &store,
        &workflow("began", vec![step("a", &[]), step("b", &[])]),
    )
    .await;
    let claimed = store.claim(&owner("worker-a"), 2).await.unwrap();
    let (a, b) = (&claimed[0], &claimed[1]);
    fn req(c: &z29c_store::leases::ClaimedStep) -> PermitRequest<'_> {
        PermitRequest {
            adapter: "http",
            operation_class: "create",
            attempt: Some(c.lease.attempt),
            request_identity: &c.request_identity,
            gateway: "gw-a",
            hold: Duration::from_secs(30),
        }
    }
    let checkpoint = |c: &'_ z29c_store::leases::ClaimedStep| {
        let pool = pool.clone();
        let attempt = c.lease.attempt.as_uuid();
        async move {
            sqlx::query_scalar::<_, String>("SELECT checkpoint::text FROM attempts WHERE id = $1")
                .bind(attempt)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };

    let (first, version) = store
        .begin_invocation_with_permit(&a.lease, &req(a), &[])
        .await
        .unwrap();
    assert_eq!(version, a.checkpoint_version + 1);
    assert_eq!(checkpoint(a).await, "invocation_began");
    assert_eq!(first.attempt_id, Some(a.lease.attempt.as_uuid()));

    // the class is full: b's invocation does not begin either
    assert!(matches!(
        store
            .begin_invocation_with_permit(&b.lease, &req(b), &[])
            .await,
        Err(StoreError::PermitsExhausted { limit: 1, .. })
    ));
    assert_eq!(checkpoint(b).await, "request_identity_persisted");

    // a refused fence takes no permit, and the ended permit it carried stays held
    let ended = EndedPermit::now(first.id, "succeeded");
    let mut stale = b.lease.clone();
    stale.owner = owner("worker-b");
    assert!(matches!(
        store
            .begin_invocation_with_permit(&stale, &req(b), &[ended])
            .await,
        Err(StoreError::Fenced(_))
    ));
    let held: String = sqlx::query_scalar("SELECT state FROM adapter_permits WHERE id = $1")
        .bind(first.id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(held, "held", "rolled back with the refused transaction");

    // carried by b's transaction, a's ended permit frees the one slot for b's call
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (second, _) = store
        .begin_invocation_with_permit(&b.lease, &req(b), &[ended])
        .await
        .unwrap();
    assert_eq!(checkpoint(b).await, "invocation_began");
    let (state, reason, waited_ms): (String, String, f64) = sqlx::query_as(
        "SELECT a.state, a.release_reason,
                extract(epoch FROM b.acquired_at - a.released_at)::float8 * 1000
         FROM adapter_permits a, adapter_permits b WHERE a.id = $1 AND b.id = $2",
    )
    .bind(first.id)
    .bind(second.id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((state.as_str(), reason.as_str()), ("released", "succeeded"));
    assert!(
        waited_ms >= 250.0,
        "released_at is when the call ended, not when the release rode along: {waited_ms} ms"
    );
}

/// A relay that keeps up marks what it published and claims the next batch in one
/// transaction; the `workflow_changed` message the mark writes is in that next batch.
#[sqlx::test(migrator = "MIGRATOR")]
async fn the_relay_marks_a_batch_and_claims_the_next_in_one_transaction(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let s = submit(&store, &workflow("relay", vec![step("only", &[])])).await;
    let relay = owner("relay-a");
    let hold = Duration::from_secs(30);
    let first = store.claim_outbox(&relay, 100, hold).await.unwrap();
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(first[0].kind, "step_ready");
    let c = store.claim(&owner("worker-a"), 1).await.unwrap().remove(0);
    invoke(&store, &c).await;
    store
        .commit_receipt(&c.lease, &success(&c, "dest-1"))
        .await
        .unwrap();
    let (marked, second) = store
        .mark_outbox_sent_and_claim(&[first[0].id], &relay, 100, hold)
        .await
        .unwrap();
    assert_eq!(marked, 1);
    let kinds: Vec<&str> = second.iter().map(|m| m.kind.as_str()).collect();
    assert!(
        kinds == ["step_completed", "workflow_changed"] || kinds == ["step_completed"],
        "{kinds:?}"
    );
    let (marked, third) = store
        .mark_outbox_sent_and_claim(
            &second.iter().map(|m| m.id).collect::<Vec<_>>(),
            &relay,
            100,
            hold,
        )
        .await
        .unwrap();
    assert_eq!(marked, second.len() as u64);
    // either the receipt completed the workflow, or the mark of its `step_completed` did,
    // and then its `workflow_changed` message is claimed by the same transaction
    let announced: Vec<&str> = second
        .iter()
        .chain(third.iter())
        .filter(|m| m.kind == "workflow_changed")
        .map(|m| m.kind.as_str())
        .collect();
    assert_eq!(announced.len(), 1, "{second:?} {third:?}");
    assert_eq!(
        store.workflow(s.workflow).await.unwrap().state,
        WorkflowState::Completed
    );
    // the batch just claimed is held from other relays until it is marked
    assert!(
        store
            .claim_outbox(&owner("relay-b"), 100, hold)
            .await
            .unwrap()
            .is_empty()
    );
}

/// The rules on columns that never change are domains (checked where a value enters, not on
/// every update of the row); with the lease invariants and the policy's cross-column rule,
/// which stay table constraints, the database still refuses every bad value, by name.
#[sqlx::test(migrator = "MIGRATOR")]
async fn the_database_refuses_bad_values_where_they_enter(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let s = submit(&store, &workflow("checks", vec![step("a", &[])])).await;
    let refused = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            let e = sqlx::query(sql)
                .bind(s.workflow.as_uuid())
                .execute(&pool)
                .await
                .expect_err(sql);
            match StoreError::from(e) {
                StoreError::Invalid { field, .. } => field,
                other => panic!("{sql}: {other:?}"),
            }
        }
    };
    let cases = [
        (
            "UPDATE steps SET input_digest = 'not-a-digest' WHERE workflow_id = $1",
            "sha256_hex",
        ),
        (
            "UPDATE steps SET name = 'no spaces allowed' WHERE workflow_id = $1",
            "step_name",
        ),
        (
            "UPDATE steps SET adapter = '' WHERE workflow_id = $1",
            "short_name",
        ),
        (
            "UPDATE steps SET max_attempts = 0 WHERE workflow_id = $1",
            "positive",
        ),
        (
            "UPDATE steps SET renew_every_ms = lease_ms WHERE workflow_id = $1",
            "steps_policy_check",
        ),
        (
            "UPDATE steps SET final_grace_ms = lease_ms WHERE workflow_id = $1",
            "steps_policy_check",
        ),
        (
            "UPDATE steps SET lease_version = -1 WHERE workflow_id = $1",
            "steps_lease_version_check",
        ),
        (
            "UPDATE steps SET state = 'leased' WHERE workflow_id = $1",
            "steps_check3",
        ),
        (
            "UPDATE workflows SET submission_digest = 'zz' WHERE id = $1",
            "sha256_hex",
        ),
        (
            "INSERT INTO workflows (id, client_key, submission_digest, name)
             VALUES (z29c_uuid_v7(), '', repeat('a', 64), $1::text)",
            "client_key",
        ),
    ];
    for (sql, constraint) in cases {
        assert_eq!(refused(sql).await, constraint, "{sql}");
    }
    // an update of other columns is not refused, and nothing above changed a row
    sqlx::query("UPDATE steps SET updated_at = now() WHERE workflow_id = $1")
        .bind(s.workflow.as_uuid())
        .execute(&pool)
        .await
        .unwrap();
    let (name, max_attempts): (String, i32) =
        sqlx::query_as("SELECT name, max_attempts FROM steps WHERE workflow_id = $1")
            .bind(s.workflow.as_uuid())
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (name.as_str(), max_attempts),
        ("a", step("a", &[]).policy.max_attempts as i32)
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_steps_history_names_its_own_workflow(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let a = submit(&store, &workflow("history-a", vec![step("a", &[])])).await;
    let b = submit(&store, &workflow("history-b", vec![step("b", &[])])).await;
    let step_of = |w: Uuid| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, Uuid>("SELECT id FROM steps WHERE workflow_id = $1")
                .bind(w)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let (wa, wb) = (a.workflow.as_uuid(), b.workflow.as_uuid());
    let (sa, sb) = (step_of(wa).await, step_of(wb).await);
    let write = |sql: &'static str, workflow: Uuid, step: Uuid| {
        let pool = pool.clone();
        async move {
            sqlx::query(sql)
                .bind(workflow)
                .bind(step)
                .execute(&pool)
                .await
                .map_err(StoreError::from)
        }
    };
    let event = "INSERT INTO step_events (workflow_id, step_id, lease_version, kind)
                 VALUES ($1, $2, 0, 'cancelled')";
    let attempt = "INSERT INTO attempts (id, workflow_id, step_id, number, lease_version, owner,
                       input_digest, adapter, attempt_deadline)
                   VALUES (gen_random_uuid(), $1, $2, 1, 1, 'test', repeat('a', 64), 'http',
                           now() + interval '1 minute')";
    for (sql, constraint) in [
        (event, "step_events_step_fkey"),
        (attempt, "attempts_step_fkey"),
    ] {
        // a step of another workflow, and a step that does not exist, are refused by name
        for (workflow, step) in [(wa, sb), (wb, sa), (wa, Uuid::new_v4())] {
            match write(sql, workflow, step).await {
                Err(StoreError::Invalid { field, .. }) => assert_eq!(field, constraint, "{sql}"),
                other => panic!("{sql} ({workflow}, {step}): {other:?}"),
            }
        }
        // the step's own workflow is accepted
        write(sql, wb, sb).await.expect(sql);
    }
    let events: i64 =
        sqlx::query_scalar("SELECT count(*) FROM step_events WHERE kind = 'cancelled'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(events, 1);
    // and what history names is neither deleted nor moved to another workflow
    for sql in [
        "DELETE FROM steps WHERE workflow_id = $1 AND id = $2",
        "UPDATE steps SET workflow_id = $1 WHERE id = $2",
        "DELETE FROM attempts WHERE workflow_id = $1 AND step_id = $2",
        "UPDATE attempts SET workflow_id = $1 WHERE step_id = $2",
    ] {
        match write(sql, wb, sb).await {
            Err(StoreError::AppendOnly(m)) => assert!(m.contains("keep their keys"), "{m}"),
            other => panic!("{sql}: {other:?}"),
        }
    }
    match write(
        "DELETE FROM workflows WHERE id = $1 AND $2::uuid IS NOT NULL",
        wb,
        sb,
    )
    .await
    {
        Err(StoreError::AppendOnly(_)) => {}
        other => panic!("deleting a workflow: {other:?}"),
    }
    assert_eq!(step_of(wb).await, sb);
}
