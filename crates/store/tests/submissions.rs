//! Submissions arriving together share one statement: each is answered as it would be alone,
//! each workflow's rows are its own, and a taken client key writes nothing in the shared
//! statement.

mod common;

use common::*;
use sqlx::PgPool;
use uuid::Uuid;
use z29c_store::submissions::SubmissionBatches;
use z29c_store::workflows::{NewWorkflow, Prepared, SubmitLimits};
use z29c_store::{MIGRATOR, Store, StoreError};

fn prepared(wf: &NewWorkflow) -> Prepared {
    Prepared::new(wf.clone(), &SubmitLimits::default()).unwrap()
}

fn diamond(key: &str) -> NewWorkflow {
    let mut wf = workflow(
        key,
        vec![
            step("a", &[]),
            step("b", &["a"]),
            step("c", &["a"]),
            step("d", &["b", "c"]),
        ],
    );
    wf.trace_context = Some(format!(
        "00-{}-b7ad6b7169203331-01",
        Uuid::new_v4().simple()
    ));
    wf
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn workflows_written_together_are_each_answered_and_stored_as_if_alone(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let taken = workflow("taken", vec![step("only", &[])]);
    submit(&store, &taken).await;
    let batch = [
        prepared(&diamond("z-diamond")),
        prepared(&taken),
        prepared(&workflow("a-single", vec![step("only", &[])])),
        prepared(&diamond("m-diamond")),
    ];
    let answers = batch_store(&pool)
        .await
        .insert_workflows(&batch)
        .await
        .unwrap();
    assert_eq!(answers.len(), 4);
    assert!(
        answers[1].is_none(),
        "a taken key wrote nothing and is answered None"
    );
    for i in [0, 2, 3] {
        let submitted = answers[i].as_ref().expect("a free key is written");
        assert!(submitted.created);
        let answered = submitted.detail.as_ref().unwrap();
        assert_eq!(answered.client_key, batch[i].client_key().as_str());
        let read = store.workflow(submitted.workflow).await.unwrap();
        assert_eq!(
            serde_json::to_value(answered).unwrap(),
            serde_json::to_value(&read).unwrap(),
            "the answer for {} differs from what was stored",
            answered.client_key
        );
    }
    // one statement: every row written by it is of one transaction
    let transactions: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT x) FROM (
             SELECT w.xmin::text AS x FROM workflows w WHERE w.client_key <> 'taken'
             UNION ALL SELECT s.xmin::text FROM steps s
                 JOIN workflows w ON w.id = s.workflow_id WHERE w.client_key <> 'taken'
             UNION ALL SELECT xmin::text FROM step_dependencies
             UNION ALL SELECT o.xmin::text FROM outbox o
                 JOIN workflows w ON w.id = o.workflow_id WHERE w.client_key <> 'taken') rows",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(transactions, 1);
    // each workflow's dependencies join its own steps, and its step.ready messages name its
    // own ready steps, in its own trace
    let crossed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM step_dependencies sd
         JOIN steps s ON s.id = sd.step_id JOIN steps d ON d.id = sd.depends_on
         WHERE s.workflow_id <> d.workflow_id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(crossed, 0);
    let dependencies: Vec<(String, i64)> = sqlx::query_as(
        "SELECT w.client_key::text, count(*) FROM step_dependencies sd
         JOIN steps s ON s.id = sd.step_id JOIN workflows w ON w.id = s.workflow_id
         GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        dependencies,
        [("m-diamond".to_owned(), 4), ("z-diamond".to_owned(), 4)]
    );
    let messages: Vec<(String, String, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT w.client_key::text, s.name::text, o.trace_context::text, w.trace_context::text
         FROM outbox o JOIN steps s ON s.id = o.step_id AND s.workflow_id = o.workflow_id
         JOIN workflows w ON w.id = o.workflow_id
         WHERE o.kind = 'step_ready' ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let keys: Vec<(&str, &str)> = messages
        .iter()
        .map(|(k, s, _, _)| (k.as_str(), s.as_str()))
        .collect();
    assert_eq!(
        keys,
        [
            ("a-single", "only"),
            ("m-diamond", "a"),
            ("taken", "only"),
            ("z-diamond", "a")
        ]
    );
    assert!(messages.iter().all(|(_, _, o, w)| o == w));
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn one_key_twice_in_a_batch_is_one_workflow_and_another_payload_under_it_conflicts(
    pool: PgPool,
) {
    let store = Store::from_pool(pool.clone());
    let first = diamond("twice");
    let mut other = first.clone();
    other.name = "another payload".into();
    let batch = [prepared(&first), prepared(&first), prepared(&other)];
    let answers = batch_store(&pool)
        .await
        .insert_workflows(&batch)
        .await
        .unwrap();
    // keys are written in key order, and a key's first submission in the batch takes it
    assert!(
        answers[0].is_some(),
        "the key's first submission is written"
    );
    assert!(
        answers[1].is_none() && answers[2].is_none(),
        "one key, one workflow"
    );
    let written = answers[0].as_ref().unwrap().workflow;
    // the ones the statement did not take are answered as submissions of their own
    let again = store.submit_prepared(&batch[1]).await.unwrap();
    assert_eq!((again.workflow, again.created), (written, false));
    let different = store.submit_prepared(&batch[2]).await;
    assert!(
        matches!(different, Err(StoreError::Conflict(_))),
        "{different:?}"
    );
    let workflows: i64 = sqlx::query_scalar("SELECT count(*) FROM workflows")
        .fetch_one(&pool)
        .await
        .unwrap();
    let steps: i64 = sqlx::query_scalar("SELECT count(*) FROM steps")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!((workflows, steps), (1, 4));
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn concurrent_submissions_share_statements_and_each_key_is_written_once(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let batches = SubmissionBatches::start(&batch_store(&pool).await, &store, 2, 32);
    // 60 submissions of 30 keys, each key twice, all at once
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..60 {
        let batches = batches.clone();
        let wf = workflow(
            &format!("k-{}", i % 30),
            vec![step("a", &[]), step("b", &["a"])],
        );
        calls.spawn(async move { batches.submit(prepared(&wf)).await });
    }
    let mut answered = Vec::new();
    while let Some(r) = calls.join_next().await {
        answered.push(r.unwrap().expect("every submission is answered"));
    }
    assert_eq!(answered.iter().filter(|s| s.created).count(), 30);
    let mut ids: Vec<_> = answered.iter().map(|s| s.workflow).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 30, "each key answered with its one workflow");
    let (workflows, steps, messages, transactions): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM workflows), (SELECT count(*) FROM steps),
                (SELECT count(*) FROM outbox), (SELECT count(DISTINCT xmin::text) FROM workflows)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((workflows, steps, messages), (30, 60, 30));
    assert!(
        transactions < 30,
        "30 workflows in {transactions} transactions: the submissions shared no statement"
    );
}
