//! The review queue: steps whose outcome only a person can establish. A resolution is a
//! compare-and-set on the item's version, needs a reason, takes the step's lease first (so no
//! stale worker can write after it), and is audited in the same transaction.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};
use uuid::Uuid;
use z29c_core::fence::FencedWrite;
use z29c_core::{
    AttemptId, Checkpoint, ExternalReference, InputDigest, LeaseClaim, LeaseKind, LeaseVersion,
    Outcome, OwnerId, RequestIdentity, StepId, Verification,
};

use crate::events::{self, EventKind, NewEvent};
use crate::leases::{Observed, finish_step};
use crate::outbox::{self, MessageKind};
use crate::{Result, Store, StoreError, fence};

/// One page of the review queue ([`Store::review_page`]).
#[derive(Debug, Clone)]
pub struct ReviewPage {
    pub items: Vec<ReviewItem>,
    /// The item to continue after; none on the last page.
    pub next: Option<Uuid>,
}

/// An item of the review queue.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct ReviewItem {
    pub id: Uuid,
    pub workflow_id: Uuid,
    pub step_id: Uuid,
    pub step_name: String,
    pub request_identity: Option<String>,
    pub reason: String,
    pub state: String,
    pub version: i64,
    pub created_at: DateTime<Utc>,
    /// Everything z29c holds about the step, oldest first: what a person decides from.
    #[sqlx(skip)]
    pub evidence: Vec<ReviewEvidence>,
}

/// One piece of what z29c holds about a step: an attempt (with whether it may have sent its
/// request and the answer recorded on it), a late observation, or a recovery decision.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct ReviewEvidence {
    #[serde(skip)]
    pub step_id: Uuid,
    pub at: DateTime<Utc>,
    /// `attempt`, `late_observation` or `recovery_decision`.
    pub kind: String,
    /// The attempt's number (the attempt a late observation or a decision concerns).
    pub attempt: Option<i32>,
    pub request_identity: Option<String>,
    /// Whether the attempt may have sent its request (attempts only).
    pub may_have_sent: Option<bool>,
    pub outcome: Option<String>,
    pub external_reference: Option<String>,
    /// What it says, in words.
    pub summary: String,
}

/// The counts behind the step- and workflow-level gauges (see [`Store::knowledge`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Knowledge {
    pub open_reviews: i64,
    pub integrity_conflicts: i64,
    /// External references that more than one receipt names: each is a duplicate effect.
    pub duplicate_references: i64,
    /// `(state, count)` for every workflow state present.
    pub workflows_by_state: Vec<(String, i64)>,
}

/// What a person decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// The effect happened; this is the external system's reference for it.
    Succeeded(ExternalReference),
    /// The effect did not happen and will not be retried.
    Failed,
    /// Send again with the same request identity.
    RetrySameIdentity,
}

impl Resolution {
    const fn as_str(&self) -> &'static str {
        match self {
            Self::Succeeded(_) => "succeeded",
            Self::Failed => "failed",
            Self::RetrySameIdentity => "retry_same_identity",
        }
    }
}

/// A resolution as audited.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct AuditEntry {
    pub id: Uuid,
    pub item_id: Uuid,
    pub resolved_by: String,
    pub resolution: String,
    pub external_reference: Option<String>,
    pub reason: String,
    pub prior_state: String,
    pub prior_version: i64,
    pub resolved_at: DateTime<Utc>,
}

#[derive(sqlx::FromRow)]
struct ItemRow {
    step_id: Uuid,
    state: String,
    version: i64,
}

impl Store {
    /// Review items, newest first; open ones only unless `include_resolved`.
    pub async fn review_items(
        &self,
        include_resolved: bool,
        limit: i64,
    ) -> Result<Vec<ReviewItem>> {
        Ok(self.review_page(include_resolved, limit, None).await?.items)
    }

