//! Gateway configuration. Defaults suit `z29c dev`; production sets them from file and
//! `Z29C_…` environment (see `z29c_runtime::load_config`).

use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};
use z29c_core::AdapterCapability;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct GatewayConfig {
    /// This instance's name in the registry and in permits.
    pub id: String,
    /// The fields every service has (database, NATS, metrics), at the top level.
    #[serde(flatten)]
    pub shared: z29c_runtime::SharedConfig,
    pub listen: SocketAddr,
    /// The gRPC address registered for executors (`http://host:port`); by default the bound
    /// address, which is right on one host but not behind `0.0.0.0` in a container or pod.
    pub advertise: Option<String>,
    pub max_connections: u32,
    pub adapters: Vec<AdapterConfig>,
    /// Calls this instance runs at once, over all adapters; more are answered "rate limited,
    /// retry shortly" so the executor gives the step back. Adding an instance adds this much
    /// capacity, up to each adapter's permit limit.
    pub max_calls: usize,
    /// Where the gRPC health protocol alone is served without TLS (kubelet probes cannot
    /// present a client certificate), if anywhere.
    pub health_listen: Option<std::net::SocketAddr>,
    /// Invocation batching: *invocation began* and the permits of calls that arrive together
    /// share one statement, up to this many (each call fenced on its own; a call that
    /// statement cannot take, such as one whose lease is not current or whose class is full,
    /// takes its own transaction, which says why). 1: off, every call is its own transaction.
    pub invocation_batch: usize,
    /// Connections writing shared invocation statements at once (a pool of their own, beside
    /// `max_connections`).
    pub invocation_committers: usize,
    /// How long the permit of an ended call may wait to be released by this gateway's next
    /// permit transaction before it is released on its own (0: at once, a `COMMIT` each).
    /// Waiting only ever holds capacity a little longer, never less.
    pub release_linger_ms: u64,
    /// Mutual TLS: executors and recovery must present a certificate from `tls.ca_file`.
    pub tls: z29c_security::TlsConfig,
    /// Deadline cap and per-connection limits of the gRPC server.
    pub grpc: z29c_runtime::ServerLimits,
    /// Largest request accepted (an invocation's input included).
    pub max_request_bytes: usize,
    /// Fault injection (only with the `faults` feature): abort after the destination answered
    /// that it committed, before replying to the executor.
    #[cfg(feature = "faults")]
    pub fault_crash_after_destination: bool,
    /// Fault injection (only with the `faults` feature): abort at a crash point the gateway
    /// owns, `before_invocation_began` or `after_invocation_began` (it commits that
    /// checkpoint with the call's permit).
    #[cfg(feature = "faults")]
    pub fault_crash: Option<z29c_store::faults::CrashPoint>,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            id: "gateway-1".into(),
            shared: z29c_runtime::SharedConfig::default(),
            listen: "127.0.0.1:50052".parse().expect("literal address"),
            advertise: None,
            max_connections: 8,
            adapters: vec![AdapterConfig::default()],
            max_calls: 256,
            health_listen: None,
            invocation_batch: 32,
            invocation_committers: 2,
            release_linger_ms: 5,
            tls: Default::default(),
            grpc: z29c_runtime::ServerLimits {
                max_deadline_ms: 60_000,
                ..Default::default()
            },
            max_request_bytes: 1024 * 1024,
            #[cfg(feature = "faults")]
            fault_crash_after_destination: false,
            #[cfg(feature = "faults")]
            fault_crash: None,
        }
    }
}

/// One adapter: an HTTP service reached at `base_url`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct AdapterConfig {
    pub name: String,
    pub version: String,
    pub base_url: String,
    pub capability: AdapterCapability,
    /// Calls in flight allowed per operation class, across all gateway instances.
    pub limits: BTreeMap<String, u32>,
    /// Limit for operation classes not listed in `limits`.
    pub default_limit: u32,
    /// How long a permit counts if its holder never releases it.
    pub permit_hold_ms: u64,
    /// How long a permit keeps counting after an unknown outcome.
    pub safety_window_ms: u64,
    /// `http`: the gateway speaks the API by `http`; `custom`: the gateway binary brings its
    /// own implementation of this adapter ([`crate::adapter::Adapter`]).
    pub kind: AdapterKind,
    /// How the adapter speaks to its API (by default z29c's own contract).
    pub http: crate::contract::HttpContract,
}

