//! A throwaway CA for `z29c dev` and the test harness: one CA, and for each member a key and a
//! certificate valid as server and as client for `localhost` and `127.0.0.1`, naming the
//! member's role (URI SAN `spiffe://z29c/<member>`) when the member is named after one. Production takes
//! its certificates from files instead ([`crate::TlsConfig`]).

use std::path::{Path, PathBuf};

use anyhow::Context;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};
use z29c_core::identity::ServiceRole;

use crate::TlsConfig;

/// Certificates written to `dir`: `ca.pem`, and `<member>.pem` / `<member>.key` per member.
#[derive(Debug, Clone)]
pub struct DevPki {
    pub dir: PathBuf,
}

impl DevPki {
    /// Makes a new CA (its key is not kept: nothing more can be signed by it) and one
    /// certificate per member.
    pub fn generate(dir: &Path, members: &[&str]) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        let mut ca = CertificateParams::default();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "z29c throwaway CA");
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate()?)?;
        write(&dir.join("ca.pem"), &ca.pem())?;
        for member in members {
            let mut params =
                CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])?;
            params.distinguished_name.push(DnType::CommonName, *member);
            if let Ok(role) = member.parse::<ServiceRole>() {
                params
                    .subject_alt_names
                    .push(SanType::URI(role.uri().try_into()?));
            }
            params.extended_key_usages = vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ];
            let key = KeyPair::generate()?;
            let cert = params.signed_by(&key, &ca)?;
            write(&dir.join(format!("{member}.pem")), &cert.pem())?;
            write(&dir.join(format!("{member}.key")), &key.serialize_pem())?;
        }
        Ok(Self {
            dir: dir.to_owned(),
        })
    }

    /// The TLS settings of `member`.
    pub fn tls(&self, member: &str) -> TlsConfig {
        TlsConfig::from_dir(&self.dir, member)
    }
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text).with_context(|| format!("write {}", path.display()))?;
    #[cfg(unix)]
    if path.extension().is_some_and(|e| e == "key") {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    }
    Ok(())
}
