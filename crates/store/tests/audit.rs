//! The audit log and the poison-message record against real PostgreSQL: stored verbatim
//! (SQL-looking text included), oversized fields cut rather than refused, append-only; and an
//! allowed change's row committed by the change itself, or not at all.
//!
//! `now()` is the time its transaction began, so a row whose `at` equals the change's own
//! timestamp (a workflow's `created_at`, its `ended_at`, a resolution's `resolved_at`) was
//! written in the change's transaction.

mod common;

use chrono::{DateTime, Utc};
use common::*;
use sqlx::PgPool;
use z29c_core::WorkflowId;
use z29c_store::audit::{AuditEntry, PoisonMessage};
use z29c_store::review::Resolution;
use z29c_store::submissions::SubmissionBatches;
use z29c_store::workflows::{Prepared, SubmitLimits};
use z29c_store::{MIGRATOR, Store, StoreError};

fn refused(subject: Option<&str>) -> AuditEntry {
    AuditEntry {
        service: "z29c.v1.WorkflowService".into(),
        method: "Submit".into(),
        subject: subject.map(str::to_owned),
        action: "submit".into(),
        outcome: "permission_denied".into(),
        detail: "val may not submit".into(),
        peer: Some("127.0.0.1:5555".into()),
    }
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn audit_rows_are_stored_verbatim_and_cannot_be_edited(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let sneaky = "x'); DELETE FROM audit_log; --";
    store.audit(&refused(Some(sneaky))).await.unwrap();
    store.audit(&refused(None)).await.unwrap();
    let log = store.audit_log(10).await.unwrap();
    assert_eq!(log.len(), 2);
    assert_eq!(log[0].entry, refused(None));
    assert_eq!(log[1].entry.subject.as_deref(), Some(sneaky));
    let edit = sqlx::query("UPDATE audit_log SET outcome = 'allowed'")
        .execute(&pool)
        .await;
    assert!(edit.is_err(), "the audit log is append-only");
    let delete = sqlx::query("DELETE FROM audit_log").execute(&pool).await;
    assert!(delete.is_err(), "the audit log is append-only");
    assert_eq!(store.audit_log(10).await.unwrap().len(), 2);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn an_oversized_subject_is_cut_not_refused(pool: PgPool) {
    let store = Store::from_pool(pool);
    let huge = "a".repeat(10_000);
    store.audit(&refused(Some(&huge))).await.unwrap();
    let log = store.audit_log(1).await.unwrap();
    assert_eq!(log[0].entry.subject.as_ref().unwrap().len(), 200);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_poison_message_keeps_its_reason_and_only_its_head(pool: PgPool) {
    let store = Store::from_pool(pool);
    let m = PoisonMessage {
        consumer: "executors".into(),
        subject: "t.step.ready".into(),
        stream_sequence: Some(7),
        deliveries: Some(1),
        reason: "malformed envelope: invalid wire type".into(),
        payload: vec![0xff; 5_000],
    };
    store.record_poison(&m).await.unwrap();
    let got = store.poison_messages(5).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].reason, m.reason);
    assert_eq!(got[0].stream_sequence, Some(7));
    assert_eq!(got[0].payload, vec![0xff; 256]);
}

fn allowed(method: &str, action: &str, subject: &str) -> AuditEntry {
    AuditEntry {
        service: "z29c.v1.WorkflowService".into(),
        method: method.into(),
        subject: Some(subject.into()),
        action: action.into(),
        outcome: "allowed".into(),
        detail: String::new(),
        peer: Some("127.0.0.1:5555".into()),
    }
}

/// The audit log's allowed rows, oldest first: subject and when.
async fn allowed_rows(pool: &PgPool) -> Vec<(String, DateTime<Utc>)> {
    sqlx::query_as("SELECT subject, at FROM audit_log WHERE outcome = 'allowed' ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn created_at(pool: &PgPool, id: WorkflowId) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT created_at FROM workflows WHERE id = $1")
        .bind(id.as_uuid())
        .fetch_one(pool)
        .await
        .unwrap()
}

fn prepared(key: &str) -> Prepared {
    Prepared::new(
        workflow(key, vec![step("only", &[])]),
        &SubmitLimits::default(),
    )
    .unwrap()
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_submission_audit_row_is_written_by_the_statement_that_creates_the_workflow(
    pool: PgPool,
) {
    let store = Store::from_pool(pool.clone());
    submit(&store, &workflow("taken", vec![step("only", &[])])).await;
    let batch = [prepared("new"), prepared("taken"), prepared("unaudited")];
    let (olga, tom) = (
        allowed("Submit", "submit", "olga"),
        allowed("Submit", "submit", "tom"),
    );
    let answers = batch_store(&pool)
        .await
        .insert_audited_workflows(&batch, &[Some(&olga), Some(&tom), None])
        .await
        .unwrap();
    assert!(answers[1].is_none(), "a taken key writes nothing");
    let created = answers[0].as_ref().unwrap().workflow;
    let rows = allowed_rows(&pool).await;
    assert_eq!(
        rows,
        [("olga".to_owned(), created_at(&pool, created).await)],
        "one row, for the workflow created, in its statement's transaction"
    );

    // the same submission again changes nothing and writes no row: its caller records it
    let again = store.submit_audited(&batch[0], Some(&tom)).await.unwrap();
    assert!(!again.created);
    assert_eq!(allowed_rows(&pool).await.len(), 1);
    // a different submission under a taken key is refused, unrecorded here
    let different = workflow("new", vec![step("other", &[])]);
    let refused = store
        .submit_audited(
            &Prepared::new(different, &SubmitLimits::default()).unwrap(),
            Some(&tom),
        )
        .await;
    assert!(
        matches!(refused, Err(StoreError::Conflict(_))),
        "{refused:?}"
    );
    assert_eq!(allowed_rows(&pool).await.len(), 1);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn submissions_batched_together_each_write_their_own_audit_row(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let batches = SubmissionBatches::start(&batch_store(&pool).await, &store, 2, 8);
    let submitted = futures::future::join_all((0..6).map(|i| {
        let batches = batches.clone();
        async move {
            batches
                .submit_audited(
                    prepared(&format!("k{i}")),
                    Some(allowed("Submit", "submit", &format!("op{i}"))),
                )
                .await
                .unwrap()
        }
    }))
    .await;
    let rows = allowed_rows(&pool).await;
    assert_eq!(rows.len(), 6, "{rows:?}");
    for (i, s) in submitted.iter().enumerate() {
        assert!(s.created);
        let at = created_at(&pool, s.workflow).await;
        assert!(
            rows.contains(&(format!("op{i}"), at)),
            "op{i}'s row commits with its workflow: {rows:?}"
        );
    }
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_cancel_and_its_audit_row_commit_together(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let s = submit(&store, &workflow("c1", vec![step("only", &[])])).await;
    let olga = allowed("Cancel", "cancel", "olga");
    store
        .cancel_workflow_audited(s.workflow, "operator asked", Some(&olga))
        .await
        .unwrap();
    let ended: DateTime<Utc> = sqlx::query_scalar("SELECT ended_at FROM workflows WHERE id = $1")
        .bind(s.workflow.as_uuid())
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(allowed_rows(&pool).await, [("olga".to_owned(), ended)]);
    // cancelling a cancelled workflow changes nothing; the call is on record all the same
    store
        .cancel_workflow_audited(s.workflow, "again", Some(&olga))
        .await
        .unwrap();
    assert_eq!(allowed_rows(&pool).await.len(), 2);
    // a cancel that fails commits nothing, its audit row included
    let unknown = store
        .cancel_workflow_audited(WorkflowId::new(), "no such", Some(&olga))
        .await;
    assert!(
        matches!(unknown, Err(StoreError::NotFound { .. })),
        "{unknown:?}"
    );
    assert_eq!(allowed_rows(&pool).await.len(), 2);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_resolution_and_its_audit_row_commit_together(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "r1", "worker-a").await;
    invoke(&store, &c).await;
    let item = sent_to_review(&store, &pool, &c).await;
    let rita = AuditEntry {
        service: "z29c.v1.ReviewService".into(),
        ..allowed("Resolve", "resolve", "rita")
    };
    let stale = store
        .resolve_review_audited(
            item.id,
            item.version + 1,
            "rita",
            "checked",
            &Resolution::Failed,
            None,
            Some(&rita),
        )
        .await;
    assert!(matches!(stale, Err(StoreError::Conflict(_))), "{stale:?}");
    assert!(
        allowed_rows(&pool).await.is_empty(),
        "a refused resolution commits nothing, its audit row included"
    );
    store
        .resolve_review_audited(
            item.id,
            item.version,
            "rita",
            "checked the destination: nothing there",
            &Resolution::Failed,
            None,
            Some(&rita),
        )
        .await
        .unwrap();
    let resolved: DateTime<Utc> =
        sqlx::query_scalar("SELECT resolved_at FROM review_resolutions WHERE item_id = $1")
            .bind(item.id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(allowed_rows(&pool).await, [("rita".to_owned(), resolved)]);
    let log = store.audit_log(1).await.unwrap();
    assert_eq!(log[0].entry, rita);
}
