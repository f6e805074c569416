//! The fault matrix: every fault of the attempt protocol, crossed with the adapter
//! capabilities where the capability changes what recovery may do, each run on real processes
//! with its own database and NATS prefix, then judged by [`crate::history`]'s checker.
//! [`table`] prints what was proven: fault × capability → invariants held, steps completed,
//! and whether the fault really bit (a crashed process, a late observation, a sprung trap…),
//! so a cell cannot pass by not happening.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::Semaphore;
use z29c_core::{AdapterCapability, Checkpoint};
use z29c_proto::v1::{self as pb};
use z29c_store::faults::CrashPoint;

use crate::cluster::{Cluster, Topology, chain};
use crate::history::{Expect, History, Invariant, Tally, Violation};
use crate::infra::{PrivateNats, PrivatePostgres};
use crate::proxy::{CommitTrap, Proxy};
use crate::wait_for_count;

/// Which adapter(s) a cell's workflows use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cap {
    One(AdapterCapability),
    /// Workflows spread over the three capabilities in one run.
    Mixed,
}

impl PartialOrd for Cap {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Cap {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.rank().cmp(&other.rank())
    }
}

impl Cap {
    fn rank(self) -> usize {
        match self {
            Cap::One(c) => AdapterCapability::ALL
                .iter()
                .position(|x| *x == c)
                .unwrap_or(0),
            Cap::Mixed => 3,
        }
    }

    pub const ALL3: [Cap; 3] = [
        Cap::One(AdapterCapability::Idempotent),
        Cap::One(AdapterCapability::Queryable),
        Cap::One(AdapterCapability::Opaque),
    ];

    /// The adapter workflow number `i` uses.
    fn adapter(self, i: usize) -> String {
        let c = match self {
            Cap::One(c) => c,
            Cap::Mixed => AdapterCapability::ALL[i % 3],
        };
        format!("http-{c}")
    }

    fn label(self) -> String {
        match self {
            Cap::One(c) => c.to_string(),
            Cap::Mixed => "mixed".into(),
        }
    }

