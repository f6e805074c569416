//! The running system across real processes: scheduler, executors, gateways and the
//! destination, each a `z29c` process, on real PostgreSQL and NATS. Invariants are checked from
//! the database and from the destination's own ledger.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use anyhow::Result;
use serde_json::json;
use sqlx::PgPool;
use z29c_proto::v1::{self as pb};
use z29c_scenarios::cluster::{Cluster, chain};

async fn submit(cluster: &Cluster, reqs: Vec<pb::SubmitRequest>) -> Result<Vec<String>> {
    let mut client = cluster.client().await?;
    let mut ids = Vec::new();
    for r in reqs {
        let w = client.submit(r).await?.into_inner().workflow.unwrap();
        ids.push(w.id);
    }
    Ok(ids)
}

/// Receipts agree with the destination: every receipt's reference is in its ledger, and no
/// request identity produced more than one effect. Receipts are read from z29c's `pool`, effects
/// from the destination's own database, `ledger`.
async fn check_receipts_against_ledger(
    pool: &PgPool,
    ledger: &PgPool,
    expected_receipts: i64,
) -> Result<()> {
    let receipts: Vec<(String, String)> = sqlx::query_as(
        "SELECT external_reference, request_identity FROM step_receipts
         WHERE outcome = 'succeeded'",
    )
    .fetch_all(pool)
    .await?;
    let succeeded = receipts.len() as i64;
    assert_eq!(succeeded, expected_receipts, "successful receipts");
    let effects: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT reference, idempotency_key FROM destination.ledger")
            .fetch_all(ledger)
            .await?;
    let recorded: HashSet<(&str, &str)> = effects
        .iter()
        .filter_map(|(reference, key)| Some((reference.as_str(), key.as_deref()?)))
        .collect();
    let unmatched = receipts
        .iter()
        .filter(|(reference, identity)| {
            !recorded.contains(&(reference.as_str(), identity.as_str()))
        })
        .count();
    assert_eq!(
        unmatched, 0,
        "every receipt names an effect the destination recorded"
    );
    // effects sent without a key are counted together, as one more key
    let mut per_key: HashMap<Option<&str>, usize> = HashMap::new();
    for (_, key) in &effects {
        *per_key.entry(key.as_deref()).or_default() += 1;
    }
    let duplicated = per_key.values().filter(|n| **n > 1).count();
    assert_eq!(duplicated, 0, "no request identity had two effects");
    let double: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT step_id FROM step_receipts GROUP BY step_id HAVING count(*) > 1) d",
    )
    .fetch_one(pool)
    .await?;
    assert_eq!(double, 0, "no step has two receipts");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_step_dag_completes_with_receipts_matching_the_ledger() -> Result<()> {
    let cluster = Cluster::start(1, 1, 16).await?;
    let pool = cluster.db.pool(2).await?;
    let ledger = cluster.ledger_pool().await?;
    let ids = submit(&cluster, vec![chain("dag-1", "deliveries", 3)]).await?;
    cluster
        .wait_all_ended(&ids, Duration::from_secs(60))
        .await?;
    let wf = cluster
        .client()
        .await?
        .get(pb::GetRequest {
            workflow_id: ids[0].clone(),
        })
        .await?
        .into_inner();
    assert_eq!(wf.state(), pb::ProductState::Completed);
    assert!(wf.steps.iter().all(|s| s.receipt.is_some()));
    check_receipts_against_ledger(&pool, &ledger, 3).await?;
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM destination.ledger")
        .fetch_one(&ledger)
        .await?;
    assert_eq!(
        effects, 3,
        "the destination saw each request identity exactly once"
    );
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_workflows_on_three_executors_and_two_gateways_keep_every_invariant() -> Result<()> {
    const WORKFLOWS: usize = 500;
    const LIMIT: i64 = 4;
    let cluster = Cluster::start(2, 3, LIMIT as u32).await?;
    let pool = cluster.db.pool(2).await?;
    let ledger = cluster.ledger_pool().await?;
    let reqs = (0..WORKFLOWS)
        .map(|i| chain(&format!("bulk-{i}"), "deliveries", 3))
        .collect();
    let ids = submit(&cluster, reqs).await?;
    cluster
        .wait_all_ended(&ids, Duration::from_secs(300))
        .await?;
    let completed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM workflows WHERE state = 'completed'")
            .fetch_one(&pool)
            .await?;
    assert_eq!(completed, WORKFLOWS as i64);
    check_receipts_against_ledger(&pool, &ledger, 3 * WORKFLOWS as i64).await?;
    // the permit limit, shared by both gateways, was never exceeded at any instant
    let peak: i64 = sqlx::query_scalar(
        "SELECT coalesce(max(n), 0) FROM (
             SELECT (SELECT count(*) FROM adapter_permits q
                     WHERE q.adapter = p.adapter AND q.operation_class = p.operation_class
                       AND q.acquired_at <= p.acquired_at
                       AND least(coalesce(q.released_at, q.expires_at), q.expires_at) > p.acquired_at) AS n
             FROM adapter_permits p) x",
    )
    .fetch_one(&pool)
    .await?;
    assert!(
        (1..=LIMIT).contains(&peak),
        "peak permits in flight {peak}, limit {LIMIT}"
    );
    let gateways: i64 = sqlx::query_scalar("SELECT count(DISTINCT gateway) FROM adapter_permits")
        .fetch_one(&pool)
        .await?;
    assert_eq!(gateways, 2, "both gateways served calls");
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_step_holds_no_lease_while_it_waits() -> Result<()> {
    let cluster = Cluster::start(1, 1, 16).await?;
    let pool = cluster.db.pool(2).await?;
    let ledger = cluster.ledger_pool().await?;
    cluster
        .set_faults("limited", json!({ "rate_limit_ms": 3000 }))
        .await?;
    let ids = submit(&cluster, vec![chain("rl-1", "limited", 1)]).await?;
    // wait until the destination has refused once
    let mut waited = 0;
    loop {
        let refused: i64 =
            sqlx::query_scalar("SELECT count(*) FROM step_events WHERE kind = 'rate_limited'")
                .fetch_one(&pool)
                .await?;
        if refused > 0 {
            break;
        }
        waited += 1;
        assert!(waited < 200, "no rate-limit answer seen");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (state, owner, waiting): (String, Option<String>, bool) =
        sqlx::query_as("SELECT state::text, lease_owner, next_eligible_at > now() FROM steps")
            .fetch_one(&pool)
            .await?;
    assert_eq!(state, "ready");
    assert_eq!(owner, None, "no lease is held while waiting");
    assert!(waiting, "next_eligible_at is in the future");
    cluster.set_faults("limited", json!({})).await?;
    cluster
        .wait_all_ended(&ids, Duration::from_secs(30))
        .await?;
    check_receipts_against_ledger(&pool, &ledger, 1).await?;
    let attempts: i64 =
        sqlx::query_scalar("SELECT count(*) FROM attempts WHERE state = 'released'")
            .fetch_one(&pool)
            .await?;
    assert!(
        attempts >= 1,
        "the refused attempt was released, not failed"
    );
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

/// Steps claimed ahead (`claim_ahead`) wait, leased, for a worker: calls never outnumber the
/// workers, a step that waits past half its renewal interval goes back unbegun (its lease released,
/// no invocation), and every step still ends with one receipt the destination agrees with.
/// Calls here run longer than that wait: after the first give-backs the executor claims no
/// further ahead, instead of claiming and giving back each half interval for the whole run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_claimed_ahead_wait_for_a_worker_and_go_back_unbegun_when_none_frees() -> Result<()> {
    const STEPS: usize = 8;
    let mut cluster = Cluster::start(1, 0, 16).await?;
    let pool = cluster.db.pool(2).await?;
    let ledger = cluster.ledger_pool().await?;
    // calls of 2 s: four times the longest wait of a step claimed ahead, and short of the
    // call budget (the adapter timeout, less the lease a claimed-ahead step spent waiting)
    // by more than a loaded machine adds
    cluster
        .set_faults("slow", json!({ "delay_ms": 2000 }))
        .await?;
    cluster
        .add_executor_with(&[
            ("Z29C_WORKERS", "2"),
            ("Z29C_CLAIM_AHEAD", "2"),
            ("Z29C_CLAIM_BATCH", "4"),
        ])
        .await?;
    let reqs = (0..STEPS)
        .map(|i| {
            let mut r = chain(&format!("ahead-{i}"), "slow", 1);
            r.steps[0].policy = Some(pb::LeasePolicy {
                lease_ms: 4000,
                renew_every_ms: 1000,
                attempt_deadline_ms: 10_000,
                final_grace_ms: 500,
                adapter_timeout_ms: 3000,
                ..Default::default()
            });
            r
        })
        .collect();
    let ids = submit(&cluster, reqs).await?;
    let mut most_leased = 0;
    let until = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (leased, ended): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM steps WHERE lease_owner = 'executor-1'),
                    (SELECT count(*) FROM workflows WHERE state <> 'running')",
        )
        .fetch_one(&pool)
        .await?;
        most_leased = most_leased.max(leased);
        if ended as usize == STEPS {
            break;
        }
        assert!(
            std::time::Instant::now() < until,
            "{ended} of {STEPS} workflows ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cluster.wait_all_ended(&ids, Duration::from_secs(5)).await?;
    // two workers and two steps claimed ahead, and an answered step's lease stays held until
    // its receipt commits while its worker goes on: at most one per worker beyond the four
    assert!(
        (4..=6).contains(&most_leased),
        "{most_leased} leases held at most: two workers, two claimed ahead, two being recorded"
    );
    let most_calls: i64 = sqlx::query_scalar(
        "SELECT max((SELECT count(*) FROM attempts b
                     WHERE b.invocation_began_at <= a.invocation_began_at
                       AND b.response_observed_at > a.invocation_began_at))
         FROM attempts a WHERE a.invocation_began_at IS NOT NULL",
    )
    .fetch_one(&pool)
    .await?;
    // each call's times, for the failure's message
    let calls: Vec<String> = sqlx::query_scalar(
        "SELECT format('began %s, answer seen %s, receipt %s', a.invocation_began_at,
                       a.response_observed_at, r.committed_at)
         FROM attempts a LEFT JOIN step_receipts r ON r.attempt_id = a.id
         WHERE a.invocation_began_at IS NOT NULL ORDER BY a.invocation_began_at",
    )
    .fetch_all(&pool)
    .await?;
    assert_eq!(
        most_calls,
        2,
        "calls in flight at once: never more than the workers; calls:\n{}",
        calls.join("\n")
    );
    let given_back: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM attempts
         WHERE state = 'released' AND invocation_began_at IS NULL",
    )
    .fetch_one(&pool)
    .await?;
    assert!(
        given_back >= 1,
        "a step claimed ahead waited past its renewal interval and was given back unbegun"
    );
    // four rounds of 2.5 s calls: claiming ahead all along would give back two steps each
    // half second, about forty in all
    assert!(
        given_back <= 2,
        "{given_back} give-backs: the executor kept claiming ahead while every call ran long"
    );
    let released_events: i64 =
        sqlx::query_scalar("SELECT count(*) FROM step_events WHERE kind = 'lease_released'")
            .fetch_one(&pool)
            .await?;
    assert!(
        released_events >= given_back,
        "each give-back is in the step's history"
    );
    check_receipts_against_ledger(&pool, &ledger, STEPS as i64).await?;
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

