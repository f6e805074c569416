//! The audit log of the public services, and the record of poison NATS messages.
//!
//! An allowed change's row is written by the change itself, in its transaction (or its
//! statement): [`Store::cancel_workflow_audited`], [`Store::submit_audited`],
//! [`Store::resolve_review_audited`]. A crash after the change's commit cannot lose it.
//! [`Store::audit`] writes a row on its own, for refusals, which a service queues.

use chrono::{DateTime, Utc};

use crate::{Result, Store};

/// One audited call.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct AuditEntry {
    pub service: String,
    pub method: String,
    pub subject: Option<String>,
    /// `read`, `submit`, `cancel` or `resolve`.
    pub action: String,
    /// `allowed`, `unauthenticated`, `permission_denied` or `rate_limited`.
    pub outcome: String,
    pub detail: String,
    pub peer: Option<String>,
}

/// An audited call as stored.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct AuditRecord {
    pub at: DateTime<Utc>,
    #[sqlx(flatten)]
    pub entry: AuditEntry,
}

/// A NATS message a consumer refused.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct PoisonMessage {
    pub consumer: String,
    pub subject: String,
    pub stream_sequence: Option<i64>,
    pub deliveries: Option<i64>,
    pub reason: String,
    #[sqlx(rename = "payload_head")]
    pub payload: Vec<u8>,
}

/// At most `max` characters of `s`, without control characters (PostgreSQL refuses a NUL in
/// text, and an audit row must never be why a change fails).
fn clip(s: &str, max: usize) -> String {
    s.chars().filter(|c| !c.is_control()).take(max).collect()
}

impl AuditEntry {
    /// The entry with its long fields cut to the columns' limits, never refused: an
    /// attacker's oversized name must not make its refusal go unrecorded, nor an operator's
    /// long reason make their change fail.
    pub(crate) fn clipped(&self) -> AuditEntry {
        AuditEntry {
            service: clip(&self.service, 100),
            method: clip(&self.method, 200),
            subject: self.subject.as_deref().map(|s| clip(s, 200)),
            action: self.action.clone(),
            outcome: self.outcome.clone(),
            detail: clip(&self.detail, 2000),
            peer: self.peer.as_deref().map(|s| clip(s, 200)),
        }
    }
}

/// Appends `e` to the audit log on `conn`: the caller's transaction, for an allowed change.
pub(crate) async fn write(conn: impl sqlx::PgExecutor<'_>, e: &AuditEntry) -> Result<()> {
    let e = e.clipped();
    sqlx::query(
        "INSERT INTO audit_log (service, method, subject, action, outcome, detail, peer) \
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(&e.service)
    .bind(&e.method)
    .bind(&e.subject)
    .bind(&e.action)
    .bind(&e.outcome)
    .bind(&e.detail)
    .bind(&e.peer)
    .execute(conn)
    .await?;
    Ok(())
}

/// How long the background writer of the queued rows stalls before each write
/// (`Z29C_FAULT_AUDIT_STALL_MS`, read once; only in a build with the `faults` feature). A
/// scenario kills a service while the rows it queued are still unwritten: what the change
/// wrote itself must be there all the same.
#[cfg(feature = "faults")]
fn queued_write_stall() -> Option<std::time::Duration> {
    static STALL: std::sync::OnceLock<Option<std::time::Duration>> = std::sync::OnceLock::new();
    *STALL.get_or_init(|| {
        let ms: u64 = std::env::var("Z29C_FAULT_AUDIT_STALL_MS")
            .ok()?
            .parse()
            .ok()?;
        tracing::error!(ms, "fault: queued audit rows are written late");
        (ms > 0).then(|| std::time::Duration::from_millis(ms))
    })
}

impl Store {
    /// Appends `e` to the audit log on its own (long fields are cut to the column's limit,
    /// never refused: an attacker's oversized name must not make its refusal go unrecorded).
    pub async fn audit(&self, e: &AuditEntry) -> Result<()> {
        #[cfg(feature = "faults")]
        if let Some(stall) = queued_write_stall() {
            tokio::time::sleep(stall).await;
        }
        write(self.pool(), e).await
    }

    /// The newest `limit` audit records, newest first.
    pub async fn audit_log(&self, limit: i64) -> Result<Vec<AuditRecord>> {
        Ok(sqlx::query_as(
            "SELECT at, service, method, subject, action, outcome, detail, peer \
             FROM audit_log ORDER BY id DESC LIMIT $1",
        )
        .bind(limit)
        .fetch_all(self.pool())
        .await?)
    }

    /// Records a refused NATS message (its first 256 bytes).
    pub async fn record_poison(&self, m: &PoisonMessage) -> Result<()> {
        sqlx::query(
            "INSERT INTO poison_messages \
             (consumer, subject, stream_sequence, deliveries, reason, payload_head) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(clip(&m.consumer, 200))
        .bind(clip(&m.subject, 500))
        .bind(m.stream_sequence)
        .bind(m.deliveries)
        .bind(clip(&m.reason, 2000))
        .bind(&m.payload[..m.payload.len().min(256)])
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// The newest `limit` poison messages, newest first.
    pub async fn poison_messages(&self, limit: i64) -> Result<Vec<PoisonMessage>> {
        Ok(sqlx::query_as(
            "SELECT consumer, subject, stream_sequence, deliveries, reason, payload_head \
             FROM poison_messages ORDER BY id DESC LIMIT $1",
        )
        .bind(limit)
        .fetch_all(self.pool())
        .await?)
    }
}
