//! Shared fixtures for the store tests. Every test gets a fresh database from `#[sqlx::test]`.

#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use serde_json::json;
use sqlx::PgPool;
use z29c_core::{ClientKey, ExternalReference, LeasePolicy, Outcome, OwnerId, StepId, StepName};
use z29c_store::Store;
use z29c_store::leases::{ClaimedStep, Observed};
use z29c_store::recovery::RecoveryLease;
use z29c_store::workflows::{NewStep, NewWorkflow, SubmitLimits, Submitted};

pub fn owner(name: &str) -> OwnerId {
    OwnerId::parse(name).unwrap()
}

pub fn step(name: &str, deps: &[&str]) -> NewStep {
    NewStep {
        name: StepName::parse(name).unwrap(),
        adapter: "http".into(),
        operation: "deliver".into(),
        input: json!({ "step": name, "amount": 42 }),
        depends_on: deps.iter().map(|d| StepName::parse(*d).unwrap()).collect(),
        policy: LeasePolicy::default(),
    }
}

pub fn workflow(key: &str, steps: Vec<NewStep>) -> NewWorkflow {
    NewWorkflow {
        trace_context: None,
        client_key: ClientKey::parse(key).unwrap(),
        name: format!("test {key}"),
        deadline: None,
        steps,
    }
}

pub async fn submit(store: &Store, wf: &NewWorkflow) -> Submitted {
    store
        .submit_workflow(wf, &SubmitLimits::default())
        .await
        .unwrap()
}

/// Submits one single-step workflow and claims its step.
pub async fn claimed_single(store: &Store, key: &str, who: &str) -> ClaimedStep {
    submit(store, &workflow(key, vec![step("only", &[])])).await;
    let mut claimed = store.claim(&owner(who), 1).await.unwrap();
    assert_eq!(claimed.len(), 1, "one ready step to claim");
    claimed.pop().unwrap()
}

/// Begins the invocation, as it is committed before anyone calls out (the claim persisted the
/// request identity already).
pub async fn invoke(store: &Store, c: &ClaimedStep) {
    store.begin_invocation(&c.lease).await.unwrap();
}

pub fn success(c: &ClaimedStep, reference: &str) -> Observed {
    Observed {
        request_identity: c.request_identity.clone(),
        input_digest: c.input_digest.clone(),
        adapter_version: "http/1".into(),
        outcome: Outcome::Succeeded,
        external_reference: Some(ExternalReference::parse(reference).unwrap()),
        result: json!({ "status": 201 }),
        seen: None,
    }
}

/// Moves a lease's expiry into the past, as if its time had run out on PostgreSQL's clock.
pub async fn expire(pool: &PgPool, step: StepId) {
    let n = sqlx::query(
        "UPDATE steps SET leased_at = leased_at - interval '1 hour',
             expires_at = now() - interval '1 millisecond'
         WHERE id = $1 AND expires_at IS NOT NULL",
    )
    .bind(step.as_uuid())
    .execute(pool)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(n, 1, "the step holds a lease to expire");
}

/// Lets the step's lease lapse and takes it over as `recovery-1`, as recovery does.
pub async fn take_over(store: &Store, pool: &PgPool, c: &ClaimedStep) -> RecoveryLease {
    expire(pool, c.lease.step).await;
    store
        .take_recovery_lease(
            c.lease.step,
            c.lease.version,
            &owner("recovery-1"),
            Duration::from_secs(30),
        )
        .await
        .unwrap()
}

/// A short policy for tests that wait for real expiry on PostgreSQL's clock.
pub fn short_policy() -> LeasePolicy {
    LeasePolicy {
        lease: Duration::from_millis(1_000),
        renew_every: Duration::from_millis(300),
        attempt_deadline: Duration::from_millis(2_000),
        final_grace: Duration::from_millis(600),
        adapter_timeout: Duration::from_millis(500),
        max_attempts: 3,
        schedule_to_start: Duration::ZERO,
        retry: Default::default(),
    }
}

