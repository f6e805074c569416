//! How every z29c HTTP listener (the scheduler's HTTP/JSON API, the console) serves HTTPS: a
//! rustls acceptor built from PEM files, and an axum [`Listener`] whose connections are past
//! their handshake. Handshakes run in tasks of their own, bounded in number and in time, so a
//! client that connects and says nothing holds up neither the next client nor a slot for long.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::serve::Listener;
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;
use z29c_security::TlsConfig;

/// A TLS handshake that has not finished by then is dropped: a client that opens
/// connections and says nothing must not hold a handshake slot.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshakes under way at once; further connections wait to be accepted.
const HANDSHAKES: usize = 256;

/// The certificate an HTTP listener presents (PEM files). Both `cert_file` and `key_file`
/// set: HTTPS only; neither: plain HTTP. With `client_ca_file` as well, a client certificate
/// from that CA is required before any request is read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct HttpsConfig {
    /// The certificate chain this listener presents, leaf first.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// When set, clients must present a certificate from this CA.
    pub client_ca_file: Option<PathBuf>,
}

impl HttpsConfig {
    /// The settings of a listener guarded like every gRPC port: this process's certificate,
    /// and a client certificate from the deployment's CA required (plain HTTP without `tls`).
    pub fn mutual(tls: &TlsConfig) -> anyhow::Result<Self> {
        if !tls.enabled()? {
            return Ok(Self::default());
        }
        Ok(Self {
            cert_file: tls.cert_file.clone(),
            key_file: tls.key_file.clone(),
            client_ca_file: tls.ca_file.clone(),
        })
    }

    /// Whether HTTPS is configured; a half-configured set is an error, not plain HTTP.
    pub fn enabled(&self) -> anyhow::Result<bool> {
        match (&self.cert_file, &self.key_file, &self.client_ca_file) {
            (None, None, None) => Ok(false),
            (Some(_), Some(_), _) => Ok(true),
            (None, None, Some(_)) => {
                anyhow::bail!("client_ca_file needs cert_file and key_file")
            }
            _ => anyhow::bail!("set both cert_file and key_file, or neither"),
        }
    }

    /// The acceptor for these settings, or none for plain HTTP. `setting` names them in
    /// errors (`tls`, `https`). Only HTTP/1.1 is offered, which every HTTP client speaks.
    pub fn acceptor(&self, setting: &str) -> anyhow::Result<Option<TlsAcceptor>> {
        if !self.enabled().with_context(|| setting.to_owned())? {
            return Ok(None);
        }
        let (Some(cert_file), Some(key_file)) = (&self.cert_file, &self.key_file) else {
            return Ok(None);
        };
        let read = |path: &Path, what: &str| {
            std::fs::read(path)
                .with_context(|| format!("{setting}: cannot read the {what} {}", path.display()))
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .context("tls: protocol versions")?;
        let builder = match &self.client_ca_file {
            Some(ca_file) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(&read(ca_file, "client CA")?) {
                    roots
                        .add(cert.with_context(|| {
                            format!("{setting}: {} is not a PEM certificate", ca_file.display())
                        })?)
                        .with_context(|| setting.to_owned())?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .with_context(|| {
                    format!(
                        "{setting}: no usable CA certificate in {}",
                        ca_file.display()
                    )
                })?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let certs = CertificateDer::pem_slice_iter(&read(cert_file, "certificate")?)
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| {
                format!(
                    "{setting}: {} is not a PEM certificate",
                    cert_file.display()
                )
            })?;
        let key =
            PrivateKeyDer::from_pem_slice(&read(key_file, "private key")?).with_context(|| {
                format!("{setting}: {} is not a PEM private key", key_file.display())
            })?;
        let mut config = builder
            .with_single_cert(certs, key)
            .with_context(|| format!("{setting}: the certificate and key do not go together"))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Some(TlsAcceptor::from(Arc::new(config))))
    }
}

/// A served connection: plain, or past its TLS handshake.
pub type Conn = Either<TcpStream, Box<tokio_rustls::server::TlsStream<TcpStream>>>;

/// Connections ready to be served: accepted, and past their TLS handshake when TLS is on.
#[derive(Debug)]
pub struct Incoming {
    local: SocketAddr,
    ready: mpsc::Receiver<(Conn, SocketAddr)>,
}

impl Incoming {
    /// Accepts on `listener` until `shutdown`, with `tls` when it is set; `name` labels the
    /// listener in logs.
    pub fn spawn(
        listener: TcpListener,
        tls: Option<TlsAcceptor>,
        name: &'static str,
        shutdown: CancellationToken,
    ) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let (tx, ready) = mpsc::channel(64);
        tokio::spawn(accept_loop(listener, tls, name, tx, shutdown));
        Ok(Self { local, ready })
    }
}

