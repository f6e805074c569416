//! *Invocation began* of many calls in one statement, on real PostgreSQL: each call is fenced
//! on its own, a call that may not begin there (a lease that is not current, a workflow no
//! longer running, no free slot) writes nothing and is answered `None`, and what the statement
//! writes is exactly what the call's own transaction writes.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};
use sqlx::PgPool;
use z29c_core::{FenceReason, LeaseVersion};
use z29c_store::invocations::{Call, InvocationBatches};
use z29c_store::leases::ClaimedStep;
use z29c_store::permits::{EndedPermit, PermitRequest};
use z29c_store::{MIGRATOR, Store, StoreError};

const HOLD: Duration = Duration::from_secs(60);

fn permit_for(c: &ClaimedStep) -> PermitRequest<'_> {
    PermitRequest {
        adapter: "http",
        operation_class: "deliver",
        attempt: Some(c.lease.attempt),
        request_identity: &c.request_identity,
        gateway: "gateway-1",
        hold: HOLD,
    }
}

fn calls(claimed: &[ClaimedStep]) -> Vec<Call<'_>> {
    claimed
        .iter()
        .map(|c| Call {
            claim: &c.lease,
            permit: permit_for(c),
        })
        .collect()
}

/// Submits `n` one-step workflows and claims their steps.
async fn claimed(store: &Store, n: usize) -> Vec<ClaimedStep> {
    for i in 0..n {
        submit(
            store,
            &workflow(&format!("wf-{i}"), vec![step("only", &[])]),
        )
        .await;
    }
    let claimed = store.claim(&owner("worker-a"), n as i64).await.unwrap();
    assert_eq!(claimed.len(), n);
    claimed
}