    fn is_opaque(self) -> bool {
        self == Cap::One(AdapterCapability::Opaque)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
/// Which deadline binds in a deadline cell; each cell sets the others well clear of it.
pub enum Deadline {
    /// The adapter timeout (2 s) cuts the call; the lease (6 s, renewed) and the attempt
    /// deadline (12 s) are far off.
    Adapter,
    /// The lease (3 s) runs out because its worker is stopped mid-call; the call itself has
    /// 10 s.
    Lease,
    /// The attempt deadline cuts the call: its worker started it 2 s after the claim, leaving
    /// 5.5 s of an 8 s attempt, short of the 7.5 s adapter timeout; the lease is renewed.
    Attempt,
    /// The workflow's deadline (3.5 s) passes during a call that has 10 s.
    Workflow,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fault {
    /// 1. The executor aborts at a crash point.
    Crash(CrashPointKey),
    /// 2. SIGSTOP longer than the lease, then SIGCONT.
    Pause,
    /// 3. Workers' and recovery's wall clocks skewed by minutes (libfaketime).
    ClockSkew,
    /// 4. The executor's database connections cut while its call is in flight.
    DbCut,
    /// 5. The connection dropped at the receipt's `COMMIT`.
    CommitDrop(bool),
    /// 6. The gateway aborts after the destination committed, before replying.
    GatewayCrash,
    /// 6. An answer larger than the gateway reads.
    OversizedReply,
    /// 7. The answer arrives just before (`false`) or just after (`true`) a deadline.
    Deadline(Deadline, bool),
    /// 8. Garbage, duplicate and purged hints, an executor killed with unacknowledged
    ///    messages, and NATS itself killed and restarted mid-run.
    NatsChaos,
    /// 9. Two recovery instances; the one deciding is killed.
    RecoveryKilled,
    /// 10. A poison step (always 5xx) in a retry storm.
    Poison,
    /// 11. PostgreSQL crashed and restarted under load.
    PostgresRestart,
}

/// [`CrashPoint`] in a form that orders and hashes for the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CrashPointKey {
    pub checkpoint_rank: u8,
    pub after: bool,
}

impl CrashPointKey {
    fn point(self) -> CrashPoint {
        let checkpoint = Checkpoint::ALL[self.checkpoint_rank as usize];
        if self.after {
            CrashPoint::after(checkpoint)
        } else {
            CrashPoint::before(checkpoint)
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::Crash(k) => write!(f, "1 SIGKILL {}", k.point()),
            Fault::Pause => write!(f, "2 SIGSTOP past the lease, SIGCONT"),
            Fault::ClockSkew => write!(f, "3 clocks skewed +7m/-7m/+3m"),
            Fault::DbCut => write!(f, "4 DB connection cut mid-call"),
            Fault::CommitDrop(after) => write!(
                f,
                "5 connection dropped at receipt COMMIT ({})",
                if *after { "after" } else { "before" }
            ),
            Fault::GatewayCrash => write!(f, "6 gateway killed after destination commit"),
            Fault::OversizedReply => write!(f, "6 oversized reply (300 KB)"),
            Fault::Deadline(d, late) => {
                let when = if *late { "after" } else { "before" };
                let what = match d {
                    Deadline::Adapter => "the adapter deadline",
                    Deadline::Lease => "the lease runs out, its worker stopped",
                    Deadline::Attempt => "the attempt deadline, its worker slow to start",
                    Deadline::Workflow => "the workflow deadline",
                };
                write!(f, "7 answer just {when} {what}")
            }
            Fault::NatsChaos => write!(f, "8 JetStream dup/lost/redelivered, NATS restart"),
            Fault::RecoveryKilled => write!(f, "9 two recoveries, one killed deciding"),
            Fault::Poison => write!(f, "10 poison steps (5xx) in a retry storm"),
            Fault::PostgresRestart => write!(f, "11 PostgreSQL crashed and restarted"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cell {
    pub fault: Fault,
    pub cap: Cap,
}

impl fmt::Display for Cell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} × {}", self.fault, self.cap.label())
    }
}

/// Every cell of the matrix.
pub fn cells() -> Vec<Cell> {
    let mut out = Vec::new();
    let per_cap = |fault: Fault, out: &mut Vec<Cell>| {
        for cap in Cap::ALL3 {
            out.push(Cell { fault, cap });
        }
    };
    for rank in 0..Checkpoint::ALL.len() as u8 {
        for after in [false, true] {
            per_cap(
                Fault::Crash(CrashPointKey {
                    checkpoint_rank: rank,
                    after,
                }),
                &mut out,
            );
        }
    }
    per_cap(Fault::Pause, &mut out);
    out.push(Cell {
        fault: Fault::ClockSkew,
        cap: Cap::Mixed,
    });
    per_cap(Fault::DbCut, &mut out);
    per_cap(Fault::CommitDrop(false), &mut out);
    per_cap(Fault::CommitDrop(true), &mut out);
    per_cap(Fault::GatewayCrash, &mut out);
    per_cap(Fault::OversizedReply, &mut out);
    for d in [
        Deadline::Adapter,
        Deadline::Lease,
        Deadline::Attempt,
        Deadline::Workflow,
    ] {
        // before a deadline the answer simply counts; the capability matters only after
        out.push(Cell {
            fault: Fault::Deadline(d, false),
            cap: Cap::Mixed,
        });
        per_cap(Fault::Deadline(d, true), &mut out);
    }
    out.push(Cell {
        fault: Fault::NatsChaos,
        cap: Cap::Mixed,
    });
    per_cap(Fault::RecoveryKilled, &mut out);
    per_cap(Fault::Poison, &mut out);
    out.push(Cell {
        fault: Fault::PostgresRestart,
        cap: Cap::Mixed,
    });
    out
}

/// The verdict on one cell.
#[derive(Debug, Clone)]
pub struct CellResult {
    pub cell: Cell,
    pub violations: Vec<Violation>,
    /// What should have happened and did not (the fault did not bite, an expected outcome).
    pub expectations: Vec<String>,
    pub tally: Tally,
    pub elapsed: Duration,
    /// Where the history and logs of a failed cell were kept.
    pub kept: Option<std::path::PathBuf>,
    /// Why a first start of the cell's cluster failed, when this result is from its second.
    pub setup_retried: Option<String>,
}

impl CellResult {
    pub fn passed(&self) -> bool {
        self.violations.is_empty() && self.expectations.is_empty()
    }

    /// What a failed cell found, a line each, with the warnings and errors its services
    /// logged: printed as the cell ends, so a CI log that keeps only the head and tail of the
    /// output still says why (the kept directory is on the CI machine).
    pub fn findings(&self) -> String {
        let mut out = self.verdict();
        if let Some(dir) = &self.kept {
            out.push_str(&logged_trouble(dir, 40));
        }
        out
    }

    /// Its violations, expectations and where its history was kept, a line each.
    fn verdict(&self) -> String {
        let mut out = String::new();
        for v in &self.violations {
            out.push_str(&format!("  violation {v}\n"));
        }
        for e in &self.expectations {
            out.push_str(&format!("  expected {e}\n"));
        }
        if let Some(dir) = &self.kept {
            out.push_str(&format!("  history and logs kept in {}\n", dir.display()));
        }
        out
    }

    /// Why the cell's cluster could not be started, before any fault: not a finding about
    /// z29c, and [`run_cells`] gives such a cell one more start.
    pub fn setup_failure(&self) -> Option<&str> {
        match (self.violations.as_slice(), self.expectations.as_slice()) {
            ([], [only]) => only.strip_prefix("setup: "),
            _ => None,
        }
    }
}

/// Options for one cell run.
#[derive(Debug, Clone, Copy, Default)]
pub struct Switches {
    /// Run the executors as the deliberately broken build (receipts unfenced).
    pub break_receipt_fencing: bool,
}

/// A short policy: leases expire in 1.5 s, so recovery happens within a cell's time.
/// The short lease every cell runs under (1.5 s lease, 8 s attempt deadline, 1 s adapter
/// timeout, 4 attempts), so faults play out in seconds.
pub fn policy() -> pb::LeasePolicy {
    pb::LeasePolicy {
        lease_ms: 1_500,
        renew_every_ms: 500,
        attempt_deadline_ms: 8_000,
        final_grace_ms: 500,
        adapter_timeout_ms: 1_000,
        max_attempts: 4,
        ..Default::default()
    }
}

struct Run {
    cluster: Cluster,
    pool: PgPool,
    /// The destination's own database: what the outside world recorded.
    ledger: PgPool,
    ids: Vec<String>,
    /// Steps that may legitimately end in review (opaque unknowns, poison steps…).
    allowance: usize,
    switches: Switches,
    expectations: Vec<String>,
}

impl Run {
    async fn submit(
        &mut self,
        key: &str,
        adapter: &str,
        route: &str,
        steps: usize,
        policy: pb::LeasePolicy,
        deadline_ms: Option<i64>,
    ) -> Result<String> {
        let mut req = chain(key, route, steps);
        for s in &mut req.steps {
            s.adapter = adapter.to_owned();
            s.policy = Some(policy.clone());
        }
        if let Some(ms) = deadline_ms {
            let at = chrono::Utc::now() + chrono::Duration::milliseconds(ms);
            req.deadline = Some(prost_types_timestamp(at));
        }
        let id = self
            .cluster
            .client()
            .await?
            .submit(req)
            .await?
            .into_inner()
            .workflow
            .context("submit answered no workflow")?
            .id;
        self.ids.push(id.clone());
        Ok(id)
    }

    /// `n` healthy two-step workflows over the cell's adapters.
    async fn healthy(&mut self, cap: Cap, n: usize) -> Result<()> {
        for i in 0..n {
            let adapter = cap.adapter(i + 1);
            if cap == Cap::Mixed && adapter == "http-opaque" {
                self.allowance += 2;
            }
            self.submit(&format!("ok-{i}"), &adapter, "ok", 2, policy(), None)
                .await?;
        }
        Ok(())
    }

    async fn executor(&mut self, extra: &[(&str, &str)]) -> Result<()> {
        let mut env: Vec<(&str, &str)> = extra.to_vec();
        if self.switches.break_receipt_fencing {
            env.push(("Z29C_FAULT_BREAK_RECEIPT_FENCING", "true"));
        }
        self.cluster.add_executor_with(&env).await
    }

    async fn wait_for(&self, sql: &str, what: &str, within: Duration) -> Result<()> {
        wait_for_count(&self.pool, sql, what, within).await
    }

    /// Waits until `sql` counts something in the destination's records.
    async fn wait_for_effect(&self, sql: &str, what: &str, within: Duration) -> Result<()> {
        wait_for_count(&self.ledger, sql, what, within).await
    }

    /// Waits until process `name`'s log has a line containing `text`.
    async fn wait_for_log(&self, name: &str, text: &str, within: Duration) -> Result<()> {
        self.cluster.wait_for_log(name, text, within).await
    }

    async fn wait_exit(&mut self, name: &str, within: Duration) -> Result<()> {
        self.cluster.wait_exited(name, within).await
    }

    async fn count(&self, sql: &str) -> i64 {
        count(&self.pool, sql).await
    }

    /// Counts in the destination's records.
    async fn count_effects(&self, sql: &str) -> i64 {
        count(&self.ledger, sql).await
    }

    /// Records an expectation that did not hold.
    fn expect(&mut self, ok: bool, what: impl Into<String>) {
        if !ok {
            self.expectations.push(what.into());
        }
    }
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap_or(-1)
}

fn prost_types_timestamp(at: chrono::DateTime<chrono::Utc>) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: at.timestamp(),
        nanos: at.timestamp_subsec_nanos() as i32,
    }
}

const INVOKED: &str = "SELECT count(*) FROM attempts WHERE invocation_began_at IS NOT NULL";

/// Runs one cell from start to verdict; nothing it started outlives it.
pub async fn run_cell(cell: Cell, switches: Switches) -> CellResult {
    let started = Instant::now();
    let mut pg = None;
    let mut nats = None;
    let outcome = async {
        if cell.fault == Fault::PostgresRestart {
            // durable as a production server is: what z29c commits with relaxed durability
            // (claims, permit releases, outbox marks) is lost in this crash as it would be in
            // production's, and the rest must survive it
            pg = Some(
                PrivatePostgres::start_with(&[
                    "fsync=on",
                    "synchronous_commit=on",
                    "max_connections=200",
                ])
                .await?,
            );
        }
        if cell.fault == Fault::NatsChaos {
            nats = Some(PrivateNats::start().await?);
        }
        let cluster = Cluster::start_with(Topology {
            // these cells add their own gateway, armed with a fault
            gateways: usize::from(!match cell.fault {
                Fault::GatewayCrash => true,
                Fault::Crash(k) => k.point().in_gateway(),
                _ => false,
            }),
            executors: 0,
            recoveries: usize::from(!matches!(
                cell.fault,
                Fault::ClockSkew | Fault::RecoveryKilled
            )),
            permit_limit: 8,
            nats_url: nats.as_ref().map(PrivateNats::url),
            postgres_admin_url: pg.as_ref().map(PrivatePostgres::admin_url),
            // the services hold the database privileges production gives them: rows only
            least_privilege: true,
            ..Topology::default()
        })
        .await?;
        let pool = cluster.db.pool(3).await?;
        let ledger = cluster.ledger_pool().await?;
        let mut run = Run {
            cluster,
            pool,
            ledger,
            ids: Vec::new(),
            allowance: 0,
            switches,
            expectations: Vec::new(),
        };
        let driven = tokio::time::timeout(
            Duration::from_secs(150),
            drive(&mut run, cell, &mut pg, &mut nats),
        )
        .await
        .unwrap_or_else(|_| Err(anyhow::anyhow!("the cell did not finish within 150 s")));
        match &driven {
            // a person then looks in the destination for what is in review, and the
            // workflows go on: the checker judges what they decided too
            Ok(()) => {
                if let Err(e) = resolve_reviews(&run).await {
                    run.expectations.push(format!("review: {e:#}"));
                }
            }
            Err(e) => run.expectations.push(format!("run: {e:#}")),
        }
        let history = History::load(&run.pool, &run.ledger).await?;
        Ok::<_, anyhow::Error>((run, history))
    }
    .await;
    let (violations, expectations, tally, kept) = match outcome {
        Ok((run, history)) => {
            let total = history.steps.len();
            let expect = Expect {
                capabilities: AdapterCapability::ALL
                    .iter()
                    .map(|c| (format!("http-{c}"), *c))
                    .collect(),
                permit_limit: 8,
                min_completed: total.saturating_sub(run.allowance).max(1),
            };
            let violations = history.check(&expect);
            let tally = history.tally();
            let Run {
                cluster,
                pool,
                ledger,
                expectations,
                ..
            } = run;
            pool.close().await;
            ledger.close().await;
            let kept = if violations.is_empty() && expectations.is_empty() {
                None
            } else {
                keep(&cell, &cluster, &history).ok()
            };
            let _ = cluster.stop().await;
            (violations, expectations, tally, kept)
        }
        Err(e) => (
            Vec::new(),
            vec![format!("setup: {e:#}")],
            Tally::default(),
            None,
        ),
    };
    if let Some(pg) = pg {
        pg.stop().await;
    }
    if let Some(n) = nats {
        n.stop().await;
    }
    CellResult {
        cell,
        violations,
        expectations,
        tally,
        elapsed: started.elapsed(),
        kept,
        setup_retried: None,
    }
}

/// Resolves review items as a person would, from the destination's records, until none is
/// left or the workflows stop asking (a dependent may go to review in its turn).
async fn resolve_reviews(run: &Run) -> Result<()> {
    for _ in 0..3 {
        if run.cluster.resolve_reviews_from_ledger().await? == 0 {
            break;
        }
        run.cluster
            .wait_all_ended(&run.ids, Duration::from_secs(60))
            .await?;
    }
    Ok(())
}

/// Copies a failed cell's logs and history under `target/fault-matrix/`.
fn keep(cell: &Cell, cluster: &Cluster, history: &History) -> Result<std::path::PathBuf> {
    let name: String = cell
        .to_string()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let dir = std::env::var("Z29C_MATRIX_KEEP")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| std::env::temp_dir().join("z29c-fault-matrix"))
        .join(format!("{name}-{}", cluster.prefix));
    std::fs::create_dir_all(&dir)?;
    history.save(&dir.join("history.json"))?;
    for entry in std::fs::read_dir(cluster.dir())? {
        let entry = entry?;
        let _ = std::fs::copy(entry.path(), dir.join(entry.file_name()));
    }
    Ok(dir)
}

