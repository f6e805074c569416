//! Retries and waiting against PostgreSQL: a step given back without sending counts against
//! its waiting budget and ends past it (failed when nothing may have been sent, in review when
//! an earlier attempt may have sent); a definite refusal its policy names is tried again under
//! the same request identity while attempts are left, and the refused attempt counts as having
//! sent nothing.

mod common;

use std::time::Duration;

use common::*;
use sqlx::PgPool;
use z29c_core::{
    AdapterCapability, AfterRefusal, AfterWait, AttemptState, ProductState, RecoveryCategory,
    StatusSet, StepId, StepState, WorkflowState, classify,
};
use z29c_store::recovery::DecisionRecord;
use z29c_store::{MIGRATOR, Store};

async fn last_event(pool: &PgPool, step: StepId) -> (String, serde_json::Value) {
    sqlx::query_as(
        "SELECT kind::text, detail FROM step_events WHERE step_id = $1 ORDER BY id DESC LIMIT 1",
    )
    .bind(step.as_uuid())
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_step_given_back_past_its_waiting_budget_fails_and_its_workflow_with_it(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let mut throttled = step("throttled", &[]);
    throttled.policy.retry.max_waits = 2;
    let wf = workflow("waits", vec![throttled, step("after", &["throttled"])]);
    let id = submit(&store, &wf).await.workflow;
    let mut outcomes = Vec::new();
    let mut step_id = None;
    for _ in 0..3 {
        let c = store.claim(&owner("worker-a"), 10).await.unwrap().remove(0);
        step_id = Some(c.lease.step);
        // the gateway began the invocation; the destination answered 429
        invoke(&store, &c).await;
        let after = store
            .release_rate_limited(&c.lease, Duration::from_millis(100), "rate_limited")
            .await
            .unwrap();
        outcomes.push(after.clone());
        if matches!(after, AfterWait::Wait { .. }) {
            eligible_now(&pool, c.lease.step).await;
        }
    }
    let step_id = step_id.unwrap();
    // a wait shorter than the initial backoff counts as the initial backoff
    let wait = AfterWait::Wait {
        after: Duration::from_millis(250),
    };
    assert_eq!(outcomes[..2], [wait.clone(), wait]);
    let AfterWait::Fail(reason) = &outcomes[2] else {
        panic!("the third wait is past max_waits: {outcomes:?}")
    };
    assert!(
        reason.contains("max_waits (2)") && reason.contains("nothing was sent"),
        "{reason}"
    );

    let detail = store.workflow(id).await.unwrap();
    assert_eq!(detail.state, WorkflowState::Failed);
    let throttled = detail.steps.iter().find(|s| s.id == step_id).unwrap();
    assert_eq!(throttled.state, StepState::Failed);
    assert_eq!(throttled.last_attempt, Some(AttemptState::Released));
    // nothing was sent that took effect: the person sees a failure, not a review
    assert_eq!(throttled.product_state(), ProductState::Failed);
    let after = detail.steps.iter().find(|s| s.name == "after").unwrap();
    assert_eq!(after.state, StepState::Cancelled);
    let (kind, detail) = last_event(&pool, step_id).await;
    assert_eq!(kind, "failed_by_policy");
    assert_eq!(detail["reason"], reason.as_str());
    let (waits, waited): (i32, i64) =
        sqlx::query_as("SELECT waits, waited_ms FROM steps WHERE id = $1")
            .bind(step_id.as_uuid())
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (waits, waited),
        (2, 500),
        "the waits within budget, counted"
    );
    assert!(
        store
            .claim(&owner("worker-b"), 10)
            .await
            .unwrap()
            .is_empty()
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_wait_past_the_budget_goes_to_review_when_an_earlier_attempt_may_have_sent(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let mut only = step("only", &[]);
    only.policy.retry.max_wait = Duration::from_secs(5);
    submit(&store, &workflow("review", vec![only])).await;
    let first = store.claim(&owner("worker-a"), 1).await.unwrap().remove(0);
    // the first attempt began its invocation and went quiet: recovery sends again
    invoke(&store, &first).await;
    let rec = take_over(&store, &pool, &first).await;
    let (category, decision) = classify(&rec.snapshot.evidence(AdapterCapability::Idempotent));
    assert_eq!(category, RecoveryCategory::InvokedIdempotent);
    store
        .record_decision(
            &rec.lease,
            &DecisionRecord {
                category,
                decision,
                capability: AdapterCapability::Idempotent,
                detail: serde_json::json!({}),
            },
        )
        .await
        .unwrap();
    eligible_now(&pool, first.lease.step).await;
    let second = store.claim(&owner("worker-b"), 1).await.unwrap().remove(0);
    assert_eq!(second.request_identity, first.request_identity);
    // the destination asks for an hour: more than the step may wait in all, so it ends now
    let after = store
        .release_rate_limited(&second.lease, Duration::from_secs(3600), "rate_limited")
        .await
        .unwrap();
    let AfterWait::Review(reason) = after else {
        panic!("expected a review, got {after:?}")
    };
    assert!(
        reason.contains("max_wait_ms (5000)") && reason.contains("may have sent"),
        "{reason}"
    );
    let detail = store.workflow(second.workflow).await.unwrap();
    assert_eq!(detail.steps[0].state, StepState::NeedsReview);
    assert_eq!(detail.state, WorkflowState::Running);
    let items = store.review_items(false, 10).await.unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(items[0].reason, reason);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_refusal_the_policy_names_is_retried_under_the_same_identity_while_attempts_last(
    pool: PgPool,
) {
    let store = Store::from_pool(pool.clone());
    let mut only = step("only", &[]);
    only.policy.max_attempts = 2;
    only.policy.retry.retryable_statuses = StatusSet::parse([408, 425]).unwrap();
    submit(&store, &workflow("refused", vec![only])).await;
    let first = store.claim(&owner("worker-a"), 1).await.unwrap().remove(0);
    assert_eq!(
        first.policy.retry.retryable_statuses,
        StatusSet::parse([408, 425]).unwrap()
    );
    invoke(&store, &first).await;
    // a status the policy does not name changes nothing: the caller commits the refusal
    assert_eq!(
        store
            .retry_refused(&first.lease, 400, "bad request")
            .await
            .unwrap(),
        AfterRefusal::Final
    );
    let after = store
        .retry_refused(&first.lease, 408, "request timeout")
        .await
        .unwrap();
    assert!(matches!(after, AfterRefusal::Retry { .. }), "{after:?}");
    let (kind, detail) = last_event(&pool, first.lease.step).await;
    assert_eq!(kind, "retry_scheduled");
    assert_eq!(detail["status"], 408);

    let wf = store.workflow(first.workflow).await.unwrap();
    assert_eq!(wf.steps[0].state, StepState::Ready);
    assert_eq!(wf.steps[0].last_attempt, Some(AttemptState::Refused));
    eligible_now(&pool, first.lease.step).await;
    let second = store.claim(&owner("worker-b"), 1).await.unwrap().remove(0);
    assert_eq!(second.attempt_number, 2);
    assert_eq!(second.request_identity, first.request_identity);
    invoke(&store, &second).await;
    // the refused attempt counts against max_attempts: the second refusal is final
    assert_eq!(
        store
            .retry_refused(&second.lease, 425, "too early")
            .await
            .unwrap(),
        AfterRefusal::Final
    );
    // and it is not an attempt that may have sent: recovery of the second sees nothing earlier
    let rec = take_over(&store, &pool, &second).await;
    assert!(!rec.snapshot.earlier_may_have_sent);
    assert_eq!(rec.snapshot.attempts_used, 2);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_step_is_given_back_unsent_only_while_its_invocation_has_not_begun(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    submit(
        &store,
        &workflow("unsent", vec![step("a", &[]), step("b", &[])]),
    )
    .await;
    let claimed = store.claim(&owner("worker-a"), 2).await.unwrap();
    let (first, second) = (&claimed[0], &claimed[1]);
    // the gateway could not be reached and never began: the step waits, its attempt released
    let after = store
        .release_unsent(&first.lease, Duration::from_secs(2), "gateway unreachable")
        .await
        .unwrap();
    assert!(matches!(after, AfterWait::Wait { .. }), "{after:?}");
    let wf = store.workflow(first.workflow).await.unwrap();
    let a = wf.steps.iter().find(|s| s.id == first.lease.step).unwrap();
    assert_eq!(
        (a.state, a.last_attempt),
        (StepState::Ready, Some(AttemptState::Released))
    );
    // the gateway began (and may have sent) before the worker heard back: only recovery decides
    invoke(&store, second).await;
    let refused = store
        .release_unsent(&second.lease, Duration::from_secs(2), "gateway unreachable")
        .await;
    assert!(
        matches!(refused, Err(z29c_store::StoreError::Conflict(_))),
        "{refused:?}"
    );
    let b = store.workflow(second.workflow).await.unwrap();
    let b = b.steps.iter().find(|s| s.id == second.lease.step).unwrap();
    assert_eq!(
        (b.state, b.last_attempt),
        (StepState::Leased, Some(AttemptState::Active))
    );
}
