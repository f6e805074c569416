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
//! - [`submissions`]: concurrent submissions in one statement (the scheduler's batching).
//! - [`leases`]: claim, renew, checkpoints, receipt commit, late observations, release.
//! - [`recovery`]: expired-lease scan, recovery leases, recovery decisions.
//! - [`review`]: the review queue and audited resolutions.
//! - [`events`]: the step event history (lease history, checkpoints).
//! - [`outbox`]: the transactional outbox (claim, mark sent).
//! - [`permits`]: adapter concurrency permits; called by the gateway alone.
//! - [`receipts`], [`invocations`]: receipts, and *invocation began* with its permit, of many
//!   attempts in one statement, each fenced on its own (the executor's and gateway's batching).
//! - [`audit`]: the public services' audit log and refused (poison) NATS messages.
//! - [`maintenance`]: vacuuming z29c's tables where no autovacuum will.
//! - [`retention`]: the time partitions: made ahead, exported, and dropped once expired.

pub mod audit;
pub mod error;
pub mod events;
pub mod faults;
pub mod invocations;
pub mod leases;
pub mod maintenance;
pub mod outbox;
pub mod permits;
pub mod receipts;
pub mod recovery;
pub mod retention;
pub mod review;
pub mod submissions;
pub mod workflows;

mod ending;
mod fence;
mod shared;

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

pub use error::{Result, StoreError};

/// The embedded migrations of `migrations/`, applied under sqlx's advisory lock so concurrent
/// service starts migrate once.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations");

/// Settings for the sessions that run shared statements ([`Store::commit_receipts`],
/// [`Store::begin_invocations`]; [`Store::connect_with`]). Their statements look every row up
/// by key, and are long: planned afresh on every call they cost more to plan than to run
/// (about 1 ms of a single call's 2.2, measured with one call per statement), so these
/// sessions keep one generic plan per statement. A generic plan made while a table was small
/// (a fresh database, or a server that never analyses) would scan it for good (seen in
/// `auto_explain`: a sequential scan of `workflows` in 51 of 77 logged plans), so these
/// sessions never plan a sequential scan.
pub const BATCH_SESSION_SETTINGS: &[(&str, &str)] = &[
    ("enable_seqscan", "off"),
    ("plan_cache_mode", "force_generic_plan"),
];

/// Settings of every session.
///
/// Each keeps one generic plan per prepared statement. The tables that grow with work are
/// partitioned ([`retention`]), and a custom plan opens and plans every partition of every
/// table a statement names, each time: planning a lookup of one step by id took 0.5 ms warm
/// and a three-table join 1.2 ms, where running them took 0.1 and 0.2, and a steady run fell
/// to a tenth of its rate. A generic plan is made once per connection and prunes the
/// partitions when it runs.
///
/// None compiles a plan to machine code (JIT). A generic plan cannot know that `= ANY($1)`
/// names one workflow, so its estimates are those of a scan, over the JIT threshold: reading
/// one workflow's steps then spent 0.95 s of its 1.0 compiling, for a plan that ran in
/// 0.003. z29c's statements look rows up by key, which JIT never speeds up.
const SESSION_DEFAULTS: &[(&str, &str)] =
    &[("plan_cache_mode", "force_generic_plan"), ("jit", "off")];

/// How long [`Store::connect`] keeps trying a server that is not there yet.
pub const CONNECT_PATIENCE: Duration = Duration::from_secs(30);

/// Errors worth another try: the server is unreachable, starting up or shutting down, or out
/// of connection slots. Configuration errors (bad URL, credentials, database) are not.
fn transient(e: &sqlx::Error) -> bool {
    match e {
        // a certificate the server or this side refuses will be refused again
        sqlx::Error::Io(io) if io.kind() == std::io::ErrorKind::InvalidData => false,
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut => true,
        sqlx::Error::Database(db) => matches!(
            db.code().as_deref(),
            Some("53300" | "57P01" | "57P02" | "57P03" | "08000" | "08001" | "08003" | "08006")
        ),
        _ => false,
    }
}

/// A handle on z29c's database. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Store {
    pool: PgPool,
    periods: std::sync::Arc<retention::Coverage>,
}