/// Makes a step that waits out its retry backoff claimable now: the backoff is pinned in
/// fencing.rs, and sleeping through it here would only slow the tests down.
pub async fn eligible_now(pool: &PgPool, step: StepId) {
    sqlx::query("UPDATE steps SET next_eligible_at = now() WHERE id = $1")
        .bind(step.as_uuid())
        .execute(pool)
        .await
        .unwrap();
}

pub async fn count(pool: &PgPool, sql: &'static str, step: StepId) -> i64 {
    sqlx::query_scalar(sql)
        .bind(step.as_uuid())
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A store on `pool`'s database whose sessions have the shared statements' settings
/// ([`z29c_store::BATCH_SESSION_SETTINGS`]: generic plans from the first call, no sequential
/// scans), as the executor's and gateway's committers run them.
pub async fn batch_store(pool: &PgPool) -> Store {
    let options = (*pool.connect_options())
        .clone()
        .options(z29c_store::BATCH_SESSION_SETTINGS.iter().copied());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap();
    Store::from_pool(pool)
}

/// Lets the invoked step `c`'s lease lapse and records recovery's decision for an opaque
/// adapter, which is review; returns the review item opened.
pub async fn sent_to_review(
    store: &Store,
    pool: &PgPool,
    c: &ClaimedStep,
) -> z29c_store::review::ReviewItem {
    use z29c_core::{AdapterCapability, RecoveryDecision, classify};
    use z29c_store::recovery::DecisionRecord;
    let rec = take_over(store, pool, c).await;
    let (category, decision) = classify(&rec.snapshot.evidence(AdapterCapability::Opaque));
    assert_eq!(decision, RecoveryDecision::HumanReview);
    store
        .record_decision(
            &rec.lease,
            &DecisionRecord {
                category,
                decision,
                capability: AdapterCapability::Opaque,
                detail: json!({}),
            },
        )
        .await
        .unwrap();
    let items = store.review_items(false, 100).await.unwrap();
    let mine: Vec<_> = items
        .into_iter()
        .filter(|i| i.step_id == c.lease.step.as_uuid())
        .collect();
    assert_eq!(mine.len(), 1, "the step is in review once");
    mine.into_iter().next().unwrap()
}

/// Makes the period of ids made now (a day long) and answers the partition of `table` that
/// holds them: where a test's rows are, and whose statistics and settings it reads.
pub async fn current_partition(pool: &PgPool, table: &str) -> String {
    Store::from_pool(pool.clone())
        .cover_ahead(Duration::from_secs(24 * 60 * 60))
        .await
        .unwrap();
    sqlx::query_scalar(
        "SELECT $1 || '_' || suffix FROM retention_periods
         WHERE starts_at <= now() AND ends_at > now()",
    )
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Whether `relation` (a name in a plan or in the statistics) is `table` or one of its
/// partitions.
pub fn is_part_of(relation: &str, table: &str) -> bool {
    relation == table
        || relation
            .strip_prefix(table)
            .is_some_and(|rest| rest == "_before" || rest.starts_with("_p"))
}

/// Turns autovacuum off for the partition of `table` that holds ids made now, and answers
/// its name.
pub async fn without_autovacuum(pool: &PgPool, table: &str) -> String {
    let partition = current_partition(pool, table).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE {partition} SET (autovacuum_enabled = false)"
    )))
    .execute(pool)
    .await
    .unwrap();
    partition
}

/// A login role in `z29c_service` and a pool of it on the test's database. The role is
/// dropped by [`drop_role`].
pub async fn service_pool(owner: &PgPool) -> (String, PgPool) {
    let role = format!(
        "z29c_svc_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE ROLE {role} LOGIN IN ROLE z29c_service"
    )))
    .execute(owner)
    .await
    .unwrap();
    let options = (*owner.connect_options()).clone().username(&role);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .unwrap();
    (role, pool)
}

pub async fn drop_role(owner: &PgPool, role: &str, pool: PgPool) {
    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP ROLE {role}")))
        .execute(owner)
        .await
        .unwrap();
}
