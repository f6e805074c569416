//! What the hot path's statements read, from PostgreSQL's own plans: a claim touches the steps
//! it may take, not the history of everything that ran before.

mod common;

use common::*;
use sqlx::PgPool;
use z29c_store::{MIGRATOR, Store};

/// Blocks the plan's scans of `relation` touched, cache hits and reads, over every node
/// (subplans included).
fn blocks_of(node: &serde_json::Value, relation: &str) -> i64 {
    let own = if node["Relation Name"] == relation {
        node["Shared Hit Blocks"].as_i64().unwrap() + node["Shared Read Blocks"].as_i64().unwrap()
    } else {
        0
    };
    let children = node["Plans"].as_array().into_iter().flatten();
    own + children.map(|c| blocks_of(c, relation)).sum::<i64>()
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn claims_do_not_read_finished_history(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    // 3,001 completed workflows of 30 steps each, as a server that has run for a while keeps
    // them: what a claim must not read
    let names: Vec<String> = (0..100).map(|i| format!("s{i}")).collect();
    let steps = |n: usize| names[..n].iter().map(|n| step(n, &[])).collect();
    submit(&store, &workflow("ended-0", steps(30))).await;
    sqlx::query(
        "WITH w AS (UPDATE workflows SET state = 'completed', ended_at = now()
                    WHERE client_key = 'ended-0' RETURNING id)
         UPDATE steps SET state = 'completed' WHERE workflow_id = (SELECT id FROM w)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO workflows (id, client_key, submission_digest, name, state, ended_at)
         SELECT gen_random_uuid(), 'ended-' || g, submission_digest, name, state, ended_at
         FROM workflows, generate_series(1, 3000) g WHERE client_key = 'ended-0'",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO steps (id, workflow_id, name, position, adapter, operation, input,
             input_digest, lease_ms, renew_every_ms, attempt_deadline_ms, final_grace_ms,
             adapter_timeout_ms, progress_observable, max_attempts, state)
         SELECT gen_random_uuid(), w.id, t.name, t.position, t.adapter, t.operation, t.input,
             t.input_digest, t.lease_ms, t.renew_every_ms, t.attempt_deadline_ms,
             t.final_grace_ms, t.adapter_timeout_ms, t.progress_observable, t.max_attempts,
             t.state
         FROM workflows w CROSS JOIN steps t
         WHERE w.client_key LIKE 'ended-%' AND w.client_key <> 'ended-0'
           AND t.workflow_id = (SELECT id FROM workflows WHERE client_key = 'ended-0')",
    )
    .execute(&pool)
    .await
    .unwrap();
    // and 30 running workflows of 100 ready steps each, as a steady load keeps them waiting
    for w in 0..30 {
        submit(&store, &workflow(&format!("live-{w}"), steps(100))).await;
    }
    sqlx::query("ANALYZE").execute(&pool).await.unwrap();

    let plan = store.claim_plan(&owner("worker-a"), 8).await.unwrap();
    // eight steps' workflows, each looked up by key twice (its state, then its deadline and
    // trace context for the worker): 48 blocks. A walk of the workflows for the running ones
    // read 3,438 (the plan this replaced).
    let read = blocks_of(&plan[0]["Plan"], "workflows");
    assert!(read > 0, "the workflow's state is checked: {plan:#}");
    assert!(
        read < 100,
        "a claim read {read} blocks of workflows: {plan:#}"
    );
    // the plan was rolled back: nothing was claimed, and a claim takes the oldest ready steps
    let leased: i64 = sqlx::query_scalar("SELECT count(*) FROM steps WHERE state = 'leased'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(leased, 0);
    let claimed = store.claim(&owner("worker-a"), 8).await.unwrap();
    assert_eq!(claimed.len(), 8);
    let first: Vec<_> = sqlx::query_scalar(
        "SELECT s.id FROM steps s JOIN workflows w ON w.id = s.workflow_id
         WHERE w.client_key LIKE 'live-%' ORDER BY s.next_eligible_at, s.id LIMIT 8",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut got: Vec<_> = claimed.iter().map(|c| c.lease.step.as_uuid()).collect();
    got.sort();
    let mut want: Vec<uuid::Uuid> = first;
    want.sort();
    assert_eq!(got, want);
}
