//! The randomized soak: a mixed load over the three adapter capabilities while random
//! processes are killed, paused and restarted and the destination misbehaves, for a set
//! duration; then the faults heal and the history is checked with the matrix's checker.
//!
//! The whole fault schedule is drawn from the seed before the run starts, so a seed names a
//! run: `z29c-scenarios soak --seed 7 --duration 10m` replays the same faults at the same
//! offsets (the interleaving with the load still varies with the machine).

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::json;
use z29c_core::AdapterCapability;
use z29c_proto::v1::{self as pb};

use crate::cluster::{Cluster, Topology, chain};
use crate::history::{Expect, History, Tally, Violation};

/// One scheduled fault.
#[derive(Debug, Clone, Serialize)]
pub enum Action {
    /// SIGKILL a process; restart it after `down_ms`.
    Kill { process: String, down_ms: u64 },
    /// SIGSTOP a process for `ms` (longer than a lease, often).
    Pause { process: String, ms: u64 },
    /// Destination faults on a route for `ms`.
    Destination {
        route: String,
        faults: serde_json::Value,
        ms: u64,
    },
}

#[derive(Debug, Clone, Serialize)]
pub struct Scheduled {
    pub at_ms: u64,
    pub action: Action,
}

const EXECUTORS: usize = 3;
const GATEWAYS: usize = 2;
const RECOVERIES: usize = 2;
/// Schedulers, `scheduler` and `scheduler-2`: the load submits to either, and goes to the
/// other when one does not answer.
const SCHEDULERS: usize = 2;
const ROUTES: [&str; 3] = ["soak-a", "soak-b", "soak-c"];

/// The fault schedule for `seed` over `duration`: one fault every 1.5–5 s.
pub fn schedule(seed: u64, duration: Duration) -> Vec<Scheduled> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut at = 2_000u64;
    let mut out = Vec::new();
    let end = duration.as_millis() as u64;
    while at < end {
        let process = match rng.random_range(0..10) {
            0..=4 => format!("executor-{}", rng.random_range(1..=EXECUTORS)),
            5..=7 => format!("gateway-{}", rng.random_range(1..=GATEWAYS)),
            _ => format!("recovery-{}", rng.random_range(1..=RECOVERIES)),
        };
        let action = match rng.random_range(0..10) {
            0..=3 => Action::Kill {
                process,
                down_ms: rng.random_range(200..3_000),
            },
            4..=6 => Action::Pause {
                process,
                ms: rng.random_range(500..4_000),
            },
            _ => {
                let route = ROUTES[rng.random_range(0..ROUTES.len())].to_owned();
                let faults = match rng.random_range(0..4) {
                    0 => json!({ "drop_response": true }),
                    1 => json!({ "server_error": 503 }),
                    2 => json!({ "answer_delay_ms": rng.random_range(500..2_500) }),
                    _ => json!({ "rate_limit_ms": 1_000 }),
                };
                Action::Destination {
                    route,
                    faults,
                    ms: rng.random_range(500..3_000),
                }
            }
        };
        out.push(Scheduled { at_ms: at, action });
        at += rng.random_range(1_500..5_000);
    }
    // every run kills one scheduler and, well after it is back, pauses the other: never both
    // at once, so a submission always has a scheduler that answers
    if end > 12_000 {
        out.push(Scheduled {
            at_ms: end / 3,
            action: Action::Kill {
                process: scheduler_name(1),
                down_ms: rng.random_range(500..3_000),
            },
        });
        out.push(Scheduled {
            at_ms: end * 2 / 3,
            action: Action::Pause {
                process: scheduler_name(2),
                ms: rng.random_range(1_000..4_000),
            },
        });
        out.sort_by_key(|s| s.at_ms);
    }
    out
}

/// The `n`-th scheduler's process name (the first is `scheduler`).
fn scheduler_name(n: usize) -> String {
    if n == 1 {
        "scheduler".to_owned()
    } else {
        format!("scheduler-{n}")
    }
}

