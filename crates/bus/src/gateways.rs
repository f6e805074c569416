//! Finding a gateway for an adapter through the registry, with cached gRPC channels. Used by
//! executors (to invoke) and recovery (to query); round-robin spreads calls over instances.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::{Bus, GatewayRecord};
use tokio::sync::Mutex;
use tonic::transport::Channel;
use z29c_core::AdapterCapability;
use z29c_proto::v1::adapter_gateway_client::AdapterGatewayClient;

/// How old a read of the registry may be before the next call reads it again (behind itself).
pub const REFRESH: Duration = Duration::from_secs(2);
/// How old a read must be before an adapter it does not name makes the next call wait for a
/// fresh one.
pub const MISS_REFRESH: Duration = Duration::from_secs(1);

#[derive(Debug, Clone)]
pub struct Gateways {
    bus: Bus,
    /// Client certificate and CA for the gateways' mutual TLS (none: plaintext).
    tls: z29c_security::TlsConfig,
    inner: Arc<Mutex<Cache>>,
    next: Arc<AtomicUsize>,
}

#[derive(Debug, Default)]
struct Cache {
    records: Vec<GatewayRecord>,
    fetched: Option<Instant>,
    /// A read of the registry is under way in the background.
    refreshing: bool,
    channels: HashMap<String, Channel>,
}

/// A gateway chosen for one call.
#[derive(Debug, Clone)]
pub struct Chosen {
    pub client: AdapterGatewayClient<Channel>,
    pub gateway: String,
    pub capability: AdapterCapability,
}

impl Gateways {
    pub fn new(bus: Bus, tls: z29c_security::TlsConfig) -> Self {
        Self {
            bus,
            tls,
            inner: Arc::default(),
            next: Arc::default(),
        }
    }

    /// Reads the registry again, waiting for it, when the cache is `max_age` old or holds no
    /// gateway. A younger cache older than [`REFRESH`] is used as it is while one read of the
    /// registry runs in the background: the read is a round trip per registered gateway,
    /// and every attempt starting meanwhile used to wait for it. An error means
    /// the registry could not be read when a read was waited for.
    async fn refresh(&self, cache: &mut Cache, max_age: Duration) -> crate::Result<()> {
        if cache.records.is_empty() || cache.fetched.is_none_or(|t| t.elapsed() >= max_age) {
            match self.bus.gateways().await {
                Ok(records) => {
                    cache.records = records;
                    cache.fetched = Some(Instant::now());
                }
                Err(e) => {
                    tracing::warn!(error = %e, "gateway registry unavailable");
                    return Err(e);
                }
            }
        } else if !cache.refreshing && cache.fetched.is_none_or(|t| t.elapsed() > REFRESH) {
            cache.refreshing = true;
            let (bus, inner) = (self.bus.clone(), self.inner.clone());
            tokio::spawn(async move {
                let read = bus.gateways().await;
                let mut cache = inner.lock().await;
                cache.refreshing = false;
                match read {
                    Ok(records) => {
                        cache.records = records;
                        cache.fetched = Some(Instant::now());
                    }
                    Err(e) => tracing::warn!(error = %e, "gateway registry unavailable"),
                }
            });
        }
        Ok(())
    }

    /// The registered gateways as read at most `max_age` ago (`Duration::ZERO`: read now).
    /// Empty when none is registered; an error when the registry could not be read, so that
    /// "nobody is registered" is never guessed from an outage.
    pub async fn records(&self, max_age: Duration) -> crate::Result<Vec<GatewayRecord>> {
        let mut cache = self.inner.lock().await;
        self.refresh(&mut cache, max_age).await?;
        Ok(cache.records.clone())
    }

    /// A gateway serving `adapter`, round-robin across the registered instances.
    pub async fn for_adapter(&self, adapter: &str) -> Option<Chosen> {
        let mut cache = self.inner.lock().await;
        // a call goes by a read no older than a registration lives; an unreadable registry
        // finds no gateway, and the caller waits and tries again
        let _ = self.refresh(&mut cache, crate::REGISTRATION_TTL).await;
        let serving = |records: &[GatewayRecord]| -> Vec<(String, String, AdapterCapability)> {
            records
                .iter()
                .filter_map(|g| {
                    g.adapters
                        .iter()
                        .find(|a| a.name == adapter)
                        .map(|a| (g.id.clone(), g.endpoint.clone(), a.capability))
                })
                .collect()
        };
        let mut found = serving(&cache.records);
        // a gateway that registered since the last read serves it, perhaps: read again, at
        // most once a [`MISS_REFRESH`]
        if found.is_empty() && cache.fetched.is_none_or(|t| t.elapsed() >= MISS_REFRESH) {
            let _ = self.refresh(&mut cache, Duration::ZERO).await;
            found = serving(&cache.records);
        }
        let serving = found;
        if serving.is_empty() {
            return None;
        }
        let (id, endpoint, capability) =
            serving[self.next.fetch_add(1, Ordering::Relaxed) % serving.len()].clone();
        let channel = match cache.channels.get(&endpoint) {
            Some(c) => c.clone(),
            None => {
                let c = match self.tls.endpoint(&endpoint) {
                    Ok(e) => e,
                    Err(e) => {
                        tracing::warn!(%endpoint, error = %e, "gateway endpoint unusable");
                        return None;
                    }
                }
                .connect_timeout(Duration::from_secs(2))
                .connect_lazy();
                cache.channels.insert(endpoint, c.clone());
                c
            }
        };
        Some(Chosen {
            client: AdapterGatewayClient::new(channel),
            gateway: id,
            capability,
        })
    }
}