    /// One page of the review queue, newest first: at most `limit` items after item `after`
    /// (the last of the previous page), and the item to continue after when more remain.
    pub async fn review_page(
        &self,
        include_resolved: bool,
        limit: i64,
        after: Option<Uuid>,
    ) -> Result<ReviewPage> {
        let limit = limit.max(1);
        let mut items: Vec<ReviewItem> = sqlx::query_as(
            "SELECT r.id, r.workflow_id, r.step_id, s.name AS step_name, r.request_identity,
                    r.reason, r.state, r.version, r.created_at
             FROM review_items r JOIN steps s ON s.id = r.step_id
             WHERE ($1 OR r.state = 'open')
               AND ($3::uuid IS NULL
                    OR (r.created_at, r.id) < (SELECT p.created_at, p.id
                                               FROM review_items p WHERE p.id = $3))
             ORDER BY r.created_at DESC, r.id DESC LIMIT $2 + 1",
        )
        .bind(include_resolved)
        .bind(limit)
        .bind(after)
        .fetch_all(&self.pool)
        .await?;
        let more = items.len() as i64 > limit;
        items.truncate(limit as usize);
        let next = if more {
            items.last().map(|i| i.id)
        } else {
            None
        };
        Ok(ReviewPage {
            items: self.with_evidence(items).await?,
            next,
        })
    }

