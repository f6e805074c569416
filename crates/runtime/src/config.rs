//! Configuration every service shares: how it is layered (defaults → file → `Z29C_…`
//! environment, `__` for nesting), the fields every service has ([`SharedConfig`]), and the
//! checks a configuration passes before anything starts ([`Validate`]).

use std::net::SocketAddr;
use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use z29c_security::{DatabaseUrl, TlsConfig};

/// The default database: the `z29c` database of a PostgreSQL on this host.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres:postgres@127.0.0.1:5432/z29c";

/// The fields every service has, read at the top level of its configuration (`database_url`,
/// `Z29C_DATABASE_URL`, and so on).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct SharedConfig {
    /// PostgreSQL, the fencing authority. Its TLS is set in the URL
    /// (`sslmode=verify-full&sslrootcert=…&sslcert=…&sslkey=…`). Its password is never shown:
    /// `--dump-config` prints it as `REDACTED`.
    pub database_url: DatabaseUrl,
    pub nats_url: String,
    /// TLS to NATS (with `tls://` URLs): CA for the server's certificate, and this process's
    /// certificate for servers that verify clients.
    pub nats_tls: TlsConfig,
    /// NATS subject and stream prefix shared by one deployment.
    pub prefix: String,
    /// Where `/metrics` is served (Prometheus), if anywhere.
    pub metrics_listen: Option<SocketAddr>,
}

impl Default for SharedConfig {
    fn default() -> Self {
        Self {
            database_url: DatabaseUrl::parse(DEFAULT_DATABASE_URL)
                .unwrap_or_else(|e| unreachable!("the default database URL is valid: {e}")),
            nats_url: "nats://127.0.0.1:4222".into(),
            nats_tls: TlsConfig::default(),
            prefix: "z29c".into(),
            metrics_listen: None,
        }
    }
}

impl SharedConfig {
    /// The service's pool of at most `max_connections` to PostgreSQL.
    pub async fn store(&self, max_connections: u32) -> anyhow::Result<z29c_store::Store> {
        use anyhow::Context;
        z29c_store::Store::connect(self.database_url.expose(), max_connections)
            .await
            .context("connect to PostgreSQL")
    }

    /// The service's connection to NATS, under the deployment's prefix.
    pub async fn bus(&self) -> anyhow::Result<z29c_bus::Bus> {
        use anyhow::Context;
        z29c_bus::Bus::connect_with(&self.nats_url, &self.prefix, &self.nats_tls)
            .await
            .context("connect to NATS")
    }
}

/// A configuration value no service can run with, naming its field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration: {field}: {reason}")]
pub struct Invalid {
    pub field: String,
    pub reason: String,
}

impl Invalid {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// Checks a configuration once it is loaded, so a value no service can run with is refused at
/// start with its field named, instead of being clamped where it is used.
pub trait Validate {
    fn validate(&self) -> Result<(), Invalid>;
}

/// Refuses zero for a count that must be at least one.
pub fn at_least_one(field: &str, value: usize) -> Result<(), Invalid> {
    if value == 0 {
        return Err(Invalid::new(field, "must be at least 1"));
    }
    Ok(())
}

impl Validate for SharedConfig {
    fn validate(&self) -> Result<(), Invalid> {
        if self.prefix.is_empty()
            || !self
                .prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(Invalid::new(
                "prefix",
                format!(
                    "{:?} is not a NATS subject token (letters, digits, '_' or '-')",
                    self.prefix
                ),
            ));
        }
        if !self.nats_url.contains("://") {
            return Err(Invalid::new(
                "nats_url",
                format!(
                    "{:?} is not a URL (nats://host:port or tls://host:port)",
                    self.nats_url
                ),
            ));
        }
        Ok(())
    }
}

/// Loads a service's configuration: its defaults, then `file` (TOML) if given, then environment
/// variables `Z29C_<FIELD>` (nested fields with `__`, e.g. `Z29C_NATS_TLS__CA_FILE`), then
/// checks it. A table set only in part keeps the service's own defaults for the rest.
pub fn load_config<T>(file: Option<&Path>) -> anyhow::Result<T>
where
    T: Serialize + DeserializeOwned + Default + Validate,
{
    // the defaults serialize as they would be shown, the database password redacted: the
    // default database URL goes back in as it is
    let mut figment = Figment::from(Serialized::defaults(T::default()))
        .merge(Serialized::default("database_url", DEFAULT_DATABASE_URL));
    if let Some(file) = file {
        figment = figment.merge(Toml::file_exact(file));
    }
    figment = figment.merge(Env::prefixed("Z29C_").split("__"));
    let config: T = figment.extract()?;
    config.validate()?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_pass_their_own_checks() {
        assert_eq!(SharedConfig::default().validate(), Ok(()));
    }

    #[test]
    fn a_bad_prefix_or_nats_url_is_refused_by_name() {
        let bad_prefix = SharedConfig {
            prefix: "z29c.prod".into(),
            ..SharedConfig::default()
        };
        assert_eq!(bad_prefix.validate().unwrap_err().field, "prefix");
        let bad_nats = SharedConfig {
            nats_url: "127.0.0.1:4222".into(),
            ..SharedConfig::default()
        };
        assert_eq!(bad_nats.validate().unwrap_err().field, "nats_url");
    }

    /// A service whose nested table has defaults of its own, as the gateway's `grpc` has.
    #[derive(Debug, Serialize, Deserialize)]
    #[serde(default)]
    struct Service {
        #[serde(flatten)]
        shared: SharedConfig,
        grpc: crate::ServerLimits,
    }

    impl Default for Service {
        fn default() -> Self {
            Self {
                shared: SharedConfig::default(),
                grpc: crate::ServerLimits {
                    max_deadline_ms: 60_000,
                    ..Default::default()
                },
            }
        }
    }

    impl Validate for Service {
        fn validate(&self) -> Result<(), Invalid> {
            self.shared.validate()
        }
    }

    #[test]
    // figment::Jail's closure returns figment's own (large) error type
    #[allow(clippy::result_large_err)]
    fn a_table_set_in_part_keeps_the_services_defaults_and_the_database_url_its_password() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("Z29C_GRPC__CONCURRENCY_PER_CONNECTION", "128");
            let c: Service = load_config(None).map_err(|e| e.to_string())?;
            assert_eq!(c.grpc.concurrency_per_connection, 128);
            assert_eq!(
                c.grpc.max_deadline_ms, 60_000,
                "the service's default, not the type's"
            );
            assert_eq!(c.shared.database_url.expose(), DEFAULT_DATABASE_URL);
            jail.set_env("Z29C_DATABASE_URL", "postgres://app:s3cret@db/z29c");
            let c: Service = load_config(None).map_err(|e| e.to_string())?;
            assert_eq!(
                c.shared.database_url.expose(),
                "postgres://app:s3cret@db/z29c"
            );
            Ok(())
        });
    }

    #[test]
    fn counts_of_zero_are_refused_by_name() {
        assert_eq!(at_least_one("workers", 1), Ok(()));
        let e = at_least_one("workers", 0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid configuration: workers: must be at least 1"
        );
    }
}
