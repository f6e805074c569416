//! The recorded history of a run and the checker of DESIGN.md §1's invariants.
//!
//! z29c's append-only tables already are a history: every claim, renewal, checkpoint, expiry
//! and decision is a `step_events` row with PostgreSQL's clock, and attempts, receipts, late
//! observations, recovery decisions and permits are kept. [`History::load`] reads them, with
//! the destination's ledger (what really happened outside), once the faults have healed;
//! [`History::check`] then judges the run on the history alone, never on what the harness
//! believes it did. [`History::save`] writes it as JSON beside the run's logs.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::Path;

use anyhow::Result;
use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;
use z29c_core::AdapterCapability;

/// One invariant of the fault matrix (DESIGN.md §1, issue 5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Invariant {
    /// No duplicate external effect for idempotent adapters, and every receipt names an effect
    /// the destination recorded under the same request identity.
    A,
    /// No receipt committed under a stale lease (superseded or expired).
    B,
    /// No step lost: each ended completed, failed by policy, or in review.
    C,
    /// An unknown outcome at an opaque adapter goes to review, never retried automatically.
    D,
    /// A stale worker's late result is only evidence.
    E,
    /// The permit limit is never exceeded.
    F,
    /// Enough steps completed that the run proves something.
    Progress,
}

impl Invariant {
    pub const ALL: [Invariant; 7] = [
        Invariant::A,
        Invariant::B,
        Invariant::C,
        Invariant::D,
        Invariant::E,
        Invariant::F,
        Invariant::Progress,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Invariant::A => "A",
            Invariant::B => "B",
            Invariant::C => "C",
            Invariant::D => "D",
            Invariant::E => "E",
            Invariant::F => "F",
            Invariant::Progress => "min",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Violation {
    pub invariant: Invariant,
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.invariant.label(), self.detail)
    }
}