    pub async fn review_item(&self, id: Uuid) -> Result<ReviewItem> {
        let item: ReviewItem = sqlx::query_as(
            "SELECT r.id, r.workflow_id, r.step_id, s.name AS step_name, r.request_identity,
                    r.reason, r.state, r.version, r.created_at
             FROM review_items r JOIN steps s ON s.id = r.step_id WHERE r.id = $1",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await?
        .ok_or(StoreError::NotFound {
            what: "review item",
        })?;
        let mut items = self.with_evidence(vec![item]).await?;
        Ok(items.remove(0))
    }

    /// Fills each item's evidence: every attempt of its step, every late observation and
    /// every recovery decision, in one statement for the page.
    async fn with_evidence(&self, mut items: Vec<ReviewItem>) -> Result<Vec<ReviewItem>> {
        let steps: Vec<Uuid> = items.iter().map(|i| i.step_id).collect();
        let evidence: Vec<ReviewEvidence> = sqlx::query_as(
            "SELECT a.step_id, a.created_at AS at, 'attempt' AS kind, a.number AS attempt,
                    a.request_identity,
                    z29c_attempt_may_have_sent(a.checkpoint, a.state) AS may_have_sent,
                    a.observed_result->>'outcome' AS outcome,
                    a.observed_result->>'external_reference' AS external_reference,
                    format('attempt %s by %s, %s at %s: %s', a.number, a.owner, a.state,
                        a.checkpoint,
                        CASE WHEN a.observed_result IS NOT NULL
                                 THEN 'the answer was recorded'
                             WHEN z29c_attempt_may_have_sent(a.checkpoint, a.state)
                                 THEN 'its request may have been sent; no answer recorded'
                             WHEN a.checkpoint >= 'invocation_began'
                                 THEN 'told its request was not performed'
                             ELSE 'sent nothing' END) AS summary
             FROM attempts a WHERE a.step_id = ANY($1)
             UNION ALL
             SELECT l.step_id, l.observed_at, 'late_observation', a.number, l.request_identity,
                    NULL, l.outcome::text, l.external_reference,
                    format('an answer seen after its lease had moved on (by %s): %s',
                        l.owner, l.outcome)
             FROM late_observations l LEFT JOIN attempts a ON a.id = l.attempt_id
             WHERE l.step_id = ANY($1)
             UNION ALL
             SELECT d.step_id, d.decided_at, 'recovery_decision', a.number, NULL, NULL, NULL,
                    NULL,
                    format('recovery (%s): %s, as %s%s', d.owner, d.decision, d.category,
                        coalesce(': ' || (d.detail->>'reason'), ''))
             FROM recovery_decisions d LEFT JOIN attempts a ON a.id = d.attempt_id
             WHERE d.step_id = ANY($1)
             ORDER BY 2, 3",
        )
        .bind(&steps)
        .fetch_all(&self.pool)
        .await?;
        for item in &mut items {
            item.evidence = evidence
                .iter()
                .filter(|e| e.step_id == item.step_id)
                .cloned()
                .collect();
        }
        Ok(items)
    }

    /// What the step- and workflow-level gauges show: open review items, integrity conflicts,
    /// external references named by more than one receipt, and workflows by state.
    pub async fn knowledge(&self) -> Result<Knowledge> {
        let (open_reviews, integrity_conflicts, duplicate_references): (i64, i64, i64) =
            sqlx::query_as(
                "SELECT (SELECT count(*) FROM review_items WHERE state = 'open'),
                        (SELECT count(*) FROM integrity_conflicts),
                        (SELECT count(*) FROM (SELECT external_reference FROM step_receipts
                                               WHERE external_reference IS NOT NULL
                                               GROUP BY external_reference
                                               HAVING count(*) > 1) d)",
            )
            .fetch_one(&self.pool)
            .await?;
        let workflows_by_state = sqlx::query_as(
            "SELECT state::text, count(*) FROM workflows GROUP BY state ORDER BY state",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(Knowledge {
            open_reviews,
            integrity_conflicts,
            duplicate_references,
            workflows_by_state,
        })
    }

    /// The audit trail of one item.
    pub async fn review_audit(&self, item: Uuid) -> Result<Vec<AuditEntry>> {
        Ok(sqlx::query_as(
            "SELECT id, item_id, resolved_by, resolution, external_reference, reason,
                    prior_state, prior_version, resolved_at
             FROM review_resolutions WHERE item_id = $1 ORDER BY resolved_at",
        )
        .bind(item)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Resolves an open item at `expected_version`. A missing reason is `Invalid`; an item that
    /// is not open or has moved on is `Conflict`. The step's lease is taken first, then the
    /// resolution is applied, the item closed, and the audit row written — one transaction.
    pub async fn resolve_review(
        &self,
        item: Uuid,
        expected_version: i64,
        who: &str,
        reason: &str,
        resolution: &Resolution,
    ) -> Result<ReviewItem> {
        self.resolve_review_found(item, expected_version, who, reason, resolution, None)
            .await
    }

    /// [`Store::resolve_review`], with the result the person found for a step that succeeded:
    /// its receipt holds it, and the steps that depend on it may refer to it as to an
    /// answer's. Without one, the receipt records who resolved it and why.
    pub async fn resolve_review_found(
        &self,
        item: Uuid,
        expected_version: i64,
        who: &str,
        reason: &str,
        resolution: &Resolution,
        found: Option<Value>,
    ) -> Result<ReviewItem> {
        self.resolve_review_audited(item, expected_version, who, reason, resolution, found, None)
            .await
    }

    /// [`Store::resolve_review_found`], with `audit` (the allowed call that asked for it)
    /// written to the audit log in the resolution's transaction, beside its `review_resolutions`
    /// row: a decision that commits is on record even if its service dies before answering.
    #[expect(
        clippy::too_many_arguments,
        reason = "resolve_review_found's arguments and the call's audit entry"
    )]
    pub async fn resolve_review_audited(
        &self,
        item: Uuid,
        expected_version: i64,
        who: &str,
        reason: &str,
        resolution: &Resolution,
        found: Option<Value>,
        audit: Option<&crate::audit::AuditEntry>,
    ) -> Result<ReviewItem> {
        if found.is_some() && !matches!(resolution, Resolution::Succeeded(_)) {
            return Err(StoreError::invalid(
                "result_json",
                "a result is recorded only with a resolution as succeeded",
            ));
        }
        if reason.trim().is_empty() {
            return Err(StoreError::invalid("reason", "a resolution needs a reason"));
        }
        let owner = OwnerId::parse(format!("review:{who}"))
            .map_err(|e| StoreError::invalid("resolved_by", e.reason))?;
        let mut tx = self.begin().await?;
        let row: ItemRow = sqlx::query_as(
            "SELECT step_id, state, version FROM review_items WHERE id = $1 FOR UPDATE",
        )
        .bind(item)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or(StoreError::NotFound {
            what: "review item",
        })?;
        if row.state != "open" {
            return Err(StoreError::Conflict(format!(
                "review item is {}",
                row.state
            )));
        }
        if row.version != expected_version {
            return Err(StoreError::Conflict(format!(
                "review item is at version {}, not {expected_version}",
                row.version
            )));
        }
        if matches!(resolution, Resolution::Succeeded(_)) && found.is_none() {
            needs_no_result(&mut tx, row.step_id).await?;
        }
        // a person's decision takes the step's lease like any other writer, fencing out
        // every earlier holder
        let taken: Option<(i64, Option<Uuid>)> = sqlx::query_as(
            "UPDATE steps SET state = 'recovering', lease_owner = $2,
                 lease_version = lease_version + 1, leased_at = now(),
                 expires_at = now() + interval '1 minute', updated_at = now()
             WHERE id = $1 AND state = 'needs_review'
             RETURNING lease_version, current_attempt_id",
        )
        .bind(row.step_id)
        .bind(owner.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        let Some((version, attempt)) = taken else {
            // an item about a step that already has its receipt (an integrity conflict) can only
            // be acknowledged: the receipt is append-only, the person's reading is audited
            let has_receipt: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM step_receipts WHERE step_id = $1)",
            )
            .bind(row.step_id)
            .fetch_one(&mut *tx)
            .await?;
            if !has_receipt || !matches!(resolution, Resolution::Succeeded(_)) {
                return Err(StoreError::Conflict(
                    "the step no longer awaits review".into(),
                ));
            }
            close_and_audit(&mut tx, item, &row, who, reason, resolution, audit).await?;
            tx.commit().await?;
            return self.review_item(item).await;
        };
        let claim = LeaseClaim {
            step: StepId::from_uuid(row.step_id),
            attempt: attempt.map_or_else(AttemptId::new, AttemptId::from_uuid),
            owner,
            version: LeaseVersion::new(version).map_err(|e| StoreError::Corrupt(e.to_string()))?,
            kind: LeaseKind::Recovery,
        };
        let write = match resolution {
            Resolution::RetrySameIdentity => FencedWrite::Release,
            _ => FencedWrite::Advance(Checkpoint::ReceiptCommitted),
        };
        let held = fence::fence(&mut tx, &claim, write).await?;
        let identity = held.request_identity.clone();
        let external_reference = match resolution {
            Resolution::Succeeded(r) => Some(r.clone()),
            _ => None,
        };
        match resolution {
            Resolution::Succeeded(_) | Resolution::Failed => {
                let request_identity = RequestIdentity::parse(identity.clone().unwrap_or_default())
                    .map_err(|_| StoreError::invalid("step", "the step has no request identity"))?;
                let observed = Observed {
                    request_identity,
                    input_digest: InputDigest::parse(held.input_digest.clone())
                        .map_err(|e| StoreError::Corrupt(e.to_string()))?,
                    adapter_version: "manual".into(),
                    outcome: if external_reference.is_some() {
                        Outcome::Succeeded
                    } else {
                        Outcome::Failed
                    },
                    external_reference: external_reference.clone(),
                    result: found
                        .clone()
                        .unwrap_or_else(|| json!({ "resolved_by": who, "reason": reason })),
                    seen: None,
                };
                finish_step(
                    &mut tx,
                    &claim,
                    &held,
                    attempt,
                    &observed,
                    Verification::Manual,
                )
                .await?;
            }
            Resolution::RetrySameIdentity => {
                // a step made ready in an ended workflow is never claimed again, and its
                // possible effect would be left with no open review
                let running: bool = sqlx::query_scalar(
                    "SELECT state = 'running' FROM workflows WHERE id = $1 FOR SHARE",
                )
                .bind(held.workflow)
                .fetch_one(&mut *tx)
                .await?;
                if !running {
                    return Err(StoreError::Conflict(
                        "the workflow has ended, so nothing will send the request again: resolve as succeeded (with the reference found) or failed".into(),
                    ));
                }
                sqlx::query(
                    "UPDATE steps SET state = 'ready', lease_owner = NULL, leased_at = NULL,
                         expires_at = NULL, next_eligible_at = now(), updated_at = now()
                     WHERE id = $1",
                )
                .bind(row.step_id)
                .execute(&mut *tx)
                .await?;
                outbox::enqueue(
                    &mut tx,
                    MessageKind::StepReady,
                    held.workflow,
                    Some(row.step_id),
                    json!({}),
                )
                .await?;
            }
        }
        if let Some(identity) = &identity {
            crate::permits::release_unknown_for(&mut tx, identity, "resolved by review").await?;
        }
        close_and_audit(&mut tx, item, &row, who, reason, resolution, audit).await?;
        events::append(
            &mut tx,
            NewEvent::by(
                &claim,
                held.workflow,
                EventKind::ReviewResolved,
                json!({ "item": item, "resolution": resolution.as_str(), "by": who, "reason": reason }),
            ),
        )
        .await?;
        tx.commit().await?;
        self.review_item(item).await
    }
}

/// Closes the item and writes its audit row, inside the resolving transaction.
/// Refuses a resolution as succeeded without the result found for a step whose waiting
/// dependents refer to its result: they would fail for want of it.
async fn needs_no_result(conn: &mut sqlx::PgConnection, step: Uuid) -> Result<()> {
    let rows: Vec<(String, Value)> = sqlx::query_as(
        "SELECT u.name, x.input_template
         FROM steps u
         JOIN step_dependencies d ON d.depends_on = u.id
         JOIN steps x ON x.id = d.step_id
         WHERE u.id = $1 AND x.state = 'blocked' AND x.input_template IS NOT NULL",
    )
    .bind(step)
    .fetch_all(&mut *conn)
    .await?;
    for (name, template) in rows {
        let used = z29c_core::refs::references(&template)
            .unwrap_or_default()
            .into_iter()
            .find(|(_, r)| r.step == name && matches!(r.part, z29c_core::refs::Part::Result(_)));
        if let Some((_, r)) = used {
            return Err(StoreError::invalid(
                "result_json",
                format!(
                    "a step after \"{name}\" uses its result ({r}): give the result found with the reference"
                ),
            ));
        }
    }
    Ok(())
}

/// Closes the item and writes its resolution row and, for an audited call, its `audit_log`
/// row, on the resolution's transaction: the decision and its record commit together.
async fn close_and_audit(
    conn: &mut sqlx::PgConnection,
    item: Uuid,
    row: &ItemRow,
    who: &str,
    reason: &str,
    resolution: &Resolution,
    audit: Option<&crate::audit::AuditEntry>,
) -> Result<()> {
    if let Some(e) = audit {
        crate::audit::write(&mut *conn, e).await?;
    }
    let external_reference = match resolution {
        Resolution::Succeeded(r) => Some(r.as_str()),
        _ => None,
    };
    sqlx::query(
        "UPDATE review_items SET state = 'resolved', version = version + 1, resolved_at = now()
         WHERE id = $1",
    )
    .bind(item)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO review_resolutions (id, item_id, step_id, resolved_by, resolution,
             external_reference, reason, prior_state, prior_version, workflow_id)
         SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, s.workflow_id FROM steps s WHERE s.id = $3",
    )
    .bind(Uuid::now_v7())
    .bind(item)
    .bind(row.step_id)
    .bind(who)
    .bind(resolution.as_str())
    .bind(external_reference)
    .bind(reason)
    .bind(&row.state)
    .bind(row.version)
    .execute(conn)
    .await?;
    Ok(())
}