impl Listener for Incoming {
    type Io = Conn;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(conn) => conn,
            // the accepting task ended with the process's shutdown; the server stops first
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

async fn accept_loop(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    name: &'static str,
    ready: mpsc::Sender<(Conn, SocketAddr)>,
    shutdown: CancellationToken,
) {
    let handshakes = Arc::new(Semaphore::new(HANDSHAKES));
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => return,
            a = listener.accept() => a,
        };
        let (tcp, peer) = match accepted {
            Ok(c) => c,
            // one connection's trouble, not the listener's
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                continue;
            }
            Err(e) => {
                // out of file descriptors, say: accepting again at once would spin
                tracing::warn!(listener = name, error = %e, "accept failed");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                }
            }
        };
        let _ = tcp.set_nodelay(true);
        let Some(acceptor) = &tls else {
            if ready.send((Either::Left(tcp), peer)).await.is_err() {
                return;
            }
            continue;
        };
        let permit = tokio::select! {
            _ = shutdown.cancelled() => return,
            p = handshakes.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return,
            },
        };
        let (acceptor, ready) = (acceptor.clone(), ready.clone());
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => {
                    let _ = ready.send((Either::Right(Box::new(stream)), peer)).await;
                }
                Ok(Err(e)) => {
                    tracing::debug!(listener = name, %peer, error = %e, "tls handshake failed");
                }
                Err(_) => tracing::debug!(listener = name, %peer, "tls handshake timed out"),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_files_or_neither_and_a_client_ca_only_with_them() {
        assert!(!HttpsConfig::default().enabled().unwrap());
        let half = HttpsConfig {
            cert_file: Some("c.pem".into()),
            ..HttpsConfig::default()
        };
        assert!(half.enabled().is_err());
        let ca_alone = HttpsConfig {
            client_ca_file: Some("ca.pem".into()),
            ..HttpsConfig::default()
        };
        assert!(ca_alone.enabled().is_err());
        assert!(
            !HttpsConfig::mutual(&TlsConfig::default())
                .unwrap()
                .enabled()
                .unwrap()
        );
    }

    #[test]
    fn a_dev_certificate_serves_with_or_without_client_certificates() {
        let dir = std::env::temp_dir().join(format!("z29c-https-{}", std::process::id()));
        let pki = z29c_security::pki::DevPki::generate(&dir, &["svc"]).unwrap();
        let mutual = HttpsConfig::mutual(&pki.tls("svc")).unwrap();
        assert_eq!(mutual.client_ca_file, Some(dir.join("ca.pem")));
        assert!(mutual.acceptor("tls").unwrap().is_some());
        let browser = HttpsConfig {
            client_ca_file: None,
            ..mutual
        };
        assert!(browser.acceptor("https").unwrap().is_some());
        let missing = HttpsConfig {
            key_file: Some(dir.join("nope.key")),
            ..browser
        };
        let Err(e) = missing.acceptor("https") else {
            panic!("a missing key file served")
        };
        let e = e.to_string();
        assert!(e.starts_with("https: cannot read the private key"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
