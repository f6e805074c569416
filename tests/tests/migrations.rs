//! Migrations apply once under concurrent service starts, and the harness leaves nothing behind.

use z29c_scenarios::{TestDatabase, database_url};
use z29c_store::Store;

#[tokio::test]
async fn concurrent_starts_migrate_once_and_the_database_is_dropped_after() -> anyhow::Result<()> {
    let db = TestDatabase::create().await?;
    // four "services" starting at once each run the migrations
    let mut starts = Vec::new();
    for _ in 0..4 {
        let pool = db.pool(2).await?;
        starts.push(tokio::spawn(async move {
            Store::from_pool(pool).migrate().await
        }));
    }
    for s in starts {
        s.await??;
    }
    let pool = db.pool(1).await?;
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE success")
        .fetch_one(&pool)
        .await?;
    assert_eq!(applied, z29c_store::MIGRATOR.iter().count() as i64);
    let tables: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables
         WHERE table_schema = 'public' AND table_name IN
           ('workflows', 'steps', 'attempts', 'step_receipts', 'late_observations',
            'recovery_decisions', 'review_items', 'integrity_conflicts', 'step_events',
            'outbox', 'adapter_permits', 'adapter_limits', 'step_dependencies')",
    )
    .fetch_one(&pool)
    .await?;
    assert_eq!(tables, 13);
    pool.close().await;

    let name = db.name().to_owned();
    db.drop_now().await?;
    let admin = sqlx::PgPool::connect(&database_url()).await?;
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname = $1")
        .bind(&name)
        .fetch_one(&admin)
        .await?;
    assert_eq!(left, 0, "nothing left behind");
    Ok(())
}
