//! How an HTTP adapter speaks to its API, declared in the gateway's configuration (the
//! `[adapters.http]` table): the request (method, path template, headers with secrets from the
//! environment or a file, where the request identity goes), where the answer names its
//! reference, which statuses mean done, refused, rate limited or still in flight, and how to
//! ask about a request (the status query, and the rules that recognise "found" and "definitely
//! not found"). Anything no rule matches is *unknown*: recovery decides, never a guess.
//!
//! The defaults are z29c's own contract (`POST {base}/v1/{operation}` with `Idempotency-Key`,
//! a top-level `reference`, status at `GET /v1/requests/{identity}`), so an adapter that sets
//! nothing speaks it.

use std::collections::BTreeMap;
use std::fmt;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;
use z29c_core::AdapterCapability;

/// An adapter's HTTP contract.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpContract {
    /// The method of a call.
    pub method: String,
    /// The path of a call, after the adapter's `base_url`: `{operation}`, `{identity}` and
    /// `{input.FIELD}` (a top-level string or number of the step's input) are replaced, each
    /// percent-escaped.
    pub path: String,
    /// The header that carries the request identity, so the API de-duplicates; empty: none
    /// (then the adapter cannot be `idempotent`).
    pub idempotency_header: String,
    /// A top-level field of the JSON body that carries the request identity too (an API that
    /// records a client reference it can be searched by); empty: none.
    pub identity_field: String,
    /// Headers sent with every call and status query. A value is a string, or
    /// `{ env = "NAME" }` / `{ file = "/path" }` with an optional `prefix` (`"Bearer "`): a
    /// secret read at start, never printed or logged.
    pub headers: BTreeMap<String, HeaderSource>,
    /// Where a success names the external reference (a JSON pointer into the answer).
    pub reference: String,
    /// Where a refusal says why (a JSON pointer to a string; the status is always shown).
    pub refusal_reason: String,
    /// Statuses that mean the call was done: with a reference, a success.
    pub done: Vec<StatusPattern>,
    /// Statuses that mean the call was definitely refused: nothing happened.
    pub refused: Vec<StatusPattern>,
    /// Statuses that mean "not now" (with `Retry-After`): nothing happened, wait.
    pub rate_limited: Vec<StatusPattern>,
    /// Statuses that mean a request with this identity is still being processed: unknown.
    pub in_flight: Vec<StatusPattern>,
    /// How to ask about a request; none: the adapter cannot be `queryable`.
    pub query: Option<QueryContract>,
}

impl Default for HttpContract {
    fn default() -> Self {
        Self {
            method: "POST".into(),
            path: "/v1/{operation}".into(),
            idempotency_header: "Idempotency-Key".into(),
            identity_field: String::new(),
            headers: BTreeMap::new(),
            reference: "/reference".into(),
            refusal_reason: "/error".into(),
            done: vec![StatusPattern::Class(2)],
            refused: vec![StatusPattern::Class(4)],
            rate_limited: vec![StatusPattern::Exact(429)],
            in_flight: vec![StatusPattern::Exact(409)],
            query: Some(QueryContract::default()),
        }
    }
}

/// How to ask an API about a request, and how to read its answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QueryContract {
    pub method: String,
    /// As a call's `path`; `{identity}` is the request identity asked about.
    pub path: String,
    /// The answer that found the request: its status, and where it names the reference.
    pub found: AnswerRule,
    /// Answers that say the request definitely never arrived. Only these: a 404 from a route
    /// the API does not have is not one unless a rule says so.
    pub not_found: Vec<AnswerRule>,
    /// Statuses that mean the request is still being processed: ask again later.
    pub in_flight: Vec<StatusPattern>,
}

impl Default for QueryContract {
    fn default() -> Self {
        Self {
            method: "GET".into(),
            path: "/v1/requests/{identity}".into(),
            found: AnswerRule {
                status: vec![StatusPattern::Exact(200)],
                reference: Some("/reference".into()),
                empty: None,
                result: None,
            },
            not_found: vec![AnswerRule {
                status: vec![StatusPattern::Exact(404)],
                reference: None,
                empty: None,
                result: None,
            }],
            in_flight: vec![StatusPattern::Exact(202), StatusPattern::Exact(409)],
        }
    }
}