/// What a soak found.
#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    pub seed: u64,
    pub duration_s: u64,
    pub workflows: usize,
    /// Submissions no scheduler accepted: none may fail, one scheduler is always up.
    pub submit_errors: Vec<String>,
    /// Submissions that went to the other scheduler after one did not answer.
    pub failovers: usize,
    /// What the client was told, checked against the end state: each client key answered
    /// with one workflow, the one the database holds for it.
    pub client_history_violations: Vec<String>,
    /// Faults that landed (a kill of a process already down does not count).
    pub faults: usize,
    pub kills: usize,
    pub pauses: usize,
    /// Kills and pauses of a scheduler.
    pub scheduler_faults: usize,
    pub destination_faults: usize,
    /// Review items resolved at the end the way a person would, from the destination's records.
    pub resolved_by_a_person: usize,
    pub tally: Tally,
    /// Idempotent and queryable steps that ended failed or in review. Every fault of the
    /// soak heals, and such a step can always be retried or asked about, so each must
    /// complete (a step cancelled because another step of its workflow failed is not one).
    pub retriable_not_completed: Vec<String>,
    pub violations: Vec<Violation>,
}

fn policy() -> pb::LeasePolicy {
    pb::LeasePolicy {
        lease_ms: 2_000,
        renew_every_ms: 500,
        attempt_deadline_ms: 10_000,
        final_grace_ms: 500,
        adapter_timeout_ms: 1_200,
        max_attempts: 6,
        ..Default::default()
    }
}

/// Runs one soak. `progress` gets a line now and then.
pub async fn soak(
    seed: u64,
    duration: Duration,
    progress: impl FnMut(String),
) -> Result<SoakReport> {
    soak_on(seed, duration, None, progress).await
}

/// [`soak`] on a PostgreSQL server of its own (several soaks at once would exhaust the shared
/// server's connection slots).
pub async fn soak_private(
    seed: u64,
    duration: Duration,
    progress: impl FnMut(String),
) -> Result<SoakReport> {
    let pg = crate::infra::PrivatePostgres::start().await?;
    let report = soak_on(seed, duration, Some(pg.admin_url()), progress).await;
    pg.stop().await;
    report
}

