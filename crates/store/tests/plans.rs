//! What the hot path's statements read, from PostgreSQL's own plans: a claim touches the steps
//! it may take, not the history of everything that ran before.

mod common;

use common::*;
use sqlx::PgPool;
use z29c_store::{MIGRATOR, Store};

/// Blocks the plan's scans of `relation` touched, cache hits and reads, over every node
/// (subplans included).
fn blocks_of(node: &serde_json::Value, relation: &str) -> i64 {
    let own = if node["Relation Name"]
        .as_str()
        .is_some_and(|r| is_part_of(r, relation))
    {
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
         SELECT z29c_uuid_v7(), 'ended-' || g, submission_digest, name, state, ended_at
         FROM workflows, generate_series(1, 3000) g WHERE client_key = 'ended-0'",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO steps (id, workflow_id, name, position, adapter, operation, input,
             input_digest, lease_ms, renew_every_ms, attempt_deadline_ms, final_grace_ms,
             adapter_timeout_ms, max_attempts, state)
         SELECT gen_random_uuid(), w.id, t.name, t.position, t.adapter, t.operation, t.input,
             t.input_digest, t.lease_ms, t.renew_every_ms, t.attempt_deadline_ms,
             t.final_grace_ms, t.adapter_timeout_ms, t.max_attempts,
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

/// Every scan in the plan, as (node type, relation, index, blocks touched), subplans included.
fn scans_of(node: &serde_json::Value, out: &mut Vec<(String, String, String, i64)>) {
    let kind = node["Node Type"].as_str().unwrap_or_default();
    if let Some(relation) = node["Relation Name"].as_str()
        && kind.ends_with("Scan")
    {
        out.push((
            kind.to_owned(),
            relation.to_owned(),
            node["Index Name"].as_str().unwrap_or_default().to_owned(),
            node["Shared Hit Blocks"].as_i64().unwrap()
                + node["Shared Read Blocks"].as_i64().unwrap(),
        ));
    }
    for child in node["Plans"].as_array().into_iter().flatten() {
        scans_of(child, out);
    }
}

/// A relay's claim walks the primary key from its head and updates what it took by key, even
/// when the outbox is a few live rows in thousands of pages of rows published since its last
/// vacuum. Left to the statistics, the planner chose at times to read the whole table and sort
/// it (37–123 ms per claim in a steady run), or to bitmap-scan it (as it does here, without
/// the claim's settings), or to merge-join the picked rows with a walk of the primary key.
/// Which one it picks depends on statistics a test cannot pin, so this checks that the claim's
/// plan has none of them.
#[sqlx::test(migrator = "MIGRATOR")]
async fn outbox_claims_walk_the_primary_key_however_bloated_the_table(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    submit(&store, &workflow("w", vec![step("a", &[])])).await;
    // 60,000 messages claimed and published (deleted), 10 still waiting, no vacuum since
    sqlx::query(
        "INSERT INTO outbox (msg_id, kind, workflow_id, payload)
         SELECT 'bulk-' || g, 'step_ready', (SELECT id FROM workflows), '{}'
         FROM generate_series(1, 60010) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("UPDATE outbox SET claimed_by = 'old-relay', claimed_until = now()")
        .execute(&pool)
        .await
        .unwrap();
    let waiting: Vec<i64> = sqlx::query_scalar(
        "WITH gone AS (DELETE FROM outbox WHERE id NOT IN
                           (SELECT id FROM outbox ORDER BY id DESC LIMIT 10))
         SELECT id FROM outbox ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE outbox").execute(&pool).await.unwrap();
    let pages: i32 = sqlx::query_scalar("SELECT relpages FROM pg_class WHERE relname = 'outbox'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(pages > 1000, "the outbox holds {pages} pages");

    let relay = owner("relay-a");
    let plan = store.outbox_claim_plan(&relay, 200).await.unwrap();
    let mut scans = Vec::new();
    scans_of(&plan[0]["Plan"], &mut scans);
    let outbox: Vec<_> = scans.iter().filter(|(_, r, _, _)| r == "outbox").collect();
    assert!(
        outbox.iter().all(|(node, _, _, _)| node == "Index Scan"),
        "the outbox is read by index only: {scans:?}"
    );
    assert!(
        outbox.iter().any(|(_, _, index, _)| index == "outbox_pkey"),
        "the claim walks the primary key: {scans:?}"
    );
    let text = plan.to_string();
    for node in ["\"Sort\"", "\"Merge Join\"", "\"Hash Join\""] {
        assert!(
            !text.contains(node),
            "the claim neither sorts nor joins: {plan:#}"
        );
    }
    // How many blocks the walk reads is not checked: until no snapshot older than the deletes
    // is open (another test's, here), each published row's entry still sends it to the heap.
    // the plans were rolled back: a claim takes the ten waiting messages, oldest first
    let claimed = store
        .claim_outbox(&relay, 200, std::time::Duration::from_secs(30))
        .await
        .unwrap();
    let got: Vec<i64> = claimed.iter().map(|m| m.id).collect();
    assert_eq!(&got[got.len() - 10..], &waiting[waiting.len() - 10..]);
}

/// A pool of one connection to `pool`'s database, and a store on it: every statement below
/// goes through that connection's plan cache.
async fn one_connection(pool: &PgPool) -> (PgPool, Store) {
    let one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    (one.clone(), Store::from_pool(one))
}

/// The connection's counts reach the statistics before it answers (PostgreSQL 15).
async fn flush_statistics(one: &PgPool) {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(one)
        .await
        .unwrap();
}

/// Rows sequential scans of `table` (its partitions) have read so far, as PostgreSQL's
/// statistics count them (an empty partition's scan reads none).
async fn seq_scans(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(seq_tup_read), 0)::bigint FROM pg_stat_user_tables
         WHERE relid IN (SELECT relid FROM pg_partition_tree($1::regclass))",
    )
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn workflow_reads_walk_indexes_whatever_plan_their_connection_cached(pool: PgPool) {
    const TABLES: [&str; 4] = ["workflows", "steps", "attempts", "step_receipts"];
    // no analyze in between: a fresh database, as every submission's answer first reads it
    for table in TABLES {
        without_autovacuum(&pool, table).await;
    }
    // one connection: its plan cache is the one every read below goes through
    let (one, store) = one_connection(&pool).await;
    // a step with an attempt and a receipt, so every join has a row to join
    let c = claimed_single(&store, "w", "executor-1").await;
    invoke(&store, &c).await;
    store
        .commit_receipt(&c.lease, &success(&c, "ref-w"))
        .await
        .unwrap();
    // the tables tiny: the connection plans the reads, then caches a generic plan (after five)
    for _ in 0..8 {
        store.workflow(c.workflow).await.unwrap();
        store
            .list_workflows(10, None, &Default::default())
            .await
            .unwrap();
    }
    // then they grow: 3,000 more workflows, each with its step, attempt and receipt
    sqlx::query(
        "WITH w AS (INSERT INTO workflows (id, client_key, submission_digest, name)
                    SELECT z29c_uuid_v7(), 'more-' || g, repeat('a', 64), 'w'
                    FROM generate_series(1, 3000) g RETURNING id),
              s AS (INSERT INTO steps (id, workflow_id, name, position, adapter, operation,
                        input, input_digest, lease_ms, renew_every_ms, attempt_deadline_ms,
                        final_grace_ms, adapter_timeout_ms, max_attempts, state)
                    SELECT gen_random_uuid(), w.id, 'only', 0, 'a', 'op', '{}', repeat('a', 64),
                        30000, 10000, 60000, 1000, 10000, 3, 'completed'
                    FROM w RETURNING id, workflow_id),
              a AS (INSERT INTO attempts (id, step_id, workflow_id, number, lease_version,
                        owner, state, checkpoint, request_identity, input_digest, adapter,
                        adapter_version, attempt_deadline, invocation_began_at)
                    SELECT gen_random_uuid(), s.id, s.workflow_id, 1, 1, 'executor-1',
                        'succeeded', 'receipt_committed', 'r-' || s.id, repeat('a', 64), 'a',
                        '1', now(), now()
                    FROM s RETURNING id, step_id, workflow_id, request_identity)
         INSERT INTO step_receipts (id, step_id, workflow_id, attempt_id, lease_version,
             input_digest, adapter, adapter_version, request_identity, external_reference,
             outcome, observed_result, verification)
         SELECT gen_random_uuid(), a.step_id, a.workflow_id, a.id, 1, repeat('a', 64), 'a', '1',
             a.request_identity, 'ref-' || a.id, 'succeeded', '{}', 'direct'
         FROM a",
    )
    .execute(&one)
    .await
    .unwrap();
    flush_statistics(&one).await;
    let mut before = Vec::new();
    for t in TABLES {
        before.push(seq_scans(&pool, t).await);
    }
    let read = store.workflow(c.workflow).await.unwrap();
    assert_eq!(read.steps.len(), 1);
    assert!(
        read.steps[0].receipt.is_some(),
        "the read still joins the receipt"
    );
    assert_eq!(
        store
            .list_workflows(10, None, &Default::default())
            .await
            .unwrap()
            .workflows
            .len(),
        10
    );
    flush_statistics(&one).await;
    for (t, before) in TABLES.iter().zip(before) {
        assert_eq!(
            seq_scans(&pool, t).await,
            before,
            "a workflow read scanned all of {t}"
        );
    }
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn the_deadline_sweep_reads_the_overdue_workflows_not_every_workflow(pool: PgPool) {
    let (one, store) = one_connection(&pool).await;
    current_partition(&pool, "workflows").await;
    // 5,000 workflows that ended long ago (their deadlines passed too), three running and
    // overdue, two running with time left
    sqlx::raw_sql(
        "INSERT INTO workflows (id, client_key, submission_digest, name, state, deadline,
                                ended_at)
         SELECT z29c_uuid_v7(), 'ended-' || g, repeat('a', 64), 'w', 'completed',
                now() - interval '1 day', now()
         FROM generate_series(1, 5000) g;
         INSERT INTO workflows (id, client_key, submission_digest, name, deadline)
         SELECT z29c_uuid_v7(), 'late-' || g, repeat('a', 64), 'w',
                now() - g * interval '1 minute'
         FROM generate_series(1, 3) g;
         INSERT INTO workflows (id, client_key, submission_digest, name, deadline)
         SELECT z29c_uuid_v7(), 'early-' || g, repeat('a', 64), 'w', now() + interval '1 hour'
         FROM generate_series(1, 2) g;
         ANALYZE workflows;",
    )
    .execute(&one)
    .await
    .unwrap();
    flush_statistics(&one).await;
    let before = seq_scans(&pool, "workflows").await;
    let overdue = store.overdue_workflows(100).await.unwrap();
    flush_statistics(&one).await;
    assert_eq!(
        seq_scans(&pool, "workflows").await,
        before,
        "the sweep read every workflow"
    );
    let mut keys = Vec::new();
    for id in overdue {
        let key: String = sqlx::query_scalar("SELECT client_key FROM workflows WHERE id = $1")
            .bind(id.as_uuid())
            .fetch_one(&pool)
            .await
            .unwrap();
        keys.push(key);
    }
    assert_eq!(
        keys,
        ["late-3", "late-2", "late-1"],
        "oldest deadline first"
    );
}

/// The Unix milliseconds of a version-7 UUID, or `None` for any other version.
fn v7_millis(id: uuid::Uuid) -> Option<u64> {
    let (seconds, nanos) = id.get_timestamp()?.to_unix();
    (id.get_version() == Some(uuid::Version::SortRand))
        .then(|| seconds * 1_000 + u64::from(nanos) / 1_000_000)
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn keys_made_in_sql_are_time_ordered_so_their_indexes_grow_at_one_edge(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    // floored, as the UUID's milliseconds are (a cast to int8 would round up)
    let clock = "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::int8";
    let before: i64 = sqlx::query_scalar(clock).fetch_one(&pool).await.unwrap();
    // the function itself: version 7, RFC 9562's variant, now's milliseconds, all distinct
    let made: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT z29c_uuid_v7() FROM generate_series(1, 1000)")
            .fetch_all(&pool)
            .await
            .unwrap();
    let distinct: std::collections::HashSet<_> = made.iter().collect();
    assert_eq!(distinct.len(), 1000, "no two alike");
    assert!(
        made.iter()
            .all(|id| id.get_variant() == uuid::Variant::RFC4122)
    );

    submit(
        &store,
        &workflow("ordered-1", vec![step("a", &[]), step("b", &[])]),
    )
    .await;
    let claimed = store.claim(&owner("worker-a"), 2).await.unwrap();
    assert_eq!(claimed.len(), 2);
    let after: i64 = sqlx::query_scalar(clock).fetch_one(&pool).await.unwrap();
    let within = |id: uuid::Uuid, what: &str| {
        let ms = v7_millis(id).unwrap_or_else(|| panic!("{what} {id} is not a version-7 UUID"));
        assert!(
            (before as u64..=after as u64).contains(&ms),
            "{what} {id} says {ms} ms, made between {before} and {after}"
        );
    };
    made.iter().for_each(|id| within(*id, "z29c_uuid_v7()"));
    // what the hot path names with it: a claim's attempts and the outbox's messages
    for c in &claimed {
        within(c.lease.attempt.as_uuid(), "an attempt");
    }
    let msg_ids: Vec<String> = sqlx::query_scalar("SELECT msg_id FROM outbox")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert!(
        !msg_ids.is_empty(),
        "the submission announced its ready steps"
    );
    for m in msg_ids {
        let (_, id) = m.split_at(m.len() - 36);
        within(id.parse().unwrap(), "an outbox msg_id");
    }
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn sessions_keep_generic_plans_and_never_compile_one(pool: PgPool) {
    let url = sqlx::ConnectOptions::to_url_lossy(&*pool.connect_options());
    let store = Store::connect(url.as_ref(), 1).await.unwrap();
    for (setting, want) in [("plan_cache_mode", "force_generic_plan"), ("jit", "off")] {
        let got: String = sqlx::query_scalar("SELECT current_setting($1)")
            .bind(setting)
            .fetch_one(store.pool())
            .await
            .unwrap();
        assert_eq!(got, want, "{setting} of a store's session");
    }
    // a plan costed far over the JIT threshold, as a generic plan's guesses can be, is run
    // as it is (a server built without JIT plans none either way)
    let plan: serde_json::Value = sqlx::query_scalar(
        "EXPLAIN (FORMAT JSON) SELECT count(*) FROM generate_series(1, 1000000) a,
                                                    generate_series(1, 1000) b",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    let cost = plan[0]["Plan"]["Total Cost"].as_f64().unwrap();
    assert!(cost > 100_000.0, "the plan is costed at {cost}");
    assert!(plan[0].get("JIT").is_none(), "a plan was compiled: {plan}");
    store.pool().close().await;
}