/// A rule that recognises an answer: one of `status`, and, when set, a non-empty string or
/// number at `reference`, an empty array at `empty` (in an answer that was read whole).
/// Unset fields serialize as nothing in TOML and as `null` in JSON, so the configuration's
/// check for unknown keys knows them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AnswerRule {
    pub status: Vec<StatusPattern>,
    pub reference: Option<String>,
    pub empty: Option<String>,
    /// `found` only: where in the answer the request's own result is (a search's
    /// `"/data/0"`), so a step completed by a status query carries the result its call
    /// would have; by default the whole answer.
    pub result: Option<String>,
}

impl AnswerRule {
    /// The reference the answer names, when the rule matches it; `Some("")` when it matches
    /// and names none (a rule without `reference`).
    pub fn matches(&self, status: u16, body: Option<&Value>) -> Option<String> {
        if !self.status.iter().any(|p| p.matches(status)) {
            return None;
        }
        // "empty" is read, never assumed: an answer that could not be read, or lacks the
        // pointer, says nothing
        if let Some(pointer) = &self.empty
            && !matches!(body.and_then(|b| b.pointer(pointer)), Some(Value::Array(a)) if a.is_empty())
        {
            return None;
        }
        match &self.reference {
            Some(pointer) => reference_at(body?, pointer),
            None => Some(String::new()),
        }
    }
}

/// A non-empty string (or a number) at `pointer`.
pub fn reference_at(body: &Value, pointer: &str) -> Option<String> {
    match body.pointer(pointer)? {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// A status (`404`) or a class of statuses (`"4xx"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusPattern {
    Exact(u16),
    /// The hundreds digit: `4` is `4xx`.
    Class(u16),
}

impl StatusPattern {
    pub fn matches(self, status: u16) -> bool {
        match self {
            Self::Exact(s) => s == status,
            Self::Class(c) => status / 100 == c,
        }
    }
}

impl fmt::Display for StatusPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Exact(s) => write!(f, "{s}"),
            Self::Class(c) => write!(f, "{c}xx"),
        }
    }
}

impl Serialize for StatusPattern {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Exact(v) => s.serialize_u16(*v),
            Self::Class(_) => s.serialize_str(&self.to_string()),
        }
    }
}

impl<'de> Deserialize<'de> for StatusPattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u16),
            S(String),
        }
        let bad = || serde::de::Error::custom("a status is 100..=599, or a class like \"4xx\"");
        match Raw::deserialize(d)? {
            Raw::N(n) if (100..=599).contains(&n) => Ok(Self::Exact(n)),
            Raw::S(s) => match s.as_bytes() {
                [c @ b'1'..=b'5', b'x' | b'X', b'x' | b'X'] => Ok(Self::Class(u16::from(c - b'0'))),
                _ => s
                    .parse::<u16>()
                    .ok()
                    .filter(|n| (100..=599).contains(n))
                    .map(Self::Exact)
                    .ok_or_else(bad),
            },
            Raw::N(_) => Err(bad()),
        }
    }
}

/// A header value: written in the file, or a secret read at start from the environment or a
/// file (with an optional prefix such as `"Bearer "`). Only where it comes from is ever shown.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged, deny_unknown_fields)]
pub enum HeaderSource {
    Literal(String),
    Env {
        env: String,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        prefix: String,
    },
    File {
        file: std::path::PathBuf,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        prefix: String,
    },
}

/// What the statuses of a call's answer establish, before the body is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusMeaning {
    RateLimited,
    InFlight,
    Done,
    Refused,
    /// No rule matches: unknown.
    Unmatched,
}

impl HttpContract {
    /// What `status` means for a call, by the first list that names it, in the order rate
    /// limited, in flight, done, refused.
    pub fn meaning(&self, status: u16) -> StatusMeaning {
        let any = |list: &[StatusPattern]| list.iter().any(|p| p.matches(status));
        if any(&self.rate_limited) {
            StatusMeaning::RateLimited
        } else if any(&self.in_flight) {
            StatusMeaning::InFlight
        } else if any(&self.done) {
            StatusMeaning::Done
        } else if any(&self.refused) {
            StatusMeaning::Refused
        } else {
            StatusMeaning::Unmatched
        }
    }