/// Who makes an adapter's calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdapterKind {
    /// The gateway, by the adapter's declared HTTP contract.
    #[default]
    Http,
    /// An implementation the gateway binary was built with.
    Custom,
}

impl Default for AdapterConfig {
    fn default() -> Self {
        Self {
            name: "http".into(),
            version: "http/1".into(),
            base_url: "http://127.0.0.1:8080".into(),
            capability: AdapterCapability::Idempotent,
            limits: BTreeMap::new(),
            default_limit: 16,
            permit_hold_ms: 60_000,
            safety_window_ms: 120_000,
            kind: AdapterKind::Http,
            http: Default::default(),
        }
    }
}

impl z29c_runtime::Validate for GatewayConfig {
    fn validate(&self) -> Result<(), z29c_runtime::config::Invalid> {
        use z29c_runtime::config::{Invalid, at_least_one};
        self.shared.validate()?;
        self.grpc.validate()?;
        at_least_one("max_connections", self.max_connections as usize)?;
        at_least_one("max_calls", self.max_calls)?;
        at_least_one("invocation_batch", self.invocation_batch)?;
        at_least_one("invocation_committers", self.invocation_committers)?;
        at_least_one("max_request_bytes", self.max_request_bytes)?;
        if self.adapters.is_empty() {
            return Err(Invalid::new(
                "adapters",
                "a gateway serves at least one adapter",
            ));
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, a) in self.adapters.iter().enumerate() {
            let field = |f: &str| format!("adapters[{i}].{f}");
            if a.name.is_empty() {
                return Err(Invalid::new(field("name"), "must not be empty"));
            }
            if !names.insert(a.name.as_str()) {
                return Err(Invalid::new(
                    field("name"),
                    format!("{:?} is served twice by this gateway", a.name),
                ));
            }
            let limit = |f: String, v: u32| {
                if v == 0 || i32::try_from(v).is_err() {
                    return Err(Invalid::new(
                        f,
                        format!("{v} is not between 1 and {}", i32::MAX),
                    ));
                }
                Ok(())
            };
            if a.kind == AdapterKind::Http {
                if !(a.base_url.starts_with("http://") || a.base_url.starts_with("https://")) {
                    return Err(Invalid::new(
                        field("base_url"),
                        format!("{:?} is not an http:// or https:// URL", a.base_url),
                    ));
                }
                a.http.check(a.capability).map_err(|(f, why)| {
                    Invalid::new(field(&f), format!("{} adapter: {why}", a.capability))
                })?;
                // a secret that cannot be read stops the gateway here, before anything runs
                // (and `--dump-config` says so), naming where it was to come from
                a.http
                    .check_secrets()
                    .map_err(|(f, why)| Invalid::new(field(&f), why))?;
            }
            limit(field("default_limit"), a.default_limit)?;
            for (class, v) in &a.limits {
                limit(field(&format!("limits.{class}")), *v)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every setting an adapter's contract takes passes the check for unknown keys, unset
    /// optional ones included; a misspelt one is named.
    #[test]
    fn every_contract_setting_is_a_known_key_and_a_typo_is_named() {
        let dir = std::env::temp_dir().join(format!("z29c-gateway-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("gateway.toml");
        let carrier = r#"
[[adapters]]
name = "carrier"
base_url = "http://127.0.0.1:9/carrier"
capability = "queryable"
limits = { shipments = 2 }
[adapters.http]
method = "POST"
path = "/shipments"
idempotency_header = ""
identity_field = "customer_reference"
reference = "/id"
refusal_reason = "/error/message"
done = [200, 201]
refused = ["4xx"]
rate_limited = [429]
in_flight = [409]
[adapters.http.headers]
Authorization = { env = "CARRIER_KEY", prefix = "Bearer " }
X-Api-Version = "3"
[adapters.http.query]
method = "GET"
path = "/shipments?customer_reference={identity}"
found = { status = [200], reference = "/data/0/id", result = "/data/0" }
not_found = [{ status = [200], empty = "/data" }, { status = [404] }]
in_flight = [202]
"#;
        std::fs::write(&file, carrier).unwrap();
        let checked = z29c_runtime::config::check_file_keys::<GatewayConfig>(&file)
            .map_err(|e| e.to_string());
        assert_eq!(checked, Ok(()));
        std::fs::write(&file, carrier.replace("empty = ", "emtpy = ")).unwrap();
        let e = z29c_runtime::config::check_file_keys::<GatewayConfig>(&file)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown key `adapters[0].http.query.not_found[0].emtpy`"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
