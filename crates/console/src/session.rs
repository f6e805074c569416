//! Signing in to the console, and CSRF protection of its forms.
//!
//! With operator authentication on, a person signs in by pasting their token (the same JWT the
//! CLI uses); it is verified and kept in an `HttpOnly`, `SameSite=Strict` cookie, and every call
//! the console makes to the services carries it, so the services decide (and audit) what the
//! person may do. Every state-changing request must carry the CSRF token in `x-csrf-token`:
//! a hash of a per-process secret and the session, handed to the page in a readable cookie
//! (the signed double-submit pattern), and its `Origin`, when sent, must be the console's own.
//! When the console serves HTTPS every cookie is also `Secure`, so a browser never sends the
//! session over plain HTTP.

use axum::http::HeaderMap;
use axum_extra::extract::cookie::{Cookie, CookieJar, SameSite};
use sha2::{Digest, Sha256};
use z29c_security::{Bearer, Caller, Verifier};

pub const SESSION_COOKIE: &str = "z29c_session";
pub const CSRF_COOKIE: &str = "z29c_csrf";
pub const CSRF_HEADER: &str = "x-csrf-token";

/// Why a console request was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Not signed in, or the session's token no longer verifies (expired).
    SignIn(String),
    /// A state-changing request without the right CSRF token or from another origin.
    Forgery(&'static str),
}

#[derive(Debug, Clone)]
pub struct Sessions {
    verifier: Verifier,
    secret: [u8; 32],
    /// Whether cookies carry `Secure`: only when the console serves HTTPS, since a browser
    /// keeps no `Secure` cookie set over plain HTTP (loopback development would not sign in).
    secure: bool,
}

impl Sessions {
    pub fn new(verifier: Verifier, secure: bool) -> Self {
        Self {
            verifier,
            secret: rand::random(),
            secure,
        }
    }

    pub fn enabled(&self) -> bool {
        self.verifier.enabled()
    }

    /// The CSRF token that goes with `session` (no session: the page's own).
    pub fn csrf_for(&self, session: Option<&str>) -> String {
        let mut h = Sha256::new();
        h.update(self.secret);
        h.update(session.unwrap_or("").as_bytes());
        hex::encode(&h.finalize()[..16])
    }

    /// The signed-in caller and the token to forward; without authentication, nobody and no
    /// token.
    pub fn caller(&self, jar: &CookieJar) -> Result<(Option<Caller>, Bearer), Refusal> {
        if !self.enabled() {
            return Ok((None, Bearer::default()));
        }
        let token = jar
            .get(SESSION_COOKIE)
            .map(|c| c.value().to_owned())
            .ok_or_else(|| Refusal::SignIn("sign in first".into()))?;
        let caller = self
            .verifier
            .verify_token(&token)
            .map_err(|d| Refusal::SignIn(d.to_string()))?;
        let bearer =
            Bearer::new(Some(&token)).map_err(|_| Refusal::SignIn("bad session".into()))?;
        Ok((Some(caller), bearer))
    }

    /// Refuses a state-changing request without the CSRF token of the caller's sign-in, or
    /// from a page of another origin.
    pub fn check_forgery(&self, jar: &CookieJar, headers: &HeaderMap) -> Result<(), Refusal> {
        if let (Some(origin), Some(host)) = (headers.get("origin"), headers.get("host")) {
            let origin = origin.to_str().unwrap_or("");
            let host = host.to_str().unwrap_or("");
            let same = origin
                .split_once("://")
                .is_some_and(|(_, rest)| rest == host);
            if !same {
                return Err(Refusal::Forgery("the request comes from another origin"));
            }
        }
        let session = jar.get(SESSION_COOKIE).map(|c| c.value().to_owned());
        let expected = self.csrf_for(session.as_deref());
        let sent = headers
            .get(CSRF_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        // equal length hex strings; a timing difference reveals nothing an attacker can use
        // without reading the cookie, which the same-origin policy already forbids
        if sent != expected {
            return Err(Refusal::Forgery("missing or wrong x-csrf-token"));
        }
        Ok(())
    }

    /// Signs in with `token`: the cookies to set, or why not.
    pub fn sign_in(&self, jar: CookieJar, token: &str) -> Result<(CookieJar, Caller), Refusal> {
        let token = token.trim();
        let caller = self
            .verifier
            .verify_token(token)
            .map_err(|d| Refusal::SignIn(d.to_string()))?;
        let session = self.session_cookie(token.to_owned());
        let csrf = self.csrf_cookie(Some(token));
        Ok((jar.add(session).add(csrf), caller))
    }

    /// The cookie carrying the session's token, out of the page's scripts' reach.
    fn session_cookie(&self, token: String) -> Cookie<'static> {
        Cookie::build((SESSION_COOKIE, token))
            .http_only(true)
            .same_site(SameSite::Strict)
            .secure(self.secure)
            .path("/")
            .build()
    }

