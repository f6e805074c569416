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

    /// Reads the registry again, waiting for it, when asked to or when the cache holds no
    /// gateway. A cache older than [`REFRESH`] is used as it is while one read of the
    /// registry runs in the background: the read creates a JetStream consumer and fetches
    /// through it, and every attempt starting meanwhile used to wait for it.
    async fn refresh(&self, cache: &mut Cache, now: bool) {
        if now || cache.records.is_empty() {
            match self.bus.gateways().await {
                Ok(records) => {
                    cache.records = records;
                    cache.fetched = Some(Instant::now());
                }
                Err(e) => tracing::warn!(error = %e, "gateway registry unavailable"),
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
    }

    /// The registered gateways as last read (at most [`REFRESH`] ago), or as read now when
    /// `fresh`. Empty when none is registered or the registry cannot be read.
    pub async fn records(&self, fresh: bool) -> Vec<GatewayRecord> {
        let mut cache = self.inner.lock().await;
        self.refresh(&mut cache, fresh).await;
        cache.records.clone()
    }

    /// A gateway serving `adapter`, round-robin across the registered instances.
    pub async fn for_adapter(&self, adapter: &str) -> Option<Chosen> {
        let mut cache = self.inner.lock().await;
        self.refresh(&mut cache, false).await;
        let serving: Vec<(String, String, AdapterCapability)> = cache
            .records
            .iter()
            .filter_map(|g| {
                g.adapters
                    .iter()
                    .find(|a| a.name == adapter)
                    .map(|a| (g.id.clone(), g.endpoint.clone(), a.capability))
            })
            .collect();
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
