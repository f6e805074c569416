//! Least privilege in the database: a service connects as a member of `z29c_service`, which
//! reads and writes rows and nothing else. It cannot disable a trigger, truncate the audit
//! log, alter, drop or create a table, or rewrite the migration history; and the audit log
//! refuses TRUNCATE even to the owner.

mod common;

use common::*;
use sqlx::PgPool;
use z29c_store::{MIGRATOR, Store};

/// The SQLSTATE of a refused statement.
async fn refused(pool: &PgPool, sql: &'static str) -> String {
    let e = sqlx::query(sql)
        .execute(pool)
        .await
        .expect_err(sql)
        .into_database_error()
        .unwrap_or_else(|| panic!("{sql}: not a database error"));
    e.code().unwrap_or_default().into_owned()
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_service_role_writes_rows_but_cannot_change_the_rules(owner: PgPool) {
    let (role, pool) = service_pool(&owner).await;
    // the work it is for: submit, claim, invoke, commit a receipt, write the audit log
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "privileges-1", "executor-a").await;
    invoke(&store, &c).await;
    let submitted: i64 = sqlx::query_scalar("SELECT count(*) FROM workflows")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(submitted, 1);

    // what it must not do: each refused for want of privilege (42501)
    for sql in [
        "ALTER TABLE audit_log DISABLE TRIGGER audit_log_append_only",
        "ALTER TABLE step_receipts DISABLE TRIGGER ALL",
        "TRUNCATE audit_log",
        "TRUNCATE step_receipts",
        "ALTER TABLE steps ADD COLUMN sneaky int",
        "DROP TABLE step_events",
        "DROP TRIGGER audit_log_append_only ON audit_log",
        "CREATE TABLE sneaky (i int)",
        "DELETE FROM _sqlx_migrations",
        "ALTER ROLE z29c_service SUPERUSER",
        // partitions are changed by the migration's functions alone
        "TRUNCATE step_receipts_before",
        "DROP TABLE step_events_before",
        "ALTER TABLE steps DETACH PARTITION steps_before",
        "UPDATE retention_periods SET dropped_at = now()",
        "DELETE FROM retention_tables",
        "UPDATE retention_rules SET min_keep = interval '1 second'",
        "DELETE FROM workflow_keys",
        "UPDATE workflow_keys SET workflow_id = workflow_id",
    ] {
        assert_eq!(refused(&pool, sql).await, "42501", "{sql}");
    }
    sqlx::query(
        "INSERT INTO audit_log (service, method, action, outcome) VALUES ('t', 't', 'read', 'allowed')",
    )
    .execute(&pool)
    .await
    .unwrap();
    // rows of the history: refused by their triggers, as for anyone (Z29A0)
    for sql in [
        "UPDATE audit_log SET detail = 'edited'",
        "DELETE FROM step_events",
    ] {
        assert_eq!(refused(&pool, sql).await, "Z29A0", "{sql}");
    }
    // and the triggers are all still there
    let enabled: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_trigger WHERE tgname LIKE '%append_only' AND tgenabled = 'O'",
    )
    .fetch_one(&owner)
    .await
    .unwrap();
    assert!(enabled >= 6, "{enabled}");
    drop_role(&owner, &role, pool).await;
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn the_audit_log_refuses_truncate_even_to_its_owner(owner: PgPool) {
    let code = refused(&owner, "TRUNCATE audit_log").await;
    assert_eq!(code, "Z29A0");
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_pool_is_measured_against_the_servers_free_connections(owner: PgPool) {
    // a session held open beside the one that asks, which does not count itself
    let held = owner.acquire().await.unwrap();
    let store = Store::from_pool(owner.clone());
    let server = store.server_connections().await.unwrap();
    assert!(server.max_connections > 0);
    assert!(server.in_use >= 1, "the held session is counted");
    assert!(server.free() < server.max_connections);
    // a pool of the whole server never fits; one connection does on a server with room
    assert!(z29c_core::connections::pool_warning(server.max_connections, &server).is_some());
    if server.free() > 0 {
        assert!(z29c_core::connections::pool_warning(1, &server).is_none());
    }
    drop(held);
}
