//! Receipts of many attempts in one statement, on real PostgreSQL: each row is fenced on its
//! own, a row that may not be written there writes nothing and is answered `None`, and what
//! the statement writes is exactly what the receipt's own transaction writes.

mod common;

use common::*;
use serde_json::{Value, json};
use sqlx::PgPool;
use z29c_core::{Outcome, StepId, WorkflowState};
use z29c_store::leases::{ClaimedStep, CommitOutcome, Observed};
use z29c_store::receipts::ReceiptBatches;
use z29c_store::{MIGRATOR, Store};

/// How many receipts there are, and how many transactions wrote them with everything they
/// changed (their steps, attempts and events).
async fn transactions(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM step_receipts), count(DISTINCT x) FROM (
             SELECT xmin::text AS x FROM step_receipts
             UNION ALL SELECT a.xmin::text FROM attempts a JOIN step_receipts r
                                                ON r.attempt_id = a.id
             UNION ALL SELECT s.xmin::text FROM steps s JOIN step_receipts r ON r.step_id = s.id
             UNION ALL SELECT e.xmin::text FROM step_events e JOIN step_receipts r
                                                  ON r.step_id = e.step_id
                       WHERE e.kind = 'lease_released') t",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Claims `n` ready steps and begins their invocations.
async fn claimed_and_begun(store: &Store, n: usize) -> Vec<ClaimedStep> {
    let claimed = store.claim(&owner("worker-a"), n as i64).await.unwrap();
    assert_eq!(claimed.len(), n);
    for c in &claimed {
        invoke(store, c).await;
    }
    claimed
}

/// Everything a receipt wrote about its step, without the ids and times that differ between
/// two steps: the attempt's end, the step's end, its last three events, its receipt, and its
/// workflow's messages after `step_ready`.
async fn written(pool: &PgPool, c: &ClaimedStep) -> Value {
    let row: Value = sqlx::query_scalar(
        "SELECT jsonb_build_object(
             'attempt', (SELECT jsonb_build_object('checkpoint', checkpoint, 'state', state,
                             'observed', response_observed_at IS NOT NULL,
                             'result', observed_result, 'adapter_version', adapter_version)
                         FROM attempts WHERE id = $2),
             'step', (SELECT jsonb_build_object('state', state, 'owner', lease_owner,
                          'leased_at', leased_at, 'expires_at', expires_at,
                          'checkpoint_version', checkpoint_version - $4,
                          'request_identity', request_identity = $5)
                      FROM steps WHERE id = $1),
             'events', (SELECT jsonb_agg(jsonb_build_object('kind', kind, 'owner', owner,
                            'lease_version', lease_version, 'attempt', attempt_id = $2,
                            'detail', detail - 'receipt' - 'checkpoint_version',
                            'version', (detail->>'checkpoint_version')::int8 - $4,
                            'names_receipt', detail->>'receipt' = (SELECT id::text
                                FROM step_receipts WHERE step_id = $1)) ORDER BY id)
                        FROM (SELECT * FROM step_events WHERE step_id = $1
                              ORDER BY id DESC LIMIT 3) e),
             'receipt', (SELECT to_jsonb(r) - 'id' - 'step_id' - 'workflow_id' - 'attempt_id'
                                - 'committed_at' - 'request_identity' - 'input_digest'
                                - 'external_reference'
                         FROM step_receipts r WHERE step_id = $1),
             'messages', (SELECT jsonb_agg(jsonb_build_object('kind', kind,
                              'names_step', step_id = $1, 'payload', payload) ORDER BY id)
                          FROM outbox WHERE workflow_id = $3 AND kind <> 'step_ready'),
             'workflow', (SELECT state FROM workflows WHERE id = $3))",
    )
    .bind(c.lease.step.as_uuid())
    .bind(c.lease.attempt.as_uuid())
    .bind(c.workflow.as_uuid())
    .bind(c.checkpoint_version)
    .bind(c.request_identity.as_str())
    .fetch_one(pool)
    .await
    .unwrap();
    row
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn the_shared_statement_writes_what_the_receipts_own_transaction_writes(pool: PgPool) {
    let store = batch_store(&pool).await;
    submit(&store, &workflow("one", vec![step("only", &[])])).await;
    submit(&store, &workflow("two", vec![step("only", &[])])).await;
    let claimed = claimed_and_begun(&store, 2).await;
    let (a, b) = (&claimed[0], &claimed[1]);

    let shared = store
        .commit_receipts(&[(&a.lease, &success(a, "dest-a"))])
        .await
        .unwrap();
    assert!(shared[0].is_some(), "a current success is written there");
    let alone = store
        .commit_or_keep_late(&b.lease, &success(b, "dest-b"))
        .await
        .unwrap();
    assert!(matches!(alone, CommitOutcome::Committed(_)));

    let (wa, wb) = (written(&pool, a).await, written(&pool, b).await);
    assert_eq!(wa, wb, "the same rows, whichever way the receipt went");
    assert_eq!(wa["workflow"], json!("completed"));
    assert_eq!(
        wa["messages"],
        json!([
            { "kind": "step_completed", "names_step": true,
              "payload": { "outcome": "succeeded", "verification": "direct" } },
            { "kind": "workflow_changed", "names_step": null,
              "payload": { "state": "completed" } }
        ])
    );
    assert_eq!(wa["events"][2]["names_receipt"], json!(true));
}