    /// The readable cookie carrying the CSRF token for `session`.
    pub fn csrf_cookie(&self, session: Option<&str>) -> Cookie<'static> {
        Cookie::build((CSRF_COOKIE, self.csrf_for(session)))
            .same_site(SameSite::Strict)
            .secure(self.secure)
            .path("/")
            .build()
    }

    pub fn sign_out(&self, jar: CookieJar) -> CookieJar {
        jar.remove(self.session_cookie(String::new()))
            .add(self.csrf_cookie(None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use z29c_core::Role;
    use z29c_security::AuthConfig;

    const SECRET: &str = "console-test-secret-console-test-secret";

    fn sessions() -> Sessions {
        sessions_over(false)
    }

    fn sessions_over(https: bool) -> Sessions {
        Sessions::new(
            Verifier::from_config(&AuthConfig {
                enabled: true,
                hs256_secrets: vec![SECRET.into()],
                ..AuthConfig::default()
            })
            .unwrap(),
            https,
        )
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn sign_in_sets_an_http_only_session_and_a_matching_csrf_token() {
        let s = sessions();
        let token = z29c_security::token::mint(
            SECRET,
            "z29c",
            "rita",
            &[Role::Resolver],
            std::time::Duration::from_secs(60),
        )
        .unwrap();
        let (jar, caller) = s.sign_in(CookieJar::new(), &token).unwrap();
        assert_eq!(caller.subject, "rita");
        let session = jar.get(SESSION_COOKIE).unwrap();
        assert_eq!(session.http_only(), Some(true));
        assert_eq!(session.same_site(), Some(SameSite::Strict));
        let csrf = jar.get(CSRF_COOKIE).unwrap().value().to_owned();
        assert!(s.caller(&jar).is_ok());
        let h = headers(&[
            (CSRF_HEADER, &csrf),
            ("origin", "http://c:1"),
            ("host", "c:1"),
        ]);
        assert!(s.check_forgery(&jar, &h).is_ok());
        // the wrong token, none, or another origin: refused
        let wrong = headers(&[(CSRF_HEADER, "00")]);
        assert!(s.check_forgery(&jar, &wrong).is_err());
        assert!(s.check_forgery(&jar, &HeaderMap::new()).is_err());
        let evil = headers(&[
            (CSRF_HEADER, &csrf),
            ("origin", "http://evil"),
            ("host", "c:1"),
        ]);
        assert_eq!(
            s.check_forgery(&jar, &evil),
            Err(Refusal::Forgery("the request comes from another origin"))
        );
    }

    #[test]
    fn every_cookie_is_secure_over_https_and_only_then() {
        let token = z29c_security::token::mint(
            SECRET,
            "z29c",
            "rita",
            &[Role::Viewer],
            std::time::Duration::from_secs(60),
        )
        .unwrap();
        let set_cookies = |jar: CookieJar| -> Vec<Cookie<'static>> {
            use axum::response::IntoResponse;
            jar.into_response()
                .headers()
                .get_all("set-cookie")
                .iter()
                .map(|v| Cookie::parse(v.to_str().unwrap().to_owned()).unwrap())
                .collect()
        };
        let signed_in = CookieJar::from_headers(&headers(&[(
            "cookie",
            &format!("{SESSION_COOKIE}={token}"),
        )]));
        for https in [false, true] {
            let s = sessions_over(https);
            let (jar, _) = s.sign_in(CookieJar::new(), &token).unwrap();
            let mut set = set_cookies(jar);
            set.extend(set_cookies(s.sign_out(signed_in.clone())));
            set.push(s.csrf_cookie(None));
            assert_eq!(set.len(), 5, "sign-in, sign-out and the page's: {set:?}");
            for c in &set {
                assert_eq!(c.secure().unwrap_or(false), https, "{c}");
                assert_eq!(c.same_site(), Some(SameSite::Strict), "{c}");
            }
            let sessions: Vec<_> = set.iter().filter(|c| c.name() == SESSION_COOKIE).collect();
            assert_eq!(sessions.len(), 2, "set and removed: {set:?}");
            assert!(sessions.iter().all(|c| c.http_only() == Some(true)));
        }
    }

    #[test]
    fn no_session_or_a_bad_token_must_sign_in() {
        let s = sessions();
        assert!(matches!(
            s.caller(&CookieJar::new()),
            Err(Refusal::SignIn(_))
        ));
        assert!(s.sign_in(CookieJar::new(), "garbage").is_err());
        let jar = CookieJar::new().add(Cookie::new(SESSION_COOKIE, "garbage"));
        assert!(matches!(s.caller(&jar), Err(Refusal::SignIn(_))));
    }

    #[test]
    fn csrf_tokens_differ_per_session_and_per_process() {
        let (a, b) = (sessions(), sessions());
        assert_ne!(a.csrf_for(Some("x")), a.csrf_for(Some("y")));
        assert_ne!(a.csrf_for(Some("x")), b.csrf_for(Some("x")));
    }
}