async fn drive(
    run: &mut Run,
    cell: Cell,
    pg: &mut Option<PrivatePostgres>,
    nats: &mut Option<PrivateNats>,
) -> Result<()> {
    let cap = cell.cap;
    let target = cap.adapter(0);
    let opaque_target = cap.is_opaque() || (cap == Cap::Mixed && target == "http-opaque");
    let long = Duration::from_secs(90);
    match cell.fault {
        Fault::Crash(k) => {
            let point = k.point();
            let s = point.to_string();
            let crash = ("Z29C_FAULT_CRASH", s.as_str());
            let one_worker = [("Z29C_WORKERS", "1"), ("Z29C_CLAIM_BATCH", "1")];
            // the process that reaches the point is the one armed (and killed)
            let armed = if point.in_gateway() {
                run.cluster.add_gateway_with(8, &[crash]).await?;
                run.executor(&one_worker).await?;
                "gateway-1"
            } else {
                run.executor(&[crash, one_worker[0], one_worker[1]]).await?;
                "executor-1"
            };
            if opaque_target && may_have_invoked(point) {
                run.allowance += 2;
            }
            run.submit("target", &target, "target", 2, policy(), None)
                .await?;
            run.wait_exit(armed, Duration::from_secs(30)).await?;
            run.cluster.restart(armed, &["Z29C_FAULT_CRASH"]).await?;
            run.healthy(cap, 2).await?;
            run.cluster.wait_all_ended(&run.ids, long).await?;
        }
        Fault::Pause => {
            // the worker holds the answer for a moment before committing: the window in
            // which it is frozen, so it comes back stale with a result in hand
            run.executor(&[("Z29C_FAULT_STALL_AFTER_RESPONSE_MS", "2000")])
                .await?;
            if opaque_target {
                run.allowance += 2;
            }
            run.submit("target", &target, "target", 2, policy(), None)
                .await?;
            // the gateway is done with its permit before it replies, so the permit table says too
            // little: the worker's own log says when it holds the answer
            run.wait_for_log(
                "executor-1",
                "fault: stalling after the response",
                Duration::from_secs(20),
            )
            .await?;
            run.cluster
                .process("executor-1")
                .context("executor-1")?
                .pause()?;
            // the gateway recorded the answer before it replied, so recovery completes the
            // step from it at expiry; the broken build's stale receipt needs recovery held
            // back to have a chance at all, and then commits after its lease expired
            let hold_recovery = run.switches.break_receipt_fencing;
            if hold_recovery {
                run.cluster
                    .process("recovery-1")
                    .context("recovery-1")?
                    .pause()?;
            }
            run.executor(&[]).await?;
            tokio::time::sleep(Duration::from_millis(4_500)).await;
            run.cluster
                .process("executor-1")
                .context("executor-1")?
                .resume()?;
            if hold_recovery {
                run.wait_for(
                    "SELECT count(*) FROM step_receipts",
                    "the stale receipt",
                    Duration::from_secs(20),
                )
                .await?;
                run.cluster
                    .process("recovery-1")
                    .context("recovery-1")?
                    .resume()?;
            }
            // kept as evidence by the real build; committed as a receipt by the broken one
            // (the gateway recorded the answer before replying; what is awaited here is the
            // worker's own commit: a late observation, or the broken build's receipt)
            run.wait_for(
                "SELECT (SELECT count(*) FROM late_observations)
                      + (SELECT count(*) FROM step_receipts r
                         JOIN attempts a ON a.id = r.attempt_id
                         WHERE a.number = 1 AND r.verification = 'direct')",
                "the paused worker's late result",
                Duration::from_secs(20),
            )
            .await?;
            // its stall would make every later step stale too: the healthy work goes to
            // executor-2
            run.cluster
                .process("executor-1")
                .context("executor-1")?
                .kill()
                .await?;
            run.healthy(cap, 2).await?;
            run.cluster.wait_all_ended(&run.ids, long).await?;
        }
        Fault::ClockSkew => {
            let lib = faketime_library()?;
            let skewed = |offset: &'static str| {
                vec![
                    ("LD_PRELOAD", lib.clone()),
                    ("FAKETIME", offset.to_owned()),
                    ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_owned()),
                ]
            };
            for offset in ["+7m", "-7m"] {
                let env = skewed(offset);
                let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
                run.executor(&env).await?;
            }
            let env = skewed("+3m");
            let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
            run.cluster.add_recovery_with(&env).await?;
            run.cluster
                .set_faults("target", json!({ "answer_delay_ms": 400 }))
                .await?;
            for i in 0..3 {
                if cap.adapter(i) == "http-opaque" {
                    run.allowance += 2;
                }
                run.submit(
                    &format!("target-{i}"),
                    &cap.adapter(i),
                    "target",
                    2,
                    policy(),
                    None,
                )
                .await?;
            }
            // force a takeover under skewed clocks: pause one worker past its lease
            run.wait_for(INVOKED, "an invocation", Duration::from_secs(20))
                .await?;
            run.cluster
                .process("executor-1")
                .context("executor-1")?
                .pause()?;
            tokio::time::sleep(Duration::from_millis(3_000)).await;
            run.cluster
                .process("executor-1")
                .context("executor-1")?
                .resume()?;
            run.healthy(cap, 6).await?;
            run.cluster.wait_all_ended(&run.ids, long).await?;
            let skew = log_clock_skew(&run.cluster.dir().join("executor-1.log"))?;
            run.expect(
                skew >= chrono::Duration::minutes(6),
                format!("executor-1's clock was not skewed (log runs {skew} ahead)"),
            );
        }
        Fault::DbCut => {
            let proxy = Proxy::start(upstream(run.cluster.db.url())?).await?;
            let via = via_proxy(run.cluster.db.url(), proxy.port)?;
            run.executor(&[("Z29C_DATABASE_URL", via.as_str())]).await?;
            run.cluster
                .set_faults("target", json!({ "answer_delay_ms": 2_500 }))
                .await?;
            if opaque_target {
                run.allowance += 2;
            }
            run.submit("target", &target, "target", 2, policy(), None)
                .await?;
            run.wait_for(INVOKED, "the invocation", Duration::from_secs(20))
                .await?;
            let cut = tokio::spawn({
                let proxy = proxy.clone();
                async move { proxy.cut_for(Duration::from_millis(4_000)).await }
            });
            run.executor(&[]).await?;
            cut.await?;
            run.cluster.set_faults("target", json!({})).await?;
            run.healthy(cap, 2).await?;
            run.cluster.wait_all_ended(&run.ids, long).await?;
            let n = run.count("SELECT count(*) FROM recovery_decisions").await;
            run.expect(n > 0, "the cut worker's lease was never recovered");
        }
        Fault::CommitDrop(after) => {
            let proxy = Proxy::start(upstream(run.cluster.db.url())?).await?;
            // no prepared statements kept: each statement's text crosses the proxy, which
            // picks the receipt's transaction by it
            let via = format!(
                "{}&statement-cache-capacity=0",
                via_proxy(run.cluster.db.url(), proxy.port)?
            );
            run.executor(&[
                ("Z29C_DATABASE_URL", via.as_str()),
                ("Z29C_WORKERS", "1"),
                ("Z29C_CLAIM_BATCH", "1"),
                // the receipt in a transaction of its own, whose COMMIT the proxy traps: a
                // batched receipt is one statement with no COMMIT message to drop
                ("Z29C_RECEIPT_BATCH", "1"),
            ])
            .await?;
            run.cluster
                .set_faults("target", json!({ "answer_delay_ms": 800 }))
                .await?;
            if opaque_target && !after {
                run.allowance += 2;
            }
            let mut p = policy();
            p.lease_ms = 6_000;
            p.renew_every_ms = 3_000;
            p.attempt_deadline_ms = 20_000;
            p.adapter_timeout_ms = 3_000;
            run.submit("target", &target, "target", 1, p, None).await?;
            run.wait_for(INVOKED, "the invocation", Duration::from_secs(20))
                .await?;
            // the receipt's transaction; a claim's may commit beside it, since the worker
            // goes on while its receipt commits
            proxy
                .trap_commit_of(
                    "INSERT INTO step_receipts",
                    if after {
                        CommitTrap::DropAfter
                    } else {
                        CommitTrap::DropBefore
                    },
                )
                .await;
            let start = Instant::now();
            while !proxy.sprung() && start.elapsed() < Duration::from_secs(15) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            run.expect(proxy.sprung(), "no COMMIT was dropped");
            run.cluster.set_faults("target", json!({})).await?;
            run.healthy(cap, 2).await?;
            run.cluster.wait_all_ended(&run.ids, long).await?;
            let first = run
                .count("SELECT count(*) FROM step_receipts r JOIN attempts a ON a.id = r.attempt_id JOIN workflows w ON w.id = r.workflow_id WHERE a.number = 1 AND w.client_key = 'target' AND r.verification = 'direct'")
                .await;
            // after: the first attempt's receipt committed though its worker never heard;
            // before: it did not, and the step was recovered
            run.expect(
                (first == 1) == after,
                format!("receipts from the first attempt: {first} (commit dropped after: {after})"),
            );
        }
        Fault::GatewayCrash => {
            run.cluster
                .add_gateway_with(8, &[("Z29C_FAULT_CRASH_AFTER_DESTINATION", "true")])
                .await?;
            run.executor(&[]).await?;
            if opaque_target {
                run.allowance += 2;
            }
            run.submit("target", &target, "target", 2, policy(), None)
                .await?;
            run.wait_exit("gateway-1", Duration::from_secs(20)).await?;
            run.cluster
                .restart("gateway-1", &["Z29C_FAULT_CRASH_AFTER_DESTINATION"])
                .await?;
            run.healthy(cap, 2).await?;
            run.cluster.wait_all_ended(&run.ids, long).await?;
            let effects = run
                .count_effects("SELECT count(*) FROM destination.ledger WHERE route = 'target'")
                .await;
            run.expect(effects >= 1, "the destination never committed the target");
        }
        Fault::OversizedReply => {
            run.executor(&[]).await?;
            run.cluster
                .set_faults("target", json!({ "oversized_bytes": 300_000 }))
                .await?;
            if cap != Cap::One(AdapterCapability::Queryable) {
                // idempotent: every retry is oversized too, until review; opaque: review
                run.allowance += 1;
            }
            let mut p = policy();
            p.max_attempts = 2;
            run.submit("target", &target, "target", 1, p, None).await?;
            run.healthy(cap, 2).await?;
            run.cluster.wait_all_ended(&run.ids, long).await?;
            let n = run.count("SELECT count(*) FROM recovery_decisions").await;
            run.expect(n > 0, "the oversized answer was not treated as unknown");
        }
        Fault::Deadline(d, late) => {
            // the attempt deadline binds alone only when it leaves the call less time than the
            // adapter timeout: the worker is slow to start the call, so the call gets what is
            // left of the attempt
            let slow_start = [("Z29C_FAULT_STALL_AFTER_CLAIM_MS", "2000")];
            run.executor(if d == Deadline::Attempt {
                &slow_start
            } else {
                &[]
            })
            .await?;
            let mut p = policy();
            let mut deadline = None;
            // margins of ~1 s either side: a loaded CI machine must not move an answer
            // across the deadline
            let (before_ms, after_ms) = match d {
                Deadline::Adapter => {
                    p.lease_ms = 6_000;
                    p.renew_every_ms = 1_000;
                    p.attempt_deadline_ms = 12_000;
                    p.adapter_timeout_ms = 2_000;
                    (800, 2_800)
                }
                Deadline::Lease => {
                    // the call may outlive the lease, which binds only once renewals stop:
                    // the worker is stopped while its call runs (below)
                    p.lease_ms = 3_000;
                    p.renew_every_ms = 1_000;
                    p.attempt_deadline_ms = 12_000;
                    p.adapter_timeout_ms = 10_000;
                    (1_000, 4_500)
                }
                Deadline::Attempt => {
                    // 2 s stalled after the claim leave the call 8 - 0.5 - 2 = 5.5 s, short of
                    // its 7.5 s adapter timeout; the lease (5 s) outlasts the stall, and is
                    // renewed from the call's start
                    p.lease_ms = 5_000;
                    p.renew_every_ms = 1_000;
                    p.attempt_deadline_ms = 8_000;
                    p.adapter_timeout_ms = 7_500;
                    (3_500, 7_000)
                }
                Deadline::Workflow => {
                    p.lease_ms = 6_000;
                    p.renew_every_ms = 1_000;
                    p.attempt_deadline_ms = 12_000;
                    p.adapter_timeout_ms = 10_000;
                    deadline = Some(3_500);
                    (1_000, 4_500)
                }
            };
            let delay = if late { after_ms } else { before_ms };
            run.cluster
                .set_faults("target", json!({ "answer_delay_ms": delay }))
                .await?;
            if late && (opaque_target || d == Deadline::Workflow) {
                run.allowance += 1;
            }
            run.submit("target", &target, "target", 1, p, deadline)
                .await?;
            if d == Deadline::Lease {
                // stopped once its request arrived: woken before the answer and the lease's
                // end, or after both
                run.wait_for_effect(
                    "SELECT count(*) FROM destination.requests WHERE route = 'target'",
                    "the target's request",
                    Duration::from_secs(20),
                )
                .await?;
                let stopped = Duration::from_millis(if late { 6_000 } else { 1_500 });
                let worker = run.cluster.process("executor-1").context("executor-1")?;
                worker.pause()?;
                tokio::time::sleep(stopped).await;
                let worker = run.cluster.process("executor-1").context("executor-1")?;
                worker.resume()?;
            }
            run.wait_for_effect(
                "SELECT count(*) FROM destination.ledger WHERE route = 'target'",
                "the target's effect",
                Duration::from_secs(20),
            )
            .await?;
            // only the first answer is late; a retry is answered at once
            run.cluster.set_faults("target", json!({})).await?;
            if d == Deadline::Attempt {
                // the slow start is the target's alone: once its first attempt is settled (a
                // receipt, or recovery deciding), the worker starts its calls at once again
                run.wait_for(
                    "SELECT count(*) FROM workflows w WHERE w.client_key = 'target'
                       AND (EXISTS (SELECT 1 FROM step_receipts r JOIN steps s ON s.id = r.step_id
                                    WHERE s.workflow_id = w.id)
                            OR EXISTS (SELECT 1 FROM recovery_decisions d
                                       WHERE d.workflow_id = w.id))",
                    "the target's first attempt settled",
                    Duration::from_secs(30),
                )
                .await?;
                run.cluster
                    .restart("executor-1", &["Z29C_FAULT_STALL_AFTER_CLAIM_MS"])
                    .await?;
            }
            run.healthy(cap, 2).await?;
            run.cluster.wait_all_ended(&run.ids, long).await?;
            let recovered = run
                .count("SELECT count(*) FROM recovery_decisions d JOIN workflows w ON w.id = d.workflow_id WHERE w.client_key = 'target'")
                .await;
            run.expect(
                (recovered > 0) == late,
                format!(
                    "recovery decisions {recovered}: expected some only when the answer is late"
                ),
            );
        }
        Fault::NatsChaos => {
            run.executor(&[]).await?;
            run.executor(&[]).await?;
            for i in 0..12 {
                if cap.adapter(i) == "http-opaque" {
                    run.allowance += 2;
                }
                run.submit(
                    &format!("load-{i}"),
                    &cap.adapter(i),
                    "load",
                    2,
                    policy(),
                    None,
                )
                .await?;
            }
            let nats_url = run.cluster.nats_url.clone();
            let bus = z29c_bus::Bus::connect(&nats_url, &run.cluster.prefix).await?;
            let subject = bus.names().subject(z29c_bus::Topic::StepReady);
            for i in 0..100u32 {
                let _ = bus
                    .client()
                    .publish(subject.clone(), vec![0xff, 0x00, 0x13].into())
                    .await;
                let hint = z29c_bus::step_ready(&format!("dup-{}", i % 5), "nope", "nope");
                let _ = bus
                    .client()
                    .publish(subject.clone(), prost::Message::encode_to_vec(&hint).into())
                    .await;
            }
            let _ = bus.purge().await;
            run.cluster
                .process("executor-1")
                .context("executor-1")?
                .kill()
                .await?;
            nats.as_mut()
                .context("private NATS")?
                .crash_and_restart(Duration::from_millis(1_500))
                .await?;
            run.cluster.restart("executor-1", &[]).await?;
            run.healthy(cap, 6).await?;
            run.cluster.wait_all_ended(&run.ids, long).await?;
        }
        Fault::RecoveryKilled => {
            for _ in 0..2 {
                run.cluster
                    .add_recovery_with(&[("Z29C_RECOVERY_LEASE_MS", "2000")])
                    .await?;
            }
            // the request reached the destination and its answer was lost on the way: nobody
            // saw it, so recovery has something to ask about (and, for queryable, a status
            // query that hangs)
            run.executor(&[("Z29C_WORKERS", "1"), ("Z29C_CLAIM_BATCH", "1")])
                .await?;
            let faults = if cap == Cap::One(AdapterCapability::Queryable) {
                json!({ "drop_response": true, "query_delay_ms": 3_000 })
            } else {
                json!({ "drop_response": true })
            };
            run.cluster.set_faults("target", faults).await?;
            if opaque_target {
                run.allowance += 2;
            }
            run.submit("target", &target, "target", 2, policy(), None)
                .await?;
            run.wait_for(
                "SELECT count(*) FROM recovery_decisions",
                "a recovery decision",
                Duration::from_secs(20),
            )
            .await?;
            let owner: String = sqlx::query_scalar(
                "SELECT owner FROM recovery_decisions ORDER BY decided_at LIMIT 1",
            )
            .fetch_one(&run.pool)
            .await?;
            run.cluster
                .process(&owner)
                .context("deciding recovery")?
                .kill()
                .await?;
            run.cluster.set_faults("target", json!({})).await?;
            run.healthy(cap, 2).await?;
            run.cluster.wait_all_ended(&run.ids, long).await?;
            if cap == Cap::One(AdapterCapability::Queryable) {
                let owners = run
                    .count("SELECT count(DISTINCT owner) FROM recovery_decisions")
                    .await;
                run.expect(owners >= 2, "the surviving recovery did not take over");
            }
        }
        Fault::Poison => {
            run.executor(&[]).await?;
            run.cluster
                .set_faults("poison", json!({ "server_error": 503 }))
                .await?;
            let mut p = policy();
            p.max_attempts = 3;
            for i in 0..4 {
                run.submit(
                    &format!("poison-{i}"),
                    &target,
                    "poison",
                    1,
                    p.clone(),
                    None,
                )
                .await?;
                run.allowance += 1;
            }
            run.healthy(cap, 2).await?;
            run.cluster.wait_all_ended(&run.ids, long).await?;
            let in_review = run
                .count("SELECT count(*) FROM steps s JOIN workflows w ON w.id = s.workflow_id WHERE w.client_key LIKE 'poison-%' AND s.state = 'needs_review'")
                .await;
            run.expect(
                in_review == 4,
                format!("{in_review} of 4 poison steps in review"),
            );
            let too_many = run
                .count("SELECT count(*) FROM (SELECT step_id FROM attempts WHERE state <> 'released' GROUP BY step_id HAVING count(*) > 3) x")
                .await;
            run.expect(
                too_many == 0,
                "a poison step ran more attempts than max_attempts",
            );
            // retries are spaced by the capped, jittered backoff: never two attempts of one
            // step closer than the base delay
            let crowded = run
                .count(
                    "SELECT count(*) FROM (SELECT created_at - lag(updated_at) OVER w AS gap, lag(state) OVER w AS before FROM attempts WINDOW w AS (PARTITION BY step_id ORDER BY number)) x WHERE before = 'expired' AND gap < interval '250 milliseconds'",
                )
                .await;
            run.expect(
                crowded == 0,
                format!("{crowded} retries came sooner than the backoff allows"),
            );
            if cap.is_opaque() {
                let retried = run
                    .count("SELECT count(*) FROM (SELECT step_id FROM attempts WHERE invocation_began_at IS NOT NULL GROUP BY step_id HAVING count(*) > 1) x")
                    .await;
                run.expect(retried == 0, "an opaque poison step was retried");
            }
        }
        Fault::PostgresRestart => {
            run.executor(&[]).await?;
            run.executor(&[]).await?;
            run.cluster
                .set_faults("load", json!({ "answer_delay_ms": 200 }))
                .await?;
            for i in 0..12 {
                if cap.adapter(i) == "http-opaque" {
                    run.allowance += 2;
                }
                run.submit(
                    &format!("load-{i}"),
                    &cap.adapter(i),
                    "load",
                    2,
                    policy(),
                    None,
                )
                .await?;
            }
            tokio::time::sleep(Duration::from_millis(1_000)).await;
            pg.as_mut()
                .context("private PostgreSQL")?
                .crash_and_restart(Duration::from_millis(1_000))
                .await?;
            // the test's own pool reconnects by itself; wait for the services to answer
            run.healthy(cap, 6)
                .await
                .or_else(|_| Ok::<_, anyhow::Error>(()))?;
            run.cluster.wait_all_ended(&run.ids, long).await?;
            let mut dead = Vec::new();
            for p in &mut run.cluster.processes {
                if p.exited() {
                    dead.push(p.name.clone());
                }
            }
            run.expect(
                dead.is_empty(),
                format!("services died with PostgreSQL: {dead:?}"),
            );
        }
    }
    Ok(())
}