impl Store {
    /// Connects with a pool of at most `max_connections`.
    ///
    /// A server that is starting, restarting, briefly unreachable or out of connection slots
    /// is retried with capped, jittered backoff for up to [`CONNECT_PATIENCE`], so services may
    /// start in any order; a wrong URL or bad credentials fail at once.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self> {
        Self::connect_with(url, max_connections, &[]).await
    }

    /// The pool of a batching path's committers ([`submissions::SubmissionBatches`],
    /// [`receipts::ReceiptBatches`], [`invocations::InvocationBatches`]): one connection per
    /// committer, each session with [`BATCH_SESSION_SETTINGS`].
    pub async fn connect_committers(url: &str, committers: usize) -> Result<Self> {
        Self::connect_with(url, committers as u32, BATCH_SESSION_SETTINGS).await
    }

    /// [`Store::connect`], with server settings for every session of the pool (startup
    /// options, e.g. `("enable_seqscan", "off")` for a pool whose statements only look rows
    /// up by key).
    pub async fn connect_with(
        url: &str,
        max_connections: u32,
        settings: &[(&str, &str)],
    ) -> Result<Self> {
        use backon::Retryable;
        let options: PgConnectOptions = url
            .parse::<PgConnectOptions>()?
            .application_name("z29c")
            .options(
                SESSION_DEFAULTS
                    .iter()
                    .filter(|(k, _)| !settings.iter().any(|(s, _)| s == k))
                    .chain(settings)
                    .copied(),
            );
        let connect = || {
            PgPoolOptions::new()
                .max_connections(max_connections)
                .acquire_timeout(Duration::from_secs(10))
                .connect_with(options.clone())
        };
        let pool = connect
            .retry(z29c_core::policy::connect_backoff(CONNECT_PATIENCE))
            .sleep(tokio::time::sleep)
            .when(transient)
            .notify(|e, wait| {
                tracing::warn!(error = %e, ?wait, "PostgreSQL not reachable yet; retrying");
            })
            .await?;
        Ok(Self::from_pool(pool))
    }

    /// `BEGIN` on a pooled connection, safe to cancel.
    ///
    /// sqlx 0.9.0 leaves a session inside a transaction when a future is dropped during the
    /// `BEGIN` round trip (transact-rs/sqlx#4393, fixed upstream after 0.9.0): the connection
    /// goes back to the pool, and the next borrower's statements run, and commit, inside that
    /// stale transaction. The soak caught it as a receipt whose transaction had begun in an
    /// aborted lease renewal. Here the `BEGIN` runs in a task of its own, so it completes
    /// whatever happens to the caller; a transaction nobody awaits any more is dropped in that
    /// task, which rolls it back as sqlx does for any begun transaction.
    pub(crate) async fn begin(&self) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
        self.begin_in_task(None).await
    }

    /// A transaction whose COMMIT does not wait for its WAL to reach disk
    /// (`synchronous_commit = off`, one round trip with the BEGIN), for bookkeeping whose loss
    /// in a server crash is safe: the permit's release (a lost one leaves the permit counting
    /// until its hold runs out) and the outbox relay's marks (a lost one republishes under the
    /// same `Nats-Msg-Id`, which JetStream drops), and an executor's claim (see
    /// [`Store::claim`]: a lost one is a lease that never existed, and the first durable write
    /// under it flushes it). A later durable COMMIT on the server flushes it too. Never for a
    /// checkpoint, a receipt, a renewal or anything a client is told.
    pub(crate) async fn begin_relaxed(&self) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
        self.begin_in_task(Some("BEGIN; SET LOCAL synchronous_commit = off"))
            .await
    }

    /// A transaction whose statements walk indexes in order (`enable_seqscan` and
    /// `enable_bitmapscan` off, in the BEGIN's round trip), for the queue claims: walking the
    /// queue's index from its head is the only plan that stays cheap however the table's
    /// statistics lag behind it. After a burst of submissions the ready steps would be
    /// bitmap-scanned and sorted (200 ms at 20,000 ready, against 0.4 ms); the outbox, a few
    /// hundred live rows in thousands of pages between vacuums, was at times read whole and
    /// sorted (37–123 ms per claim in a steady run, against under 1 ms by its index).
    /// Reads by key use it too ([`Store::workflow`]): a plan a connection cached while the
    /// tables were small must not go on scanning them whole. A plan cached in such a
    /// transaction was made under these settings, so its statements run only in them.
    /// `relaxed` as [`Store::begin_relaxed`].
    pub(crate) async fn begin_walking_indexes(
        &self,
        relaxed: bool,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
        self.begin_in_task(Some(if relaxed {
            "BEGIN; SET LOCAL synchronous_commit = off; \
             SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off"
        } else {
            "BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off"
        }))
        .await
    }

    /// `BEGIN` (or `statement`) in a task of its own, for the reason given at [`Store::begin`].
    async fn begin_in_task(
        &self,
        statement: Option<&'static str>,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
        let pool = self.pool.clone();
        let tx = tokio::spawn(async move {
            match statement {
                Some(s) => pool.begin_with(s).await,
                None => pool.begin().await,
            }
        })
        .await
        .map_err(|e| StoreError::Database(sqlx::Error::Protocol(format!("BEGIN task: {e}"))))??;
        Ok(tx)
    }

    /// Whether PostgreSQL answers a trivial query now (readiness).
    pub async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }

    pub fn from_pool(pool: PgPool) -> Self {
        Self {
            pool,
            periods: std::sync::Arc::default(),
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies pending migrations.
    pub async fn migrate(&self) -> Result<()> {
        MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    /// The server's connection limits and the sessions open on it now.
    pub async fn server_connections(&self) -> Result<z29c_core::connections::ServerConnections> {
        let (max_connections, reserved, in_use): (i32, i32, i64) = sqlx::query_as(
            "SELECT current_setting('max_connections')::int,
                    current_setting('superuser_reserved_connections')::int,
                    -- sessions on a database (others' details are hidden from a role
                    -- without pg_read_all_stats, their database is not), this one aside
                    (SELECT count(*) FROM pg_stat_activity
                     WHERE datid IS NOT NULL AND pid <> pg_backend_pid())",
        )
        .fetch_one(&self.pool)
        .await?;
        let count = |n: i64| u32::try_from(n.max(0)).unwrap_or(u32::MAX);
        Ok(z29c_core::connections::ServerConnections {
            max_connections: count(max_connections.into()),
            reserved: count(reserved.into()),
            in_use: count(in_use),
        })
    }

    /// PostgreSQL's clock: the only one that decides lease expiry.
    pub async fn now(&self) -> Result<chrono::DateTime<chrono::Utc>> {
        Ok(sqlx::query_scalar("SELECT now()")
            .fetch_one(&self.pool)
            .await?)
    }
}

/// A step's retry policy as `steps.retry_policy` holds it: the fields its submission set, or
/// NULL for every default.
pub(crate) fn retry_policy_to_row(p: &z29c_core::RetryPolicy) -> Option<serde_json::Value> {
    (*p != z29c_core::RetryPolicy::default())
        .then(|| serde_json::to_value(p).expect("a retry policy serializes"))
}

/// A step's retry policy read back from `steps.retry_policy`.
pub(crate) fn retry_policy_from_row(
    v: Option<serde_json::Value>,
) -> Result<z29c_core::RetryPolicy> {
    v.map_or(Ok(z29c_core::RetryPolicy::default()), |v| {
        serde_json::from_value(v).map_err(|e| StoreError::Corrupt(format!("retry_policy: {e}")))
    })
}

/// Milliseconds of a duration as the `bigint` PostgreSQL intervals are built from.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sqlx::PgPool;
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

    use super::Store;

    /// Whether the pool's (one) connection is inside a transaction block someone left open:
    /// PostgreSQL takes a savepoint only inside one.
    async fn left_open(pool: &PgPool) -> bool {
        sqlx::raw_sql("SAVEPOINT z29c_probe")
            .execute(pool)
            .await
            .is_ok()
    }

    /// A relaxed transaction commits without waiting for the disk, and only it: the setting
    /// ends with it, so the session's next borrower commits durably again.
    #[sqlx::test(migrations = false)]
    async fn a_relaxed_commit_is_relaxed_for_its_own_transaction_only(
        _: PgPoolOptions,
        connect: PgConnectOptions,
    ) {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(connect)
            .await
            .expect("pool");
        let store = Store::from_pool(pool.clone());
        let show = "SELECT current_setting('synchronous_commit')";
        let mut tx = store.begin_relaxed().await.unwrap();
        let inside: String = sqlx::query_scalar(show).fetch_one(&mut *tx).await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(inside, "off");
        let after: String = sqlx::query_scalar(show).fetch_one(&pool).await.unwrap();
        assert_eq!(after, "on");
        let mut tx = store.begin().await.unwrap();
        let durable: String = sqlx::query_scalar(show).fetch_one(&mut *tx).await.unwrap();
        assert_eq!(durable, "on");
    }

    #[sqlx::test(migrations = false)]
    async fn a_begin_cancelled_at_any_moment_leaves_no_transaction_open(
        _: PgPoolOptions,
        connect: PgConnectOptions,
    ) {
        // one connection, handed out without a ping, so a cancellation lands in the BEGIN
        // round trip itself and the next borrower gets the same session
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .connect_with(connect)
            .await
            .expect("pool");
        let store = Store::from_pool(pool.clone());
        let mut cancelled = 0;
        for i in 0..200u32 {
            // poll the BEGIN a few times, letting the runtime run in between, then drop it:
            // the cancellation lands wherever it has got to by then
            let polls = 1 + i % 8;
            let mut begin = Box::pin(store.begin());
            let mut done = false;
            for _ in 0..polls {
                if futures::poll!(&mut begin).is_ready() {
                    done = true;
                    break;
                }
                tokio::time::sleep(Duration::from_micros(100)).await;
            }
            drop(begin);
            if !done {
                cancelled += 1;
            }
            assert!(
                !left_open(&pool).await,
                "a BEGIN dropped after {polls} polls left its transaction open for the next borrower"
            );
        }
        assert!(
            cancelled >= 20,
            "only {cancelled} of 200 BEGINs were cancelled"
        );
    }
}
