//! *Invocation began* and its permit in one statement, on real PostgreSQL: the fence, the
//! attempt's checkpoint, its event, the slot, the permit and the ended permits' releases
//! commit together, and each condition alone keeps all of them out.

mod common;

use std::time::Duration;

use common::*;
use sqlx::PgPool;
use z29c_core::{AttemptId, LeaseVersion};
use z29c_store::leases::ClaimedStep;
use z29c_store::permits::{EndedPermit, PermitRequest};
use z29c_store::{MIGRATOR, Store};

fn req(c: &ClaimedStep) -> PermitRequest<'_> {
    PermitRequest {
        adapter: "http",
        operation_class: "create",
        attempt: Some(c.lease.attempt),
        request_identity: &c.request_identity,
        gateway: "gw-a",
        hold: Duration::from_secs(30),
    }
}

/// What an invocation's beginning writes, counted over the whole database: permits held,
/// slots taken, attempts at *invocation began*, their events, and permits released.
async fn written(pool: &PgPool) -> (i64, i64, i64, i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM adapter_permits WHERE state = 'held'),
                (SELECT count(*) FROM adapter_permit_slots WHERE permit_id IS NOT NULL),
                (SELECT count(*) FROM attempts WHERE checkpoint = 'invocation_began'),
                (SELECT count(*) FROM step_events WHERE detail->>'checkpoint' = 'invocation_began'),
                (SELECT count(*) FROM adapter_permits WHERE state = 'released')",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn each_condition_alone_keeps_the_invocation_and_its_permit_out(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    store.set_permit_limit("http", "create", 2).await.unwrap();
    for i in 0..4 {
        submit(&store, &workflow(&format!("w{i}"), vec![step("only", &[])])).await;
    }
    let claimed = store.claim(&owner("worker-a"), 4).await.unwrap();
    let (c, expired, full, cancelled) = (&claimed[0], &claimed[1], &claimed[2], &claimed[3]);

    // one permit held by an earlier call that has ended, to be released by the next one
    let (earlier, _) = store
        .begin_invocation_with_permit_at_once(&full.lease, &req(full), None)
        .await
        .unwrap()
        .expect("a free slot, a current lease: at once");
    let ended = [EndedPermit::now(earlier.id, "succeeded")];
    assert_eq!(written(&pool).await, (1, 1, 1, 1, 0));

    let mut other_owner = c.lease.clone();
    other_owner.owner = owner("worker-b");
    let mut older = c.lease.clone();
    older.version = LeaseVersion::new(c.lease.version.get() - 1).unwrap();
    let mut other_attempt = c.lease.clone();
    other_attempt.attempt = AttemptId::new();
    expire(&pool, expired.lease.step).await;
    store
        .cancel_workflow(cancelled.workflow, "test")
        .await
        .unwrap();
    let cases = [
        ("another owner", other_owner, c),
        ("an older lease version", older, c),
        ("another attempt", other_attempt, c),
        ("an expired lease", expired.lease.clone(), expired),
        ("a cancelled workflow", cancelled.lease.clone(), cancelled),
        // its invocation began already: a second beginning is the transaction's to refuse
        ("an invocation that began", full.lease.clone(), full),
    ];
    for (why, lease, step) in &cases {
        let at_once = store
            .begin_invocation_with_permit_at_once(lease, &req(step), ended.first())
            .await
            .unwrap();
        assert!(at_once.is_none(), "{why}: not at once");
        assert_eq!(
            written(&pool).await,
            (1, 1, 1, 1, 0),
            "{why}: nothing written"
        );
    }

    // a full class: the one free slot taken by another holder (not one that ended)
    let mut holder = req(c);
    holder.gateway = "gw-b";
    let blocker = store.acquire_permit(&holder).await.unwrap();
    let at_once = store
        .begin_invocation_with_permit_at_once(&c.lease, &req(c), None)
        .await
        .unwrap();
    assert!(at_once.is_none(), "no free slot: not at once");
    assert_eq!(
        written(&pool).await,
        (2, 2, 1, 1, 0),
        "a full class: nothing written"
    );
    store.release_permit(blocker.id, "test").await.unwrap();

    // and the lease as it is: the invocation, its permit and the ended permit's release, in
    // one transaction
    let (permit, version) = store
        .begin_invocation_with_permit_at_once(&c.lease, &req(c), ended.first())
        .await
        .unwrap()
        .expect("at once");
    assert_eq!(version, c.checkpoint_version + 1);
    assert_eq!(permit.attempt_id, Some(c.lease.attempt.as_uuid()));
    assert_eq!(written(&pool).await, (1, 1, 2, 2, 2));
    let xacts: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT x) FROM (
             SELECT xmin::text AS x FROM adapter_permits WHERE id = ANY($1)
             UNION ALL SELECT xmin::text FROM adapter_permit_slots WHERE permit_id = $2
             UNION ALL SELECT xmin::text FROM attempts WHERE id = $3
             UNION ALL SELECT xmin::text FROM steps WHERE id = $4
             UNION ALL SELECT xmin::text FROM step_events
                       WHERE step_id = $4 AND detail->>'checkpoint' = 'invocation_began') t",
    )
    .bind(vec![permit.id, earlier.id])
    .bind(permit.id)
    .bind(c.lease.attempt.as_uuid())
    .bind(c.lease.step.as_uuid())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(xacts, 1, "all of it one statement's transaction");
}