/// Whether a crash at `point` may leave an invocation without an answer.
fn may_have_invoked(point: CrashPoint) -> bool {
    point.checkpoint > Checkpoint::InvocationBegan
        || (point.checkpoint == Checkpoint::InvocationBegan
            && point.side == z29c_store::faults::Side::After)
}

fn faketime_library() -> Result<String> {
    for p in [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/faketime/libfaketime.so.1",
    ] {
        if std::path::Path::new(p).exists() {
            return Ok(p.to_owned());
        }
    }
    bail!("libfaketime not found: install the `faketime` package (scripts/services does)")
}

/// How far ahead of this process's clock the first timestamp in a service log is.
fn log_clock_skew(log: &std::path::Path) -> Result<chrono::Duration> {
    let text = std::fs::read_to_string(log)?;
    let now = chrono::Utc::now();
    for i in 0..text.len().saturating_sub(19) {
        if let Some(window) = text.get(i..i + 19)
            && let Ok(t) = chrono::NaiveDateTime::parse_from_str(window, "%Y-%m-%dT%H:%M:%S")
        {
            return Ok(t.and_utc() - now);
        }
    }
    bail!("no timestamp in {}", log.display())
}

/// `host:port` of a database URL.
fn upstream(url: &str) -> Result<String> {
    let u = reqwest::Url::parse(url)?;
    Ok(format!(
        "{}:{}",
        u.host_str().unwrap_or("127.0.0.1"),
        u.port().unwrap_or(5432)
    ))
}