/// A worker whose call has answered goes on to its next call while the receipt commits, and
/// it waits only when every worker's worth of receipts is still being recorded. Receipts are
/// held back by a lock on `step_receipts`: one worker makes its second call under it, not its
/// third; once the lock goes, every receipt commits and matches the ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_goes_on_to_its_next_call_while_its_receipt_commits() -> Result<()> {
    const STEPS: usize = 3;
    let mut cluster = Cluster::start(1, 0, 16).await?;
    let pool = cluster.db.pool(3).await?;
    let ledger = cluster.ledger_pool().await?;
    cluster
        .add_executor_with(&[("Z29C_WORKERS", "1"), ("Z29C_CLAIM_AHEAD", "2")])
        .await?;
    // SHARE mode: reads go on, every INSERT into step_receipts waits
    let mut lock = pool.begin().await?;
    sqlx::query("LOCK TABLE step_receipts IN SHARE MODE")
        .execute(&mut *lock)
        .await?;
    let reqs = (0..STEPS)
        .map(|i| chain(&format!("recording-{i}"), "deliveries", 1))
        .collect();
    let ids = submit(&cluster, reqs).await?;
    let calls = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM destination.ledger")
            .fetch_one(&ledger)
            .await
    };
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while calls().await? < 2 {
        assert!(
            std::time::Instant::now() < until,
            "the worker's second call never came while the first receipt waited"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // the second answer waits for the first receipt: the worker makes no third call
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        calls().await?,
        2,
        "one worker: one receipt being recorded, one answer waiting for it, no third call"
    );
    let receipts: i64 = sqlx::query_scalar("SELECT count(*) FROM step_receipts")
        .fetch_one(&pool)
        .await?;
    assert_eq!(receipts, 0, "no receipt committed while the lock held");
    lock.commit().await?;
    cluster
        .wait_all_ended(&ids, Duration::from_secs(60))
        .await?;
    check_receipts_against_ledger(&pool, &ledger, STEPS as i64).await?;
    assert_eq!(calls().await?, STEPS as i64, "one call per step");
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_workflow_stops_but_records_the_call_in_flight() -> Result<()> {
    let cluster = Cluster::start(1, 1, 16).await?;
    let pool = cluster.db.pool(2).await?;
    let ledger = cluster.ledger_pool().await?;
    cluster
        .set_faults("slow", json!({ "delay_ms": 1500 }))
        .await?;
    let ids = submit(&cluster, vec![chain("cancel-1", "slow", 2)]).await?;
    loop {
        let began: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM attempts WHERE checkpoint >= 'invocation_began'",
        )
        .fetch_one(&pool)
        .await?;
        if began > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cluster
        .client()
        .await?
        .cancel(pb::CancelRequest {
            workflow_id: ids[0].clone(),
            reason: "changed my mind".into(),
        })
        .await?;
    // the call in flight still gets its outcome recorded
    let mut tries = 0;
    loop {
        let receipts: i64 = sqlx::query_scalar("SELECT count(*) FROM step_receipts")
            .fetch_one(&pool)
            .await?;
        if receipts == 1 {
            break;
        }
        tries += 1;
        assert!(tries < 200, "the in-flight outcome was not recorded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let states: Vec<(String, String)> =
        sqlx::query_as("SELECT name, state::text FROM steps ORDER BY position")
            .fetch_all(&pool)
            .await?;
    assert_eq!(
        states,
        [
            ("s0".into(), "completed".into()),
            ("s1".into(), "cancelled".into())
        ]
    );
    let wf: String = sqlx::query_scalar("SELECT state::text FROM workflows")
        .fetch_one(&pool)
        .await?;
    assert_eq!(wf, "cancelled");
    check_receipts_against_ledger(&pool, &ledger, 1).await?;
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_to_an_executor_under_load_loses_nothing() -> Result<()> {
    const WORKFLOWS: usize = 60;
    let mut cluster = Cluster::start(1, 2, 32).await?;
    let pool = cluster.db.pool(2).await?;
    let ledger = cluster.ledger_pool().await?;
    // the destination holds every call until executor-1 is seen busy: on a fast machine the
    // whole load could otherwise finish before the test looks
    cluster.set_faults("work", json!({ "hold": true })).await?;
    let reqs = (0..WORKFLOWS)
        .map(|i| chain(&format!("term-{i}"), "work", 3))
        .collect();
    let ids = submit(&cluster, reqs).await?;
    // let executor-1 get busy, then ask it to stop
    let start = std::time::Instant::now();
    loop {
        let held: i64 =
            sqlx::query_scalar("SELECT count(*) FROM steps WHERE lease_owner = 'executor-1'")
                .fetch_one(&pool)
                .await?;
        if held > 0 {
            break;
        }
        if start.elapsed() > Duration::from_secs(60) {
            anyhow::bail!("executor-1 never held a step");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cluster
        .set_faults("work", json!({ "delay_ms": 100 }))
        .await?;
    let status = cluster
        .process("executor-1")
        .expect("executor-1")
        .terminate(Duration::from_secs(15))
        .await?;
    assert!(status.success(), "executor-1 exited cleanly: {status}");
    let held: i64 =
        sqlx::query_scalar("SELECT count(*) FROM steps WHERE lease_owner = 'executor-1'")
            .fetch_one(&pool)
            .await?;
    assert_eq!(held, 0, "no step is left leased to the stopped executor");
    cluster
        .wait_all_ended(&ids, Duration::from_secs(120))
        .await?;
    let completed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM workflows WHERE state = 'completed'")
            .fetch_one(&pool)
            .await?;
    assert_eq!(completed, WORKFLOWS as i64);
    check_receipts_against_ledger(&pool, &ledger, 3 * WORKFLOWS as i64).await?;
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_duplicated_and_garbage_hints_change_nothing_but_latency() -> Result<()> {
    const WORKFLOWS: usize = 40;
    let cluster = Cluster::start(1, 1, 16).await?;
    let pool = cluster.db.pool(2).await?;
    let ledger = cluster.ledger_pool().await?;
    let bus = z29c_bus::Bus::connect(&z29c_scenarios::cluster::nats_url(), &cluster.prefix).await?;
    let nats = bus.client().clone();
    let subject = bus.names().subject(z29c_bus::Topic::StepReady);
    let noise = tokio::spawn(async move {
        for i in 0..200u32 {
            // garbage, and hints for steps that do not exist, published around the real ones
            let _ = nats
                .publish(subject.clone(), vec![0xff, 0x00, 0x13].into())
                .await;
            let hint = z29c_bus::step_ready(
                &format!("fake-{}", i % 7),
                "no-such-workflow",
                "no-such-step",
            );
            let _ = nats
                .publish(subject.clone(), prost_encode(&hint).into())
                .await;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    let reqs = (0..WORKFLOWS)
        .map(|i| chain(&format!("hint-{i}"), "hints", 2))
        .collect();
    let ids = submit(&cluster, reqs).await?;
    // drop real hints too: purge the stream while the workflows run
    for _ in 0..5 {
        let _ = bus.purge().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster
        .wait_all_ended(&ids, Duration::from_secs(120))
        .await?;
    noise.await?;
    check_receipts_against_ledger(&pool, &ledger, 2 * WORKFLOWS as i64).await?;
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

fn prost_encode(e: &pb::Envelope) -> Vec<u8> {
    use prost::Message;
    e.encode_to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_submissions_name_the_field_and_store_nothing() -> Result<()> {
    let cluster = Cluster::start(1, 0, 16).await?;
    let pool = cluster.db.pool(2).await?;
    let mut client = cluster.client().await?;
    let mut cases: Vec<(pb::SubmitRequest, &str)> = Vec::new();
    let mut r = chain("bad-1", "x", 1);
    r.steps[0].operation = "charges/../refunds".into();
    cases.push((r, "steps[0].operation"));
    let mut r = chain("bad-1b", "x", 2);
    r.steps[1].input_json = r#"{"reservation": "${steps.s9.result/id}"}"#.into();
    cases.push((r, "steps[1].input"));
    let mut r = chain("bad-2", "x", 2);
    r.steps[0].depends_on = vec!["s1".into()];
    cases.push((r, "steps: dependency cycle"));
    let mut r = chain("bad-3", "x", 1);
    r.steps[0].policy = Some(pb::LeasePolicy {
        lease_ms: 10,
        ..Default::default()
    });
    cases.push((r, "steps[0].policy.lease_ms"));
    let mut r = chain("bad-4", "x", 1);
    r.steps[0].input_json = format!("{{\"blob\":\"{}\"}}", "x".repeat(70 * 1024));
    cases.push((r, "steps[0].input"));
    let mut r = chain("bad-5", "x", 1);
    r.steps[0].input_json = "{not json".into();
    cases.push((r, "steps[0].input_json"));
    let mut r = chain("bad-6", "x", 1);
    r.client_key = String::new();
    cases.push((r, "client_key"));
    for (req, field) in cases {
        let status = client.submit(req).await.unwrap_err();
        assert_eq!(
            status.code(),
            tonic::Code::InvalidArgument,
            "{field}: {status:?}"
        );
        assert!(
            status.message().starts_with(field),
            "{field}: {}",
            status.message()
        );
    }
    // an adapter no gateway serves: refused until one does
    let mut r = chain("bad-unserved", "x", 1);
    r.steps[0].adapter = "carrier-pigeon".into();
    let status = client.submit(r).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert!(
        status
            .message()
            .starts_with("steps[0].adapter: no gateway serves adapter \"carrier-pigeon\""),
        "{}",
        status.message()
    );
    // an input left out, or null, is an empty object: accepted, and shown as sent
    for (key, input) in [("no-input", ""), ("null-input", "null")] {
        let mut r = chain(key, "x", 1);
        r.steps[0].input_json = input.into();
        let wf = client
            .submit(r)
            .await?
            .into_inner()
            .workflow
            .expect("workflow");
        assert_eq!(wf.steps[0].input_json, "{}", "{key}");
    }
    // the same key with a different payload
    client.submit(chain("good", "x", 1)).await?;
    let status = client.submit(chain("good", "y", 1)).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM workflows")
        .fetch_one(&pool)
        .await?;
    assert_eq!(n, 3, "only the three accepted submissions were stored");
    pool.close().await;
    cluster.stop().await
}

/// A step that nobody starts within its schedule-to-start deadline fails with that reason,
/// having sent nothing, and its workflow fails (the step after it never starts). A step that
/// starts in time is not touched by its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_not_started_within_its_schedule_to_start_deadline_fails_having_sent_nothing()
-> Result<()> {
    // no executor: nothing claims the first workflow's step
    let mut cluster = Cluster::start(1, 0, 4).await?;
    let pool = cluster.db.pool(2).await?;
    let ledger = cluster.ledger_pool().await?;
    let with_deadline = |key: &str, ms: u64| {
        let mut req = chain(key, "ok", 2);
        req.steps[0].policy = Some(pb::LeasePolicy {
            schedule_to_start_ms: ms,
            ..Default::default()
        });
        req
    };
    let late = submit(&cluster, vec![with_deadline("never-started", 1_500)]).await?;
    cluster
        .wait_all_ended(&late, Duration::from_secs(30))
        .await?;
    let states: Vec<(String, String)> =
        sqlx::query_as("SELECT s.name, s.state::text FROM steps s ORDER BY s.position")
            .fetch_all(&pool)
            .await?;
    assert_eq!(states[0].1, "failed", "{states:?}");
    assert_ne!(states[1].1, "completed", "{states:?}");
    let workflow: String = sqlx::query_scalar("SELECT state::text FROM workflows")
        .fetch_one(&pool)
        .await?;
    assert_eq!(workflow, "failed");
    let reason: String = sqlx::query_scalar(
        "SELECT detail->>'reason' FROM step_events WHERE kind = 'failed_by_policy'",
    )
    .fetch_one(&pool)
    .await?;
    assert!(
        reason.contains("schedule-to-start") && reason.contains("1500 ms"),
        "{reason}"
    );
    let attempts: i64 = sqlx::query_scalar("SELECT count(*) FROM attempts")
        .fetch_one(&pool)
        .await?;
    assert_eq!(attempts, 0, "nothing was claimed");
    let requests: i64 = sqlx::query_scalar("SELECT count(*) FROM destination.requests")
        .fetch_one(&ledger)
        .await?;
    assert_eq!(requests, 0, "nothing reached the destination");

    // with a worker, a step started in time completes, its deadline notwithstanding
    cluster.add_executor_with(&[]).await?;
    let on_time = submit(&cluster, vec![with_deadline("started-in-time", 30_000)]).await?;
    cluster
        .wait_all_ended(&on_time, Duration::from_secs(30))
        .await?;
    let completed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM steps s JOIN workflows w ON w.id = s.workflow_id
         WHERE w.client_key = 'started-in-time' AND s.state = 'completed'",
    )
    .fetch_one(&pool)
    .await?;
    assert_eq!(completed, 2);
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

/// A destination that answers every request `429 Too Many Requests` does not hold a step
/// forever: past its waiting budget (`max_waits`) the step fails, saying why, with no effect at
/// the destination, and its workflow fails with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_that_always_answers_429_ends_the_step_past_its_waiting_budget() -> Result<()>
{
    let cluster = Cluster::start(1, 1, 4).await?;
    let pool = cluster.db.pool(2).await?;
    let ledger = cluster.ledger_pool().await?;
    // Retry-After: 1 (seconds) on every request
    cluster
        .set_faults("throttled", json!({ "rate_limit_ms": 1 }))
        .await?;
    let mut req = chain("always-429", "throttled", 1);
    req.steps[0].policy = Some(pb::LeasePolicy {
        max_waits: 3,
        ..Default::default()
    });
    let ids = submit(&cluster, vec![req]).await?;
    cluster
        .wait_all_ended(&ids, Duration::from_secs(60))
        .await?;

    let (step, workflow): (String, String) = sqlx::query_as(
        "SELECT s.state::text, w.state::text FROM steps s JOIN workflows w ON w.id = s.workflow_id",
    )
    .fetch_one(&pool)
    .await?;
    assert_eq!((step.as_str(), workflow.as_str()), ("failed", "failed"));
    let reason: String = sqlx::query_scalar(
        "SELECT detail->>'reason' FROM step_events WHERE kind = 'failed_by_policy'",
    )
    .fetch_one(&pool)
    .await?;
    assert!(
        reason.starts_with("rate_limited") && reason.contains("max_waits (3)"),
        "{reason}"
    );
    // three waits, then the fourth refusal ended it: four requests, all refused, no effect
    let refused: Vec<Option<String>> = sqlx::query_scalar(
        "SELECT refused FROM destination.requests WHERE route = 'throttled' ORDER BY id",
    )
    .fetch_all(&ledger)
    .await?;
    assert_eq!(refused, vec![Some("rate_limited".to_owned()); 4]);
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM destination.ledger")
        .fetch_one(&ledger)
        .await?;
    assert_eq!(effects, 0);
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

/// A definite refusal the step's policy names (`408 Request Timeout`) is sent again under the
/// same request identity after its backoff, and the step completes once the destination
/// accepts: one effect, one key. A refusal the policy does not name (`400`) ends its step at
/// once, with one request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_the_policy_retries_is_sent_again_under_the_same_identity() -> Result<()> {
    let cluster = Cluster::start(1, 1, 4).await?;
    let pool = cluster.db.pool(2).await?;
    let ledger = cluster.ledger_pool().await?;
    let retrying = || pb::LeasePolicy {
        max_attempts: 3,
        retryable_statuses: vec![408, 425],
        // long enough for the test to lift the fault before the retry
        initial_backoff_ms: 3_000,
        ..Default::default()
    };
    cluster
        .set_faults("flaky", json!({ "refuse_status": 408 }))
        .await?;
    cluster
        .set_faults("bad", json!({ "refuse_status": 400 }))
        .await?;
    let mut flaky = chain("refused-then-accepted", "flaky", 1);
    flaky.steps[0].policy = Some(retrying());
    let mut bad = chain("refused-for-good", "bad", 1);
    bad.steps[0].policy = Some(retrying());
    let ids = submit(&cluster, vec![flaky, bad]).await?;
    z29c_scenarios::wait_for_count(
        &ledger,
        "SELECT count(*) FROM destination.requests WHERE route = 'flaky'",
        "the first, refused, request",
        Duration::from_secs(30),
    )
    .await?;
    cluster.set_faults("flaky", json!({})).await?;
    cluster
        .wait_all_ended(&ids, Duration::from_secs(60))
        .await?;

    let states: HashMap<String, String> =
        sqlx::query_as("SELECT client_key, state::text FROM workflows")
            .fetch_all(&pool)
            .await?
            .into_iter()
            .collect();
    assert_eq!(states["refused-then-accepted"], "completed", "{states:?}");
    assert_eq!(states["refused-for-good"], "failed", "{states:?}");
    let flaky: Vec<(Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT idempotency_key, refused FROM destination.requests WHERE route = 'flaky'
         ORDER BY id",
    )
    .fetch_all(&ledger)
    .await?;
    assert_eq!(flaky.len(), 2, "{flaky:?}");
    assert_eq!(flaky[0].1.as_deref(), Some("refused"));
    assert_eq!(flaky[1].1, None);
    assert!(
        flaky[0].0.is_some() && flaky[0].0 == flaky[1].0,
        "{flaky:?}"
    );
    let attempts: Vec<String> = sqlx::query_scalar(
        "SELECT a.state::text FROM attempts a JOIN workflows w ON w.id = a.workflow_id
         WHERE w.client_key = 'refused-then-accepted' ORDER BY a.number",
    )
    .fetch_all(&pool)
    .await?;
    assert_eq!(attempts, ["refused", "succeeded"]);
    let bad: i64 =
        sqlx::query_scalar("SELECT count(*) FROM destination.requests WHERE route = 'bad'")
            .fetch_one(&ledger)
            .await?;
    assert_eq!(
        bad, 1,
        "a refusal the policy does not name is not sent again"
    );
    check_receipts_against_ledger(&pool, &ledger, 1).await?;
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}

/// A call far longer than its lease: the destination takes 20 s to answer, the lease is 3 s.
/// The worker renews the lease while the call runs, so the step completes in one attempt, with
/// one request, and recovery never has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_longer_than_its_lease_completes_in_one_attempt_with_renewals() -> Result<()> {
    let cluster = Cluster::start(1, 1, 4).await?;
    let pool = cluster.db.pool(2).await?;
    let ledger = cluster.ledger_pool().await?;
    cluster
        .set_faults("slow", json!({ "delay_ms": 20_000 }))
        .await?;
    let mut req = chain("long-call", "slow", 1);
    req.steps[0].policy = Some(pb::LeasePolicy {
        lease_ms: 3_000,
        renew_every_ms: 1_000,
        final_grace_ms: 1_000,
        adapter_timeout_ms: 30_000,
        attempt_deadline_ms: 40_000,
        ..Default::default()
    });
    let ids = submit(&cluster, vec![req]).await?;
    cluster
        .wait_all_ended(&ids, Duration::from_secs(90))
        .await?;

    let (state, attempts, renewals, decisions): (String, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT state::text FROM workflows),
                (SELECT count(*) FROM attempts),
                (SELECT count(*) FROM step_events WHERE kind = 'lease_renewed'),
                (SELECT count(*) FROM recovery_decisions)",
    )
    .fetch_one(&pool)
    .await?;
    assert_eq!(state, "completed");
    assert_eq!(attempts, 1, "one attempt");
    assert_eq!(decisions, 0, "recovery never had the step");
    // about one a second for 20 s; even a slow machine renews several times
    assert!(renewals >= 5, "{renewals} renewals");
    let requests: i64 = sqlx::query_scalar("SELECT count(*) FROM destination.requests")
        .fetch_one(&ledger)
        .await?;
    assert_eq!(requests, 1);
    check_receipts_against_ledger(&pool, &ledger, 1).await?;
    pool.close().await;
    ledger.close().await;
    cluster.stop().await
}