async fn soak_on(
    seed: u64,
    duration: Duration,
    postgres_admin_url: Option<String>,
    mut progress: impl FnMut(String),
) -> Result<SoakReport> {
    let plan = schedule(seed, duration);
    let mut cluster = Cluster::start_with(Topology {
        gateways: GATEWAYS,
        executors: EXECUTORS,
        recoveries: RECOVERIES,
        permit_limit: 6,
        postgres_admin_url,
        ..Topology::default()
    })
    .await?;
    for _ in 1..SCHEDULERS {
        cluster.add_scheduler().await?;
    }
    let pool = cluster.db.pool(3).await?;
    let mut submitter = Submitter::new(&cluster);
    let mut told: Vec<(String, String)> = Vec::new();
    // client keys are never reused, whatever became of a submission
    let mut submitted = 0usize;
    let started = Instant::now();
    let mut ids = Vec::new();
    let mut next = 0usize;
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let mut pending: Vec<(Instant, Heal)> = Vec::new();
    let mut last_report = Instant::now();
    let mut submit_errors = Vec::new();
    let mut landed: Vec<&Action> = Vec::new();
    while started.elapsed() < duration {
        // the load: a few workflows every 200 ms over the three capabilities and routes
        for _ in 0..rng.random_range(0..3) {
            let n = submitted;
            submitted += 1;
            let mut req = chain(
                &format!("soak-{n}"),
                ROUTES[n % ROUTES.len()],
                rng.random_range(1..=3),
            );
            for s in &mut req.steps {
                s.adapter = format!("http-{}", AdapterCapability::ALL[n % 3]);
                s.policy = Some(policy());
            }
            match submitter.submit(&cluster, req).await {
                Ok(id) => {
                    told.push((format!("soak-{n}"), id.clone()));
                    ids.push(id);
                }
                Err(e) => submit_errors.push(format!("soak-{n}: {e:#}")),
            }
        }
        let now = started.elapsed().as_millis() as u64;
        while next < plan.len() && plan[next].at_ms <= now {
            let heal = apply(&mut cluster, &plan[next].action).await;
            match heal {
                Ok(Some((after, h))) => {
                    landed.push(&plan[next].action);
                    pending.push((Instant::now() + after, h));
                }
                Ok(None) => {}
                Err(e) => progress(format!("fault {next} not applied: {e:#}")),
            }
            next += 1;
        }
        let due: Vec<Heal> = {
            let (due, keep): (Vec<_>, Vec<_>) =
                pending.drain(..).partition(|(t, _)| *t <= Instant::now());
            pending = keep;
            due.into_iter().map(|(_, h)| h).collect()
        };
        for h in due {
            if let Err(e) = heal(&mut cluster, h).await {
                progress(format!("heal failed: {e:#}"));
            }
        }
        if last_report.elapsed() > Duration::from_secs(30) {
            last_report = Instant::now();
            let done: i64 =
                sqlx::query_scalar("SELECT count(*) FROM steps WHERE state = 'completed'")
                    .fetch_one(&pool)
                    .await
                    .unwrap_or(-1);
            progress(format!(
                "seed {seed}: {:>4}s, {} workflows submitted, {} faults landed, {done} steps completed",
                started.elapsed().as_secs(),
                ids.len(),
                landed.len()
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // heal everything, then let the system finish
    for (_, h) in pending.drain(..) {
        let _ = heal(&mut cluster, h).await;
    }
    for route in ROUTES {
        cluster.set_faults(route, json!({})).await?;
    }
    for name in all_processes() {
        if let Some(p) = cluster.process(&name) {
            let _ = p.resume();
            if p.exited() {
                // a restart can lose a race with the same process's last heal; try again
                if let Err(e) = cluster.restart(&name, &[]).await {
                    progress(format!("restarting {name} again after: {e:#}"));
                    cluster.restart(&name, &[]).await?;
                }
            }
        }
    }
    progress(format!(
        "seed {seed}: load stopped; waiting for {} workflows to end",
        ids.len()
    ));
    cluster
        .wait_all_ended(&ids, Duration::from_secs(300))
        .await?;
    // a person looks in the destination for what is in review, and the workflows go on
    let mut resolved_by_a_person = 0;
    for _ in 0..3 {
        let n = cluster.resolve_reviews_from_ledger().await?;
        if n == 0 {
            break;
        }
        resolved_by_a_person += n;
        cluster
            .wait_all_ended(&ids, Duration::from_secs(120))
            .await?;
    }
    let history = History::load(&pool, &cluster.ledger_pool().await?).await?;
    let total = history.steps.len();
    let expect = Expect {
        capabilities: AdapterCapability::ALL
            .iter()
            .map(|c| (format!("http-{c}"), *c))
            .collect(),
        permit_limit: 6,
        // opaque unknowns and exhausted retries end in review; most must complete
        min_completed: total / 2,
    };
    let violations = history.check(&expect);
    if !violations.is_empty() {
        let keep = std::env::temp_dir().join(format!("z29c-soak-{seed}"));
        std::fs::create_dir_all(&keep)?;
        history.save(&keep.join("history.json"))?;
        for entry in std::fs::read_dir(cluster.dir())? {
            let entry = entry?;
            let _ = std::fs::copy(entry.path(), keep.join(entry.file_name()));
        }
        progress(format!("history and logs kept in {}", keep.display()));
    }
    let retriable_not_completed = history
        .steps
        .iter()
        .filter(|st| {
            matches!(
                expect.capabilities.get(&st.adapter),
                Some(AdapterCapability::Idempotent | AdapterCapability::Queryable)
            ) && matches!(st.state.as_str(), "failed" | "needs_review")
        })
        .map(|st| {
            format!(
                "{}/{} ({}): {}",
                st.client_key, st.name, st.adapter, st.state
            )
        })
        .collect();
    let client_history_violations = check_client_history(&pool, &told).await?;
    let count = |f: fn(&Action) -> bool| landed.iter().filter(|a| f(a)).count();
    let report = SoakReport {
        seed,
        duration_s: duration.as_secs(),
        workflows: ids.len(),
        submit_errors,
        failovers: submitter.failovers,
        client_history_violations,
        resolved_by_a_person,
        faults: landed.len(),
        kills: count(|a| matches!(a, Action::Kill { .. })),
        pauses: count(|a| matches!(a, Action::Pause { .. })),
        scheduler_faults: count(|a| match a {
            Action::Kill { process, .. } | Action::Pause { process, .. } => {
                process.starts_with("scheduler")
            }
            Action::Destination { .. } => false,
        }),
        destination_faults: count(|a| matches!(a, Action::Destination { .. })),
        tally: history.tally(),
        retriable_not_completed,
        violations,
    };
    pool.close().await;
    cluster.stop().await?;
    Ok(report)
}

fn all_processes() -> Vec<String> {
    (1..=EXECUTORS)
        .map(|i| format!("executor-{i}"))
        .chain((1..=GATEWAYS).map(|i| format!("gateway-{i}")))
        .chain((1..=RECOVERIES).map(|i| format!("recovery-{i}")))
        .chain((1..=SCHEDULERS).map(scheduler_name))
        .collect()
}

/// How long a submission waits for a scheduler before it goes to the other (a paused one
/// never answers).
const SUBMIT_PATIENCE: Duration = Duration::from_secs(3);

/// Submits round-robin over the schedulers; one that does not answer is skipped and the same
/// submission, with the same client key, goes to the next. A scheduler that received it
/// before it stopped answering may commit it later: the client key makes that the same
/// workflow, which [`check_client_history`] verifies.
struct Submitter {
    clients: Vec<
        Option<
            z29c_proto::v1::workflow_service_client::WorkflowServiceClient<z29c_security::Authed>,
        >,
    >,
    next: usize,
    failovers: usize,
}

impl Submitter {
    fn new(cluster: &Cluster) -> Self {
        Self {
            clients: vec![None; cluster.scheduler_urls.len()],
            next: 0,
            failovers: 0,
        }
    }

    async fn submit(&mut self, cluster: &Cluster, req: pb::SubmitRequest) -> Result<String> {
        let n = self.clients.len();
        let first = self.next;
        self.next = (self.next + 1) % n;
        let mut last = None;
        for i in (0..n).map(|k| (first + k) % n) {
            if i != first {
                self.failovers += 1;
            }
            let url = &cluster.scheduler_urls[i];
            let client = match &mut self.clients[i] {
                Some(c) => c,
                slot => match tokio::time::timeout(SUBMIT_PATIENCE, cluster.client_at(url)).await {
                    Ok(Ok(c)) => slot.insert(c),
                    Ok(Err(e)) => {
                        last = Some(e.context(format!("connecting to {url}")));
                        continue;
                    }
                    Err(_) => {
                        last = Some(anyhow::anyhow!("{url} did not accept a connection"));
                        continue;
                    }
                },
            };
            match tokio::time::timeout(SUBMIT_PATIENCE, client.submit(req.clone())).await {
                Ok(Ok(r)) => return Ok(r.into_inner().workflow.context("no workflow")?.id),
                // a refusal of the submission itself is an answer: no other scheduler will
                // think otherwise
                Ok(Err(status)) if status.code() == tonic::Code::InvalidArgument => {
                    anyhow::bail!("{url}: {status}")
                }
                Ok(Err(status)) => last = Some(anyhow::anyhow!("{url}: {status}")),
                Err(_) => {
                    last = Some(anyhow::anyhow!(
                        "{url} did not answer within {SUBMIT_PATIENCE:?}"
                    ))
                }
            }
            // reconnect next time: the process may have been restarted
            self.clients[i] = None;
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no scheduler")))
    }
}

/// What the client was told against what the database holds: the workflow each answer named
/// is the one held under its client key, and no workflow is held that no answer named (a
/// submission a stopped scheduler committed after the client gave up on it, say).
async fn check_client_history(
    pool: &sqlx::PgPool,
    told: &[(String, String)],
) -> Result<Vec<String>> {
    let held: std::collections::BTreeMap<String, String> =
        sqlx::query_as::<_, (String, String)>("SELECT client_key, id::text FROM workflows")
            .fetch_all(pool)
            .await?
            .into_iter()
            .collect();
    let answered: std::collections::BTreeMap<&str, &str> = told
        .iter()
        .map(|(key, id)| (key.as_str(), id.as_str()))
        .collect();
    let mut out = Vec::new();
    for (key, id) in &answered {
        match held.get(*key) {
            Some(h) if h == id => {}
            Some(h) => out.push(format!("{key}: told {id}, the database holds {h}")),
            None => out.push(format!("{key}: told {id}, the database holds no workflow")),
        }
    }
    for (key, id) in &held {
        if !answered.contains_key(key.as_str()) {
            out.push(format!(
                "{key}: the database holds {id}, which no answer named"
            ));
        }
    }
    Ok(out)
}

enum Heal {
    Restart(String),
    Resume(String),
    ClearRoute(String),
}

async fn apply(cluster: &mut Cluster, action: &Action) -> Result<Option<(Duration, Heal)>> {
    Ok(match action {
        Action::Kill { process, down_ms } => {
            let p = cluster.process(process).context("process")?;
            if p.exited() {
                return Ok(None);
            }
            p.kill().await?;
            Some((
                Duration::from_millis(*down_ms),
                Heal::Restart(process.clone()),
            ))
        }
        Action::Pause { process, ms } => {
            let p = cluster.process(process).context("process")?;
            if p.exited() {
                return Ok(None);
            }
            p.pause()?;
            Some((Duration::from_millis(*ms), Heal::Resume(process.clone())))
        }
        Action::Destination { route, faults, ms } => {
            cluster.set_faults(route, faults.clone()).await?;
            Some((Duration::from_millis(*ms), Heal::ClearRoute(route.clone())))
        }
    })
}

async fn heal(cluster: &mut Cluster, h: Heal) -> Result<()> {
    match h {
        Heal::Restart(name) => cluster.restart(&name, &[]).await,
        Heal::Resume(name) => cluster.process(&name).context("process")?.resume(),
        Heal::ClearRoute(route) => cluster.set_faults(&route, json!({})).await,
    }
}

impl SoakReport {
    pub fn summary(&self) -> String {
        format!(
            "seed {} · {} s · {} workflows ({} steps, {} submissions refused, {} sent to the \
             other scheduler): {} completed, \
             {} failed ({} of them idempotent or queryable), {} in review ({} resolved from \
             the destination's records) · \
             {} faults landed ({} kills, {} pauses, {} of a scheduler, {} destination faults) · \
             {} recoveries, {} late observations, {} external effects · violations: {}",
            self.seed,
            self.duration_s,
            self.workflows,
            self.tally.steps,
            self.submit_errors.len(),
            self.failovers,
            self.tally.completed,
            self.tally.failed,
            self.retriable_not_completed.len(),
            self.tally.in_review,
            self.resolved_by_a_person,
            self.faults,
            self.kills,
            self.pauses,
            self.scheduler_faults,
            self.destination_faults,
            self.tally.recoveries,
            self.tally.late_observations,
            self.tally.effects,
            self.violations.len() + self.client_history_violations.len()
        )
    }
}
