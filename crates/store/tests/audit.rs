//! The audit log and the poison-message record against real PostgreSQL: stored verbatim
//! (SQL-looking text included), oversized fields cut rather than refused, append-only.

use sqlx::PgPool;
use z29c_store::audit::{AuditEntry, PoisonMessage};
use z29c_store::{MIGRATOR, Store};

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
