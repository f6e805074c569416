//! A connection URL whose password is a secret: it connects with the whole URL, and shows
//! (`Debug`, `Display`, serialization, so `--dump-config`) the URL with the password redacted.

use std::fmt;

use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// What a redacted password reads as.
pub const REDACTED: &str = "REDACTED";

/// A PostgreSQL connection URL, checked when it is read: a `postgres://` or `postgresql://`
/// URL with a host. Its password never leaves it except through [`DatabaseUrl::expose`].
#[derive(Clone)]
pub struct DatabaseUrl {
    url: SecretString,
    shown: String,
}

impl DatabaseUrl {
    /// Checks `url` and keeps it; the error says what is wrong, never the password.
    pub fn parse(url: &str) -> Result<Self, String> {
        let parsed = url::Url::parse(url).map_err(|e| format!("not a URL ({e})"))?;
        if !matches!(parsed.scheme(), "postgres" | "postgresql") {
            return Err(format!(
                "the scheme is {:?}; a PostgreSQL URL starts with postgres:// or postgresql://",
                parsed.scheme()
            ));
        }
        // a Unix socket is named by a `host` parameter (`postgres:///z29c?host=/run/postgresql`)
        if parsed.host_str().is_none_or(str::is_empty)
            && !parsed.query_pairs().any(|(k, _)| k == "host")
        {
            return Err("the URL names no host (nor a `host` parameter)".into());
        }
        let mut shown = parsed.clone();
        if parsed.password().is_some() {
            // a URL with a host always takes a password
            let _ = shown.set_password(Some(REDACTED));
        }
        // a password given as a query parameter is as secret, and so is a client key's
        let secret = |k: &str| matches!(k, "password" | "sslpassword");
        if parsed.query_pairs().any(|(k, _)| secret(&k)) {
            let pairs: Vec<(String, String)> = parsed
                .query_pairs()
                .map(|(k, v)| {
                    let v = if secret(&k) {
                        REDACTED.into()
                    } else {
                        v.into_owned()
                    };
                    (k.into_owned(), v)
                })
                .collect();
            shown.query_pairs_mut().clear().extend_pairs(pairs);
        }
        Ok(Self {
            url: SecretString::from(url.to_owned()),
            shown: shown.into(),
        })
    }

    /// The whole URL, password included: for connecting, and nothing else.
    pub fn expose(&self) -> &str {
        self.url.expose_secret()
    }

    /// The URL with its password redacted.
    pub fn shown(&self) -> &str {
        &self.shown
    }
}

impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("DatabaseUrl").field(&self.shown).finish()
    }
}

impl fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown)
    }
}

impl PartialEq for DatabaseUrl {
    fn eq(&self, other: &Self) -> bool {
        self.expose() == other.expose()
    }
}

impl Serialize for DatabaseUrl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.shown)
    }
}

impl<'de> Deserialize<'de> for DatabaseUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let url = String::deserialize(d)?;
        // named here: a field read through `#[serde(flatten)]` loses its key in the error
        Self::parse(&url).map_err(|e| {
            serde::de::Error::custom(format!("invalid configuration: database_url: {e}"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_password_is_used_but_never_shown() {
        let url = DatabaseUrl::parse("postgres://app:s3cret@db.example:5432/z29c").unwrap();
        assert_eq!(url.expose(), "postgres://app:s3cret@db.example:5432/z29c");
        for shown in [
            url.to_string(),
            format!("{url:?}"),
            serde_json::to_string(&url).unwrap(),
        ] {
            assert!(!shown.contains("s3cret"), "{shown}");
            assert!(
                shown.contains("app:REDACTED@db.example:5432/z29c"),
                "{shown}"
            );
        }
    }

    #[test]
    fn a_password_in_the_query_is_redacted_too() {
        let url = DatabaseUrl::parse(
            "postgresql://db.example/z29c?user=app&password=s3cret&sslmode=require&sslpassword=k3y",
        )
        .unwrap();
        assert!(!url.shown().contains("k3y"), "{}", url.shown());
        assert!(!url.shown().contains("s3cret"), "{}", url.shown());
        assert!(url.shown().contains("sslmode=require"), "{}", url.shown());
        assert!(url.expose().contains("s3cret"));
    }

    #[test]
    fn a_url_without_a_password_is_shown_as_it_is() {
        let url = DatabaseUrl::parse("postgres://postgres@127.0.0.1/z29c").unwrap();
        assert_eq!(url.shown(), "postgres://postgres@127.0.0.1/z29c");
        let socket = DatabaseUrl::parse("postgres:///z29c?host=/run/postgresql").unwrap();
        assert_eq!(socket.expose(), "postgres:///z29c?host=/run/postgresql");
    }

    #[test]
    fn what_is_not_a_postgresql_url_is_refused_with_the_reason() {
        for (bad, says) in [
            ("localhost:5432", "scheme"),
            ("mysql://db/z29c", "scheme"),
            ("not a url", "not a URL"),
            ("postgres:///z29c", "no host"),
        ] {
            let e = DatabaseUrl::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let e = serde_json::from_str::<DatabaseUrl>("\"mysql://u:pw@db/x\"").unwrap_err();
        assert!(!e.to_string().contains("pw@"), "{e}");
    }
}