    /// Checks the contract, and that it supports `capability`; the error names the field.
    pub fn check(&self, capability: AdapterCapability) -> Result<(), (String, String)> {
        let bad = |f: &str, why: String| Err((format!("http.{f}"), why));
        reqwest::Method::from_bytes(self.method.as_bytes()).map_err(|_| {
            (
                "http.method".to_owned(),
                format!("{:?} is not an HTTP method", self.method),
            )
        })?;
        check_template("path", &self.path, false)?;
        for pointer in [&self.reference, &self.refusal_reason] {
            if !pointer.is_empty() && !pointer.starts_with('/') {
                return bad(
                    "reference",
                    format!("{pointer:?} is not a JSON pointer (it starts with /)"),
                );
            }
        }
        if !self.idempotency_header.is_empty() {
            HeaderName::from_bytes(self.idempotency_header.as_bytes()).map_err(|_| {
                (
                    "http.idempotency_header".to_owned(),
                    format!("{:?} is not a header name", self.idempotency_header),
                )
            })?;
        }
        for name in self.headers.keys() {
            HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                (
                    format!("http.headers.{name}"),
                    "not a header name".to_owned(),
                )
            })?;
        }
        match capability {
            AdapterCapability::Idempotent if self.idempotency_header.is_empty() => bad(
                "idempotency_header",
                "an idempotent adapter needs the header its API de-duplicates by".into(),
            ),
            AdapterCapability::Queryable => match &self.query {
                None => bad("query", "a queryable adapter needs a status query".into()),
                Some(q) => {
                    reqwest::Method::from_bytes(q.method.as_bytes()).map_err(|_| {
                        (
                            "http.query.method".to_owned(),
                            format!("{:?} is not an HTTP method", q.method),
                        )
                    })?;
                    check_template("query.path", &q.path, true)?;
                    for (f, pointer) in
                        std::iter::once(("query.found.reference", &q.found.reference)).chain(
                            q.not_found
                                .iter()
                                .map(|r| ("query.not_found.empty", &r.empty)),
                        )
                    {
                        if pointer.as_ref().is_some_and(|p| !p.starts_with('/')) {
                            return bad(f, "a JSON pointer starts with /".into());
                        }
                    }
                    if q.found.status.is_empty() || q.found.reference.is_none() {
                        return bad(
                            "query.found",
                            "a queryable adapter needs the rule that recognises a found request: its status and where it names the reference".into(),
                        );
                    }
                    if q.not_found.is_empty() || q.not_found.iter().any(|r| r.status.is_empty()) {
                        return bad(
                            "query.not_found",
                            "a queryable adapter needs the rule that recognises a request that never arrived; without one, no answer is read as \"not found\"".into(),
                        );
                    }
                    Ok(())
                }
            },
            _ => Ok(()),
        }
    }

    /// Checks that every secret header can be read (its variable set, its file readable),
    /// without reading it into anything shown; the error names the header and the source.
    pub fn check_secrets(&self) -> Result<(), (String, String)> {
        for (name, source) in &self.headers {
            let field = format!("http.headers.{name}");
            match source {
                HeaderSource::Literal(_) => {}
                HeaderSource::Env { env, .. } => {
                    if std::env::var_os(env).is_none() {
                        return Err((field, format!("environment variable {env} is not set")));
                    }
                }
                HeaderSource::File { file, .. } => {
                    std::fs::File::open(file)
                        .map_err(|e| (field, format!("{}: {e}", file.display())))?;
                }
            }
        }
        Ok(())
    }

    /// The headers of every request, secrets read now (marked sensitive, so no log shows
    /// them). The error names the header and where its value was to come from, never a value.
    pub fn resolve_headers(&self) -> Result<HeaderMap, String> {
        let mut out = HeaderMap::new();
        for (name, source) in &self.headers {
            let (value, secret) = match source {
                HeaderSource::Literal(v) => (v.clone(), false),
                HeaderSource::Env { env, prefix } => {
                    let v = std::env::var(env).map_err(|_| {
                        format!("header {name}: environment variable {env} is not set")
                    })?;
                    (format!("{prefix}{}", v.trim()), true)
                }
                HeaderSource::File { file, prefix } => {
                    let v = std::fs::read_to_string(file)
                        .map_err(|e| format!("header {name}: {}: {e}", file.display()))?;
                    (format!("{prefix}{}", v.trim()), true)
                }
            };
            let mut value = HeaderValue::from_str(&value)
                .map_err(|_| format!("header {name}: its value is not a valid header value"))?;
            value.set_sensitive(secret);
            let name = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("header {name}: not a header name"))?;
            out.insert(name, value);
        }
        Ok(out)
    }
}