/// What the run must show.
#[derive(Debug, Clone)]
pub struct Expect {
    /// Capability of each adapter name the run used.
    pub capabilities: BTreeMap<String, AdapterCapability>,
    /// Permits allowed in flight per adapter and operation class.
    pub permit_limit: i64,
    /// Completed steps below this fail the run.
    pub min_completed: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct StepRow {
    pub id: Uuid,
    pub workflow_id: Uuid,
    pub adapter: String,
    pub state: String,
    pub workflow_state: String,
    pub request_identity: Option<String>,
    pub max_attempts: i32,
}

#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct AttemptRow {
    pub id: Uuid,
    pub step_id: Uuid,
    pub lease_version: i64,
    pub owner: String,
    pub state: String,
    pub checkpoint: String,
    pub request_identity: Option<String>,
    pub created_at: DateTime<Utc>,
    pub invocation_began_at: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct ReceiptRow {
    pub step_id: Uuid,
    pub attempt_id: Option<Uuid>,
    pub lease_version: i64,
    pub request_identity: String,
    pub external_reference: Option<String>,
    pub outcome: String,
    pub verification: String,
    pub committed_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct LateRow {
    pub step_id: Uuid,
    pub attempt_id: Uuid,
    pub lease_version: i64,
    pub external_reference: Option<String>,
    pub fence_reason: serde_json::Value,
}

#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct EventRow {
    pub step_id: Uuid,
    pub lease_version: i64,
    pub owner: Option<String>,
    pub kind: String,
    pub expires_at: Option<DateTime<Utc>>,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct DecisionRow {
    pub step_id: Uuid,
    pub decision: String,
    pub category: String,
    pub owner: String,
    pub decided_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct LedgerRow {
    pub reference: String,
    pub idempotency_key: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct PermitRow {
    pub adapter: String,
    pub operation_class: String,
    pub acquired_at: DateTime<Utc>,
    /// When it stopped counting: released, or expired.
    pub until: DateTime<Utc>,
}

/// Everything a run left behind, as read after it healed.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct History {
    pub steps: Vec<StepRow>,
    pub attempts: Vec<AttemptRow>,
    pub receipts: Vec<ReceiptRow>,
    pub late_observations: Vec<LateRow>,
    pub events: Vec<EventRow>,
    pub decisions: Vec<DecisionRow>,
    pub open_reviews: Vec<Uuid>,
    pub integrity_conflicts: Vec<Uuid>,
    pub ledger: Vec<LedgerRow>,
    pub permits: Vec<PermitRow>,
}

/// Counts a reader of the matrix wants beside the verdict.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Tally {
    pub steps: usize,
    pub completed: usize,
    pub failed: usize,
    pub in_review: usize,
    pub recoveries: usize,
    pub late_observations: usize,
    pub effects: usize,
}

/// A lease may be judged expired at most this much late: a renewal that committed while the
/// receipt's transaction was starting carries a slightly later timestamp than the receipt.
const CLOCK_SLACK_MS: i64 = 250;

impl History {
    pub async fn load(pool: &PgPool) -> Result<Self> {
        Ok(Self {
            steps: sqlx::query_as(
                "SELECT s.id, s.workflow_id, s.adapter, s.state::text AS state,
                        w.state::text AS workflow_state, s.request_identity, s.max_attempts
                 FROM steps s JOIN workflows w ON w.id = s.workflow_id ORDER BY s.id",
            )
            .fetch_all(pool)
            .await?,
            attempts: sqlx::query_as(
                "SELECT id, step_id, lease_version, owner, state::text AS state,
                        checkpoint::text AS checkpoint, request_identity, created_at,
                        invocation_began_at
                 FROM attempts ORDER BY step_id, number",
            )
            .fetch_all(pool)
            .await?,
            receipts: sqlx::query_as(
                "SELECT step_id, attempt_id, lease_version, request_identity, external_reference,
                        outcome::text AS outcome, verification::text AS verification, committed_at
                 FROM step_receipts",
            )
            .fetch_all(pool)
            .await?,
            late_observations: sqlx::query_as(
                "SELECT step_id, attempt_id, lease_version, external_reference, fence_reason
                 FROM late_observations",
            )
            .fetch_all(pool)
            .await?,
            events: sqlx::query_as(
                "SELECT step_id, lease_version, owner, kind,
                        (detail->>'expires_at')::timestamptz AS expires_at, at
                 FROM step_events
                 WHERE kind IN ('lease_acquired', 'lease_renewed', 'recovery_lease_acquired',
                                'lease_expired')
                 ORDER BY id",
            )
            .fetch_all(pool)
            .await?,
            decisions: sqlx::query_as(
                "SELECT step_id, decision::text AS decision, category::text AS category, owner,
                        decided_at
                 FROM recovery_decisions ORDER BY decided_at",
            )
            .fetch_all(pool)
            .await?,
            open_reviews: sqlx::query_scalar(
                "SELECT step_id FROM review_items WHERE state = 'open'",
            )
            .fetch_all(pool)
            .await?,
            integrity_conflicts: sqlx::query_scalar("SELECT step_id FROM integrity_conflicts")
                .fetch_all(pool)
                .await?,
            ledger: sqlx::query_as("SELECT reference, idempotency_key FROM destination.ledger")
                .fetch_all(pool)
                .await
                .unwrap_or_default(),
            permits: sqlx::query_as(
                "SELECT adapter, operation_class, acquired_at,
                        least(coalesce(released_at, expires_at), expires_at) AS until
                 FROM adapter_permits",
            )
            .fetch_all(pool)
            .await?,
        })
    }

    /// Reads a history [`History::save`] wrote, to check it again.
    pub fn read(path: &Path) -> Result<Self> {
        Ok(serde_json::from_slice(&std::fs::read(path)?)?)
    }

    /// Writes the history as JSON, for the post-mortem of a failed cell.
    pub fn save(&self, path: &Path) -> Result<()> {
        std::fs::write(path, serde_json::to_vec_pretty(self)?)?;
        Ok(())
    }

    pub fn tally(&self) -> Tally {
        let count = |s: &str| self.steps.iter().filter(|x| x.state == s).count();
        Tally {
            steps: self.steps.len(),
            completed: count("completed"),
            failed: count("failed"),
            in_review: count("needs_review"),
            recoveries: self
                .events
                .iter()
                .filter(|e| e.kind == "recovery_lease_acquired")
                .count(),
            late_observations: self.late_observations.len(),
            effects: self.ledger.len(),
        }
    }

    /// Every violation of the invariants in this history; empty when the run is correct.
    pub fn check(&self, expect: &Expect) -> Vec<Violation> {
        let mut out = Vec::new();
        let mut v = |invariant, detail: String| out.push(Violation { invariant, detail });
        let capability = |adapter: &str| expect.capabilities.get(adapter).copied();
        let steps: HashMap<Uuid, &StepRow> = self.steps.iter().map(|s| (s.id, s)).collect();
        let receipts: HashMap<Uuid, &ReceiptRow> =
            self.receipts.iter().map(|r| (r.step_id, r)).collect();
        let open_reviews: BTreeSet<Uuid> = self.open_reviews.iter().copied().collect();

        // A: one effect per request identity; receipts name real effects
        let mut effects: BTreeMap<&str, usize> = BTreeMap::new();
        for l in &self.ledger {
            if let Some(k) = &l.idempotency_key {
                *effects.entry(k.as_str()).or_default() += 1;
            }
        }
        for (key, n) in &effects {
            if *n > 1 {
                v(
                    Invariant::A,
                    format!("request identity {key} has {n} external effects"),
                );
            }
        }
        let ledger: BTreeSet<(&str, &str)> = self
            .ledger
            .iter()
            .filter_map(|l| Some((l.reference.as_str(), l.idempotency_key.as_deref()?)))
            .collect();
        let mut references: BTreeMap<&str, usize> = BTreeMap::new();
        for r in &self.receipts {
            if r.outcome != "succeeded" || r.verification == "manual" {
                continue;
            }
            let reference = r.external_reference.as_deref().unwrap_or("");
            *references.entry(reference).or_default() += 1;
            if !ledger.contains(&(reference, r.request_identity.as_str())) {
                v(
                    Invariant::A,
                    format!(
                        "step {}: receipt names {reference:?}, which the destination has not recorded for {}",
                        r.step_id, r.request_identity
                    ),
                );
            }
        }
        for (reference, n) in references {
            if n > 1 {
                v(
                    Invariant::A,
                    format!("{n} receipts name the same external reference {reference}"),
                );
            }
        }

        // B: each receipt's lease was current (not superseded, not expired) when it committed
        for r in &self.receipts {
            if r.verification == "manual" {
                continue;
            }
            let events: Vec<&EventRow> = self
                .events
                .iter()
                .filter(|e| e.step_id == r.step_id)
                .collect();
            if let Some(newer) = events.iter().find(|e| {
                e.lease_version > r.lease_version
                    && e.at < r.committed_at
                    && matches!(
                        e.kind.as_str(),
                        "lease_acquired" | "recovery_lease_acquired"
                    )
            }) {
                v(
                    Invariant::B,
                    format!(
                        "step {}: receipt under lease version {} committed at {} after version {} was acquired by {:?} at {}",
                        r.step_id,
                        r.lease_version,
                        r.committed_at,
                        newer.lease_version,
                        newer.owner,
                        newer.at
                    ),
                );
                continue;
            }
            let expiry = events
                .iter()
                .filter(|e| e.lease_version == r.lease_version && e.at <= r.committed_at)
                .filter_map(|e| e.expires_at)
                .max();
            match expiry {
                Some(expiry)
                    if r.committed_at > expiry + Duration::milliseconds(CLOCK_SLACK_MS) =>
                {
                    v(
                        Invariant::B,
                        format!(
                            "step {}: receipt committed at {} under lease version {} that expired at {expiry}",
                            r.step_id, r.committed_at, r.lease_version
                        ),
                    );
                }
                Some(_) => {}
                None => v(
                    Invariant::B,
                    format!(
                        "step {}: receipt under lease version {} that the history never granted",
                        r.step_id, r.lease_version
                    ),
                ),
            }
        }

        // C: nothing lost
        for s in &self.steps {
            let ok = match s.state.as_str() {
                "completed" => receipts
                    .get(&s.id)
                    .is_some_and(|r| r.outcome == "succeeded"),
                "failed" => {
                    receipts.contains_key(&s.id)
                        || self
                            .decisions
                            .iter()
                            .any(|d| d.step_id == s.id && d.decision == "fail")
                        || s.workflow_state != "running"
                }
                "needs_review" => open_reviews.contains(&s.id),
                "cancelled" => s.workflow_state != "running",
                // waiting behind a step in review, or stopped with its workflow
                "blocked" => {
                    s.workflow_state != "running"
                        || self
                            .steps
                            .iter()
                            .any(|o| o.workflow_id == s.workflow_id && o.state == "needs_review")
                }
                _ => false,
            };
            if !ok {
                v(
                    Invariant::C,
                    format!(
                        "step {} is {} (workflow {}), receipt: {}, open review: {}",
                        s.id,
                        s.state,
                        s.workflow_state,
                        receipts.contains_key(&s.id),
                        open_reviews.contains(&s.id)
                    ),
                );
            }
        }
        for id in &open_reviews {
            if steps.get(id).is_some_and(|s| s.state != "needs_review")
                && !self.integrity_conflicts.contains(id)
            {
                v(
                    Invariant::C,
                    format!("step {id} has an open review item but is not in review"),
                );
            }
        }

        // D: opaque adapters are never sent the request twice by the machine
        for s in &self.steps {
            if capability(&s.adapter) != Some(AdapterCapability::Opaque) {
                continue;
            }
            // an attempt released after invocation began got a definite "not performed"
            // (429, connection refused, no permit): sending again is no repetition
            let invoked: Vec<&AttemptRow> = self
                .attempts
                .iter()
                .filter(|a| {
                    a.step_id == s.id && a.invocation_began_at.is_some() && a.state != "released"
                })
                .collect();
            if invoked.len() > 1 {
                v(
                    Invariant::D,
                    format!("opaque step {}: {} invocations began", s.id, invoked.len()),
                );
            }
            if !invoked.is_empty() && !receipts.contains_key(&s.id) && s.state != "needs_review" {
                v(
                    Invariant::D,
                    format!(
                        "opaque step {} has an unknown outcome and is {}, not in review",
                        s.id, s.state
                    ),
                );
            }
            if let Some(d) = self.decisions.iter().find(|d| {
                d.step_id == s.id
                    && matches!(d.decision.as_str(), "retry_same_identity" | "status_query")
            }) {
                v(
                    Invariant::D,
                    format!("opaque step {}: recovery decided {}", s.id, d.decision),
                );
            }
        }

        // E: late results are evidence only
        for l in &self.late_observations {
            if let Some(r) = receipts.get(&l.step_id)
                && r.attempt_id == Some(l.attempt_id)
                && r.lease_version == l.lease_version
                && r.verification == "direct"
            {
                v(
                    Invariant::E,
                    format!(
                        "step {}: attempt {} is both a receipt and a late observation",
                        l.step_id, l.attempt_id
                    ),
                );
            }
            if l.fence_reason.get("reason").is_none() {
                v(
                    Invariant::E,
                    format!("late observation for step {} has no reason", l.step_id),
                );
            }
            if let Some(r) = receipts.get(&l.step_id)
                && r.outcome == "succeeded"
                && l.external_reference.is_some()
                && l.external_reference != r.external_reference
                && !self.integrity_conflicts.contains(&l.step_id)
            {
                v(
                    Invariant::E,
                    format!(
                        "step {}: late reference {:?} contradicts the receipt's {:?} and no integrity conflict was recorded",
                        l.step_id, l.external_reference, r.external_reference
                    ),
                );
            }
        }

        // F: permits in flight never above the limit
        type Changes = Vec<(DateTime<Utc>, i32)>;
        let mut by_class: BTreeMap<(&str, &str), Changes> = BTreeMap::new();
        for p in &self.permits {
            let e = by_class
                .entry((p.adapter.as_str(), p.operation_class.as_str()))
                .or_default();
            e.push((p.acquired_at, 1));
            e.push((p.until, -1));
        }
        for ((adapter, class), mut points) in by_class {
            // at equal instants, a release comes before an acquisition
            points.sort();
            let (mut now, mut peak) = (0i64, 0i64);
            for (_, d) in points {
                now += i64::from(d);
                peak = peak.max(now);
            }
            if peak > expect.permit_limit {
                v(
                    Invariant::F,
                    format!(
                        "{adapter}/{class}: {peak} permits in flight, limit {}",
                        expect.permit_limit
                    ),
                );
            }
        }

        let t = self.tally();
        if t.completed < expect.min_completed {
            v(
                Invariant::Progress,
                format!(
                    "only {} of {} steps completed, {} needed",
                    t.completed, t.steps, expect.min_completed
                ),
            );
        }
        out
    }
}
