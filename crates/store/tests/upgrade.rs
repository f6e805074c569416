//! Upgrading a database that holds history to the partitioned schema: every row moves into
//! the first period with its keys, the tables that did not name their workflow learn it, the
//! first period reaches past an id a clock ahead of the database made, event ids go on where
//! they were, and a client key already taken stays taken.

mod common;

use common::*;
use sqlx::PgPool;
use sqlx::migrate::Migrator;
use z29c_store::{MIGRATOR, Store, StoreError};

/// The first migration of the partitioned schema.
const PARTITIONED: i64 = 20261218000001;

#[sqlx::test(migrations = false)]
async fn partitioning_keeps_the_history_already_written(pool: PgPool) {
    // the schema as it was before partitioning
    let before = std::env::temp_dir().join(format!("z29c-migrations-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&before).unwrap();
    let all = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../migrations");
    for entry in std::fs::read_dir(&all).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let version: i64 = name.split('_').next().unwrap().parse().unwrap();
        if version < PARTITIONED {
            std::fs::copy(&path, before.join(&name)).unwrap();
        }
    }
    Migrator::new(before.as_path())
        .await
        .unwrap()
        .run(&pool)
        .await
        .unwrap();
    std::fs::remove_dir_all(&before).unwrap();

    // history: a finished workflow of two dependent steps with an event each and a resolved
    // review, and a running one whose id a clock ten minutes ahead made
    sqlx::raw_sql(
        "INSERT INTO workflows (id, client_key, submission_digest, name, state, ended_at)
         VALUES (z29c_uuid_v7(), 'old-1', repeat('a', 64), 'w', 'completed', now()),
                (encode(overlay(uuid_send(z29c_uuid_v7())
                        PLACING substring(int8send(floor(extract(epoch FROM
                            now() + interval '10 minutes') * 1000)::bigint) FROM 3)
                        FROM 1 FOR 6), 'hex')::uuid,
                 'ahead-1', repeat('a', 64), 'w', 'running', NULL);
         INSERT INTO steps (id, workflow_id, name, position, adapter, operation, input,
             input_digest, lease_ms, renew_every_ms, attempt_deadline_ms, final_grace_ms,
             adapter_timeout_ms, max_attempts, state, pending_deps)
         SELECT z29c_uuid_v7(), w.id, n.name, n.position, 'a', 'op', '{}', repeat('a', 64),
                10000, 2000, 20000, 1000, 5000, 3, n.state::step_state, n.deps
         FROM workflows w,
              (VALUES ('first', 0, 'ready', 0), ('second', 1, 'blocked', 1))
                  AS n (name, position, state, deps);
         INSERT INTO step_dependencies (step_id, depends_on)
         SELECT s.id, f.id FROM steps s JOIN steps f
             ON f.workflow_id = s.workflow_id AND f.name = 'first'
         WHERE s.name = 'second';
         INSERT INTO step_events (workflow_id, step_id, lease_version, kind)
         SELECT workflow_id, id, 0, 'checkpoint' FROM steps;
         INSERT INTO review_items (id, step_id, workflow_id, reason, state, resolved_at)
         SELECT z29c_uuid_v7(), s.id, s.workflow_id, 'unknown outcome', 'resolved', now()
         FROM steps s JOIN workflows w ON w.id = s.workflow_id
         WHERE w.client_key = 'old-1' AND s.name = 'first';
         INSERT INTO review_resolutions (id, item_id, step_id, resolved_by, resolution, reason,
             prior_state, prior_version)
         SELECT z29c_uuid_v7(), id, step_id, 'rita', 'failed', 'no charge in the ledger',
                'open', 1
         FROM review_items;",
    )
    .execute(&pool)
    .await
    .unwrap();

    MIGRATOR.run(&pool).await.unwrap();

    let count = async |sql: &'static str| -> i64 {
        sqlx::query_scalar(sql).fetch_one(&pool).await.unwrap()
    };
    assert_eq!(count("SELECT count(*) FROM workflows_before").await, 2);
    assert_eq!(count("SELECT count(*) FROM steps_before").await, 4);
    assert_eq!(count("SELECT count(*) FROM step_events_before").await, 4);
    assert_eq!(
        count("SELECT count(*) FROM review_resolutions_before").await,
        1
    );
    // the two tables that did not name their workflow now do, and name the right one
    assert_eq!(
        count(
            "SELECT count(*) FROM step_dependencies d JOIN steps s
                 ON s.id = d.step_id AND s.workflow_id = d.workflow_id"
        )
        .await,
        2
    );
    assert_eq!(
        count(
            "SELECT count(*) FROM review_resolutions r JOIN steps s
                 ON s.id = r.step_id AND s.workflow_id = r.workflow_id"
        )
        .await,
        1
    );
    // the first period holds the id made ahead, and event ids go on
    assert_eq!(
        count(
            "SELECT count(*) FROM retention_periods p, workflows w
             WHERE p.suffix = 'before' AND w.client_key = 'ahead-1'
               AND w.id < z29c_uuid_at(p.ends_at)"
        )
        .await,
        1
    );
    let next: i64 = sqlx::query_scalar(
        "INSERT INTO step_events (workflow_id, step_id, lease_version, kind)
         SELECT workflow_id, id, 0, 'checkpoint' FROM steps LIMIT 1 RETURNING id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(next, 5);

    // a key taken before the upgrade is still taken; a new one is free
    let store = Store::from_pool(pool.clone());
    let e = store
        .submit_workflow(
            &workflow("old-1", vec![step("only", &[])]),
            &Default::default(),
        )
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::Conflict(_)), "{e}");
    let new = submit(&store, &workflow("new-1", vec![step("only", &[])])).await;
    assert!(new.created);
    assert_eq!(count("SELECT count(*) FROM workflows").await, 3);
}
