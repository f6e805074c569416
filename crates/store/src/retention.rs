//! Retention by whole partitions.
//!
//! Every table that grows with work is partitioned by range of its workflow's id (a
//! version-7 UUID, so by the time the workflow was made); permits by their own. A *period*
//! is one range: the partitions `<table>_<suffix>` of every such table. Periods are made
//! ahead of the ids that need them ([`Store::cover_ahead`], and on demand before a write
//! that would need one), and a period is dropped whole once it may go
//! ([`Store::drop_period`]): it ended more than the retention ago, each of its workflows
//! finished more than the retention ago, none of its steps is leased or waiting for a
//! person, none of its review items is open and none of its permits is held. No row is
//! updated or deleted to make room.
//!
//! The services' database role holds no DDL: the changes run in SECURITY DEFINER functions
//! of the migration, which apply the rules, one table at a time (taking the locks of all
//! twelve at once never succeeded under a steady load), and write each period's drop to the
//! audit log in the transaction of its last table.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use uuid::Uuid;

use crate::{Result, Store, StoreError};

/// How far past an id's time its period must reach before the id is written without asking.
const COVER_MARGIN_MS: i64 = 1_000;

/// What this handle knows of the periods made so far: the end of the last one, in Unix
/// milliseconds (0 before it has asked).
#[derive(Debug, Default)]
pub(crate) struct Coverage {
    until_ms: AtomicI64,
}

/// One period of the partitioned tables.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Period {
    /// Names its partitions: `<table>_<suffix>`.
    pub suffix: String,
    /// None for the first period, which holds everything made before partitioning.
    pub starts_at: Option<DateTime<Utc>>,
    pub ends_at: DateTime<Utc>,
}

/// A file written by [`Store::export_period`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exported {
    pub table: String,
    pub path: PathBuf,
    pub bytes: u64,
}

