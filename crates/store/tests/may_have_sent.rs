//! "May this step have sent its request?" is asked of every attempt of the step
//! (`z29c_may_have_sent`), never only of its current one: a later attempt that stopped before
//! its own invocation must not hide an earlier attempt's request. Each test brings a step to
//! where the current attempt alone says "nothing was sent" while an earlier one began its
//! invocation, and pins what cancellation, a release, recovery and review do there. The broken
//! build `current_attempt_only` (feature `faults`) asks the current attempt alone: it breaks
//! the rule these tests pin.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;
use z29c_core::{
    AdapterCapability, AttemptState, Checkpoint, RecoveryCategory, RecoveryDecision, StepId,
    StepState, WorkflowState, classify,
};
use z29c_store::leases::ClaimedStep;
use z29c_store::recovery::{DecisionRecord, RecoveryLease};
use z29c_store::review::Resolution;
use z29c_store::{MIGRATOR, Store, StoreError};

/// A decision for an idempotent adapter, the one capability under which recovery may send
/// again after an invocation began.
fn record(category: RecoveryCategory, decision: RecoveryDecision) -> DecisionRecord {
    DecisionRecord {
        category,
        decision,
        capability: AdapterCapability::Idempotent,
        detail: json!({}),
    }
}

/// Begins `first`'s invocation, lets its lease lapse, and has recovery send the request again
/// with the same identity (idempotent adapter, attempts left); returns the step's second
/// attempt, claimed by `worker-b` and not invoked. No other step may be claimable then.
async fn sent_then_retried(store: &Store, pool: &PgPool, first: &ClaimedStep) -> ClaimedStep {
    invoke(store, first).await;
    let rec = take_over(store, pool, first).await;
    let (category, decision) = classify(&rec.snapshot.evidence(AdapterCapability::Idempotent));
    assert_eq!(
        (category, decision),
        (
            RecoveryCategory::InvokedIdempotent,
            RecoveryDecision::RetrySameIdentity
        )
    );
    store
        .record_decision(&rec.lease, &record(category, decision))
        .await
        .unwrap();
    eligible_now(pool, first.lease.step).await;
    let mut claimed = store.claim(&owner("worker-b"), 10).await.unwrap();
    assert_eq!(claimed.len(), 1, "only the retried step is claimable");
    let second = claimed.pop().unwrap();
    assert_eq!(
        (second.lease.step, second.attempt_number),
        (first.lease.step, 2)
    );
    assert_eq!(second.request_identity, first.request_identity);
    second
}

/// A one-step workflow (at most `max_attempts` attempts) whose first attempt began its
/// invocation and expired, and whose second attempt, sent by recovery with the same identity,
/// expired before its own invocation; recovery (`recovery-1`) holds the step now.
async fn second_attempt_expired_unbegun(
    store: &Store,
    pool: &PgPool,
    key: &str,
    max_attempts: u32,
) -> (ClaimedStep, RecoveryLease) {
    let mut wf = workflow(key, vec![step("only", &[])]);
    wf.steps[0].policy.max_attempts = max_attempts;
    submit(store, &wf).await;
    let first = store.claim(&owner("worker-a"), 1).await.unwrap().remove(0);
    let second = sent_then_retried(store, pool, &first).await;
    let rec = take_over(store, pool, &second).await;
    (second, rec)
}

async fn state_of(store: &Store, c: &ClaimedStep) -> StepState {
    let wf = store.workflow(c.workflow).await.unwrap();
    wf.steps
        .iter()
        .find(|s| s.id == c.lease.step)
        .unwrap()
        .state
}