/// A worker goes on to its next call while its receipt waits for a statement: the attempt's
/// `response_observed_at` is when the answer was seen, as the worker reckons it on
/// PostgreSQL's clock, not when the receipt was written, in the shared statement and in the
/// receipt's own transaction alike; kept between the invocation's beginning and the
/// statement's time, and the statement's time when the observer gave none.
#[sqlx::test(migrator = "MIGRATOR")]
async fn the_attempt_records_when_its_answer_was_seen_not_when_its_receipt_was_written(
    pool: PgPool,
) {
    use chrono::{DateTime, TimeDelta, Utc};
    let store = batch_store(&pool).await;
    for key in ["a", "b", "c", "d", "e", "f"] {
        submit(&store, &workflow(key, vec![step("only", &[])])).await;
    }
    let claimed = claimed_and_begun(&store, 6).await;
    let began = |c: &ClaimedStep| {
        let pool = pool.clone();
        let attempt = c.lease.attempt.as_uuid();
        async move {
            sqlx::query_scalar::<_, DateTime<Utc>>(
                "SELECT invocation_began_at FROM attempts WHERE id = $1",
            )
            .bind(attempt)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let ms = TimeDelta::milliseconds;
    // (the time the observer gives, what the attempt must record: None for the receipt's
    // statement time), for the shared statement and the transaction in turn
    let mut cases = Vec::new();
    for (i, c) in claimed.iter().enumerate() {
        let b = began(c).await;
        let (seen, want) = match i % 3 {
            0 => (Some(b + ms(1)), Some(b + ms(1))),
            1 => (Some(b - ms(1000)), Some(b)),
            _ => (None, None),
        };
        let observed = Observed {
            seen,
            ..success(c, &format!("dest-{i}"))
        };
        let receipt = if i < 3 {
            store
                .commit_receipts(&[(&c.lease, &observed)])
                .await
                .unwrap()[0]
                .clone()
                .expect("written in the shared statement")
        } else {
            match store
                .commit_or_keep_late(&c.lease, &observed)
                .await
                .unwrap()
            {
                CommitOutcome::Committed(r) => r,
                other => panic!("{other:?}"),
            }
        };
        cases.push((c, want, receipt.committed_at));
    }
    for (c, want, committed_at) in cases {
        let got: DateTime<Utc> =
            sqlx::query_scalar("SELECT response_observed_at FROM attempts WHERE id = $1")
                .bind(c.lease.attempt.as_uuid())
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(
            got,
            want.unwrap_or(committed_at),
            "response observed for {want:?}"
        );
    }
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn many_receipts_share_one_statement_and_each_is_fenced_on_its_own(pool: PgPool) {
    let store = batch_store(&pool).await;
    // ten one-step workflows, and a fan-out of six whose receipts all come in the batch
    for i in 0..10 {
        submit(
            &store,
            &workflow(&format!("single-{i}"), vec![step("only", &[])]),
        )
        .await;
    }
    let fan: Vec<_> = (0..6).map(|i| step(&format!("s{i}"), &[])).collect();
    let fan_id = submit(&store, &workflow("fan", fan)).await.workflow;
    let claimed = claimed_and_begun(&store, 16).await;

    // four that may not be written here: a lease lost to recovery, an observation of another
    // request, a failure, and a receipt whose lease has no invocation that began
    let stale = &claimed[1];
    let _recovery = take_over(&store, &pool, stale).await;
    let mut foreign = success(&claimed[2], "dest-foreign");
    foreign.request_identity = claimed[3].request_identity.clone();
    let mut failed = success(&claimed[4], "dest-failed");
    failed.outcome = Outcome::Failed;
    failed.external_reference = None;
    let observed: Vec<Observed> = claimed
        .iter()
        .enumerate()
        .map(|(i, c)| match i {
            2 => foreign.clone(),
            4 => failed.clone(),
            _ => success(c, &format!("dest-{i}")),
        })
        .collect();
    let refused = [1, 2, 4];
    let rows: Vec<_> = claimed
        .iter()
        .zip(&observed)
        .map(|(c, o)| (&c.lease, o))
        .collect();
    let answers = store.commit_receipts(&rows).await.unwrap();
    assert_eq!(
        transactions(&pool).await,
        (13, 1),
        "thirteen receipts, with their steps, attempts and events, in one transaction"
    );

    for (i, (c, answer)) in claimed.iter().zip(&answers).enumerate() {
        let receipts = count(
            &pool,
            "SELECT count(*) FROM step_receipts WHERE step_id = $1",
            c.lease.step,
        )
        .await;
        if refused.contains(&i) {
            assert!(answer.is_none(), "row {i} is left to its own transaction");
            assert_eq!(receipts, 0, "row {i} wrote nothing");
            let state: String = sqlx::query_scalar("SELECT state::text FROM steps WHERE id = $1")
                .bind(c.lease.step.as_uuid())
                .fetch_one(&pool)
                .await
                .unwrap();
            let expected = if i == 1 { "recovering" } else { "leased" };
            assert_eq!(state, expected, "row {i}'s step is as it was");
        } else {
            let receipt = answer.as_ref().unwrap_or_else(|| panic!("row {i} written"));
            assert_eq!(receipt.step, c.lease.step);
            assert_eq!(receipt.attempt, Some(c.lease.attempt.as_uuid()));
            assert_eq!(
                receipt.external_reference.as_deref(),
                Some(format!("dest-{i}").as_str())
            );
            assert_eq!(receipts, 1);
        }
    }

    // the ones left over take their own transactions and end as they always did
    let late = store
        .commit_or_keep_late(&stale.lease, &observed[1])
        .await
        .unwrap();
    assert!(matches!(late, CommitOutcome::Late { .. }), "{late:?}");
    let conflict = store
        .commit_or_keep_late(&claimed[2].lease, &foreign)
        .await
        .unwrap();
    assert!(
        matches!(conflict, CommitOutcome::Late { .. }),
        "another request's observation is kept as evidence, not as the receipt: {conflict:?}"
    );
    let failure = store
        .commit_or_keep_late(&claimed[4].lease, &failed)
        .await
        .unwrap();
    assert!(matches!(failure, CommitOutcome::Committed(_)));

    // the fan-out's siblings all finished in the statement: it completed the workflow, with
    // one message, after its last step's
    let fan_steps: Vec<StepId> = claimed
        .iter()
        .filter(|c| c.workflow == fan_id)
        .map(|c| c.lease.step)
        .collect();
    assert_eq!(fan_steps.len(), 6);
    // (claims take the oldest ready steps first: the one-step workflows' were submitted first)
    assert!(
        fan_steps.iter().all(|s| {
            let i = claimed.iter().position(|c| c.lease.step == *s).unwrap();
            !refused.contains(&i)
        }),
        "the refused rows are one-step workflows'"
    );
    {
        assert_eq!(
            store.workflow(fan_id).await.unwrap().state,
            WorkflowState::Completed
        );
        let kinds: Vec<String> = sqlx::query_scalar(
            "SELECT kind FROM outbox WHERE workflow_id = $1 AND kind <> 'step_ready' ORDER BY id",
        )
        .bind(fan_id.as_uuid())
        .fetch_all(&pool)
        .await
        .unwrap();
        let mut expected = vec!["step_completed".to_owned(); 6];
        expected.push("workflow_changed".to_owned());
        assert_eq!(kinds, expected);
    }
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_step_with_dependents_or_a_stopped_workflow_takes_the_transaction(pool: PgPool) {
    let store = batch_store(&pool).await;
    submit(
        &store,
        &workflow("chain", vec![step("a", &[]), step("b", &["a"])]),
    )
    .await;
    let cancelled = submit(&store, &workflow("cancelled", vec![step("only", &[])]))
        .await
        .workflow;
    let claimed = claimed_and_begun(&store, 2).await;
    store.cancel_workflow(cancelled, "test").await.unwrap();
    let rows: Vec<_> = claimed
        .iter()
        .map(|c| {
            (
                c.lease.clone(),
                success(c, &format!("dest-{}", c.lease.step)),
            )
        })
        .collect();
    let refs: Vec<_> = rows.iter().map(|(l, o)| (l, o)).collect();
    let answers = store.commit_receipts(&refs).await.unwrap();
    assert!(
        answers.iter().all(Option::is_none),
        "neither is written here"
    );
    let (receipts, _) = transactions(&pool).await;
    assert_eq!(receipts, 0);
    // the receipt's own transaction releases the dependent, and records the cancelled
    // workflow's in-flight outcome
    for (lease, o) in &rows {
        let r = store.commit_receipt(lease, o).await.unwrap();
        assert_eq!(r.step, lease.step);
    }
    let ready: i64 = sqlx::query_scalar("SELECT count(*) FROM steps WHERE state = 'ready'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(ready, 1, "b was released");
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn concurrent_receipts_go_through_batches_and_a_stale_one_is_kept_as_evidence(pool: PgPool) {
    const STEPS: usize = 40;
    let store = batch_store(&pool).await;
    for i in 0..STEPS {
        submit(&store, &workflow(&format!("w{i}"), vec![step("only", &[])])).await;
    }
    let claimed = claimed_and_begun(&store, STEPS).await;
    let stale = claimed[5].clone();
    let _recovery = take_over(&store, &pool, &stale).await;
    let batches = ReceiptBatches::start(&store, &store, 2, 16);
    let mut tasks = tokio::task::JoinSet::new();
    for c in claimed {
        let batches = batches.clone();
        tasks.spawn(async move {
            let o = success(&c, &format!("dest-{}", c.lease.step));
            (
                c.lease.step,
                batches.commit_or_keep_late(&c.lease, &o).await,
            )
        });
    }
    let mut committed = 0;
    while let Some(r) = tasks.join_next().await {
        match r.unwrap() {
            (step, Ok(CommitOutcome::Committed(receipt))) => {
                assert_eq!(receipt.step, step);
                committed += 1;
            }
            (step, Ok(CommitOutcome::Late { .. })) => assert_eq!(step, stale.lease.step),
            (step, other) => panic!("{step}: {other:?}"),
        }
    }
    assert_eq!(committed, STEPS - 1);
    let late: i64 = sqlx::query_scalar("SELECT count(*) FROM late_observations WHERE step_id = $1")
        .bind(stale.lease.step.as_uuid())
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(late, 1, "what the stale attempt saw is kept");
    let done: i64 = sqlx::query_scalar("SELECT count(*) FROM workflows WHERE state = 'completed'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(done, (STEPS - 1) as i64);
    // the receipts waiting together shared statements
    let (receipts, xacts) = transactions(&pool).await;
    assert_eq!(receipts, (STEPS - 1) as i64);
    assert!(
        xacts < receipts,
        "{receipts} receipts in {xacts} transactions: none shared"
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn each_condition_of_the_fence_alone_keeps_a_row_out(pool: PgPool) {
    let store = batch_store(&pool).await;
    for i in 0..2 {
        submit(&store, &workflow(&format!("w{i}"), vec![step("only", &[])])).await;
    }
    let claimed = claimed_and_begun(&store, 2).await;
    let (c, expired) = (&claimed[0], &claimed[1]);
    let o = success(c, "dest-1");
    let mut other_owner = c.lease.clone();
    other_owner.owner = owner("worker-b");
    let mut older = c.lease.clone();
    older.version = z29c_core::LeaseVersion::new(c.lease.version.get() - 1).unwrap();
    let mut newer = c.lease.clone();
    newer.version = z29c_core::LeaseVersion::new(c.lease.version.get() + 1).unwrap();
    let mut other_attempt = c.lease.clone();
    other_attempt.attempt = z29c_core::AttemptId::new();
    let mut other_input = o.clone();
    other_input.input_digest = expired.input_digest.clone();
    if other_input.input_digest == o.input_digest {
        other_input.input_digest = z29c_core::InputDigest::of_json(&json!({ "other": true }));
    }
    // the second step's lease ran out by PostgreSQL's clock; nothing else about it changed
    expire(&pool, expired.lease.step).await;
    let expired_o = success(expired, "dest-2");
    let cases: Vec<(&str, &z29c_store::leases::ClaimedStep, _, &Observed)> = vec![
        ("another owner", c, other_owner, &o),
        ("an older lease version", c, older, &o),
        ("a newer lease version", c, newer, &o),
        ("another attempt", c, other_attempt, &o),
        ("another input", c, c.lease.clone(), &other_input),
        (
            "an expired lease",
            expired,
            expired.lease.clone(),
            &expired_o,
        ),
    ];
    for (why, _, lease, observed) in &cases {
        let answers = store.commit_receipts(&[(lease, observed)]).await.unwrap();
        assert!(answers[0].is_none(), "{why}: not written");
        let (receipts, _) = transactions(&pool).await;
        assert_eq!(receipts, 0, "{why}: nothing written");
    }
    // and the lease as it is, with its own observation, is written
    let answers = store.commit_receipts(&[(&c.lease, &o)]).await.unwrap();
    assert!(answers[0].is_some());
    assert_eq!(transactions(&pool).await, (1, 1));
}