fn check_template(field: &str, template: &str, query: bool) -> Result<(), (String, String)> {
    let bad = |why: String| Err((format!("http.{field}"), why));
    if !template.starts_with('/') {
        return bad(format!("{template:?} must start with /"));
    }
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let Some(close) = rest[open..].find('}') else {
            return bad(format!("{template:?}: a {{ without its }}"));
        };
        let name = &rest[open + 1..open + close];
        let known = name == "identity"
            || (!query
                && (name == "operation"
                    || name.strip_prefix("input.").is_some_and(|f| !f.is_empty())));
        if !known {
            return bad(if query {
                format!(
                    "{template:?}: a status query knows only the request's {{identity}}, not {{{name}}}"
                )
            } else {
                format!(
                    "{template:?}: {{{name}}} is not one of {{operation}}, {{identity}}, {{input.FIELD}}"
                )
            });
        }
        rest = &rest[open + close + 1..];
    }
    Ok(())
}

/// Characters escaped in a path or query value: everything but unreserved ones.
const ESCAPED: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// `template` with its placeholders replaced, each percent-escaped. An input field that is
/// missing, or not a string or number, is an error naming it: nothing is sent.
pub fn fill(
    template: &str,
    operation: &str,
    identity: &str,
    input: &Value,
) -> Result<String, String> {
    let mut out = String::with_capacity(template.len() + 32);
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let close = rest[open..].find('}').ok_or("an unclosed placeholder")? + open;
        let name = &rest[open + 1..close];
        let value = match name {
            "operation" => operation.to_owned(),
            "identity" => identity.to_owned(),
            _ => {
                let field = name
                    .strip_prefix("input.")
                    .ok_or_else(|| format!("unknown placeholder {{{name}}}"))?;
                match input.get(field) {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Number(n)) => n.to_string(),
                    _ => {
                        return Err(format!(
                            "input.{field} is not a string or number in the step's input"
                        ));
                    }
                }
            }
        };
        out.extend(utf8_percent_encode(&value, ESCAPED));
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn placeholders_are_filled_and_escaped() {
        let input = json!({ "customer": "cus 1/2", "n": 7, "nested": { "x": 1 } });
        assert_eq!(
            fill(
                "/v1/{operation}/{input.customer}?n={input.n}",
                "charges",
                "z29c:w:s",
                &input
            )
            .unwrap(),
            "/v1/charges/cus%201%2F2?n=7"
        );
        assert_eq!(
            fill("/s?ref={identity}", "o", "z29c:a b", &input).unwrap(),
            "/s?ref=z29c%3Aa%20b"
        );
        assert!(
            fill("/{input.nested}", "o", "i", &input)
                .unwrap_err()
                .contains("input.nested")
        );
        assert!(
            fill("/{input.missing}", "o", "i", &input)
                .unwrap_err()
                .contains("input.missing")
        );
    }

    #[test]
    fn a_status_reads_by_the_first_list_that_names_it_and_otherwise_is_unknown() {
        let c = HttpContract::default();
        for (status, meaning) in [
            (200, StatusMeaning::Done),
            (201, StatusMeaning::Done),
            (400, StatusMeaning::Refused),
            (401, StatusMeaning::Refused),
            (409, StatusMeaning::InFlight),
            (429, StatusMeaning::RateLimited),
            (500, StatusMeaning::Unmatched),
            (302, StatusMeaning::Unmatched),
        ] {
            assert_eq!(c.meaning(status), meaning, "{status}");
        }
        let narrow = HttpContract {
            refused: vec![StatusPattern::Exact(400), StatusPattern::Exact(402)],
            ..HttpContract::default()
        };
        assert_eq!(narrow.meaning(404), StatusMeaning::Unmatched);
        assert_eq!(narrow.meaning(402), StatusMeaning::Refused);
    }

    #[test]
    fn a_capability_the_contract_cannot_support_is_refused_naming_the_field() {
        let none = HttpContract {
            idempotency_header: String::new(),
            query: None,
            ..HttpContract::default()
        };
        assert_eq!(
            none.check(AdapterCapability::Idempotent).unwrap_err().0,
            "http.idempotency_header"
        );
        assert_eq!(
            none.check(AdapterCapability::Queryable).unwrap_err().0,
            "http.query"
        );
        none.check(AdapterCapability::Opaque).unwrap();
        let no_not_found = HttpContract {
            query: Some(QueryContract {
                not_found: vec![],
                ..QueryContract::default()
            }),
            ..HttpContract::default()
        };
        assert_eq!(
            no_not_found
                .check(AdapterCapability::Queryable)
                .unwrap_err()
                .0,
            "http.query.not_found"
        );
        let bad_path = HttpContract {
            path: "/v1/{what}".into(),
            ..HttpContract::default()
        };
        assert_eq!(
            bad_path.check(AdapterCapability::Opaque).unwrap_err().0,
            "http.path"
        );
        // a status query knows the identity alone: a path naming more would be asked wrongly
        for path in ["/v1/{operation}/{identity}", "/q/{input.id}"] {
            let asks_more = HttpContract {
                query: Some(QueryContract {
                    path: path.into(),
                    ..QueryContract::default()
                }),
                ..HttpContract::default()
            };
            assert_eq!(
                asks_more.check(AdapterCapability::Queryable).unwrap_err().0,
                "http.query.path",
                "{path}"
            );
        }
        HttpContract::default()
            .check(AdapterCapability::Queryable)
            .unwrap();
    }

    #[test]
    fn answer_rules_need_their_status_and_their_pointers() {
        let found = AnswerRule {
            status: vec![StatusPattern::Exact(200)],
            reference: Some("/data/0/id".into()),
            empty: None,
            result: None,
        };
        let hit = json!({ "data": [{ "id": "shp_1" }] });
        assert_eq!(found.matches(200, Some(&hit)).as_deref(), Some("shp_1"));
        assert_eq!(found.matches(201, Some(&hit)), None);
        assert_eq!(found.matches(200, Some(&json!({ "data": [] }))), None);
        let none = AnswerRule {
            status: vec![StatusPattern::Exact(200)],
            reference: None,
            empty: Some("/data".into()),
            result: None,
        };
        assert_eq!(
            none.matches(200, Some(&json!({ "data": [] }))).as_deref(),
            Some("")
        );
        assert_eq!(none.matches(200, Some(&hit)), None);
        // nothing read, or no such pointer, is not "empty": it says nothing
        assert_eq!(none.matches(200, None), None);
        assert_eq!(none.matches(200, Some(&json!({ "items": [] }))), None);
        assert_eq!(none.matches(200, Some(&json!({ "data": null }))), None);
    }

    #[test]
    fn statuses_read_as_numbers_or_classes() {
        #[derive(Deserialize)]
        struct T {
            s: Vec<StatusPattern>,
        }
        let t: T = serde_json::from_value(json!({ "s": [404, "4xx", "503"] })).unwrap();
        assert_eq!(
            t.s,
            [
                StatusPattern::Exact(404),
                StatusPattern::Class(4),
                StatusPattern::Exact(503)
            ]
        );
        assert!(serde_json::from_value::<T>(json!({ "s": [99] })).is_err());
        assert!(serde_json::from_value::<T>(json!({ "s": ["6xx"] })).is_err());
        assert_eq!(
            serde_json::to_value(StatusPattern::Class(2)).unwrap(),
            json!("2xx")
        );
    }

    #[test]
    fn a_secret_header_is_read_at_start_and_only_its_source_is_shown() {
        let dir = std::env::temp_dir().join(format!("z29c-contract-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("key");
        std::fs::write(&file, "sk_test_secret\n").unwrap();
        let c = HttpContract {
            headers: BTreeMap::from([
                (
                    "Authorization".into(),
                    HeaderSource::File {
                        file: file.clone(),
                        prefix: "Bearer ".into(),
                    },
                ),
                (
                    "Api-Version".into(),
                    HeaderSource::Literal("2026-01-01".into()),
                ),
            ]),
            ..HttpContract::default()
        };
        let headers = c.resolve_headers().unwrap();
        let auth = &headers["authorization"];
        assert_eq!(auth.to_str().unwrap(), "Bearer sk_test_secret");
        assert!(auth.is_sensitive() && !headers["api-version"].is_sensitive());
        assert!(!format!("{headers:?}").contains("sk_test_secret"));
        let shown = serde_json::to_string(&c).unwrap();
        assert!(
            !shown.contains("sk_test_secret") && shown.contains("key"),
            "{shown}"
        );
        let missing = HttpContract {
            headers: BTreeMap::from([(
                "Authorization".into(),
                HeaderSource::Env {
                    env: "Z29C_TEST_SURELY_UNSET".into(),
                    prefix: String::new(),
                },
            )]),
            ..HttpContract::default()
        };
        assert!(
            missing
                .resolve_headers()
                .unwrap_err()
                .contains("Z29C_TEST_SURELY_UNSET")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
