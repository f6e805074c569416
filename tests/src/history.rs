//! The recorded history of a run and the checker of z29c's invariants.
//!
//! Two records make a history. The outside world's: the destination's own database, which
//! never rolls back with z29c's, holds every request it received and every effect it
//! committed. z29c's: its append-only tables, where every claim, renewal, checkpoint, expiry
//! and decision is a `step_events` row with PostgreSQL's clock, and attempts, receipts, late
//! observations, recovery decisions and permits are kept. [`History::load`] reads both once
//! the faults have healed; [`History::check`] then judges the run on them alone, never on what
//! the harness believes it did. The money questions are asked of the outside world's record:
//! how many effects each step had, and how many requests reached an opaque route.
//! [`History::save`] writes it as JSON beside the run's logs.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::Path;

use anyhow::Result;
use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;
use z29c_core::AdapterCapability;

/// One invariant of the fault matrix (docs/design.md, Invariants).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Invariant {
    /// Effects, counted in the destination's ledger per step, are what the step's end says: a
    /// completed step has exactly one and its receipt names it; a failed, cancelled or never
    /// started step has none; a manual "succeeded REF" names an effect the ledger has.
    EffectMatchesEnd,
    /// No receipt committed under a stale lease (superseded or expired).
    NoStaleReceipt,
    /// No step lost: each ended completed, failed by policy, or in review.
    NoStepLost,
    /// An opaque request reaches the destination at most once; an unknown outcome at an
    /// opaque adapter goes to review, never retried automatically.
    OpaqueSentOnce,
    /// A stale worker's late result is only evidence.
    LateResultIsEvidence,
    /// The permit limit is never exceeded: not in the permits z29c granted, not in the
    /// requests the destination was processing at once.
    PermitLimitHeld,
    /// Enough steps completed that the run proves something.
    Progress,
}

impl Invariant {
    pub const ALL: [Invariant; 7] = [
        Invariant::EffectMatchesEnd,
        Invariant::NoStaleReceipt,
        Invariant::NoStepLost,
        Invariant::OpaqueSentOnce,
        Invariant::LateResultIsEvidence,
        Invariant::PermitLimitHeld,
        Invariant::Progress,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Invariant::EffectMatchesEnd => "effect-matches-end",
            Invariant::NoStaleReceipt => "no-stale-receipt",
            Invariant::NoStepLost => "no-step-lost",
            Invariant::OpaqueSentOnce => "opaque-sent-once",
            Invariant::LateResultIsEvidence => "late-result-is-evidence",
            Invariant::PermitLimitHeld => "permit-limit-held",
            Invariant::Progress => "min-completed",
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
    /// The workflow's client key and the step's name: with them, a request's body names its
    /// step (see [`step_token`]).
    pub client_key: String,
    pub name: String,
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

/// One effect the destination committed.
#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct LedgerRow {
    pub reference: String,
    pub idempotency_key: Option<String>,
    pub route: String,
    pub request_id: i64,
}

/// One request the destination received, effect or not.
#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct RequestRow {
    pub id: i64,
    pub received_at: DateTime<Utc>,
    pub mode: String,
    pub route: String,
    pub idempotency_key: Option<String>,
    pub body: serde_json::Value,
    /// Refused before anything was done (`rate_limited`, `server_error`), as only the
    /// destination knows.
    pub refused: Option<String>,
    /// When the destination was done with it (answered, or chose to stay silent); none if
    /// it never was (the destination died first).
    #[serde(default)]
    pub finished_at: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct PermitRow {
    pub adapter: String,
    pub operation_class: String,
    #[serde(default)]
    pub request_identity: Option<String>,
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
    pub requests: Vec<RequestRow>,
    pub permits: Vec<PermitRow>,
}

/// What the destination recorded for one step.
#[derive(Debug, Default)]
struct Seen<'a> {
    /// Every request it received for the step, effect or not.
    requests: Vec<&'a RequestRow>,
    /// The references of the effects it committed for the step.
    effects: Vec<&'a str>,
}

/// What a scenario workflow's step puts in its input so that the outside world's record names
/// it: `{"step": "<client key>/<step name>"}`. A step's identity at the destination must not
/// depend on z29c's request identities, which a broken build may get wrong.
pub fn step_token(client_key: &str, step: &str) -> String {
    format!("{client_key}/{step}")
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
    pub requests: usize,
}