/// The steps that have an open review item.
/// The kinds of the step's events, oldest first.
async fn event_kinds(pool: &PgPool, step: StepId) -> Vec<String> {
    sqlx::query_scalar("SELECT kind::text FROM step_events WHERE step_id = $1 ORDER BY id")
        .bind(step.as_uuid())
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn open_reviews(store: &Store) -> Vec<Uuid> {
    let items = store.review_items(false, 100).await.unwrap();
    items.into_iter().map(|i| i.step_id).collect()
}

/// Everything a recovery decision could change: the step's and its workflow's rows, and how
/// many decisions, events, review items and messages there are.
async fn footprint(pool: &PgPool, step: StepId) -> Value {
    sqlx::query_scalar(
        "SELECT jsonb_build_object(
             'step', to_jsonb(s), 'workflow', to_jsonb(w),
             'decisions', (SELECT count(*) FROM recovery_decisions d WHERE d.step_id = s.id),
             'events', (SELECT count(*) FROM step_events e WHERE e.step_id = s.id),
             'reviews', (SELECT count(*) FROM review_items r WHERE r.step_id = s.id),
             'messages', (SELECT count(*) FROM outbox o WHERE o.workflow_id = w.id))
         FROM steps s JOIN workflows w ON w.id = s.workflow_id WHERE s.id = $1",
    )
    .bind(step.as_uuid())
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_cancelled_workflow_sends_a_step_to_review_when_an_earlier_attempt_may_have_sent(
    pool: PgPool,
) {
    let store = Store::from_pool(pool.clone());
    let steps = vec![
        step("sent", &[]),
        step("throttled", &[]),
        step("unsent", &[]),
    ];
    submit(&store, &workflow("cancelled", steps)).await;
    let claimed = store.claim(&owner("worker-a"), 3).await.unwrap();
    assert_eq!(claimed.len(), 3);
    let named = |name: &str| claimed.iter().find(|c| c.name.as_str() == name).unwrap();
    let (sent, throttled, unsent) = (named("sent"), named("throttled"), named("unsent"));
    // a 429 after the invocation began: told "not performed", so its attempt is released and
    // counts as having sent nothing; the minute it waits keeps it out of the next claim
    invoke(&store, throttled).await;
    store
        .release_rate_limited(&throttled.lease, Duration::from_secs(60), "rate_limited")
        .await
        .unwrap();
    let second = sent_then_retried(&store, &pool, sent).await;
    // the second attempt gives the step back unbegun (a shutdown): the current attempt now
    // says nothing was sent, and only the first one remembers the request
    store.release_unbegun(&second.lease).await.unwrap();
    store.release_unbegun(&unsent.lease).await.unwrap();
    let wf = store.workflow(sent.workflow).await.unwrap();
    let current = wf.steps.iter().find(|s| s.id == sent.lease.step).unwrap();
    assert_eq!(
        (current.state, current.checkpoint, current.last_attempt),
        (
            StepState::Ready,
            Some(Checkpoint::RequestIdentityPersisted),
            Some(AttemptState::Released)
        )
    );
    assert!(wf.steps.iter().all(|s| s.state == StepState::Ready));

    store
        .cancel_workflow(sent.workflow, "operator asked")
        .await
        .unwrap();

    assert_eq!(state_of(&store, sent).await, StepState::NeedsReview);
    assert_eq!(state_of(&store, throttled).await, StepState::Cancelled);
    assert_eq!(state_of(&store, unsent).await, StepState::Cancelled);
    assert_eq!(
        open_reviews(&store).await,
        [sent.lease.step.as_uuid()],
        "only the step whose request may exist waits for a person"
    );
    // its history says a review opened, not that it was cancelled
    let kinds = event_kinds(&pool, sent.lease.step).await;
    assert_eq!(
        kinds.last().map(String::as_str),
        Some("review_opened"),
        "{kinds:?}"
    );
    assert!(!kinds.iter().any(|k| k == "cancelled"), "{kinds:?}");
    let kinds = event_kinds(&pool, unsent.lease.step).await;
    assert_eq!(
        kinds.last().map(String::as_str),
        Some("cancelled"),
        "{kinds:?}"
    );
    assert!(
        store
            .claim(&owner("worker-c"), 10)
            .await
            .unwrap()
            .is_empty()
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn recovery_sees_an_earlier_attempt_that_may_have_sent(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    // two attempts allowed, both made: the budget is spent
    let (second, rec) = second_attempt_expired_unbegun(&store, &pool, "spent", 2).await;
    let snapshot = &rec.snapshot;
    assert_eq!(snapshot.attempt, Some(second.lease.attempt));
    assert_eq!(
        snapshot.checkpoint,
        Some(Checkpoint::RequestIdentityPersisted)
    );
    assert!(snapshot.earlier_may_have_sent);
    assert_eq!((snapshot.attempts_used, snapshot.max_attempts), (2, 2));
    // the current attempt alone says "identity persisted, nothing sent, no attempts left",
    // which is a failure; the earlier request makes it an unknown outcome for a person
    let (category, decision) = classify(&snapshot.evidence(AdapterCapability::Idempotent));
    assert_ne!(decision, RecoveryDecision::Fail);
    assert_eq!(
        (category, decision),
        (
            RecoveryCategory::InvokedIdempotent,
            RecoveryDecision::HumanReview
        )
    );

    // a step whose only attempt never began: nothing earlier to remember
    let never = claimed_single(&store, "never-began", "worker-a").await;
    let rec = take_over(&store, &pool, &never).await;
    assert!(!rec.snapshot.earlier_may_have_sent);
    assert_eq!(
        classify(&rec.snapshot.evidence(AdapterCapability::Idempotent)),
        (
            RecoveryCategory::IdentityNotInvoked,
            RecoveryDecision::Retry
        )
    );

    // an earlier attempt told "not performed" (a 429 after it began) is not one that may have
    // sent, and does not count against the budget either
    let throttled = claimed_single(&store, "throttled", "worker-a").await;
    invoke(&store, &throttled).await;
    store
        .release_rate_limited(&throttled.lease, Duration::from_secs(60), "rate_limited")
        .await
        .unwrap();
    eligible_now(&pool, throttled.lease.step).await;
    let again = store.claim(&owner("worker-b"), 10).await.unwrap().remove(0);
    assert_eq!(
        (again.lease.step, again.attempt_number),
        (throttled.lease.step, 2)
    );
    let rec = take_over(&store, &pool, &again).await;
    assert!(!rec.snapshot.earlier_may_have_sent);
    assert_eq!(rec.snapshot.attempts_used, 1);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn recovery_may_not_fail_a_step_that_may_have_sent(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let (second, rec) = second_attempt_expired_unbegun(&store, &pool, "spent", 2).await;
    let step_id = second.lease.step;
    let before = footprint(&pool, step_id).await;
    // what a recovery worker that looked only at the current attempt would decide: fail it
    // (budget spent), or send a fresh request; the store refuses each whatever classify said
    for wrong in [
        RecoveryDecision::Fail,
        RecoveryDecision::MakeReady,
        RecoveryDecision::Retry,
    ] {
        let r = store
            .record_decision(
                &rec.lease,
                &record(RecoveryCategory::IdentityNotInvoked, wrong),
            )
            .await;
        assert!(matches!(r, Err(StoreError::Conflict(_))), "{wrong}: {r:?}");
    }
    assert_eq!(
        footprint(&pool, step_id).await,
        before,
        "a refused decision changes nothing"
    );
    let wf = store.workflow(second.workflow).await.unwrap();
    assert_eq!(
        (wf.state, wf.steps[0].state),
        (WorkflowState::Running, StepState::Recovering)
    );

    // the lease survived the refusals: the decision the evidence calls for still goes through
    let (category, decision) = classify(&rec.snapshot.evidence(AdapterCapability::Idempotent));
    assert_eq!(decision, RecoveryDecision::HumanReview);
    store
        .record_decision(&rec.lease, &record(category, decision))
        .await
        .unwrap();
    assert_eq!(state_of(&store, &second).await, StepState::NeedsReview);
    assert_eq!(open_reviews(&store).await, [step_id.as_uuid()]);
    assert_eq!(
        store.workflow(second.workflow).await.unwrap().state,
        WorkflowState::Running,
        "an unknown outcome never fails the workflow"
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_release_in_an_ended_workflow_reviews_a_step_that_may_have_sent(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    submit(
        &store,
        &workflow("ended", vec![step("sent", &[]), step("unsent", &[])]),
    )
    .await;
    let claimed = store.claim(&owner("worker-a"), 2).await.unwrap();
    assert_eq!(claimed.len(), 2);
    let named = |name: &str| claimed.iter().find(|c| c.name.as_str() == name).unwrap();
    let (sent, unsent) = (named("sent"), named("unsent"));
    let second = sent_then_retried(&store, &pool, sent).await;

    store
        .cancel_workflow(sent.workflow, "operator asked")
        .await
        .unwrap();
    // cancellation stops only steps that hold no lease: these two stop at their next safe
    // point, which is the release below, so the release is what decides their state
    assert_eq!(state_of(&store, sent).await, StepState::Leased);
    assert_eq!(state_of(&store, unsent).await, StepState::Leased);
    assert!(open_reviews(&store).await.is_empty());

    store.release_unbegun(&second.lease).await.unwrap();
    store.release_unbegun(&unsent.lease).await.unwrap();

    // the second attempt, released, sent nothing; the first may have, so the step is not
    // cancelled but left to a person
    assert_eq!(state_of(&store, sent).await, StepState::NeedsReview);
    assert_eq!(state_of(&store, unsent).await, StepState::Cancelled);
    assert_eq!(open_reviews(&store).await, [sent.lease.step.as_uuid()]);
    let kinds = event_kinds(&pool, sent.lease.step).await;
    assert!(kinds.iter().any(|k| k == "review_opened"), "{kinds:?}");
    assert!(
        store
            .claim(&owner("worker-c"), 10)
            .await
            .unwrap()
            .is_empty()
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_review_in_an_ended_workflow_cannot_be_resolved_by_sending_again(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let first = claimed_single(&store, "ended", "worker-a").await;
    let second = sent_then_retried(&store, &pool, &first).await;
    store.release_unbegun(&second.lease).await.unwrap();
    store
        .cancel_workflow(first.workflow, "operator asked")
        .await
        .unwrap();
    let items = store.review_items(false, 10).await.unwrap();
    assert_eq!(items.len(), 1);
    let item = items[0].id;

    // a step made ready in an ended workflow is never claimed, so "send it again" would leave
    // its possible effect with no one looking at it
    let r = store
        .resolve_review(
            item,
            1,
            "alice",
            "destination has no record",
            &Resolution::RetrySameIdentity,
        )
        .await;
    assert!(matches!(r, Err(StoreError::Conflict(_))), "{r:?}");
    let kept = store.review_item(item).await.unwrap();
    assert_eq!((kept.state.as_str(), kept.version), ("open", 1));
    assert_eq!(state_of(&store, &first).await, StepState::NeedsReview);
    assert!(store.review_audit(item).await.unwrap().is_empty());

    // a person's finding still closes it
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
    assert_eq!(state_of(&store, &first).await, StepState::Failed);
    assert_eq!(
        store.workflow(first.workflow).await.unwrap().state,
        WorkflowState::Cancelled
    );
}
