//! Every SQL statement on z29c's schema. No other z29c crate writes SQL.
//!
//! The store turns the rules of `z29c-core` into PostgreSQL transactions. Every write made
//! under a lease is a conditional `UPDATE … WHERE lease_version = $n AND lease_owner = $o …`
//! inside the committing transaction; a write that changes no row is [`StoreError::Fenced`]
//! with the reason, never a silent success. PostgreSQL's clock is the only one that decides
//! expiry: no function here takes a time from its caller.
//!
//! # Layout
//! - [`workflows`]: submit (idempotent on a client key), get, list, cancel.
//! - [`leases`]: claim, renew, checkpoints, receipt commit, late observations, release.
//! - [`recovery`]: expired-lease scan, recovery leases, recovery decisions.
//! - [`review`]: the review queue and audited resolutions.
//! - [`events`]: the step event history (lease history, checkpoints).
//! - [`outbox`]: the transactional outbox (claim, mark sent).
//! - [`permits`]: adapter concurrency permits; called by the gateway alone.

pub mod error;
pub mod events;
pub mod faults;
pub mod leases;
pub mod outbox;
pub mod permits;
pub mod recovery;
pub mod review;
pub mod workflows;

mod fence;

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

pub use error::{Result, StoreError};

/// The embedded migrations of `migrations/`, applied under sqlx's advisory lock so concurrent
/// service starts migrate once.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations");

/// A handle on z29c's database. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Store {
    pool: PgPool,
}

impl Store {
    /// Connects with a pool of at most `max_connections`.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self> {
        let options: PgConnectOptions = url.parse()?;
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options.application_name("z29c"))
            .await?;
        Ok(Self { pool })
    }

    pub fn from_pool(pool: PgPool) -> Self {
        Self { pool }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies pending migrations.
    pub async fn migrate(&self) -> Result<()> {
        MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    /// PostgreSQL's clock: the only one that decides lease expiry.
    pub async fn now(&self) -> Result<chrono::DateTime<chrono::Utc>> {
        Ok(sqlx::query_scalar("SELECT now()")
            .fetch_one(&self.pool)
            .await?)
    }
}

/// Milliseconds of a duration as the `bigint` PostgreSQL intervals are built from.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
