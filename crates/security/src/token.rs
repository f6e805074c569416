//! Operator tokens: JWTs carrying a subject and roles, verified against configured keys (HS256
//! shared secrets, or Ed25519 / P-256 / RSA public keys in PEM files), with an expiry that is
//! always required. Missing or bad credentials are `UNAUTHENTICATED`; a known caller without a
//! role that allows the action is `PERMISSION_DENIED`.

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use tonic::metadata::MetadataMap;
use z29c_core::{Action, Role};

/// How operators authenticate.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct AuthConfig {
    /// Off: calls carry no credentials and every caller may do everything (loopback
    /// development only; a warning says so).
    pub enabled: bool,
    /// Shared secrets for HS256 tokens; any of them verifies (so a secret can be rotated).
    /// Never printed by `--dump-config`: each shows as `REDACTED`.
    #[serde(serialize_with = "redacted_each")]
    pub hs256_secrets: Vec<SecretString>,
    /// PEM public keys (Ed25519, P-256 or RSA) of token issuers.
    pub public_key_files: Vec<PathBuf>,
    /// The `aud` every token must carry.
    pub audience: String,
    /// The `iss` every token must carry, if set.
    pub issuer: Option<String>,
}

fn redacted_each<S: serde::Serializer>(secrets: &[SecretString], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(secrets.iter().map(|_| crate::secret_url::REDACTED))
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            hs256_secrets: Vec::new(),
            public_key_files: Vec::new(),
            audience: "z29c".into(),
            issuer: None,
        }
    }
}

/// A token's claims.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Claims {
    pub sub: String,
    pub exp: u64,
    pub aud: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iss: Option<String>,
    #[serde(default)]
    pub roles: Vec<String>,
}

/// Who is calling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub subject: String,
    pub roles: Vec<Role>,
}

impl Caller {
    /// The caller when authentication is off: may do everything.
    pub fn unauthenticated_development() -> Self {
        Self {
            subject: "anonymous".into(),
            roles: Role::ALL.to_vec(),
        }
    }
}

/// Why a call was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    /// No credentials, or credentials that do not verify (bad signature, expired, wrong
    /// audience): the caller must get a valid token.
    #[error("{0}")]
    Unauthenticated(String),
    /// A verified caller without a role that allows the action: someone must grant it.
    #[error("{subject} may not {action}: it needs the role {needs} (it has {has})")]
    PermissionDenied {
        subject: String,
        action: Action,
        needs: &'static str,
        has: String,
    },
}

impl Denied {
    /// The subject, when the caller was identified.
    pub fn subject(&self) -> Option<&str> {
        match self {
            Denied::Unauthenticated(_) => None,
            Denied::PermissionDenied { subject, .. } => Some(subject),
        }
    }

    /// `unauthenticated` or `permission_denied`, as audited.
    pub fn kind(&self) -> &'static str {
        match self {
            Denied::Unauthenticated(_) => "unauthenticated",
            Denied::PermissionDenied { .. } => "permission_denied",
        }
    }
}

impl From<Denied> for tonic::Status {
    fn from(d: Denied) -> Self {
        match d {
            Denied::Unauthenticated(_) => tonic::Status::unauthenticated(d.to_string()),
            Denied::PermissionDenied { .. } => tonic::Status::permission_denied(d.to_string()),
        }
    }
}

/// Checks tokens against the configured keys.
#[derive(Clone)]
pub struct Verifier {
    enabled: bool,
    keys: Vec<(DecodingKey, Validation)>,
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verifier")
            .field("enabled", &self.enabled)
            .field("keys", &self.keys.len())
            .finish()
    }
}

fn validation(alg: Algorithm, c: &AuthConfig) -> Validation {
    let mut v = Validation::new(alg);
    v.set_audience(&[&c.audience]);
    if let Some(iss) = &c.issuer {
        v.set_issuer(&[iss]);
    }
    v.set_required_spec_claims(&["exp", "sub", "aud"]);
    v.leeway = 5;
    v
}