/// A lease may be judged expired at most this much late: a renewal that committed while the
/// receipt's transaction was starting carries a slightly later timestamp than the receipt.
const CLOCK_SLACK_MS: i64 = 250;

impl History {
    /// Reads z29c's tables from `pool` and the destination's records from `ledger`.
    pub async fn load(pool: &PgPool, ledger: &PgPool) -> Result<Self> {
        Ok(Self {
            steps: sqlx::query_as(
                "SELECT s.id, s.workflow_id, w.client_key, s.name, s.adapter,
                        s.state::text AS state, w.state::text AS workflow_state,
                        s.request_identity, s.max_attempts
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
            ledger: sqlx::query_as(
                "SELECT reference, idempotency_key, route, request_id FROM destination.ledger
                 ORDER BY request_id",
            )
            .fetch_all(ledger)
            .await?,
            requests: sqlx::query_as(
                "SELECT id, received_at, mode, route, idempotency_key, body, refused, finished_at
                 FROM destination.requests ORDER BY id",
            )
            .fetch_all(ledger)
            .await?,
            permits: sqlx::query_as(
                "SELECT adapter, operation_class, request_identity, acquired_at,
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
            requests: self.requests.len(),
        }
    }

    /// The step a request was for: the one its body names, else the one whose request identity
    /// (the step's, or any of its attempts') it carried as its key.
    fn step_of(&self, request: &RequestRow) -> Option<Uuid> {
        if let Some(token) = request.body.get("step").and_then(serde_json::Value::as_str) {
            return self
                .steps
                .iter()
                .find(|s| step_token(&s.client_key, &s.name) == token)
                .map(|s| s.id);
        }
        let key = request.idempotency_key.as_deref()?;
        self.steps
            .iter()
            .find(|s| s.request_identity.as_deref() == Some(key))
            .map(|s| s.id)
            .or_else(|| {
                self.attempts
                    .iter()
                    .find(|a| a.request_identity.as_deref() == Some(key))
                    .map(|a| a.step_id)
            })
    }

    /// Per step, what the destination recorded for it; and the effects no step asked for.
    fn outside_world(&self) -> (HashMap<Uuid, Seen<'_>>, Vec<&LedgerRow>) {
        let mut per_step: HashMap<Uuid, Seen<'_>> = HashMap::new();
        let mut of_request: HashMap<i64, Uuid> = HashMap::new();
        for r in &self.requests {
            if let Some(step) = self.step_of(r) {
                of_request.insert(r.id, step);
                per_step.entry(step).or_default().requests.push(r);
            }
        }
        let mut orphans = Vec::new();
        for l in &self.ledger {
            match of_request.get(&l.request_id) {
                Some(step) => per_step
                    .entry(*step)
                    .or_default()
                    .effects
                    .push(l.reference.as_str()),
                None => orphans.push(l),
            }
        }
        (per_step, orphans)
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

        // effect-matches-end: effects counted where the outside world records them, per step
        let (world, orphans) = self.outside_world();
        let none = Seen::default();
        for l in orphans {
            v(
                Invariant::EffectMatchesEnd,
                format!(
                    "effect {} on route {} (key {:?}) belongs to no step",
                    l.reference, l.route, l.idempotency_key
                ),
            );
        }
        let all_references: BTreeSet<&str> =
            self.ledger.iter().map(|l| l.reference.as_str()).collect();
        for s in &self.steps {
            let effects = &world.get(&s.id).unwrap_or(&none).effects;
            let receipt = receipts.get(&s.id);
            match s.state.as_str() {
                "completed" => {
                    let Some(r) = receipt else { continue };
                    let reference = r.external_reference.as_deref().unwrap_or("");
                    if r.verification == "manual" {
                        // a person said so, having looked: the ledger must have what they named,
                        // for this step, and no second effect beside it
                        if !all_references.contains(reference) {
                            v(
                                Invariant::EffectMatchesEnd,
                                format!(
                                    "step {}: resolved by hand as succeeded with {reference:?}, which the destination never recorded",
                                    s.id
                                ),
                            );
                        } else if !effects.contains(&reference) || effects.len() > 1 {
                            v(
                                Invariant::EffectMatchesEnd,
                                format!(
                                    "step {}: resolved by hand as succeeded with {reference:?}; the destination recorded for it: {effects:?}",
                                    s.id
                                ),
                            );
                        }
                    } else if effects.len() != 1 || !effects.contains(&reference) {
                        v(
                            Invariant::EffectMatchesEnd,
                            format!(
                                "step {} completed with receipt {reference:?}; the destination recorded {} effect(s) for it: {effects:?}",
                                s.id,
                                effects.len()
                            ),
                        );
                    }
                }
                // a step that ended without a receipt of success must have left no effect
                // (leased and recovering steps are no-step-lost's: a run ends with none)
                "failed" | "cancelled" | "ready" | "blocked"
                    if !effects.is_empty() && !open_reviews.contains(&s.id) =>
                {
                    v(
                        Invariant::EffectMatchesEnd,
                        format!(
                            "step {} is {} (workflow {}) but the destination recorded {} effect(s) for it: {effects:?}",
                            s.id,
                            s.state,
                            s.workflow_state,
                            effects.len()
                        ),
                    );
                }
                _ => {}
            }
        }
        for r in &self.receipts {
            if r.outcome != "succeeded" || r.verification == "manual" {
                continue;
            }
            if steps
                .get(&r.step_id)
                .is_some_and(|s| s.state != "completed")
            {
                v(
                    Invariant::EffectMatchesEnd,
                    format!(
                        "step {}: a receipt of success, but the step is {}",
                        r.step_id,
                        steps.get(&r.step_id).map_or("", |s| s.state.as_str())
                    ),
                );
            }
        }

        // no-stale-receipt: each receipt's lease was current (not superseded, not expired) when it committed
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
                    Invariant::NoStaleReceipt,
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
                        Invariant::NoStaleReceipt,
                        format!(
                            "step {}: receipt committed at {} under lease version {} that expired at {expiry}",
                            r.step_id, r.committed_at, r.lease_version
                        ),
                    );
                }
                Some(_) => {}
                None => v(
                    Invariant::NoStaleReceipt,
                    format!(
                        "step {}: receipt under lease version {} that the history never granted",
                        r.step_id, r.lease_version
                    ),
                ),
            }
        }

