//! Vacuuming z29c's tables where no autovacuum will ([`z29c_core::maintenance`] has the rule
//! and why). The scheduler calls [`Store::vacuum_neglected`] on a timer.

use std::time::{Duration, Instant};

use sqlx::{ConnectOptions, Connection};
use z29c_core::maintenance::TableHealth;

use crate::{Result, Store};

/// The advisory lock one vacuuming scheduler holds for the length of its round, so that
/// scheduler replicas take turns. Advisory locks belong to one database, so replicas on other
/// databases do not wait on each other.
pub const VACUUM_LOCK: i64 = 0x7a32_3963_7661_6375; // "z29cvacu"

/// A table of z29c's schema with its dead rows and the autovacuum settings that apply to it.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    pub name: String,
    pub health: TableHealth,
}

/// What the database keeps, for people to watch grow ([`Store::storage`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Storage {
    /// Bytes on disk of each z29c table, its indexes and TOAST included, by table name.
    pub tables: Vec<(String, i64)>,
    /// How long ago the oldest workflow still kept was submitted; none without workflows.
    pub oldest_workflow_age: Option<Duration>,
}

/// One table vacuumed by [`Store::vacuum_neglected`].
#[derive(Debug, Clone, PartialEq)]
pub struct Vacuumed {
    pub table: String,
    /// Dead rows before the vacuum, by the statistics.
    pub dead: i64,
    pub took: Duration,
}

impl Store {
    /// Every table of z29c's schema, with its dead and live rows (PostgreSQL's statistics) and
    /// the autovacuum settings that apply to it (the table's own options, else the server's).
    pub async fn table_health(&self) -> Result<Vec<Table>> {
        let rows: Vec<(String, i64, i64, i64, f64, bool)> = sqlx::query_as(
            "SELECT s.relname::text, s.n_dead_tup, s.n_live_tup,
                    coalesce(o.threshold, current_setting('autovacuum_vacuum_threshold')::int8),
                    coalesce(o.scale,
                             current_setting('autovacuum_vacuum_scale_factor')::float8),
                    current_setting('autovacuum')::bool
                        AND current_setting('track_counts')::bool
                        AND coalesce(o.enabled, true)
             FROM pg_stat_user_tables s
             JOIN pg_class c ON c.oid = s.relid
             CROSS JOIN LATERAL (
                 SELECT max(split_part(x, '=', 2))
                            FILTER (WHERE x LIKE 'autovacuum_vacuum_threshold=%')::int8
                            AS threshold,
                        max(split_part(x, '=', 2))
                            FILTER (WHERE x LIKE 'autovacuum_vacuum_scale_factor=%')::float8
                            AS scale,
                        max(split_part(x, '=', 2))
                            FILTER (WHERE x LIKE 'autovacuum_enabled=%')::bool AS enabled
                 FROM unnest(coalesce(c.reloptions, '{}')) AS x
             ) o
             WHERE s.schemaname = current_schema()
             ORDER BY s.relname",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(name, dead, live, threshold, scale, autovacuum)| Table {
                name,
                health: TableHealth {
                    dead,
                    live,
                    threshold,
                    scale,
                    autovacuum,
                },
            })
            .collect())
    }

    /// The bytes each z29c table holds and the age of the oldest workflow kept: what
    /// retention has to keep flat.
    pub async fn storage(&self) -> Result<Storage> {
        let tables = sqlx::query_as(
            // a partitioned table's bytes are its partitions'
            "SELECT coalesce(pg_partition_root(c.oid), c.oid)::regclass::text AS name,
                    sum(pg_total_relation_size(c.oid))::bigint
             FROM pg_class c
             WHERE c.relkind = 'r' AND c.relnamespace = 'public'::regnamespace
               AND c.relname <> '_sqlx_migrations'
             GROUP BY 1
             ORDER BY 1",
        )
        .fetch_all(&self.pool)
        .await?;
        // the index on `created_at` finds the oldest without a scan
        let age: Option<f64> = sqlx::query_scalar(
            "SELECT extract(epoch FROM now() - min(created_at))::float8 FROM workflows",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(Storage {
            tables,
            oldest_workflow_age: age.map(|s| Duration::from_secs_f64(s.max(0.0))),
        })
    }

    /// Vacuums (and analyses) each table of z29c's schema that no autovacuum will visit and
    /// whose dead rows are past autovacuum's own threshold for it, one at a time, at
    /// autovacuum's cost-based pace so the work beside it keeps its share of the disk and
    /// CPU. `None` when another instance is vacuuming this database now.
    ///
    /// It runs on a connection of its own (outside the pool, so the pool's size is the
    /// service's), closed at the end, so its lock and pace end with it even if this future is
    /// dropped half-way; a table another session has locked is skipped until the next round
    /// (`SKIP_LOCKED`).
    pub async fn vacuum_neglected(&self) -> Result<Option<Vec<Vacuumed>>> {
        let due: Vec<Table> = self
            .table_health()
            .await?
            .into_iter()
            .filter(|t| t.health.needs_our_vacuum())
            .collect();
        if due.is_empty() {
            return Ok(Some(Vec::new()));
        }
        // a connection of its own, not the pool's, whose slow statements are not logged: a
        // vacuum of a large table takes seconds by design
        let mut conn = (*self.pool.connect_options())
            .clone()
            .disable_statement_logging()
            .connect()
            .await?;
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(VACUUM_LOCK)
            .fetch_one(&mut conn)
            .await?;
        if !locked {
            conn.close().await?;
            return Ok(None);
        }
        // autovacuum's pace: its own cost settings where set, else the manual ones
        sqlx::query(
            "SELECT set_config('vacuum_cost_delay',
                        CASE current_setting('autovacuum_vacuum_cost_delay')
                            WHEN '-1' THEN current_setting('vacuum_cost_delay')
                            ELSE current_setting('autovacuum_vacuum_cost_delay') END, false),
                    set_config('vacuum_cost_limit',
                        CASE current_setting('autovacuum_vacuum_cost_limit')
                            WHEN '-1' THEN current_setting('vacuum_cost_limit')
                            ELSE current_setting('autovacuum_vacuum_cost_limit') END, false)",
        )
        .execute(&mut conn)
        .await?;
        let mut done = Vec::with_capacity(due.len());
        for table in due {
            let started = Instant::now();
            // VACUUM takes no parameters: the name is quoted as an identifier. No truncation:
            // cutting empty pages off a table's end takes its exclusive lock, which every
            // claim, receipt and outbox write would queue behind (the space is reused anyway)
            let statement = format!(
                "VACUUM (ANALYZE, SKIP_LOCKED, TRUNCATE false) {}",
                quote_identifier(&table.name)
            );
            sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
                .execute(&mut conn)
                .await?;
            done.push(Vacuumed {
                table: table.name,
                dead: table.health.dead,
                took: started.elapsed(),
            });
        }
        conn.close().await?;
        Ok(Some(done))
    }
}

/// `name` as a PostgreSQL identifier: in double quotes, with its own double quotes doubled.
fn quote_identifier(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::quote_identifier;

    #[test]
    fn identifiers_are_quoted_so_a_name_cannot_end_the_statement() {
        assert_eq!(quote_identifier("steps"), "\"steps\"");
        assert_eq!(
            quote_identifier("a\"; DROP TABLE steps; --"),
            "\"a\"\"; DROP TABLE steps; --\""
        );
    }
}