/// The same database URL, through a local proxy port, in plaintext: the proxy reads the wire
/// protocol to find a `COMMIT`, which TLS (sqlx prefers it when the server offers it) hides.
fn via_proxy(url: &str, port: u16) -> Result<String> {
    let mut u = reqwest::Url::parse(url)?;
    u.set_host(Some("127.0.0.1"))?;
    u.set_port(Some(port))
        .map_err(|()| anyhow::anyhow!("cannot set a port on {url}"))?;
    crate::with_sslmode(u.as_str(), "disable")
}

/// Fails unless the `z29c` binary beside the harness was built with its fault points (a
/// build of `-p z29c-cli` alone has none, and every crash cell would wait in vain).
pub fn require_fault_build() -> Result<()> {
    let out = std::process::Command::new(crate::cluster::z29c_binary()?)
        .args(["executor", "--dump-config"])
        .output()?;
    if !String::from_utf8_lossy(&out.stdout).contains("fault_break_receipt_fencing") {
        bail!(
            "this z29c binary has no fault points: build it with the harness, \
             `cargo build -p z29c-cli -p z29c-scenarios`"
        );
    }
    Ok(())
}

/// Runs `cells`, `parallel` at a time, reporting each as it ends.
pub async fn run_cells(
    cells: Vec<Cell>,
    parallel: usize,
    switches: Switches,
    mut progress: impl FnMut(usize, usize, &CellResult),
) -> Vec<CellResult> {
    let gate = Arc::new(Semaphore::new(parallel.max(1)));
    let total = cells.len();
    let mut tasks = tokio::task::JoinSet::new();
    for cell in cells {
        let gate = gate.clone();
        tasks.spawn(async move {
            let _slot = gate.acquire_owned().await;
            let first = run_cell(cell, switches).await;
            match first.setup_failure() {
                // said in the log, so a start that keeps failing is seen even when it passes
                Some(why) => {
                    let why = why.to_owned();
                    let mut second = run_cell(cell, switches).await;
                    second.setup_retried = Some(why);
                    second
                }
                None => first,
            }
        });
    }
    let mut out = Vec::new();
    while let Some(r) = tasks.join_next().await {
        if let Ok(r) = r {
            progress(out.len() + 1, total, &r);
            out.push(r);
        }
    }
    out.sort_by_key(|r| r.cell);
    out
}

