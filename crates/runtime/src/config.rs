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
    /// How this service proves itself to NATS: its NKey seed file (`z29c nats-auth` writes
    /// one per role, and the server's users). None: a server without users.
    pub nats_auth: z29c_bus::auth::NatsAuth,
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
            nats_auth: z29c_bus::auth::NatsAuth::default(),
            prefix: "z29c".into(),
            metrics_listen: None,
        }
    }
}

impl SharedConfig {
    /// The service's pool of at most `max_connections` to PostgreSQL.
    /// Warns, with the numbers, when the pool may want more sessions than the server has free.
    pub async fn store(&self, max_connections: u32) -> anyhow::Result<z29c_store::Store> {
        use anyhow::Context;
        let store = z29c_store::Store::connect(self.database_url.expose(), max_connections)
            .await
            .context("connect to PostgreSQL")?;
        match store.server_connections().await {
            Ok(server) => {
                if let Some(warning) =
                    z29c_core::connections::pool_warning(max_connections, &server)
                {
                    tracing::warn!(pool = max_connections, "{warning}");
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot read the server's connection limits"),
        }
        Ok(store)
    }

    /// The connection to NATS of the service `role`, under the deployment's prefix.
    pub async fn bus(
        &self,
        role: z29c_core::identity::ServiceRole,
    ) -> anyhow::Result<z29c_bus::Bus> {
        use anyhow::Context;
        z29c_bus::Bus::connect_as(
            &self.nats_url,
            &self.prefix,
            &self.nats_tls,
            Some(role),
            &self.nats_auth,
        )
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
        check_file_keys::<T>(file)?;
        figment = figment.merge(Toml::file_exact(file));
    }
    figment = figment.merge(Env::prefixed("Z29C_").split("__"));
    let config: T = figment.extract()?;
    config.validate()?;
    Ok(config)
}

/// Refuses a file holding a key the service does not read, naming the key and the file: a
/// misspelt setting would otherwise be ignored, and its default run instead. The keys a
/// service reads are those its defaults serialize to; a table its defaults leave empty (a
/// map, such as an adapter's `limits`) takes any key, and each element of an array is
/// checked against the default's first element. (The environment is not checked: it holds
/// other programs' `Z29C_…` variables too.)
pub fn check_file_keys<T: Serialize + Default>(file: &Path) -> anyhow::Result<()> {
    use anyhow::Context;
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("read the configuration file {}", file.display()))?;
    let given: toml::Table =
        toml::from_str(&text).with_context(|| format!("{}: not TOML", file.display()))?;
    let known = serde_json::to_value(T::default())?;
    let mut unknown = Vec::new();
    unknown_keys(&known, &serde_json::to_value(given)?, "", &mut unknown);
    if let Some(first) = unknown.first() {
        anyhow::bail!(
            "{}: unknown key `{first}`{} (a misspelt setting would be ignored; see --dump-config for every key)",
            file.display(),
            match unknown.len() {
                1 => String::new(),
                n => format!(" and {} more: {}", n - 1, unknown[1..].join(", ")),
            }
        );
    }
    Ok(())
}

fn unknown_keys(
    known: &serde_json::Value,
    given: &serde_json::Value,
    at: &str,
    out: &mut Vec<String>,
) {
    use serde_json::Value;
    match (known, given) {
        (Value::Object(known), Value::Object(given)) if !known.is_empty() => {
            for (key, value) in given {
                let path = if at.is_empty() {
                    key.clone()
                } else {
                    format!("{at}.{key}")
                };
                match known.get(key) {
                    Some(k) => unknown_keys(k, value, &path, out),
                    None => out.push(path),
                }
            }
        }
        (Value::Array(known), Value::Array(given)) => {
            if let Some(template) = known.first() {
                for (i, value) in given.iter().enumerate() {
                    unknown_keys(template, value, &format!("{at}[{i}]"), out);
                }
            }
        }
        _ => {}
    }
}

/// A configuration as `--dump-config` prints it (TOML): secrets the types keep redact
/// themselves, and every credential inside a URL (`nats://user:password@…`, a
/// `base_url` with a password, a `password`, `token`, `secret` or `key` query parameter)
/// is shown as `REDACTED`.
pub fn dump<T: Serialize>(config: &T) -> anyhow::Result<String> {
    let mut value = toml::Value::try_from(config)?;
    redact_urls(&mut value);
    Ok(toml::to_string_pretty(&value)?)
}

fn redact_urls(value: &mut toml::Value) {
    match value {
        toml::Value::String(s) => {
            // a list of servers (`nats://a:4222,nats://b:4222`) is redacted server by server
            let parts: Vec<String> = s
                .split(',')
                .map(|part| redacted_url(part).unwrap_or_else(|| part.to_owned()))
                .collect();
            let redacted = parts.join(",");
            if redacted != *s {
                *s = redacted;
            }
        }
        toml::Value::Array(items) => items.iter_mut().for_each(redact_urls),
        toml::Value::Table(t) => {
            for (k, v) in t.iter_mut() {
                // a header's value given literally is as secret as its name says
                if k == "headers"
                    && let toml::Value::Table(headers) = v
                {
                    for (name, value) in headers.iter_mut() {
                        if secret_name(name) && value.is_str() {
                            *value =
                                toml::Value::String(z29c_security::secret_url::REDACTED.into());
                        }
                    }
                }
                redact_urls(v);
            }
        }
        _ => {}
    }
}

/// A name that says its value is a credential.
fn secret_name(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    [
        "password",
        "passwd",
        "token",
        "secret",
        "key",
        "authorization",
        "signature",
        "cookie",
    ]
    .iter()
    .any(|w| name.contains(w))
}

/// `s` with its URL credentials redacted, if it is a URL that holds any: a password, a user
/// alone where it is a token (any scheme but PostgreSQL's, whose user is a name), and secret
/// query parameters.
fn redacted_url(s: &str) -> Option<String> {
    use z29c_security::secret_url::REDACTED;
    let mut url = url::Url::parse(s.trim()).ok()?;
    if !url.has_host() {
        return None;
    }
    let mut changed = false;
    if url.password().is_some_and(|p| p != REDACTED) {
        let _ = url.set_password(Some(REDACTED));
        changed = true;
    } else if url.password().is_none()
        && !url.username().is_empty()
        && url.username() != REDACTED
        && !matches!(url.scheme(), "postgres" | "postgresql")
    {
        let _ = url.set_username(REDACTED);
        changed = true;
    }
    let secret = |k: &str| secret_name(k);
    if url.query_pairs().any(|(k, v)| secret(&k) && v != REDACTED) {
        let pairs: Vec<(String, String)> = url
            .query_pairs()
            .map(|(k, v)| {
                let v = if secret(&k) {
                    REDACTED.to_owned()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        url.query_pairs_mut().clear().extend_pairs(pairs);
        changed = true;
    }
    changed.then(|| url.into())
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
    // figment::Jail's closure returns figment's own (large) error type
    #[allow(clippy::result_large_err)]
    fn a_file_with_a_key_the_service_does_not_read_is_refused_naming_it() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "ok.toml",
                "prefix = \"prod\"\n[grpc]\nconcurrency_per_connection = 64\n",
            )?;
            let c: Service = load_config(Some(Path::new("ok.toml"))).map_err(|e| e.to_string())?;
            assert_eq!(c.grpc.concurrency_per_connection, 64);
            jail.create_file(
                "typo.toml",
                "prefx = \"prod\"\n[grpc]\nconcurency_per_connection = 64\n",
            )?;
            let e = load_config::<Service>(Some(Path::new("typo.toml")))
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with(
                    "typo.toml: unknown key `grpc.concurency_per_connection` and 1 more: prefx"
                ),
                "{e}"
            );
            // the environment may hold any Z29C_ variable: other programs' too
            jail.set_env("Z29C_SOMETHING_ELSE", "1");
            load_config::<Service>(Some(Path::new("ok.toml"))).map_err(|e| e.to_string())?;
            Ok(())
        });
    }

    #[test]
    fn arrays_are_checked_by_their_defaults_first_element_and_maps_take_any_key() {
        let known = serde_json::json!({ "items": [{ "name": "", "limits": {} }], "n": 1 });
        let given = serde_json::json!({
            "items": [{ "name": "a", "limits": { "charges": 2 } }, { "nmae": "b" }],
            "n": 2
        });
        let mut out = Vec::new();
        unknown_keys(&known, &given, "", &mut out);
        assert_eq!(out, ["items[1].nmae"]);
    }

    #[test]
    fn a_dump_redacts_credentials_in_every_url() {
        #[derive(Serialize)]
        struct C {
            nats_url: String,
            adapters: Vec<A>,
            plain: String,
        }
        #[derive(Serialize)]
        struct A {
            base_url: String,
        }
        #[derive(Serialize)]
        struct H {
            headers: std::collections::BTreeMap<&'static str, &'static str>,
            servers: String,
        }
        let h = H {
            headers: [("Authorization", "Bearer sk_live_2"), ("Accept", "json")].into(),
            servers: "nats://t0ken@a:4222,nats://b:4222".into(),
        };
        let out = dump(&h).unwrap();
        assert!(
            !out.contains("sk_live_2") && !out.contains("t0ken"),
            "{out}"
        );
        assert!(
            out.contains("nats://REDACTED@a:4222,nats://b:4222"),
            "{out}"
        );
        assert!(out.contains("Accept = \"json\""), "{out}");
        let c = C {
            nats_url: "nats://svc:hunter2@nats:4222".into(),
            adapters: vec![A {
                base_url: "https://api.example.com/v1?api_key=sk_live_1&region=eu".into(),
            }],
            plain: "not a url: hunter2".into(),
        };
        let out = dump(&c).unwrap();
        assert!(!out.contains("hunter2@"), "{out}");
        assert!(!out.contains("sk_live_1"), "{out}");
        assert!(out.contains("nats://svc:REDACTED@nats:4222"), "{out}");
        assert!(out.contains("api_key=REDACTED&region=eu"), "{out}");
        assert!(out.contains("not a url: hunter2"), "{out}");
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