impl Verifier {
    pub fn from_config(c: &AuthConfig) -> anyhow::Result<Self> {
        let mut keys = Vec::new();
        for s in &c.hs256_secrets {
            let secret = s.expose_secret().as_bytes();
            anyhow::ensure!(
                secret.len() >= 32,
                "auth.hs256_secrets: a secret needs at least 32 bytes"
            );
            keys.push((
                DecodingKey::from_secret(secret)?,
                validation(Algorithm::HS256, c),
            ));
        }
        for path in &c.public_key_files {
            let pem = std::fs::read(path).with_context(|| {
                format!("auth.public_key_files: cannot read {}", path.display())
            })?;
            let key = if let Ok(k) = DecodingKey::from_ed_pem(&pem) {
                (k, Algorithm::EdDSA)
            } else if let Ok(k) = DecodingKey::from_ec_pem(&pem) {
                (k, Algorithm::ES256)
            } else if let Ok(k) = DecodingKey::from_rsa_pem(&pem) {
                (k, Algorithm::RS256)
            } else {
                anyhow::bail!(
                    "auth.public_key_files: {} is not an Ed25519, P-256 or RSA public key (PEM)",
                    path.display()
                );
            };
            keys.push((key.0, validation(key.1, c)));
        }
        anyhow::ensure!(
            !c.enabled || !keys.is_empty(),
            "auth.enabled needs auth.hs256_secrets or auth.public_key_files"
        );
        Ok(Self {
            enabled: c.enabled,
            keys,
        })
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The caller a token names, if it verifies.
    pub fn verify_token(&self, token: &str) -> Result<Caller, Denied> {
        if !self.enabled {
            return Ok(Caller::unauthenticated_development());
        }
        let mut why = "the token does not verify against any configured key".to_owned();
        for (key, validation) in &self.keys {
            match jsonwebtoken::decode::<Claims>(token, key, validation) {
                Ok(data) => {
                    let c = data.claims;
                    if c.sub.trim().is_empty() {
                        return Err(Denied::Unauthenticated("the token has no subject".into()));
                    }
                    return Ok(Caller {
                        subject: c.sub,
                        roles: c.roles.iter().filter_map(|r| r.parse().ok()).collect(),
                    });
                }
                Err(e) => match e.kind() {
                    // a signature made by another key, or for another algorithm: try the next
                    ErrorKind::InvalidSignature | ErrorKind::InvalidAlgorithm => {}
                    ErrorKind::ExpiredSignature => {
                        return Err(Denied::Unauthenticated("the token has expired".into()));
                    }
                    ErrorKind::InvalidAudience => {
                        why = "the token is for another audience".into();
                    }
                    ErrorKind::InvalidIssuer => why = "the token is from another issuer".into(),
                    ErrorKind::ImmatureSignature => {
                        why = "the token is not valid yet (nbf)".into();
                    }
                    ErrorKind::MissingRequiredClaim(claim) => {
                        why = format!("the token lacks the claim `{claim}`");
                    }
                    ErrorKind::InvalidToken
                    | ErrorKind::Base64(_)
                    | ErrorKind::Json(_)
                    | ErrorKind::Utf8(_) => {
                        why = "the token is not well formed (a JWT is three base64url parts joined by dots)".into();
                    }
                    _ => why = "the token could not be verified".into(),
                },
            }
        }
        Err(Denied::Unauthenticated(why))
    }

    /// The caller of a gRPC request (`authorization: Bearer <token>`).
    pub fn caller(&self, metadata: &MetadataMap) -> Result<Caller, Denied> {
        if !self.enabled {
            return Ok(Caller::unauthenticated_development());
        }
        let Some(value) = metadata.get("authorization") else {
            return Err(Denied::Unauthenticated(
                "no credentials: send `authorization: Bearer <token>`".into(),
            ));
        };
        let token = value
            .to_str()
            .ok()
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .ok_or_else(|| {
                Denied::Unauthenticated("authorization is not `Bearer <token>`".into())
            })?;
        self.verify_token(token.trim())
    }

    /// The caller, if it may do `action`.
    pub fn authorize(&self, metadata: &MetadataMap, action: Action) -> Result<Caller, Denied> {
        let caller = self.caller(metadata)?;
        permit(caller, action)
    }
}

/// `caller` if one of its roles allows `action`.
pub fn permit(caller: Caller, action: Action) -> Result<Caller, Denied> {
    if z29c_core::access::allowed(&caller.roles, action) {
        return Ok(caller);
    }
    let needs = match action {
        Action::Read => "viewer",
        Action::Submit | Action::Cancel => "operator",
        Action::Resolve => "resolver",
    };
    let has = if caller.roles.is_empty() {
        "none".to_owned()
    } else {
        caller
            .roles
            .iter()
            .map(|r| r.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    Err(Denied::PermissionDenied {
        subject: caller.subject,
        action,
        needs,
        has,
    })
}

/// Signs an HS256 token for `subject` with `roles`, valid for `ttl` (dev, tests, `z29c token`).
pub fn mint(
    secret: &str,
    audience: &str,
    subject: &str,
    roles: &[Role],
    ttl: Duration,
) -> anyhow::Result<String> {
    let exp = SystemTime::now()
        .checked_add(ttl)
        .unwrap_or_else(SystemTime::now)
        .duration_since(UNIX_EPOCH)?
        .as_secs();
    let claims = Claims {
        sub: subject.to_owned(),
        exp,
        aud: audience.to_owned(),
        iss: None,
        roles: roles.iter().map(|r| r.as_str().to_owned()).collect(),
    };
    Ok(jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret.as_bytes())?,
    )?)
}

/// A random secret long enough for HS256 (dev and tests).
pub fn random_secret() -> String {
    use rand::Rng;
    rand::rng()
        .sample_iter(rand::distr::Alphanumeric)
        .take(64)
        .map(char::from)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "0123456789abcdef0123456789abcdef-test";

    fn config() -> AuthConfig {
        AuthConfig {
            enabled: true,
            hs256_secrets: vec![SecretString::from(SECRET)],
            ..AuthConfig::default()
        }
    }

    fn bearer(token: &str) -> MetadataMap {
        let mut m = MetadataMap::new();
        m.insert("authorization", format!("Bearer {token}").parse().unwrap());
        m
    }

    #[test]
    fn a_valid_token_names_its_caller_and_roles() {
        let v = Verifier::from_config(&config()).unwrap();
        let t = mint(
            SECRET,
            "z29c",
            "alice",
            &[Role::Operator],
            Duration::from_secs(60),
        )
        .unwrap();
        let c = v.caller(&bearer(&t)).unwrap();
        assert_eq!(c.subject, "alice");
        assert_eq!(c.roles, vec![Role::Operator]);
        assert!(v.authorize(&bearer(&t), Action::Submit).is_ok());
    }

    #[test]
    fn missing_garbage_expired_and_foreign_tokens_are_unauthenticated() {
        let v = Verifier::from_config(&config()).unwrap();
        assert!(matches!(
            v.caller(&MetadataMap::new()),
            Err(Denied::Unauthenticated(_))
        ));
        assert!(matches!(
            v.caller(&bearer("not.a.token")),
            Err(Denied::Unauthenticated(_))
        ));
        let expired = {
            let claims = Claims {
                sub: "alice".into(),
                exp: 1,
                aud: "z29c".into(),
                iss: None,
                roles: vec!["operator".into()],
            };
            jsonwebtoken::encode(
                &Header::new(Algorithm::HS256),
                &claims,
                &EncodingKey::from_secret(SECRET.as_bytes()).unwrap(),
            )
            .unwrap()
        };
        let e = v.caller(&bearer(&expired)).unwrap_err();
        assert_eq!(e, Denied::Unauthenticated("the token has expired".into()));
        let other = mint(
            "another-secret-another-secret-another",
            "z29c",
            "mallory",
            &[Role::Resolver],
            Duration::from_secs(60),
        )
        .unwrap();
        assert!(matches!(
            v.caller(&bearer(&other)),
            Err(Denied::Unauthenticated(_))
        ));
        let wrong_aud = mint(SECRET, "elsewhere", "alice", &[], Duration::from_secs(60)).unwrap();
        assert_eq!(
            v.caller(&bearer(&wrong_aud)).unwrap_err(),
            Denied::Unauthenticated("the token is for another audience".into())
        );
    }

    #[test]
    fn a_caller_without_the_role_is_denied_with_what_it_needs() {
        let v = Verifier::from_config(&config()).unwrap();
        let t = mint(
            SECRET,
            "z29c",
            "val",
            &[Role::Viewer],
            Duration::from_secs(60),
        )
        .unwrap();
        let e = v.authorize(&bearer(&t), Action::Resolve).unwrap_err();
        assert_eq!(e.kind(), "permission_denied");
        assert_eq!(e.subject(), Some("val"));
        let status: tonic::Status = e.into();
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        assert!(
            status.message().contains("resolver"),
            "{}",
            status.message()
        );
    }

    #[test]
    fn disabled_lets_everyone_do_everything_and_enabled_needs_a_key() {
        let v = Verifier::from_config(&AuthConfig::default()).unwrap();
        assert!(v.authorize(&MetadataMap::new(), Action::Resolve).is_ok());
        let e = Verifier::from_config(&AuthConfig {
            enabled: true,
            ..AuthConfig::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("hs256_secrets"), "{e}");
        let short = Verifier::from_config(&AuthConfig {
            enabled: true,
            hs256_secrets: vec![SecretString::from("short")],
            ..AuthConfig::default()
        });
        assert!(short.is_err());
    }

    #[test]
    fn random_secrets_are_long_and_differ() {
        let (a, b) = (random_secret(), random_secret());
        assert!(a.len() >= 64);
        assert_ne!(a, b);
    }
}
