//! z29c vacuums the tables no autovacuum will visit, past autovacuum's own threshold, one
//! instance at a time.

mod common;

use std::time::{Duration, Instant};

use common::*;
use sqlx::PgPool;
use z29c_store::maintenance::{Table, VACUUM_LOCK};
use z29c_store::{MIGRATOR, Store};

/// 300 steps, then every one updated twice: up to 600 dead row versions in `steps` (fewer
/// where the updates pruned their pages as they went), whose threshold is 50 + 0.02 × 300 =
/// 56. Autovacuum is turned off for `steps` alone, so that whatever the server's setting, no
/// autovacuum will visit it.
async fn dead_steps(store: &Store, pool: &PgPool) -> Table {
    let steps = without_autovacuum(pool, "steps").await;
    let names: Vec<String> = (0..100).map(|i| format!("s{i}")).collect();
    for w in 0..3 {
        let steps = names.iter().map(|n| step(n, &[])).collect();
        submit(store, &workflow(&format!("dead-{w}"), steps)).await;
    }
    for _ in 0..2 {
        sqlx::query("UPDATE steps SET updated_at = clock_timestamp()")
            .execute(pool)
            .await
            .unwrap();
    }
    // statistics reach the server's shared counters when a session goes idle, within a second
    // or so: once they show the updates, a second more for the last of them
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let health = health_of(store, &steps).await;
        if health.health.dead >= 300 {
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            return health_of(store, &steps).await;
        }
        assert!(
            Instant::now() < until,
            "the statistics never showed the dead rows: {health:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn health_of(store: &Store, table: &str) -> Table {
    store
        .table_health()
        .await
        .unwrap()
        .into_iter()
        .find(|t| t.name == table)
        .unwrap_or_else(|| panic!("no statistics for {table}"))
}

/// `(dead rows, vacuumed by hand, analysed by hand)` of the steps' partition now.
async fn steps_stats(pool: &PgPool) -> (i64, bool, bool) {
    sqlx::query_as(
        "SELECT n_dead_tup, last_vacuum IS NOT NULL, last_analyze IS NOT NULL
         FROM pg_stat_user_tables WHERE relname = $1",
    )
    .bind(current_partition(pool, "steps").await)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_table_no_autovacuum_visits_is_vacuumed_once_past_its_threshold(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let steps = dead_steps(&store, &pool).await;
    let partition = steps.name.clone();
    // the table's own settings, from the migrations; the server's where the table has none
    let (server_on, server_scale): (bool, f64) = sqlx::query_as(
        "SELECT current_setting('autovacuum')::bool AND current_setting('track_counts')::bool,
                current_setting('autovacuum_vacuum_scale_factor')::float8",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(!steps.health.autovacuum, "{steps:?}");
    assert_eq!(steps.health.scale, 0.02);
    assert!(steps.health.needs_our_vacuum(), "{steps:?}");
    let workflows = health_of(&store, &current_partition(&pool, "workflows").await).await;
    assert_eq!(workflows.health.scale, server_scale);
    assert_eq!(workflows.health.autovacuum, server_on);
    assert_eq!(steps_stats(&pool).await, (steps.health.dead, false, false));

    let done = store
        .vacuum_neglected()
        .await
        .unwrap()
        .expect("no one else vacuums");
    let vacuumed = done
        .iter()
        .find(|v| v.table == partition)
        .unwrap_or_else(|| panic!("steps not vacuumed: {done:?}"));
    assert!(vacuumed.dead >= 300, "{vacuumed:?}");
    let (dead, vacuumed, analysed) = steps_stats(&pool).await;
    assert!(
        vacuumed && analysed,
        "steps was neither vacuumed nor analysed"
    );
    assert!(
        dead < steps.health.dead / 2,
        "{dead} dead rows left of {}",
        steps.health.dead
    );
    // nothing is past its threshold any more: the next round vacuums nothing
    let again = store.vacuum_neglected().await.unwrap().unwrap();
    assert!(again.iter().all(|v| v.table != partition), "{again:?}");
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_table_under_its_threshold_is_not_vacuumed(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let partition = without_autovacuum(&pool, "steps").await;
    let names: Vec<String> = (0..100).map(|i| format!("s{i}")).collect();
    let steps = names.iter().map(|n| step(n, &[])).collect();
    submit(&store, &workflow("few-dead", steps)).await;
    // 40 dead rows of 100: under the threshold of 50 + 0.02 × 100 = 52
    sqlx::query("UPDATE steps SET updated_at = clock_timestamp() WHERE position < 40")
        .execute(&pool)
        .await
        .unwrap();
    let until = Instant::now() + Duration::from_secs(20);
    while health_of(&store, &partition).await.health.dead < 40 {
        assert!(
            Instant::now() < until,
            "the statistics never showed the dead rows"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        !health_of(&store, &partition)
            .await
            .health
            .needs_our_vacuum()
    );
    let done = store.vacuum_neglected().await.unwrap().unwrap();
    assert!(done.iter().all(|v| v.table != partition), "{done:?}");
    assert_eq!(steps_stats(&pool).await, (40, false, false));
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn one_instance_vacuums_a_database_at_a_time(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let steps = dead_steps(&store, &pool).await;
    // another scheduler's round, holding the lock
    let mut other = pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(VACUUM_LOCK)
        .execute(&mut *other)
        .await
        .unwrap();
    assert_eq!(store.vacuum_neglected().await.unwrap(), None);
    assert_eq!(steps_stats(&pool).await, (steps.health.dead, false, false));
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(VACUUM_LOCK)
        .execute(&mut *other)
        .await
        .unwrap();
    drop(other);
    let done = store.vacuum_neglected().await.unwrap().unwrap();
    assert!(done.iter().any(|v| v.table == steps.name), "{done:?}");
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn storage_names_every_table_and_the_oldest_workflow(pool: PgPool) {
    let store = Store::from_pool(pool);
    let empty = store.storage().await.unwrap();
    assert_eq!(empty.oldest_workflow_age, None);
    let names: Vec<&str> = empty.tables.iter().map(|(t, _)| t.as_str()).collect();
    for table in [
        "workflows",
        "steps",
        "attempts",
        "step_receipts",
        "audit_log",
    ] {
        assert!(names.contains(&table), "{table}: {names:?}");
    }
    assert!(!names.contains(&"_sqlx_migrations"));
    let bytes = |s: &z29c_store::maintenance::Storage, t: &str| {
        s.tables
            .iter()
            .find(|(n, _)| n == t)
            .map(|(_, b)| *b)
            .unwrap()
    };
    for i in 0..50 {
        submit(
            &store,
            &workflow(&format!("size-{i}"), vec![step("only", &[])]),
        )
        .await;
    }
    let full = store.storage().await.unwrap();
    assert!(full.oldest_workflow_age.is_some());
    assert!(
        bytes(&full, "steps") > bytes(&empty, "steps"),
        "{} then {}",
        bytes(&empty, "steps"),
        bytes(&full, "steps")
    );
}
