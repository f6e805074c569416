//! Mutual TLS between services. One CA signs every service's certificate; each server
//! requires a client certificate from that CA, and each client presents its own, so a process
//! without a certificate from the deployment's CA cannot call any service.

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// Certificate files (PEM). All three set: TLS with client certificates required; none set:
/// plaintext (loopback development only; a warning says so).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TlsConfig {
    /// The CA that signs every service's certificate (and operators' client certificates).
    pub ca_file: Option<PathBuf>,
    /// This process's certificate, used as server and as client.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// The name clients expect in servers' certificates; by default the URL's host.
    pub server_name: Option<String>,
}

fn read(path: &Path, what: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("tls.{what}: cannot read {}", path.display()))
}

impl TlsConfig {
    /// The files of a [`crate::pki::DevPki`] member.
    pub fn from_dir(dir: &Path, name: &str) -> Self {
        Self {
            ca_file: Some(dir.join("ca.pem")),
            cert_file: Some(dir.join(format!("{name}.pem"))),
            key_file: Some(dir.join(format!("{name}.key"))),
            server_name: None,
        }
    }

    /// Whether TLS is configured; a half-configured set is an error, not plaintext.
    pub fn enabled(&self) -> anyhow::Result<bool> {
        match (&self.ca_file, &self.cert_file, &self.key_file) {
            (None, None, None) => Ok(false),
            (Some(_), Some(_), Some(_)) => Ok(true),
            _ => anyhow::bail!("tls: set all of ca_file, cert_file and key_file, or none"),
        }
    }

    fn identity(&self) -> anyhow::Result<(Certificate, Identity)> {
        let (Some(ca), Some(cert), Some(key)) = (&self.ca_file, &self.cert_file, &self.key_file)
        else {
            anyhow::bail!("tls: set all of ca_file, cert_file and key_file");
        };
        Ok((
            Certificate::from_pem(read(ca, "ca_file")?),
            Identity::from_pem(read(cert, "cert_file")?, read(key, "key_file")?),
        ))
    }

    /// Server settings requiring a client certificate from the CA, if TLS is configured.
    pub fn server(&self) -> anyhow::Result<Option<ServerTlsConfig>> {
        if !self.enabled()? {
            return Ok(None);
        }
        let (ca, identity) = self.identity()?;
        Ok(Some(
            ServerTlsConfig::new()
                .identity(identity)
                .client_ca_root(ca)
                .client_auth_optional(false),
        ))
    }

    /// Client settings presenting this process's certificate, if TLS is configured.
    pub fn client(&self) -> anyhow::Result<Option<ClientTlsConfig>> {
        if !self.enabled()? {
            return Ok(None);
        }
        let (ca, identity) = self.identity()?;
        let mut c = ClientTlsConfig::new().ca_certificate(ca).identity(identity);
        if let Some(name) = &self.server_name {
            c = c.domain_name(name.clone());
        }
        Ok(Some(c))
    }

    /// A tonic server builder with these settings applied.
    pub fn server_builder(&self) -> anyhow::Result<tonic::transport::Server> {
        let builder = tonic::transport::Server::builder();
        Ok(match self.server()? {
            Some(tls) => builder.tls_config(tls).context("tls: server settings")?,
            None => builder,
        })
    }

    /// An endpoint for `url` with these settings: `https://` when TLS is on (an `http://` URL
    /// is upgraded, since the registry and configuration may hold either).
    pub fn endpoint(&self, url: &str) -> anyhow::Result<Endpoint> {
        match self.client()? {
            Some(tls) => {
                let url = match url.strip_prefix("http://") {
                    Some(rest) => format!("https://{rest}"),
                    None => url.to_owned(),
                };
                Ok(Endpoint::from_shared(url.clone())
                    .with_context(|| format!("bad URL {url:?}"))?
                    .tls_config(tls)
                    .context("tls: client settings")?)
            }
            None => {
                Endpoint::from_shared(url.to_owned()).with_context(|| format!("bad URL {url:?}"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_or_nothing() {
        assert!(!TlsConfig::default().enabled().unwrap());
        let half = TlsConfig {
            ca_file: Some("ca.pem".into()),
            ..TlsConfig::default()
        };
        let e = half.enabled().unwrap_err().to_string();
        assert!(e.contains("cert_file"), "{e}");
        assert!(half.server().is_err());
        assert!(half.client().is_err());
    }

    #[test]
    fn missing_files_name_the_setting() {
        let c = TlsConfig::from_dir(Path::new("/nonexistent-z29c"), "x");
        let e = c.server().unwrap_err().to_string();
        assert!(e.contains("tls.ca_file"), "{e}");
    }

    #[test]
    fn plaintext_endpoint_keeps_the_url_and_tls_upgrades_it() {
        let dir = std::env::temp_dir().join(format!("z29c-tls-{}", std::process::id()));
        let pki = crate::pki::DevPki::generate(&dir, &["svc"]).unwrap();
        let plain = TlsConfig::default().endpoint("http://127.0.0.1:1").unwrap();
        assert_eq!(plain.uri().scheme_str(), Some("http"));
        let tls = pki.tls("svc").endpoint("http://127.0.0.1:1").unwrap();
        assert_eq!(tls.uri().scheme_str(), Some("https"));
        assert!(pki.tls("svc").server().unwrap().is_some());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