/// The Unix milliseconds a version-7 UUID was made at.
fn uuid_millis(id: &Uuid) -> i64 {
    let b = id.as_bytes();
    b[..6].iter().fold(0i64, |ms, &x| (ms << 8) | i64::from(x))
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Store {
    /// Makes sure the periods for the ids in `ids` exist before they are written. Free when
    /// they do, which this handle remembers; otherwise the migration's function makes them.
    /// A period that could not be made now (a busy table's lock) is an error only for an id
    /// no period covers yet.
    pub(crate) async fn cover_ids(&self, ids: impl IntoIterator<Item = Uuid>) -> Result<()> {
        match ids.into_iter().map(|id| uuid_millis(&id)).max() {
            Some(ms) => self.cover(ms, None).await,
            None => Ok(()),
        }
    }

    /// [`Store::cover_ids`] for an id made now (a permit's).
    pub(crate) async fn cover_now(&self) -> Result<()> {
        self.cover(Utc::now().timestamp_millis(), None).await
    }

    async fn cover(&self, at_ms: i64, width: Option<Duration>) -> Result<()> {
        let until = self.periods.until_ms.load(Ordering::Relaxed);
        if width.is_none() && at_ms + COVER_MARGIN_MS < until {
            return Ok(());
        }
        match self.make_periods(at_ms + COVER_MARGIN_MS, width).await {
            Ok(end) => {
                self.periods
                    .until_ms
                    .fetch_max(end.timestamp_millis(), Ordering::Relaxed);
                Ok(())
            }
            Err(e) if at_ms < until => {
                tracing::warn!(error = %e, "the next retention period could not be made yet");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Makes periods (of `width`, or as long as the last) until one ends after `until_ms`, a
    /// table at a time, each in a transaction of its own (the migration says why), and
    /// answers the end of the last period.
    async fn make_periods(&self, until_ms: i64, width: Option<Duration>) -> Result<DateTime<Utc>> {
        let tables: Vec<String> =
            sqlx::query_scalar("SELECT name FROM retention_tables ORDER BY detach_order DESC")
                .fetch_all(&self.pool)
                .await?;
        // a thousand periods at most in one call, as a runaway guard
        for _ in 0..1_000 {
            let next: Option<(String, DateTime<Utc>, DateTime<Utc>)> = sqlx::query_as(
                "SELECT suffix, starts_at, ends_at
                 FROM z29c_next_period(to_timestamp($1::float8 / 1000),
                                       $2::bigint * interval '1 millisecond')",
            )
            .bind(until_ms)
            .bind(width.map(millis))
            .fetch_optional(&self.pool)
            .await?;
            let Some((period, starts_at, ends_at)) = next else {
                break;
            };
            tracing::debug!(%period, %starts_at, %ends_at, "making a retention period");
            for table in &tables {
                sqlx::query("SELECT z29c_make_partition($1, $2)")
                    .bind(table)
                    .bind(&period)
                    .execute(&self.pool)
                    .await?;
            }
            sqlx::query("SELECT z29c_record_period($1)")
                .bind(&period)
                .execute(&self.pool)
                .await?;
        }
        Ok(sqlx::query_scalar(
            "SELECT max(ends_at) FROM retention_periods WHERE made_at IS NOT NULL",
        )
        .fetch_one(&self.pool)
        .await?)
    }

    /// Makes periods of `width` until one ends at least `width` from now, and answers the
    /// end of the last one. Called on a timer, so that writes seldom wait for a new period.
    pub async fn cover_ahead(&self, width: Duration) -> Result<DateTime<Utc>> {
        if width < Duration::from_secs(1) {
            return Err(StoreError::invalid(
                "retention.period",
                "a period is at least one second",
            ));
        }
        self.cover(Utc::now().timestamp_millis() + millis(width), Some(width))
            .await?;
        let ms = self.periods.until_ms.load(Ordering::Relaxed);
        DateTime::from_timestamp_millis(ms)
            .ok_or_else(|| StoreError::Corrupt(format!("period end {ms}")))
    }

    /// Every period not dropped yet, oldest first.
    pub async fn periods(&self) -> Result<Vec<Period>> {
        Ok(sqlx::query_as(
            "SELECT suffix, CASE WHEN starts_at = '-infinity' THEN NULL ELSE starts_at END
                        AS starts_at, ends_at
             FROM retention_periods
             WHERE made_at IS NOT NULL AND dropped_at IS NULL ORDER BY ends_at",
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// The periods that may be dropped with a retention of `keep`, oldest first (see the
    /// module's rule). [`Store::drop_period`] checks again under the period's locks.
    pub async fn expired_periods(&self, keep: Duration) -> Result<Vec<Period>> {
        Ok(sqlx::query_as(
            "WITH p AS (
                 SELECT suffix, starts_at, ends_at,
                        CASE WHEN starts_at = '-infinity'
                             THEN '00000000-0000-0000-0000-000000000000'::uuid
                             ELSE z29c_uuid_at(starts_at) END AS lo,
                        z29c_uuid_at(ends_at) AS hi
                 FROM retention_periods
                 WHERE made_at IS NOT NULL AND dropped_at IS NULL
                   AND ends_at < now() - $1::bigint * interval '1 millisecond'
             )
             SELECT suffix, CASE WHEN starts_at = '-infinity' THEN NULL ELSE starts_at END
                        AS starts_at, ends_at
             FROM p
             WHERE NOT EXISTS (SELECT 1 FROM workflows w
                               WHERE w.state = 'running' AND w.id >= p.lo AND w.id < p.hi)
               AND NOT EXISTS (SELECT 1 FROM steps s
                               WHERE s.state IN ('leased', 'recovering', 'needs_review')
                                 AND s.workflow_id >= p.lo AND s.workflow_id < p.hi)
               AND NOT EXISTS (SELECT 1 FROM attempts a
                               WHERE a.state = 'active'
                                 AND a.workflow_id >= p.lo AND a.workflow_id < p.hi)
               AND NOT EXISTS (SELECT 1 FROM review_items r
                               WHERE r.state = 'open'
                                 AND r.workflow_id >= p.lo AND r.workflow_id < p.hi)
               AND NOT EXISTS (SELECT 1 FROM adapter_permits a
                               WHERE a.state <> 'released' AND a.expires_at > now()
                                 AND a.id >= p.lo AND a.id < p.hi)
               AND NOT EXISTS (SELECT 1 FROM workflows w
                               WHERE w.id >= p.lo AND w.id < p.hi
                                 AND w.ended_at > now() - $1::bigint * interval '1 millisecond')
             ORDER BY ends_at",
        )
        .bind(millis(keep))
        .fetch_all(&self.pool)
        .await?)
    }

    /// Writes each partition of `period` to `<dir>/<table>_<suffix>.csv.gz` (CSV with a
    /// header row, gzip), each file complete and on disk before it takes its name; a file
    /// that has its name already is kept as it is.
    pub async fn export_period(&self, period: &Period, dir: &Path) -> Result<Vec<Exported>> {
        // a period half dropped (its export was written whole before) exports what is left
        let tables: Vec<String> = sqlx::query_scalar(
            "SELECT name FROM retention_tables
             WHERE z29c_partition(name, $1) IS NOT NULL ORDER BY detach_order",
        )
        .bind(&period.suffix)
        .fetch_all(&self.pool)
        .await?;
        let io = |e: std::io::Error| StoreError::Io(format!("export to {}: {e}", dir.display()));
        tokio::fs::create_dir_all(dir).await.map_err(io)?;
        let mut written = Vec::with_capacity(tables.len());
        for table in tables {
            let partition = format!("{table}_{}", period.suffix);
            if !partition
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            {
                return Err(StoreError::Corrupt(format!("partition name {partition:?}")));
            }
            let path = dir.join(format!("{partition}.csv.gz"));
            // written whole by an earlier round whose drop did not go through: the rows of a
            // period that may go do not change
            if let Ok(done) = tokio::fs::metadata(&path).await {
                written.push(Exported {
                    table,
                    path,
                    bytes: done.len(),
                });
                continue;
            }
            let partial = dir.join(format!(".{partition}.csv.gz.partial"));
            let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
            let file = partial.clone();
            let writer = tokio::task::spawn_blocking(move || -> std::io::Result<u64> {
                use std::io::Write;
                let out = std::fs::File::create(&file)?;
                let mut gz = flate2::write::GzEncoder::new(out, flate2::Compression::default());
                while let Some(chunk) = rx.blocking_recv() {
                    gz.write_all(&chunk)?;
                }
                let out = gz.finish()?;
                out.sync_all()?;
                out.metadata().map(|m| m.len())
            });
            // a session of its own, closed after: a COPY that fails half-way must not leave
            // its unread answer to the pool's next borrower
            let mut conn = self.pool.acquire().await?.detach();
            let mut rows = conn
                .copy_out_raw(&format!(
                    "COPY (SELECT * FROM {partition}) TO STDOUT WITH (FORMAT csv, HEADER)"
                ))
                .await?;
            while let Some(chunk) = rows.try_next().await? {
                if tx.send(chunk.to_vec()).await.is_err() {
                    break;
                }
            }
            drop(rows);
            drop(tx);
            let _ = sqlx::Connection::close(conn).await;
            let bytes = writer
                .await
                .map_err(|e| StoreError::Io(format!("export writer: {e}")))?
                .map_err(io)?;
            tokio::fs::rename(&partial, &path).await.map_err(io)?;
            written.push(Exported { table, path, bytes });
        }
        // the names themselves reach the disk before anything is dropped
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io)?;
        Ok(written)
    }

    /// Drops `period` if it may go with a retention of `keep`, a table at a time, each in a
    /// transaction of its own, and answers the rows removed per table; None when it may not
    /// (yet), or a table stayed busy (the next call goes on from there). The drop is in the
    /// audit log once its last table has gone, with `exported_to` when the partitions were
    /// exported first.
    pub async fn drop_period(
        &self,
        period: &str,
        keep: Duration,
        exported_to: Option<&str>,
    ) -> Result<Option<serde_json::Value>> {
        let tables: Vec<String> =
            sqlx::query_scalar("SELECT name FROM retention_tables ORDER BY detach_order")
                .fetch_all(&self.pool)
                .await?;
        for table in &tables {
            let removed: Option<i64> = sqlx::query_scalar(
                "SELECT z29c_drop_partition($1, $2, $3::bigint * interval '1 millisecond', $4)",
            )
            .bind(period)
            .bind(table)
            .bind(millis(keep))
            .bind(exported_to)
            .fetch_one(&self.pool)
            .await?;
            if removed.is_none() {
                return Ok(None);
            }
        }
        Ok(sqlx::query_scalar(
            "SELECT removed FROM retention_periods WHERE suffix = $1 AND dropped_at IS NOT NULL",
        )
        .bind(period)
        .fetch_optional(&self.pool)
        .await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_7_ids_time_is_its_first_48_bits() {
        let before = Utc::now().timestamp_millis();
        let id = Uuid::now_v7();
        let after = Utc::now().timestamp_millis();
        let ms = uuid_millis(&id);
        assert!(before <= ms && ms <= after, "{before} {ms} {after}");
        assert_eq!(uuid_millis(&Uuid::nil()), 0);
    }
}
