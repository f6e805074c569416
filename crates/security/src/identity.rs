//! Service identities: the roles a peer's certificate names (URI SANs `spiffe://z29c/<role>`),
//! and the check each server runs on every call before anything else
//! (`z29c_core::identity` says which roles each server accepts).

use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
use z29c_core::identity::{Server, ServiceRole, refusal};

/// The z29c roles named in a DER certificate's URI SANs; none for a certificate that names no
/// role or cannot be read.
pub fn roles_in(der: &[u8]) -> Vec<ServiceRole> {
    let Ok((_, cert)) = X509Certificate::from_der(der) else {
        return Vec::new();
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::URI(uri) => ServiceRole::from_uri(uri),
            _ => None,
        })
        .collect()
}

/// The roles of a peer's certificate chain: those its leaf (the first certificate) names.
pub fn peer_roles<C: AsRef<[u8]>>(chain: &[C]) -> Vec<ServiceRole> {
    chain
        .first()
        .map(|c| roles_in(c.as_ref()))
        .unwrap_or_default()
}

/// Whether a caller whose certificate names `roles` may call `server`; the refusal says why
/// not (`PERMISSION_DENIED`).
pub fn admit(server: Server, roles: &[ServiceRole]) -> Result<(), tonic::Status> {
    if server.admits(roles) {
        Ok(())
    } else {
        Err(tonic::Status::permission_denied(refusal(server, roles)))
    }
}

/// A tonic interceptor refusing calls whose client certificate names no role `server`
/// accepts. Without TLS (`enforce` false: loopback development) there is no certificate to
/// read and every call passes; the server warns about plaintext at start.
#[derive(Debug, Clone, Copy)]
pub struct RoleCheck {
    server: Server,
    enforce: bool,
}

impl RoleCheck {
    pub fn new(server: Server, tls: &crate::TlsConfig) -> anyhow::Result<Self> {
        Ok(Self {
            server,
            enforce: tls.enabled()?,
        })
    }
}

impl tonic::service::Interceptor for RoleCheck {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if !self.enforce {
            return Ok(request);
        }
        let roles = request
            .peer_certs()
            .map(|chain| peer_roles(&chain))
            .unwrap_or_default();
        if let Err(refused) = admit(self.server, &roles) {
            tracing::warn!(
                server = %self.server,
                roles = ?roles,
                peer = ?request.remote_addr(),
                "call refused: the certificate's role may not call this server"
            );
            return Err(refused);
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dev_certificate_names_its_role_and_others_name_none() {
        let dir = std::env::temp_dir().join(format!("z29c-roles-{}", std::process::id()));
        let pki =
            crate::pki::DevPki::generate(&dir, &["executor", "operator", "stranger"]).unwrap();
        let der = |member: &str| {
            let pem = std::fs::read(pki.tls(member).cert_file.unwrap()).unwrap();
            rustls_pemfile_der(&pem)
        };
        assert_eq!(roles_in(&der("executor")), [ServiceRole::Executor]);
        assert_eq!(roles_in(&der("operator")), [ServiceRole::Operator]);
        assert!(roles_in(&der("stranger")).is_empty());
        assert!(roles_in(b"not a certificate").is_empty());
        assert_eq!(
            peer_roles(&[der("executor"), der("operator")]),
            [ServiceRole::Executor]
        );
        assert!(peer_roles::<Vec<u8>>(&[]).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn admission_follows_the_core_rule() {
        assert!(admit(Server::Gateway, &[ServiceRole::Executor]).is_ok());
        let refused = admit(Server::Gateway, &[ServiceRole::Operator]).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        assert!(
            refused.message().contains("operator"),
            "{}",
            refused.message()
        );
    }

    /// The DER bytes of the first PEM block.
    fn rustls_pemfile_der(pem: &[u8]) -> Vec<u8> {
        let (_, parsed) = x509_parser::pem::parse_x509_pem(pem).unwrap();
        parsed.contents
    }
}
