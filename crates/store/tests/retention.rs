//! Retention by whole partitions: a period whose workflows all finished long enough ago is
//! dropped with every row of their history, exported first when asked; a period with an
//! unfinished workflow or an open review item waits. All of it under the services'
//! rows-only role, which asks the migration's functions and holds no DDL itself.

mod common;

use std::io::Read;
use std::time::Duration;

use common::*;
use sqlx::PgPool;
use z29c_store::retention::Period;
use z29c_store::{MIGRATOR, Store};

const PERIOD: Duration = Duration::from_secs(1);
const KEEP: Duration = Duration::from_secs(1);

/// Submits a single-step workflow in a period of its own: the periods are made a second
/// long, and the next submission waits for the next period.
async fn in_a_period_of_its_own(store: &Store, key: &str) -> uuid::Uuid {
    store.cover_ahead(PERIOD).await.unwrap();
    let id = submit(store, &workflow(key, vec![step("only", &[])]))
        .await
        .workflow
        .as_uuid();
    tokio::time::sleep(PERIOD + Duration::from_millis(100)).await;
    id
}

/// Claims the one ready step, begins its call and commits its successful receipt, which
/// completes its single-step workflow.
async fn complete_the_ready_step(store: &Store, reference: &str) {
    let c = store
        .claim(&common::owner("executor-a"), 1)
        .await
        .unwrap()
        .pop()
        .unwrap();
    invoke(store, &c).await;
    store
        .commit_receipt(&c.lease, &success(&c, reference))
        .await
        .unwrap();
}

async fn period_of(store: &Store, pool: &PgPool, workflow: uuid::Uuid) -> Period {
    let suffix: String = sqlx::query_scalar(
        "SELECT p.suffix FROM retention_periods p
         WHERE p.starts_at <> '-infinity'
           AND $1 >= z29c_uuid_at(p.starts_at) AND $1 < z29c_uuid_at(p.ends_at)",
    )
    .bind(workflow)
    .fetch_one(pool)
    .await
    .unwrap();
    store
        .periods()
        .await
        .unwrap()
        .into_iter()
        .find(|p| p.suffix == suffix)
        .unwrap()
}

/// Rows of each table of `workflow`'s history.
async fn history(pool: &PgPool, workflow: uuid::Uuid) -> Vec<(&'static str, i64)> {
    let mut out = Vec::new();
    for (table, sql) in [
        ("workflows", "SELECT count(*) FROM workflows WHERE id = $1"),
        ("steps", "SELECT count(*) FROM steps WHERE workflow_id = $1"),
        (
            "attempts",
            "SELECT count(*) FROM attempts WHERE workflow_id = $1",
        ),
        (
            "step_receipts",
            "SELECT count(*) FROM step_receipts WHERE workflow_id = $1",
        ),
        (
            "step_events",
            "SELECT count(*) FROM step_events WHERE workflow_id = $1",
        ),
        (
            "review_items",
            "SELECT count(*) FROM review_items WHERE workflow_id = $1",
        ),
        (
            "workflow_keys",
            "SELECT count(*) FROM workflow_keys WHERE workflow_id = $1",
        ),
    ] {
        let n: i64 = sqlx::query_scalar(sql)
            .bind(workflow)
            .fetch_one(pool)
            .await
            .unwrap();
        out.push((table, n));
    }
    out
}