        // no-step-lost: nothing lost
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
                    Invariant::NoStepLost,
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
                    Invariant::NoStepLost,
                    format!("step {id} has an open review item but is not in review"),
                );
            }
        }

        // opaque-sent-once: opaque requests reach the destination at most once, and what an opaque adapter
        // left unknown goes to review
        for s in &self.steps {
            if capability(&s.adapter) != Some(AdapterCapability::Opaque) {
                continue;
            }
            // a 429 is a definite "not performed" that only the destination can give: sending
            // again after it is no repetition
            let received: Vec<&RequestRow> = world
                .get(&s.id)
                .map(|seen| {
                    seen.requests
                        .iter()
                        .copied()
                        .filter(|r| r.refused.as_deref() != Some("rate_limited"))
                        .collect()
                })
                .unwrap_or_default();
            if received.len() > 1 {
                v(
                    Invariant::OpaqueSentOnce,
                    format!(
                        "opaque step {}: the destination received its request {} times (at {})",
                        s.id,
                        received.len(),
                        received
                            .iter()
                            .map(|r| r.received_at.format("%H:%M:%S%.3f").to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                );
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
                    Invariant::OpaqueSentOnce,
                    format!("opaque step {}: {} invocations began", s.id, invoked.len()),
                );
            }
            if !invoked.is_empty() && !receipts.contains_key(&s.id) && s.state != "needs_review" {
                v(
                    Invariant::OpaqueSentOnce,
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
                    Invariant::OpaqueSentOnce,
                    format!("opaque step {}: recovery decided {}", s.id, d.decision),
                );
            }
        }

        // late-result-is-evidence: late results are evidence only
        for l in &self.late_observations {
            if let Some(r) = receipts.get(&l.step_id)
                && r.attempt_id == Some(l.attempt_id)
                && r.lease_version == l.lease_version
                && r.verification == "direct"
            {
                v(
                    Invariant::LateResultIsEvidence,
                    format!(
                        "step {}: attempt {} is both a receipt and a late observation",
                        l.step_id, l.attempt_id
                    ),
                );
            }
            if l.fence_reason.get("reason").is_none() {
                v(
                    Invariant::LateResultIsEvidence,
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
                    Invariant::LateResultIsEvidence,
                    format!(
                        "step {}: late reference {:?} contradicts the receipt's {:?} and no integrity conflict was recorded",
                        l.step_id, l.external_reference, r.external_reference
                    ),
                );
            }
        }

        // permit-limit-held: permits in flight never above the limit
        type Changes = Vec<(DateTime<Utc>, i32)>;
        let mut by_class: BTreeMap<(&str, &str), Changes> = BTreeMap::new();
        for p in &self.permits {
            let e = by_class
                .entry((p.adapter.as_str(), p.operation_class.as_str()))
                .or_default();
            e.push((p.acquired_at, 1));
            e.push((p.until, -1));
        }
        for ((adapter, class), points) in by_class {
            let peak = most_at_once(points);
            if peak > expect.permit_limit {
                v(
                    Invariant::PermitLimitHeld,
                    format!(
                        "{adapter}/{class}: {peak} permits in flight, limit {}",
                        expect.permit_limit
                    ),
                );
            }
        }

        // F as the destination saw it: the requests of one route it was processing at once.
        // Each counts until it finished, or until the permit it was sent under stopped
        // counting if that came first (a permit held for an unknown outcome runs out after
        // its safety window, and the limit then lets another call begin beside a request
        // still being processed). A request no permit covered counts until it finished.
        let mut by_route: BTreeMap<(&str, &str), Changes> = BTreeMap::new();
        for r in &self.requests {
            let covered_until = self
                .permits
                .iter()
                .filter(|p| {
                    p.request_identity.is_some()
                        && p.request_identity == r.idempotency_key
                        && p.acquired_at <= r.received_at
                })
                .max_by_key(|p| p.acquired_at)
                .map(|p| p.until);
            let finished = r.finished_at.unwrap_or(r.received_at);
            let until = covered_until.map_or(finished, |u| u.min(finished));
            let e = by_route
                .entry((r.mode.as_str(), r.route.as_str()))
                .or_default();
            e.push((r.received_at, 1));
            e.push((until.max(r.received_at), -1));
        }
        for ((mode, route), points) in by_route {
            let peak = most_at_once(points);
            if peak > expect.permit_limit {
                v(
                    Invariant::PermitLimitHeld,
                    format!(
                        "the destination processed {peak} requests of {mode}/{route} at once, limit {}",
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

/// The most intervals open at once, given each as `(start, 1)` and `(end, -1)`; at equal
/// instants an end comes before a start.
fn most_at_once(mut points: Vec<(DateTime<Utc>, i32)>) -> i64 {
    points.sort();
    let (mut now, mut peak) = (0i64, 0i64);
    for (_, d) in points {
        now += i64::from(d);
        peak = peak.max(now);
    }
    peak
}

#[cfg(test)]
mod tests {
    //! The checker over synthetic histories: each bad history must be caught by the invariant
    //! that names its fault, and the good one by none.

    use super::*;

    const OPAQUE: &str = "http-opaque";
    const IDEMPOTENT: &str = "http-idempotent";

    fn expect() -> Expect {
        Expect {
            capabilities: AdapterCapability::ALL
                .iter()
                .map(|c| (format!("http-{c}"), *c))
                .collect(),
            permit_limit: 8,
            min_completed: 0,
        }
    }

    fn at(ms: i64) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(1_800_000_000_000 + ms).unwrap()
    }

    fn id(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    /// One step of workflow `wf-<n>`, in `state`, with its identity `key-<n>`.
    fn step(n: u128, adapter: &str, state: &str, workflow_state: &str) -> StepRow {
        StepRow {
            id: id(n),
            workflow_id: id(1000 + n),
            client_key: format!("wf-{n}"),
            name: "s0".into(),
            adapter: adapter.into(),
            state: state.into(),
            workflow_state: workflow_state.into(),
            request_identity: Some(format!("key-{n}")),
            max_attempts: 4,
        }
    }

    /// A request for step `n` received at `ms`, with its effect `reference` if it had one.
    fn request(h: &mut History, n: u128, ms: i64, reference: Option<&str>) {
        let rid = h.requests.len() as i64 + 1;
        h.requests.push(RequestRow {
            id: rid,
            received_at: at(ms),
            mode: "idempotent".into(),
            route: "target".into(),
            idempotency_key: Some(format!("key-{n}")),
            body: serde_json::json!({ "n": 0, "step": step_token(&format!("wf-{n}"), "s0") }),
            refused: None,
            finished_at: Some(at(ms + 100)),
        });
        if let Some(reference) = reference {
            h.ledger.push(LedgerRow {
                reference: reference.into(),
                idempotency_key: Some(format!("key-{n}")),
                route: "target".into(),
                request_id: rid,
            });
        }
    }

    fn granted(h: &mut History, n: u128, version: i64, ms: i64) {
        h.events.push(EventRow {
            step_id: id(n),
            lease_version: version,
            owner: Some("executor-1".into()),
            kind: "lease_acquired".into(),
            expires_at: Some(at(ms + 1_500)),
            at: at(ms),
        });
    }

    fn attempt(h: &mut History, n: u128, number: u128, state: &str, invoked: bool) {
        h.attempts.push(AttemptRow {
            id: id(100 * n + number),
            step_id: id(n),
            lease_version: number as i64,
            owner: "executor-1".into(),
            state: state.into(),
            checkpoint: if invoked {
                "invocation_began".into()
            } else {
                "request_identity_persisted".into()
            },
            request_identity: Some(format!("key-{n}")),
            created_at: at(0),
            invocation_began_at: invoked.then(|| at(10)),
        });
    }

    fn receipt(h: &mut History, n: u128, reference: &str, verification: &str) {
        h.receipts.push(ReceiptRow {
            step_id: id(n),
            attempt_id: Some(id(100 * n + 1)),
            lease_version: 1,
            request_identity: format!("key-{n}"),
            external_reference: Some(reference.into()),
            outcome: "succeeded".into(),
            verification: verification.into(),
            committed_at: at(100),
        });
    }

    /// Step 1 completed with one effect that its receipt names.
    fn good() -> History {
        let mut h = History::default();
        h.steps.push(step(1, IDEMPOTENT, "completed", "completed"));
        granted(&mut h, 1, 1, 0);
        attempt(&mut h, 1, 1, "succeeded", true);
        request(&mut h, 1, 20, Some("dst-1"));
        receipt(&mut h, 1, "dst-1", "direct");
        h
    }

    fn broken(h: &History) -> BTreeSet<Invariant> {
        h.check(&expect())
            .into_iter()
            .map(|v| v.invariant)
            .collect()
    }

    #[test]
    fn a_run_whose_ledger_matches_its_end_passes() {
        assert_eq!(
            good().check(&expect()).len(),
            0,
            "{:?}",
            good().check(&expect())
        );
    }

    #[test]
    fn a_duplicate_effect_for_one_step_is_caught_whatever_its_keys() {
        let mut h = good();
        // a retry under a new request identity: the destination cannot de-duplicate it
        request(&mut h, 1, 500, Some("dst-2"));
        h.requests[1].idempotency_key = Some("another-key".into());
        h.ledger[1].idempotency_key = Some("another-key".into());
        assert!(
            broken(&h).contains(&Invariant::EffectMatchesEnd),
            "{:?}",
            h.check(&expect())
        );
    }

    #[test]
    fn a_receipt_naming_an_effect_the_ledger_lacks_is_caught() {
        let mut h = good();
        h.receipts[0].external_reference = Some("made-up".into());
        assert!(broken(&h).contains(&Invariant::EffectMatchesEnd));
    }

    #[test]
    fn a_failed_step_with_an_effect_is_caught() {
        let mut h = History::default();
        h.steps.push(step(2, IDEMPOTENT, "failed", "failed"));
        h.decisions.push(DecisionRow {
            step_id: id(2),
            decision: "fail".into(),
            category: "identity_not_invoked".into(),
            owner: "recovery-1".into(),
            decided_at: at(3_000),
        });
        attempt(&mut h, 2, 1, "expired", true);
        attempt(&mut h, 2, 2, "expired", false);
        request(&mut h, 2, 20, Some("dst-9"));
        assert!(
            broken(&h).contains(&Invariant::EffectMatchesEnd),
            "{:?}",
            h.check(&expect())
        );
    }

    #[test]
    fn a_cancelled_step_with_an_effect_is_caught_but_one_in_review_is_not() {
        let mut h = History::default();
        h.steps.push(step(3, IDEMPOTENT, "cancelled", "cancelled"));
        attempt(&mut h, 3, 1, "expired", true);
        request(&mut h, 3, 20, Some("dst-3"));
        assert!(broken(&h).contains(&Invariant::EffectMatchesEnd));
        h.steps[0].state = "needs_review".into();
        h.open_reviews.push(id(3));
        assert!(
            !broken(&h).contains(&Invariant::EffectMatchesEnd),
            "{:?}",
            h.check(&expect())
        );
    }

    #[test]
    fn an_opaque_request_received_twice_is_caught_even_in_review() {
        let mut h = History::default();
        h.steps.push(step(4, OPAQUE, "needs_review", "running"));
        h.open_reviews.push(id(4));
        attempt(&mut h, 4, 1, "expired", true);
        request(&mut h, 4, 20, None);
        assert!(broken(&h).is_empty(), "{:?}", h.check(&expect()));
        // the second request failed at the destination: it reached it all the same
        request(&mut h, 4, 900, None);
        h.requests[1].refused = Some("server_error".into());
        assert!(broken(&h).contains(&Invariant::OpaqueSentOnce));
        // a 429 is a definite "not performed": sending again after it is allowed
        h.requests[1].refused = Some("rate_limited".into());
        assert!(
            !broken(&h).contains(&Invariant::OpaqueSentOnce),
            "{:?}",
            h.check(&expect())
        );
    }

    #[test]
    fn a_manual_success_must_name_an_effect_the_ledger_has() {
        let mut h = History::default();
        h.steps.push(step(5, OPAQUE, "completed", "completed"));
        attempt(&mut h, 5, 1, "expired", true);
        request(&mut h, 5, 20, Some("dst-5"));
        receipt(&mut h, 5, "dst-5", "manual");
        assert!(broken(&h).is_empty(), "{:?}", h.check(&expect()));
        h.receipts[0].external_reference = Some("what-the-person-guessed".into());
        assert!(broken(&h).contains(&Invariant::EffectMatchesEnd));
    }

    #[test]
    fn an_effect_no_step_asked_for_is_caught() {
        let mut h = good();
        h.requests.push(RequestRow {
            id: 99,
            received_at: at(5),
            mode: "opaque".into(),
            route: "target".into(),
            idempotency_key: Some("nobody".into()),
            body: serde_json::json!({}),
            refused: None,
            finished_at: None,
        });
        h.ledger.push(LedgerRow {
            reference: "dst-99".into(),
            idempotency_key: Some("nobody".into()),
            route: "target".into(),
            request_id: 99,
        });
        assert!(broken(&h).contains(&Invariant::EffectMatchesEnd));
    }

    #[test]
    fn a_completed_step_with_no_effect_is_caught() {
        let mut h = good();
        h.ledger.clear();
        assert!(broken(&h).contains(&Invariant::EffectMatchesEnd));
    }

    #[test]
    fn more_requests_processed_at_once_than_the_limit_is_caught_at_the_destination() {
        // nine steps' requests overlap at the destination, limit 8; z29c's permit table has
        // no row for them (a build that sends without a permit)
        let mut h = History::default();
        for n in 0..9 {
            h.steps.push(step(n, IDEMPOTENT, "completed", "completed"));
            request(&mut h, n, 10 * n as i64, None);
            h.requests[n as usize].finished_at = Some(at(1_000));
        }
        let found = h.check(&expect());
        assert!(
            found
                .iter()
                .any(|v| v.invariant == Invariant::PermitLimitHeld && v.detail.contains("at once")),
            "{found:?}"
        );
        // one of them finished before the ninth arrived: eight at most
        h.requests[0].finished_at = Some(at(50));
        let found = h.check(&expect());
        assert!(
            !found
                .iter()
                .any(|v| v.invariant == Invariant::PermitLimitHeld),
            "{found:?}"
        );
    }

    #[test]
    fn a_request_outliving_its_permit_does_not_count_past_it() {
        // each request runs on after its permit ran out (its safety window ended), and the
        // next permit was granted then: never more than one permit, nine slow requests
        let mut h = History::default();
        for n in 0..9 {
            h.steps.push(step(n, IDEMPOTENT, "completed", "completed"));
            let ms = 100 * n as i64;
            request(&mut h, n, ms + 1, None);
            h.requests[n as usize].finished_at = Some(at(5_000));
            h.permits.push(PermitRow {
                adapter: IDEMPOTENT.into(),
                operation_class: "target".into(),
                request_identity: Some(format!("key-{n}")),
                acquired_at: at(ms),
                until: at(ms + 100),
            });
        }
        let found = h.check(&Expect {
            permit_limit: 1,
            ..expect()
        });
        assert!(
            !found
                .iter()
                .any(|v| v.invariant == Invariant::PermitLimitHeld),
            "{found:?}"
        );
        // the same requests, their permits still counting: nine at once
        for p in &mut h.permits {
            p.until = at(5_000);
        }
        let found = h.check(&Expect {
            permit_limit: 1,
            ..expect()
        });
        assert!(
            found
                .iter()
                .any(|v| v.invariant == Invariant::PermitLimitHeld),
            "{found:?}"
        );
    }
}