/// The matrix as a table: one row per fault, one column per capability; each cell says
/// which invariants held and how many steps completed.
pub fn table(results: &[CellResult]) -> String {
    let columns = [
        Cap::One(AdapterCapability::Idempotent),
        Cap::One(AdapterCapability::Queryable),
        Cap::One(AdapterCapability::Opaque),
        Cap::Mixed,
    ];
    let mut rows: BTreeMap<Fault, BTreeMap<Cap, &CellResult>> = BTreeMap::new();
    for r in results {
        rows.entry(r.cell.fault).or_default().insert(r.cell.cap, r);
    }
    let width = rows.keys().map(|f| f.to_string().len()).max().unwrap_or(10);
    let mut out = format!("{:width$}", "fault \\ adapter capability");
    for c in columns {
        out.push_str(&format!(" | {:22}", c.label()));
    }
    out.push('\n');
    out.push_str(&"-".repeat(width + columns.len() * 25));
    out.push('\n');
    for (fault, cells) in &rows {
        out.push_str(&format!("{:width$}", fault.to_string()));
        for c in columns {
            let text = match cells.get(&c) {
                None => String::new(),
                Some(r) if r.passed() => format!(
                    "ok {}/{} {:.0}s",
                    r.tally.completed,
                    r.tally.steps,
                    r.elapsed.as_secs_f64()
                ),
                Some(r) => {
                    let mut broken: Vec<&str> = Invariant::ALL
                        .iter()
                        .filter(|i| r.violations.iter().any(|v| v.invariant == **i))
                        .map(|i| i.label())
                        .collect();
                    if !r.expectations.is_empty() {
                        broken.push("expect");
                    }
                    format!("FAIL {}", broken.join(","))
                }
            };
            out.push_str(&format!(" | {text:22}"));
        }
        out.push('\n');
    }
    let passed = results.iter().filter(|r| r.passed()).count();
    out.push_str(&format!(
        "\n{passed}/{} cells passed. FAIL names the invariants of tests/src/history.rs broken, effects \
         counted in the destination's own records; ok n/m: steps completed of steps submitted, \
         after a person resolved what went to review from those records; every cell also \
         checks that its fault bit.\n",
        results.len()
    ));
    for r in results.iter().filter(|r| !r.passed()) {
        out.push_str(&format!("\n{}:\n{}", r.cell, r.verdict()));
    }
    out
}

/// The last `max` WARN and ERROR lines of the service logs in `dir` (bar the start-up notices
/// every test cluster prints), oldest first, each named by its log and cut to 300 characters.
fn logged_trouble(dir: &std::path::Path, max: usize) -> String {
    let mut lines: Vec<(String, String)> = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return String::new();
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.ends_with(".log") {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        for line in text.lines() {
            // every service warns at start that TLS and operator authentication are off
            let boilerplate = ["gRPC without TLS", "operator authentication is off"];
            if (line.contains(" WARN ") || line.contains(" ERROR "))
                && !boilerplate.iter().any(|b| line.contains(b))
            {
                let cut: String = line.chars().take(300).collect();
                // the timestamp leads each line: sorting on it interleaves the logs
                lines.push((cut, name.clone()));
            }
        }
    }
    lines.sort();
    let skip = lines.len().saturating_sub(max);
    lines
        .into_iter()
        .skip(skip)
        .map(|(line, log)| format!("    {log}: {line}\n"))
        .collect()
}
