//! Throwaway PostgreSQL and NATS for `z29c dev` when none is configured (`z29c_throwaway`):
//! children on free loopback ports, removed on exit.

use anyhow::Context;
use z29c_throwaway::{PrivateNats, PrivatePostgres};

/// A dev server keeps nothing worth a disk flush.
const DEV_SETTINGS: &[&str] = &[
    "fsync=off",
    "synchronous_commit=off",
    "full_page_writes=off",
];

/// The servers `z29c dev` runs on. Dropping it stops the throwaway ones and removes their
/// files.
#[derive(Debug)]
pub(crate) struct Infra {
    pub(crate) database_url: String,
    pub(crate) nats_url: String,
    _postgres: Option<PrivatePostgres>,
    _nats: Option<PrivateNats>,
}

impl Infra {
    /// Uses `database_url`/`nats_url` when given; starts throwaway servers for what is not,
    /// NATS with `nats_config` (its users and their permissions) when given.
    pub(crate) async fn start(
        database_url: Option<String>,
        nats_url: Option<String>,
        nats_config: Option<&str>,
    ) -> anyhow::Result<Self> {
        let (database_url, postgres) = match database_url {
            Some(url) => (url, None),
            None => {
                let pg = PrivatePostgres::start_with(DEV_SETTINGS).await?;
                let admin = sqlx::PgPool::connect(&pg.admin_url())
                    .await
                    .context("connect to the throwaway PostgreSQL")?;
                sqlx::query("CREATE DATABASE z29c").execute(&admin).await?;
                admin.close().await;
                tracing::info!(port = pg.port, "throwaway PostgreSQL started");
                (
                    format!("postgres://postgres@127.0.0.1:{}/z29c", pg.port),
                    Some(pg),
                )
            }
        };
        let (nats_url, nats) = match nats_url {
            Some(url) => (url, None),
            None => {
                let nats = PrivateNats::start_with_config(nats_config).await?;
                tracing::info!(port = nats.port, "throwaway NATS started");
                (nats.url(), Some(nats))
            }
        };
        Ok(Self {
            database_url,
            nats_url,
            _postgres: postgres,
            _nats: nats,
        })
    }
}