fn gunzip(path: &std::path::Path) -> String {
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).unwrap())
        .read_to_string(&mut text)
        .unwrap();
    text
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_finished_period_goes_whole_and_the_unfinished_and_reviewed_ones_wait(owner: PgPool) {
    let (role, pool) = service_pool(&owner).await;
    let store = Store::from_pool(pool.clone());
    let export = std::env::temp_dir().join(format!("z29c-export-{}", uuid::Uuid::now_v7()));

    // finished: its step succeeded, so the workflow completed
    let finished = in_a_period_of_its_own(&store, "finished").await;
    complete_the_ready_step(&store, "ref-finished").await;
    // unfinished: its step was never claimed
    let unfinished = in_a_period_of_its_own(&store, "unfinished").await;
    // in review: its opaque call's outcome is unknown, a person must decide
    let reviewed = in_a_period_of_its_own(&store, "reviewed").await;
    let mut claimed = store.claim(&common::owner("executor-b"), 2).await.unwrap();
    let c = claimed
        .iter()
        .position(|c| c.workflow.as_uuid() == reviewed)
        .map(|i| claimed.swap_remove(i))
        .unwrap();
    invoke(&store, &c).await;
    sent_to_review(&store, &pool, &c).await;
    // cancelled, so it is no longer running: what keeps it is the question still open
    store
        .cancel_workflow(c.workflow, "the customer withdrew")
        .await
        .unwrap();
    let kept_before = [
        history(&pool, unfinished).await,
        history(&pool, reviewed).await,
    ];
    assert_eq!(history(&pool, finished).await[3], ("step_receipts", 1));

    // the retention passes for all three
    tokio::time::sleep(KEEP + Duration::from_millis(200)).await;
    let expired = store.expired_periods(KEEP).await.unwrap();
    let finished_period = period_of(&store, &pool, finished).await;
    let unfinished_period = period_of(&store, &pool, unfinished).await;
    let reviewed_period = period_of(&store, &pool, reviewed).await;
    assert!(expired.contains(&finished_period), "{expired:?}");
    assert!(!expired.contains(&unfinished_period), "{expired:?}");
    assert!(!expired.contains(&reviewed_period), "{expired:?}");

    // exported, then dropped
    let files = store
        .export_period(&finished_period, &export)
        .await
        .unwrap();
    assert_eq!(files.len(), 12, "one file per partitioned table: {files:?}");
    let receipts = files.iter().find(|f| f.table == "step_receipts").unwrap();
    let text = gunzip(&receipts.path);
    assert!(text.starts_with("id,step_id,workflow_id"), "{text}");
    assert!(text.contains("ref-finished"), "{text}");
    assert!(text.contains(&finished.to_string()), "{text}");
    let removed = store
        .drop_period(
            &finished_period.suffix,
            KEEP,
            Some(&export.display().to_string()),
        )
        .await
        .unwrap()
        .expect("the finished period may go");
    assert_eq!(removed["workflows"], 1, "{removed}");
    assert_eq!(removed["step_receipts"], 1, "{removed}");
    assert!(removed["step_events"].as_i64().unwrap() >= 1, "{removed}");

    // every row of the finished workflow's history is gone, its key free again
    for (table, n) in history(&pool, finished).await {
        assert_eq!(n, 0, "{table} still holds the dropped workflow");
    }
    // the others are as they were, and their periods refuse to go
    assert_eq!(
        [
            history(&pool, unfinished).await,
            history(&pool, reviewed).await
        ],
        kept_before
    );
    for p in [&unfinished_period, &reviewed_period] {
        assert_eq!(
            store.drop_period(&p.suffix, KEEP, None).await.unwrap(),
            None
        );
    }
    // a period goes once
    assert_eq!(
        store
            .drop_period(&finished_period.suffix, KEEP, None)
            .await
            .unwrap(),
        None
    );
    let periods = store.periods().await.unwrap();
    assert!(!periods.contains(&finished_period));
    assert!(periods.contains(&unfinished_period));

    // the audit log records the drop, what it removed and where it was exported to
    let (subject, detail): (String, String) = sqlx::query_as(
        "SELECT subject, detail FROM audit_log WHERE action = 'drop' AND method = 'retention'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(subject, format!("period {}", finished_period.suffix));
    let detail: serde_json::Value = serde_json::from_str(&detail).unwrap();
    assert_eq!(detail["removed"], removed);
    assert_eq!(detail["exported_to"], export.display().to_string());

    // the key of the dropped workflow may be used again
    let again = submit(&store, &workflow("finished", vec![step("only", &[])])).await;
    assert!(again.created);
    assert_ne!(again.workflow.as_uuid(), finished);

    std::fs::remove_dir_all(&export).unwrap();
    drop_role(&owner, &role, pool).await;
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn no_drop_is_shorter_than_the_owners_minimum(owner: PgPool) {
    let store = Store::from_pool(owner.clone());
    let id = in_a_period_of_its_own(&store, "kept-by-the-owner").await;
    complete_the_ready_step(&store, "ref-kept").await;
    tokio::time::sleep(KEEP + Duration::from_millis(200)).await;
    let period = period_of(&store, &owner, id).await;
    // the owner keeps everything for an hour: a service asking for a second is refused
    sqlx::query("UPDATE retention_rules SET min_keep = interval '1 hour'")
        .execute(&owner)
        .await
        .unwrap();
    let e = store
        .drop_period(&period.suffix, KEEP, None)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("min_keep"), "{e}");
    assert_eq!(history(&owner, id).await[0], ("workflows", 1));
    // at the owner's minimum the period is not old enough yet, and stays
    assert_eq!(
        store
            .drop_period(&period.suffix, Duration::from_secs(3600), None)
            .await
            .unwrap(),
        None
    );
    assert_eq!(history(&owner, id).await[3], ("step_receipts", 1));
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_workflow_that_finished_recently_keeps_its_period(owner: PgPool) {
    let store = Store::from_pool(owner.clone());
    let id = in_a_period_of_its_own(&store, "late-finisher").await;
    // its period ended more than the retention ago, but it ends only now
    tokio::time::sleep(KEEP + Duration::from_millis(200)).await;
    complete_the_ready_step(&store, "ref-late").await;
    let period = period_of(&store, &owner, id).await;
    assert!(!store.expired_periods(KEEP).await.unwrap().contains(&period));
    assert_eq!(
        store.drop_period(&period.suffix, KEEP, None).await.unwrap(),
        None
    );
    // once it has been finished for the retention too, it goes
    tokio::time::sleep(KEEP + Duration::from_millis(200)).await;
    assert!(store.expired_periods(KEEP).await.unwrap().contains(&period));
    assert!(
        store
            .drop_period(&period.suffix, KEEP, None)
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(history(&owner, id).await[0], ("workflows", 0));
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn periods_are_made_ahead_and_ids_without_one_get_one(owner: PgPool) {
    let store = Store::from_pool(owner.clone());
    let end = store.cover_ahead(Duration::from_secs(60)).await.unwrap();
    assert!(
        end > chrono::Utc::now() + chrono::Duration::seconds(59),
        "{end}"
    );
    // asking again makes nothing new
    let count = store.periods().await.unwrap().len();
    assert_eq!(
        store.cover_ahead(Duration::from_secs(60)).await.unwrap(),
        end
    );
    assert_eq!(store.periods().await.unwrap().len(), count);
    // a period shorter than a second is refused, naming the setting
    let e = store
        .cover_ahead(Duration::from_millis(10))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("retention.period"), "{e}");
    // the partitions each period made exist for every partitioned table
    let partitions: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE c.relkind = 'r' AND c.relname LIKE 'steps\\_p%'",
    )
    .fetch_one(&owner)
    .await
    .unwrap();
    assert_eq!(
        partitions as usize,
        count - 1,
        "one per period but the first"
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn services_making_periods_at_once_make_the_same_ones(owner: PgPool) {
    let (role, pool) = service_pool(&owner).await;
    // four services, each on its own session and with a period of its own length, all
    // making the next periods at once, six times over, a second apart: periods run out and
    // are made again while it goes on
    let mut stores = Vec::new();
    for _ in 0..4 {
        let one = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with((*pool.connect_options()).clone())
            .await
            .unwrap();
        stores.push(Store::from_pool(one));
    }
    for _ in 0..6 {
        let ends = futures::future::join_all(stores.iter().enumerate().map(|(i, s)| {
            let width = Duration::from_secs(1 + i as u64);
            async move { s.cover_ahead(width).await }
        }))
        .await;
        for end in ends {
            end.unwrap();
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // one chain of periods, each made whole, every partition with its period's bounds
    let periods: Vec<(
        String,
        chrono::DateTime<chrono::Utc>,
        chrono::DateTime<chrono::Utc>,
        bool,
    )> = sqlx::query_as(
        "SELECT suffix, starts_at, ends_at, made_at IS NOT NULL FROM retention_periods
         WHERE suffix <> 'before' ORDER BY ends_at",
    )
    .fetch_all(&owner)
    .await
    .unwrap();
    // however long the first period, one of four seconds at most, it had run out by the sixth
    // round
    assert!(periods.len() >= 2, "{periods:?}");
    for pair in periods.windows(2) {
        assert_eq!(
            pair[0].2, pair[1].1,
            "periods follow each other: {periods:?}"
        );
    }
    assert!(
        periods.iter().all(|p| p.3),
        "every period made: {periods:?}"
    );
    let mismatched: Vec<(String, String)> = sqlx::query_as(
        "SELECT c.relname::text, pg_get_expr(c.relpartbound, c.oid)
         FROM retention_tables t
         JOIN pg_inherits i ON i.inhparent = t.name::regclass
         JOIN pg_class c ON c.oid = i.inhrelid
         JOIN retention_periods p ON c.relname = t.name || '_' || p.suffix
         WHERE p.suffix <> 'before'
           AND pg_get_expr(c.relpartbound, c.oid)
               <> format('FOR VALUES FROM (%L) TO (%L)',
                         z29c_uuid_at(p.starts_at), z29c_uuid_at(p.ends_at))",
    )
    .fetch_all(&owner)
    .await
    .unwrap();
    assert_eq!(
        mismatched,
        vec![],
        "partitions whose bounds are not their period's"
    );
    let partitions: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM retention_tables t JOIN pg_inherits i
             ON i.inhparent = t.name::regclass",
    )
    .fetch_one(&owner)
    .await
    .unwrap();
    assert_eq!(
        partitions as usize,
        12 * (periods.len() + 1),
        "twelve per period, the first too"
    );
    // and what is written now has its partition
    let store = Store::from_pool(pool.clone());
    assert!(
        submit(&store, &workflow("after", vec![step("only", &[])]))
            .await
            .created
    );
    for s in stores {
        s.pool().close().await;
    }
    drop_role(&owner, &role, pool).await;
}
