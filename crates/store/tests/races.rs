//! Races between concurrent tasks on real PostgreSQL: claimers never share a lease and never
//! lose a step; a commit racing a recovery takeover lets exactly one of them win.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use z29c_core::{LeaseVersion, StepId};
use z29c_store::leases::CommitOutcome;
use z29c_store::{MIGRATOR, Store, StoreError};

const CLAIMERS: usize = 32;
const STEPS: usize = 300;

/// Deterministic "coin": most claims give the step back so it is claimed again and again.
fn gives_back(task: usize, round: usize, step: StepId) -> bool {
    let h = (task as u64 * 7_919) ^ (round as u64 * 104_729) ^ (step.as_uuid().as_u128() as u64);
    h % 10 < 9
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn racing_claimers_never_share_a_lease_and_never_lose_a_step(
    opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    // sqlx's test harness caps a test pool at 20 connections: 32 claimers share 18, so up to
    // 18 claims are in PostgreSQL at once and the rest queue for a connection
    let pool = opts
        .max_connections(18)
        .connect_with(connect)
        .await
        .unwrap();
    let store = Store::from_pool(pool.clone());
    for i in 0..STEPS {
        // a step given back is claimable again a millisecond later: the race stays a race
        let mut only = step("only", &[]);
        only.policy.retry.initial_backoff = Duration::from_millis(1);
        submit(&store, &workflow(&format!("race-{i}"), vec![only])).await;
    }

    // who holds each step right now, by the claimers' own account
    let holders: Arc<Mutex<HashMap<StepId, usize>>> = Default::default();
    let claims: Arc<Mutex<Vec<(StepId, LeaseVersion, usize)>>> = Default::default();
    let violations: Arc<Mutex<Vec<String>>> = Default::default();

    let mut tasks = Vec::new();
    for task in 0..CLAIMERS {
        let (store, holders, claims, violations) = (
            store.clone(),
            holders.clone(),
            claims.clone(),
            violations.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let me = owner(&format!("claimer-{task}"));
            let mut idle = 0;
            for round in 0.. {
                let batch = store.claim(&me, 4).await.unwrap();
                if batch.is_empty() {
                    idle += 1;
                    if idle > 20 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                idle = 0;
                for c in batch {
                    if let Some(other) = holders.lock().unwrap().insert(c.lease.step, task) {
                        violations.lock().unwrap().push(format!(
                            "step {} claimed by {task} while held by {other}",
                            c.lease.step
                        ));
                    }
                    claims
                        .lock()
                        .unwrap()
                        .push((c.lease.step, c.lease.version, task));
                    // give up the claim in our books before giving it back in the database,
                    // so a fair re-claim by someone else is never mistaken for a violation
                    let back = gives_back(task, round, c.lease.step);
                    holders.lock().unwrap().remove(&c.lease.step);
                    if back {
                        store
                            .release_rate_limited(&c.lease, Duration::ZERO, "rate_limited")
                            .await
                            .unwrap();
                    } else {
                        invoke(&store, &c).await;
                        let r = store
                            .commit_receipt(
                                &c.lease,
                                &success(&c, &format!("ref-{}", c.lease.step)),
                            )
                            .await
                            .unwrap();
                        assert_eq!(r.lease_version, c.lease.version);
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }

    let violations = std::mem::take(&mut *violations.lock().unwrap());
    assert!(violations.is_empty(), "{violations:#?}");
    let claims = std::mem::take(&mut *claims.lock().unwrap());
    assert!(
        claims.len() >= 2_000,
        "the race ran many rounds: {} claims",
        claims.len()
    );
    // every acquisition handed out a distinct version, increasing per step without gaps
    let mut seen = HashSet::new();
    let mut per_step: HashMap<StepId, Vec<i64>> = HashMap::new();
    for (step, version, _) in claims.iter() {
        assert!(
            seen.insert((*step, *version)),
            "version {version} of {step} handed out twice"
        );
        per_step.entry(*step).or_default().push(version.get());
    }
    assert_eq!(per_step.len(), STEPS, "every step was claimed");
    for (step, mut versions) in per_step {
        versions.sort_unstable();
        let expected: Vec<i64> = (1..=versions.len() as i64).collect();
        assert_eq!(versions, expected, "versions of {step}");
    }
    // nothing lost: every step ended with exactly one receipt, nothing is left ready or leased
    let (completed, receipts, open): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM steps WHERE state = 'completed'),
                (SELECT count(*) FROM step_receipts),
                (SELECT count(*) FROM steps WHERE state <> 'completed')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((completed, receipts, open), (STEPS as i64, STEPS as i64, 0));
    let acquired: i64 =
        sqlx::query_scalar("SELECT count(*) FROM step_events WHERE kind = 'lease_acquired'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        acquired as usize,
        claims.len(),
        "one lease event per acquisition"
    );
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn stale_lease_cannot_commit_receipt_while_recovery_takes_over(
    opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = opts
        .max_connections(12)
        .connect_with(connect)
        .await
        .unwrap();
    let store = Store::from_pool(pool.clone());
    const N: usize = 60;
    let mut claimed = Vec::new();
    for i in 0..N {
        let c = claimed_single(&store, &format!("takeover-{i}"), "worker-a").await;
        invoke(&store, &c).await;
        expire(&pool, c.lease.step).await;
        claimed.push(c);
    }
    // the stale worker commits while recovery takes the lease: both at once, for every step
    let mut tasks = Vec::new();
    for c in claimed {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let recovery = owner("recovery-1");
            let observed = success(&c, "dest");
            let (commit, take) = tokio::join!(
                store.commit_or_keep_late(&c.lease, &observed),
                store.take_recovery_lease(
                    c.lease.step,
                    c.lease.version,
                    &recovery,
                    Duration::from_secs(30)
                ),
            );
            (c, commit.unwrap(), take)
        }));
    }
    let mut late = 0;
    for t in tasks {
        let (c, commit, take) = t.await.unwrap();
        // the lease had expired by PostgreSQL time before either began: the commit must lose
        assert!(matches!(commit, CommitOutcome::Late { .. }), "{commit:?}");
        late += 1;
        let rec = take.unwrap();
        assert_eq!(rec.lease.version, c.lease.version.next());
        let receipts: i64 = count(
            &pool,
            "SELECT count(*) FROM step_receipts WHERE step_id = $1",
            c.lease.step,
        )
        .await;
        assert_eq!(receipts, 0);
    }
    assert_eq!(late, N);
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM late_observations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(kept, N as i64, "every stale result was kept as evidence");
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_live_commit_and_a_recovery_attempt_never_both_win(
    opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    // the lease expires *during* the race: whichever transaction PostgreSQL orders first wins,
    // and the other sees it
    let pool = opts
        .max_connections(12)
        .connect_with(connect)
        .await
        .unwrap();
    let store = Store::from_pool(pool.clone());
    const N: usize = 40;
    let mut tasks = Vec::new();
    for i in 0..N {
        let c = claimed_single(&store, &format!("edge-{i}"), "worker-a").await;
        invoke(&store, &c).await;
        // expire a few milliseconds from now, on PostgreSQL's clock
        sqlx::query(
            "UPDATE steps SET leased_at = now() - interval '1 hour',
                 expires_at = clock_timestamp() + make_interval(secs => $2::float8 / 1000)
             WHERE id = $1",
        )
        .bind(c.lease.step.as_uuid())
        .bind((i % 8) as f64)
        .execute(&pool)
        .await
        .unwrap();
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let recovery = owner("recovery-1");
            let commit = store
                .commit_or_keep_late(&c.lease, &success(&c, "dest"))
                .await
                .unwrap();
            let mut took = None;
            for _ in 0..50 {
                match store
                    .take_recovery_lease(
                        c.lease.step,
                        c.lease.version,
                        &recovery,
                        Duration::from_secs(30),
                    )
                    .await
                {
                    Ok(r) => {
                        took = Some(r);
                        break;
                    }
                    Err(StoreError::Fenced(_)) => {
                        tokio::time::sleep(Duration::from_millis(2)).await
                    }
                    Err(e) => panic!("{e}"),
                }
                if matches!(commit, CommitOutcome::Committed(_)) {
                    break;
                }
            }
            (c, commit, took)
        }));
    }
    let (mut committed, mut recovered) = (0, 0);
    for t in tasks {
        let (c, commit, took) = t.await.unwrap();
        let receipts = count(
            &pool,
            "SELECT count(*) FROM step_receipts WHERE step_id = $1",
            c.lease.step,
        )
        .await;
        match commit {
            CommitOutcome::Committed(r) => {
                committed += 1;
                assert_eq!(r.lease_version, c.lease.version);
                assert!(
                    took.is_none(),
                    "recovery must not take a step that has its receipt"
                );
                assert_eq!(receipts, 1);
            }
            CommitOutcome::Late { .. } => {
                recovered += 1;
                assert!(took.is_some(), "an expired lease is recoverable");
                assert_eq!(receipts, 0);
            }
        }
    }
    assert_eq!(committed + recovered, N);
}

/// Holds the step's row lock in a transaction of its own, changed by `change`, while the
/// worker commits its receipt, then commits: the receipt's fence waits for the lock and is
/// judged on the row as that transaction left it.
async fn receipt_behind(pool: &sqlx::PgPool, key: &str, change: &'static str) -> (i64, bool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, key, "worker-a").await;
    invoke(&store, &c).await;
    let mut holder = pool.begin().await.unwrap();
    sqlx::query(change)
        .bind(c.lease.step.as_uuid())
        .execute(&mut *holder)
        .await
        .unwrap();
    let observed = success(&c, "dest");
    let commit = tokio::spawn({
        let store = store.clone();
        let lease = c.lease.clone();
        async move { store.commit_or_keep_late(&lease, &observed).await }
    });
    // the commit is waiting on the row lock, not done
    let mut waiting = 0i64;
    for _ in 0..200 {
        waiting = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(waiting, 1, "the receipt's fence waits for the row lock");
    assert!(!commit.is_finished());
    holder.commit().await.unwrap();
    let committed = matches!(commit.await.unwrap().unwrap(), CommitOutcome::Committed(_));
    let receipts = count(
        pool,
        "SELECT count(*) FROM step_receipts WHERE step_id = $1",
        c.lease.step,
    )
    .await;
    (receipts, committed)
}

#[sqlx::test(migrator = "MIGRATOR")]
async fn a_receipt_waiting_on_the_step_is_judged_on_the_row_it_waited_for(pool: sqlx::PgPool) {
    // the lease moved on while the receipt waited (a takeover): no receipt, the result is late
    let (receipts, committed) = receipt_behind(
        &pool,
        "moved-on",
        "UPDATE steps SET lease_version = lease_version + 1 WHERE id = $1",
    )
    .await;
    assert_eq!((receipts, committed), (0, false));
    // the lease is as it was (another write of the step's row): the receipt commits after it
    let (receipts, committed) = receipt_behind(
        &pool,
        "unchanged",
        "UPDATE steps SET updated_at = now() WHERE id = $1",
    )
    .await;
    assert_eq!((receipts, committed), (1, true));
}
