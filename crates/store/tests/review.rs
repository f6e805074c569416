//! Review resolutions against real PostgreSQL: compare-and-set, a reason, the step's lease
//! taken first, the audit row in the same transaction.

mod common;

use common::*;
use sqlx::PgPool;
use z29c_core::{ExternalReference, StepState, WorkflowState};
use z29c_store::review::Resolution;
use z29c_store::{MIGRATOR, Store, StoreError};

/// A step whose invocation began and whose lease expired at an opaque adapter: in review.
async fn in_review(store: &Store, pool: &PgPool) -> (z29c_store::leases::ClaimedStep, uuid::Uuid) {
    let c = claimed_single(store, "k1", "worker-a").await;
    invoke(store, &c).await;
    let item = sent_to_review(store, pool, &c).await;
    (c, item.id)
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_resolution_needs_the_current_version_and_a_reason(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let (c, item) = in_review(&store, &pool).await;
    let ok = Resolution::Succeeded(ExternalReference::parse("dst-1").unwrap());
    assert!(matches!(
        store.resolve_review(item, 1, "alice", "  ", &ok).await,
        Err(StoreError::Invalid { ref field, .. }) if field == "reason"
    ));
    assert!(matches!(
        store.resolve_review(item, 2, "alice", "checked", &ok).await,
        Err(StoreError::Conflict(_))
    ));
    assert!(
        store.review_audit(item).await.unwrap().is_empty(),
        "refusals change nothing"
    );

    let resolved = store
        .resolve_review(item, 1, "alice", "checked the ledger", &ok)
        .await
        .unwrap();
    assert_eq!((resolved.state.as_str(), resolved.version), ("resolved", 2));
    assert!(matches!(
        store
            .resolve_review(item, 2, "bob", "again", &Resolution::Failed)
            .await,
        Err(StoreError::Conflict(_))
    ));
    let wf = store.workflow(c.workflow).await.unwrap();
    assert_eq!(wf.state, WorkflowState::Completed);
    let receipt = wf.steps[0].receipt.as_ref().unwrap();
    assert_eq!(receipt.verification, z29c_core::Verification::Manual);
    assert_eq!(receipt.external_reference.as_deref(), Some("dst-1"));
    let audit = store.review_audit(item).await.unwrap();
    assert_eq!(audit.len(), 1);
    assert_eq!(
        (
            audit[0].resolved_by.as_str(),
            audit[0].resolution.as_str(),
            audit[0].prior_state.as_str(),
            audit[0].prior_version
        ),
        ("alice", "succeeded", "open", 1)
    );
    // the stale worker is fenced out by the person's lease too
    assert!(matches!(
        store.commit_receipt(&c.lease, &success(&c, "late")).await,
        Err(StoreError::Conflict(_))
    ));
    let audit_update = sqlx::query("UPDATE review_resolutions SET reason = 'rewritten'")
        .execute(&pool)
        .await;
    assert!(matches!(
        audit_update.map_err(StoreError::from),
        Err(StoreError::AppendOnly(_))
    ));
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn retry_with_the_same_identity_makes_the_step_claimable_again(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let (c, item) = in_review(&store, &pool).await;
    store
        .resolve_review(
            item,
            1,
            "alice",
            "destination has no record",
            &Resolution::RetrySameIdentity,
        )
        .await
        .unwrap();
    let again = store.claim(&owner("worker-b"), 1).await.unwrap().remove(0);
    assert_eq!(again.request_identity, c.request_identity);
    assert!(again.lease.version.get() > c.lease.version.get() + 1);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_failed_resolution_fails_the_step_with_a_manual_receipt(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let (c, item) = in_review(&store, &pool).await;
    store
        .resolve_review(
            item,
            1,
            "alice",
            "destination refused it",
            &Resolution::Failed,
        )
        .await
        .unwrap();
    let wf = store.workflow(c.workflow).await.unwrap();
    assert_eq!(wf.steps[0].state, StepState::Failed);
    assert_eq!(wf.state, WorkflowState::Failed);
    assert_eq!(
        wf.steps[0].receipt.as_ref().unwrap().outcome,
        z29c_core::Outcome::Failed
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn the_review_queue_pages_newest_first_without_repeats_or_gaps(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let mut opened = Vec::new();
    for i in 0..5 {
        let c = claimed_single(&store, &format!("page-{i}"), "worker-a").await;
        invoke(&store, &c).await;
        opened.push(sent_to_review(&store, &pool, &c).await.id);
    }
    let mut seen = Vec::new();
    let mut sizes = Vec::new();
    let mut after = None;
    loop {
        let page = store.review_page(false, 2, after).await.unwrap();
        sizes.push(page.items.len());
        seen.extend(page.items.iter().map(|i| i.id));
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    assert_eq!(sizes, [2, 2, 1]);
    opened.reverse();
    assert_eq!(seen, opened, "newest first, each once");
    // a page that ends exactly at the last item says so
    let whole = store.review_page(false, 5, None).await.unwrap();
    assert_eq!(whole.items.len(), 5);
    assert_eq!(whole.next, None);
}
