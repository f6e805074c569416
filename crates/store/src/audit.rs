//! The audit log of the public services, and the record of poison NATS messages.

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

fn clip(s: &str, max: usize) -> String {
    s.chars().take(max).collect()
}

impl Store {
    /// Appends `e` to the audit log (long fields are cut to the column's limit, never refused:
    /// an attacker's oversized name must not make its refusal go unrecorded).
    pub async fn audit(&self, e: &AuditEntry) -> Result<()> {
        sqlx::query(
            "INSERT INTO audit_log (service, method, subject, action, outcome, detail, peer) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(clip(&e.service, 100))
        .bind(clip(&e.method, 200))
        .bind(e.subject.as_deref().map(|s| clip(s, 200)))
        .bind(&e.action)
        .bind(&e.outcome)
        .bind(clip(&e.detail, 2000))
        .bind(e.peer.as_deref().map(|s| clip(s, 200)))
        .execute(self.pool())
        .await?;
        Ok(())
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