/// Everything *invocation began* wrote about a step, without the ids and times that differ
/// between two steps: the attempt, the step's checkpoint version, its last event, its permit
/// and the permit's slot.
async fn written(pool: &PgPool, c: &ClaimedStep) -> Value {
    sqlx::query_scalar(
        "SELECT jsonb_build_object(
             'attempt', (SELECT jsonb_build_object('checkpoint', checkpoint, 'state', state,
                             'began', invocation_began_at IS NOT NULL)
                         FROM attempts WHERE id = $2),
             'version', (SELECT checkpoint_version - $3 FROM steps WHERE id = $1),
             'event', (SELECT jsonb_build_object('kind', kind, 'owner', owner,
                           'attempt', attempt_id = $2, 'checkpoint', detail->>'checkpoint',
                           'version', (detail->>'checkpoint_version')::int8 - $3)
                       FROM step_events WHERE step_id = $1 ORDER BY id DESC LIMIT 1),
             'permits', (SELECT jsonb_agg(jsonb_build_object('state', p.state,
                             'adapter', p.adapter, 'class', p.operation_class,
                             'identity', p.request_identity = $4, 'gateway', p.gateway,
                             'hold_s', round(extract(epoch FROM p.expires_at - p.acquired_at)),
                             'slot_held', s.permit_id = p.id AND s.expires_at = p.expires_at))
                         FROM adapter_permits p
                         LEFT JOIN adapter_permit_slots s
                           ON (s.adapter, s.operation_class, s.slot)
                              = (p.adapter, p.operation_class, p.slot)
                         WHERE p.attempt_id = $2))",
    )
    .bind(c.lease.step.as_uuid())
    .bind(c.lease.attempt.as_uuid())
    .bind(c.checkpoint_version)
    .bind(c.request_identity.as_str())
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The transactions that wrote the permits of `claimed` with everything that came with them
/// (their attempts and *invocation began* events).
async fn transactions(pool: &PgPool, claimed: &[ClaimedStep]) -> i64 {
    let attempts: Vec<uuid::Uuid> = claimed.iter().map(|c| c.lease.attempt.as_uuid()).collect();
    sqlx::query_scalar(
        "SELECT count(DISTINCT x) FROM (
             SELECT xmin::text AS x FROM adapter_permits WHERE attempt_id = ANY ($1)
             UNION ALL SELECT xmin::text FROM attempts WHERE id = ANY ($1)
             UNION ALL SELECT xmin::text FROM step_events
                       WHERE attempt_id = ANY ($1) AND detail->>'checkpoint' = 'invocation_began'
         ) t",
    )
    .bind(&attempts)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn slots_taken(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM adapter_permit_slots WHERE permit_id IS NOT NULL")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn the_shared_statement_writes_what_the_calls_own_transaction_writes(pool: PgPool) {
    let store = batch_store(&pool).await;
    store.set_permit_limit("http", "deliver", 4).await.unwrap();
    let claimed = claimed(&store, 2).await;
    let (a, b) = (&claimed[0], &claimed[1]);

    let (shared, released) = store.begin_invocations(&calls(&claimed[..1]), &[]).await;
    assert!(released, "nothing to release");
    let (permit_a, version_a) = shared[0].clone().expect("a current call begins there");
    let (permit_b, version_b) = store
        .begin_invocation_with_permit(&b.lease, &permit_for(b), &[])
        .await
        .unwrap();
    assert_eq!(version_a - a.checkpoint_version, 1);
    assert_eq!(
        version_a - a.checkpoint_version,
        version_b - b.checkpoint_version
    );
    assert_eq!(permit_a.attempt_id, Some(a.lease.attempt.as_uuid()));
    assert_eq!(
        (permit_a.state.as_str(), permit_b.state.as_str()),
        ("held", "held")
    );

    let (wa, wb) = (written(&pool, a).await, written(&pool, b).await);
    assert_eq!(wa, wb, "the same rows, whichever way the call began");
    assert_eq!(wa["attempt"]["checkpoint"], json!("invocation_began"));
    assert_eq!(wa["event"]["checkpoint"], json!("invocation_began"));
    assert_eq!(wa["permits"][0]["slot_held"], json!(true));
    assert_eq!(wa["permits"][0]["hold_s"], json!(60));
    assert_eq!(slots_taken(&pool).await, 2);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn many_calls_share_one_statement_and_each_is_fenced_on_its_own(pool: PgPool) {
    let store = batch_store(&pool).await;
    store.set_permit_limit("http", "deliver", 64).await.unwrap();
    let claimed = claimed(&store, 16).await;

    // seven that may not begin: a lease lost to recovery, another owner, an older and a newer
    // lease version, another step's attempt, an expired lease, a cancelled workflow
    let mut leases: Vec<_> = claimed.iter().map(|c| c.lease.clone()).collect();
    let _recovery = take_over(&store, &pool, &claimed[1]).await;
    leases[2].owner = owner("worker-b");
    leases[3].version = LeaseVersion::new(leases[3].version.get() - 1).unwrap();
    leases[4].version = LeaseVersion::new(leases[4].version.get() + 1).unwrap();
    leases[5].attempt = claimed[6].lease.attempt;
    expire(&pool, claimed[7].lease.step).await;
    store
        .cancel_workflow(claimed[8].workflow, "test")
        .await
        .unwrap();
    let requests: Vec<_> = claimed
        .iter()
        .enumerate()
        .map(|(i, c)| PermitRequest {
            attempt: Some(leases[i].attempt),
            ..permit_for(c)
        })
        .collect();
    let shared: Vec<Call<'_>> = leases
        .iter()
        .zip(&requests)
        .map(|(claim, permit)| Call {
            claim,
            permit: permit.clone(),
        })
        .collect();
    let refused = [1, 2, 3, 4, 5, 7, 8];

    let (answers, _) = store.begin_invocations(&shared, &[]).await;
    for (i, answer) in answers.iter().enumerate() {
        assert_eq!(answer.is_none(), refused.contains(&i), "call {i}");
    }
    let began: Vec<_> = (0..16)
        .filter(|i| !refused.contains(i))
        .map(|i| claimed[i].clone())
        .collect();
    assert_eq!(
        transactions(&pool, &began).await,
        1,
        "nine calls, one transaction"
    );
    assert_eq!(slots_taken(&pool).await, 9);
    for &i in &refused {
        let c = &claimed[i];
        let w = written(&pool, c).await;
        assert_eq!(w["permits"], Value::Null, "call {i} took no permit");
        assert_ne!(
            w["attempt"]["checkpoint"],
            json!("invocation_began"),
            "call {i}"
        );
    }

    // each then takes its transaction, which says why it may not begin
    for &i in &refused {
        let err = store
            .begin_invocation_with_permit(&leases[i], &requests[i], &[])
            .await
            .unwrap_err();
        let StoreError::Fenced(reason) = err else {
            panic!("call {i}: {err}");
        };
        let expected = match i {
            1 | 3 | 4 => matches!(reason, FenceReason::Superseded { .. }),
            2 => reason == FenceReason::NotOwner,
            5 => reason == FenceReason::NotCurrentAttempt,
            7 => reason == FenceReason::Expired,
            _ => matches!(reason, FenceReason::WorkflowForbids { .. }),
        };
        assert!(expected, "call {i}: {reason}");
    }
    assert_eq!(slots_taken(&pool).await, 9, "no refused call took a slot");

    // and a call that began already does not begin twice
    let again = calls(&claimed[..1]);
    let (answers, _) = store.begin_invocations(&again, &[]).await;
    assert!(answers[0].is_none(), "invocation began once");
    assert_eq!(slots_taken(&pool).await, 9);
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn calls_beyond_the_limit_take_no_slot_and_hear_so_from_their_transaction(pool: PgPool) {
    let store = batch_store(&pool).await;
    store.set_permit_limit("http", "deliver", 3).await.unwrap();
    let claimed = claimed(&store, 5).await;

    let (answers, _) = store.begin_invocations(&calls(&claimed), &[]).await;
    let began = answers.iter().filter(|a| a.is_some()).count();
    assert_eq!(began, 3, "as many as the limit");
    assert_eq!(slots_taken(&pool).await, 3);
    let permits: i64 = sqlx::query_scalar("SELECT count(*) FROM adapter_permits")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(permits, 3, "no permit without a slot");
    for (c, a) in claimed.iter().zip(&answers) {
        let w = written(&pool, c).await;
        let checkpoint = w["attempt"]["checkpoint"].clone();
        assert_eq!(a.is_some(), checkpoint == json!("invocation_began"));
        if a.is_none() {
            let err = store
                .begin_invocation_with_permit(&c.lease, &permit_for(c), &[])
                .await
                .unwrap_err();
            assert!(
                matches!(err, StoreError::PermitsExhausted { limit: 3, .. }),
                "{err}"
            );
            let w = written(&pool, c).await;
            assert_eq!(w["attempt"]["checkpoint"], checkpoint, "nothing began");
        }
    }
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_lowered_limit_holds_for_the_shared_statement(pool: PgPool) {
    let store = batch_store(&pool).await;
    store.set_permit_limit("http", "deliver", 4).await.unwrap();
    let claimed = claimed(&store, 8).await;
    let (first, _) = store.begin_invocations(&calls(&claimed[..4]), &[]).await;
    assert!(first.iter().all(Option::is_some));
    // lowered while all four are held: slots 2 and 3 stay until their permits end, and are
    // free, but above the limit, once they have
    store.set_permit_limit("http", "deliver", 2).await.unwrap();
    let ended: Vec<_> = first
        .iter()
        .map(|a| EndedPermit::now(a.as_ref().unwrap().0.id, "succeeded"))
        .collect();
    let (_, released) = store.begin_invocations(&[], &ended).await;
    assert!(released);
    let (second, _) = store.begin_invocations(&calls(&claimed[4..]), &[]).await;
    assert_eq!(
        second.iter().filter(|a| a.is_some()).count(),
        2,
        "{second:?}"
    );
    let above: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM adapter_permit_slots WHERE slot >= 2 AND permit_id IS NOT NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(above, 0, "no permit above the lowered limit");
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn the_permits_of_ended_calls_are_released_by_the_next_statement(pool: PgPool) {
    let store = batch_store(&pool).await;
    store.set_permit_limit("http", "deliver", 2).await.unwrap();
    let claimed = claimed(&store, 5).await;
    let (first, _) = store.begin_invocations(&calls(&claimed[..2]), &[]).await;
    let ended: Vec<_> = first
        .iter()
        .map(|a| EndedPermit::now(a.as_ref().unwrap().0.id, "succeeded"))
        .collect();
    assert_eq!(slots_taken(&pool).await, 2, "the class is full");

    // the releases free the slots, and this statement's calls take them
    let (second, released) = store
        .begin_invocations(&calls(&claimed[2..4]), &ended)
        .await;
    assert!(released);
    assert!(second.iter().all(Option::is_some), "{second:?}");
    assert_eq!(
        slots_taken(&pool).await,
        2,
        "the slots went to the new permits"
    );
    let states: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT state, release_reason FROM adapter_permits WHERE id = ANY ($1) ORDER BY id",
    )
    .bind(ended.iter().map(|e| e.permit).collect::<Vec<_>>())
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        states,
        vec![("released".to_owned(), Some("succeeded".to_owned())); 2]
    );
    let held: Vec<uuid::Uuid> = sqlx::query_scalar(
        "SELECT permit_id FROM adapter_permit_slots WHERE permit_id IS NOT NULL ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut new: Vec<_> = second.iter().map(|a| a.as_ref().unwrap().0.id).collect();
    new.sort();
    assert_eq!(held, new, "each slot names the permit that holds it");
    // never more than the limit held at once, by the permits' own history
    let overlap: i64 = sqlx::query_scalar(
        "SELECT max(n) FROM (SELECT (SELECT count(*) FROM adapter_permits q
                                     WHERE q.acquired_at <= p.acquired_at
                                       AND coalesce(q.released_at, 'infinity') > p.acquired_at) n
                             FROM adapter_permits p) t",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(overlap <= 2, "{overlap} permits held at once");

    // the class is full again: a call without releases finds no slot
    let (third, _) = store.begin_invocations(&calls(&claimed[4..]), &[]).await;
    assert!(third[0].is_none());

    // releasing again changes nothing, and a statement with nothing to begin still releases
    let (none, released) = store.begin_invocations(&[], &ended).await;
    assert!(none.is_empty() && released);
    assert_eq!(slots_taken(&pool).await, 2, "released twice is a no-op");
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn concurrent_calls_share_statements_and_a_stale_one_hears_why(pool: PgPool) {
    let store = batch_store(&pool).await;
    store.set_permit_limit("http", "deliver", 64).await.unwrap();
    let claimed = claimed(&store, 41).await;
    let batches = InvocationBatches::start(&store, &store, 2, 32);
    let stale = claimed[40].clone();
    let _recovery = take_over(&store, &pool, &stale).await;

    let mut tasks = Vec::new();
    for c in claimed[..40].iter().cloned() {
        let batches = batches.clone();
        tasks.push(tokio::spawn(async move {
            batches
                .begin_invocation_with_permit(&c.lease, &permit_for(&c), &[])
                .await
        }));
    }
    let refused = batches
        .begin_invocation_with_permit(&stale.lease, &permit_for(&stale), &[])
        .await;
    assert!(
        matches!(
            refused,
            Err(StoreError::Fenced(FenceReason::Superseded { .. }))
        ),
        "{refused:?}"
    );
    let mut slots = std::collections::HashSet::new();
    for t in tasks {
        let (permit, _) = t.await.unwrap().unwrap();
        let slot: i32 = sqlx::query_scalar("SELECT slot FROM adapter_permits WHERE id = $1")
            .bind(permit.id)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert!(slots.insert(slot), "slot {slot} given twice");
    }
    assert_eq!(slots_taken(&pool).await, 40);
    let shared = transactions(&pool, &claimed[..40]).await;
    assert!(
        shared < 40,
        "40 calls in {shared} transactions: none shared"
    );
}
