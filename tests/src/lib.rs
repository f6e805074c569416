//! `z29c-scenarios`: the harness that runs z29c against real PostgreSQL and NATS.
//!
//! It owns the isolation every scenario needs: a throwaway database per test, created from
//! `DATABASE_URL`, migrated with the embedded migrations, and dropped afterwards, so scenarios
//! run in parallel and leave nothing behind.
//!
//! # Layout
//! - [`apis`]: mock APIs of real shapes (payments, a carrier, notifications), with their own records.
//! - [`order`]: a three-step order whose steps use upstream results, against [`apis`].
//! - [`cluster`]: real z29c processes (destination, gateways, scheduler, executors, recovery).
//! - [`infra`]: PostgreSQL and NATS servers of a scenario's own, to crash and restart.
//! - [`proxy`]: a TCP proxy to cut a service's database connection, or drop it at `COMMIT`.
//! - [`history`]: the recorded history of a run and the invariant checker.
//! - [`matrix`]: the fault matrix (fault × adapter capability → invariants held).
//! - [`soak`]: the randomized soak with a reproducible fault schedule.
//! - [`otlp`]: an in-process OTLP trace receiver, to check traces across services.

use anyhow::{Context, Result};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};
use z29c_store::Store;

static SERVER: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The server tests run against: the one [`use_server`] set, else `DATABASE_URL`'s, else the
/// machine's PostgreSQL.
pub fn database_url() -> String {
    if let Some(url) = SERVER.get() {
        return url.clone();
    }
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres:postgres@127.0.0.1:5432/postgres".into())
}

/// `url` with its `sslmode` set to `mode` (`disable`, `prefer`, …), whatever it named before.
pub fn with_sslmode(url: &str, mode: &str) -> Result<String> {
    let mut u = reqwest::Url::parse(url)?;
    let kept: Vec<(String, String)> = u
        .query_pairs()
        .filter(|(k, _)| k != "sslmode")
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    u.query_pairs_mut()
        .clear()
        .extend_pairs(kept)
        .append_pair("sslmode", mode);
    Ok(u.to_string())
}

/// Makes every database this process creates from now on live on `admin_url`'s server (the
/// benchmark's own PostgreSQL). Only the first call counts.
pub fn use_server(admin_url: String) {
    let _ = SERVER.set(admin_url);
}

/// Waits until `sql` (a query the test wrote, never input) counts something, for at most
/// `within`; the error names `what` was waited for.
pub async fn wait_for_count(
    pool: &PgPool,
    sql: &str,
    what: &str,
    within: std::time::Duration,
) -> Result<()> {
    let start = std::time::Instant::now();
    loop {
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_one(pool)
            .await
            .unwrap_or(0);
        if n > 0 {
            return Ok(());
        }
        if start.elapsed() > within {
            anyhow::bail!("waited {within:?} for {what}");
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Rows in `table` (a name the test wrote, never input).
pub async fn count_rows(pool: &PgPool, table: &str) -> Result<i64> {
    Ok(
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
            .fetch_one(pool)
            .await?,
    )
}

/// A database that exists for one test.
#[derive(Debug)]
pub struct TestDatabase {
    admin: PgConnectOptions,
    name: String,
    url: String,
    /// A login role in `z29c_service` made for this database, dropped with it.
    service_role: Option<String>,
}

impl TestDatabase {
    /// Creates an empty database with a unique name.
    pub async fn create() -> Result<Self> {
        Self::create_on(&database_url()).await
    }

    /// Creates an empty database on the server `admin_url` points at.
    pub async fn create_on(admin_url: &str) -> Result<Self> {
        let admin: PgConnectOptions = admin_url.parse().context("DATABASE_URL")?;
        let name = format!("z29c_scn_{}", uuid::Uuid::new_v4().simple());
        let mut conn = admin.connect().await.context("connect to PostgreSQL")?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await?;
        let url = admin.clone().database(&name).to_url_lossy().to_string();
        Ok(Self {
            admin,
            name,
            url,
            service_role: None,
        })
    }

    /// This database's URL for a login role in `z29c_service`, the role services connect as
    /// in production (rows only: no DDL, no TRUNCATE, no trigger changes). The role is made
    /// once, after the migrations that create `z29c_service`, and dropped with the database.
    pub async fn service_url(&mut self) -> Result<String> {
        let role = format!("z29c_svc_{}", &self.name["z29c_scn_".len()..][..16]);
        if self.service_role.is_none() {
            let mut conn = self.admin.connect().await?;
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "CREATE ROLE {role} LOGIN IN ROLE z29c_service"
            )))
            .execute(&mut conn)
            .await
            .context("create the service's login role (migrate first)")?;
            self.service_role = Some(role.clone());
        }
        Ok(self
            .admin
            .clone()
            .database(&self.name)
            .username(&role)
            .password("")
            .to_url_lossy()
            .to_string())
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// A pool on this database.
    pub async fn pool(&self, max: u32) -> Result<PgPool> {
        Ok(PgPoolOptions::new()
            .max_connections(max)
            .connect_with(self.admin.clone().database(&self.name))
            .await?)
    }

    /// A store on this database, migrated.
    pub async fn store(&self) -> Result<Store> {
        let store = Store::from_pool(self.pool(8).await?);
        store.migrate().await?;
        Ok(store)
    }

    /// Drops the database, ending any session still connected to it.
    pub async fn drop_now(self) -> Result<()> {
        let mut conn = self.admin.connect().await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        )))
        .execute(&mut conn)
        .await?;
        if let Some(role) = &self.service_role {
            sqlx::query(sqlx::AssertSqlSafe(format!("DROP ROLE IF EXISTS {role}")))
                .execute(&mut conn)
                .await?;
        }
        Ok(())
    }
}

pub mod apis;
pub mod cluster;
pub mod history;
pub mod infra;
pub mod matrix;
pub mod order;
pub mod otlp;
pub mod proxy;
pub mod soak;

/// Prints one line of a long run's progress to standard output.
pub fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
}

/// The first SIGINT or SIGTERM. A command run beside it in a `select!` is dropped when it
/// comes, and with it every process it started (all are `kill_on_drop`).
pub async fn stop_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}
