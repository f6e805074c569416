//! Newtype identifiers. Each one parses; none is a bare `Uuid`, `i64` or `String` once it has
//! crossed a crate boundary.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::ParseError;

macro_rules! uuid_id {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(Uuid);

        impl $name {
            /// A new, time-ordered identifier (UUID v7), so inserts stay index-friendly.
            pub fn new() -> Self {
                Self(Uuid::now_v7())
            }

            /// Wraps an identifier read back from storage.
            pub const fn from_uuid(id: Uuid) -> Self {
                Self(id)
            }

            /// The identifier as a `Uuid`, for storage and the wire.
            pub const fn as_uuid(&self) -> Uuid {
                self.0
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl FromStr for $name {
            type Err = ParseError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Uuid::parse_str(s)
                    .map(Self)
                    .map_err(|e| ParseError::new($what, e.to_string()))
            }
        }
    };
}

uuid_id!(
    /// One submitted intent with its DAG of steps.
    WorkflowId,
    "workflow id"
);
uuid_id!(
    /// One step of a workflow.
    StepId,
    "step id"
);
uuid_id!(
    /// One try at a step by one worker under one lease.
    AttemptId,
    "attempt id"
);

/// Checks a text identifier: non-empty, bounded, and free of control characters so it can be
/// logged, put in a header and shown to a person as it is.
fn check_text(what: &'static str, s: &str, max: usize) -> Result<(), ParseError> {
    if s.is_empty() {
        return Err(ParseError::new(what, "must not be empty"));
    }
    if s.len() > max {
        return Err(ParseError::new(
            what,
            format!("is {} bytes, at most {max} allowed", s.len()),
        ));
    }
    if let Some(c) = s.chars().find(|c| c.is_control()) {
        return Err(ParseError::new(
            what,
            format!("contains control character {c:?}"),
        ));
    }
    Ok(())
}

macro_rules! text_id {
    ($(#[$doc:meta])* $name:ident, $what:literal, $max:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// Longest accepted value, in bytes.
            pub const MAX_LEN: usize = $max;

            /// Parses a value, refusing empty, oversized or control-character input.
            pub fn parse(s: impl Into<String>) -> Result<Self, ParseError> {
                let s = s.into();
                check_text($what, &s, $max)?;
                Ok(Self(s))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl FromStr for $name {
            type Err = ParseError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::parse(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = ParseError;
            fn try_from(s: String) -> Result<Self, Self::Error> {
                Self::parse(s)
            }
        }

        impl From<$name> for String {
            fn from(v: $name) -> String {
                v.0
            }
        }
    };
}

text_id!(
    /// Names one logical external effect. It is durable before any side-effecting invocation and
    /// survives attempts, so an idempotent destination sees the same key on every retry.
    RequestIdentity,
    "request identity",
    200
);
text_id!(
    /// The client's idempotency key for a submission: the same key submits one workflow.
    ClientKey,
    "client key",
    200
);
text_id!(
    /// Who holds a lease: an executor or recovery worker instance.
    OwnerId,
    "lease owner",
    128
);
text_id!(
    /// The external system's own reference for an effect it committed.
    ExternalReference,
    "external reference",
    512
);

impl RequestIdentity {
    /// The stable identity of a step's external effect. Derived from the workflow and the step's
    /// name only, so every attempt and every recovery retry of one step carries the same key.
    pub fn for_step(workflow: WorkflowId, step: &StepName) -> Self {
        Self(format!("z29c:{workflow}:{step}"))
    }
}

/// A step's name, unique within its workflow; used in dependencies and request identities.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct StepName(String);

impl StepName {
    pub const MAX_LEN: usize = 64;

    /// Letters, digits, `-`, `_` and `.`; 1 to 64 bytes.
    pub fn parse(s: impl Into<String>) -> Result<Self, ParseError> {
        let s = s.into();
        check_text("step name", &s, Self::MAX_LEN)?;
        if let Some(c) = s
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
        {
            return Err(ParseError::new(
                "step name",
                format!("contains {c:?}; use letters, digits, '-', '_' or '.'"),
            ));
        }
        Ok(Self(s))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for StepName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for StepName {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl TryFrom<String> for StepName {
    type Error = ParseError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::parse(s)
    }
}

impl From<StepName> for String {
    fn from(v: StepName) -> String {
        v.0
    }
}

/// The fencing token: incremented by PostgreSQL on every lease acquisition of a step.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct LeaseVersion(i64);

impl LeaseVersion {
    /// The version of a step that has never been leased.
    pub const NEVER_LEASED: Self = Self(0);

    pub fn new(v: i64) -> Result<Self, ParseError> {
        if v < 0 {
            return Err(ParseError::new("lease version", "must not be negative"));
        }
        Ok(Self(v))
    }

    pub const fn get(self) -> i64 {
        self.0
    }

    /// The version the next acquisition will carry.
    pub const fn next(self) -> Self {
        Self(self.0 + 1)
    }
}

impl fmt::Display for LeaseVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// SHA-256 of a step's input, hex-encoded. Late evidence converges only when it names the same
/// request identity *and* the same input digest.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct InputDigest(String);

impl InputDigest {
    /// Digest of a JSON input. `serde_json` orders object keys, so equal values hash equally
    /// whatever order the client wrote them in.
    pub fn of_json(value: &serde_json::Value) -> Self {
        let bytes = serde_json::to_vec(value).unwrap_or_default();
        Self(hex::encode(Sha256::digest(&bytes)))
    }

    pub fn parse(s: impl Into<String>) -> Result<Self, ParseError> {
        let s = s.into();
        if s.len() != 64
            || !s
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        {
            return Err(ParseError::new(
                "input digest",
                "must be 64 lowercase hex characters",
            ));
        }
        Ok(Self(s))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for InputDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for InputDigest {
    type Error = ParseError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::parse(s)
    }
}

impl From<InputDigest> for String {
    fn from(v: InputDigest) -> String {
        v.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_ids_refuse_empty_oversized_and_control_characters() {
        assert!(RequestIdentity::parse("").is_err());
        assert!(RequestIdentity::parse("a".repeat(201)).is_err());
        assert!(RequestIdentity::parse("a".repeat(200)).is_ok());
        assert!(ClientKey::parse("key\nwith newline").is_err());
        assert!(OwnerId::parse("executor-1").is_ok());
        let err = ExternalReference::parse("").unwrap_err();
        assert_eq!(err.what, "external reference");
    }

    #[test]
    fn sql_looking_text_is_kept_verbatim() {
        let key = ClientKey::parse("'; DROP TABLE steps; --").unwrap();
        assert_eq!(key.as_str(), "'; DROP TABLE steps; --");
    }

    #[test]
    fn step_names_are_restricted_to_a_safe_alphabet() {
        assert!(StepName::parse("charge-card_1.v2").is_ok());
        assert!(StepName::parse("charge card").is_err());
        assert!(StepName::parse("ä").is_err());
        assert!(StepName::parse("a".repeat(65)).is_err());
    }

    #[test]
    fn request_identity_is_stable_for_a_step() {
        let wf = WorkflowId::new();
        let step = StepName::parse("deliver").unwrap();
        assert_eq!(
            RequestIdentity::for_step(wf, &step),
            RequestIdentity::for_step(wf, &step)
        );
        assert_ne!(
            RequestIdentity::for_step(wf, &step),
            RequestIdentity::for_step(WorkflowId::new(), &step)
        );
    }

    #[test]
    fn input_digest_ignores_key_order() {
        let a: serde_json::Value = serde_json::from_str(r#"{"a":1,"b":[1,2]}"#).unwrap();
        let b: serde_json::Value = serde_json::from_str(r#"{"b":[1,2],"a":1}"#).unwrap();
        assert_eq!(InputDigest::of_json(&a), InputDigest::of_json(&b));
        let c: serde_json::Value = serde_json::from_str(r#"{"a":2,"b":[1,2]}"#).unwrap();
        assert_ne!(InputDigest::of_json(&a), InputDigest::of_json(&c));
        assert!(InputDigest::parse(InputDigest::of_json(&a).to_string()).is_ok());
        assert!(InputDigest::parse("ABC").is_err());
    }

    #[test]
    fn lease_versions_are_non_negative_and_increase() {
        assert!(LeaseVersion::new(-1).is_err());
        let v = LeaseVersion::new(7).unwrap();
        assert_eq!(v.next().get(), 8);
        assert!(v < v.next());
    }

    #[test]
    fn uuid_ids_round_trip_through_text() {
        let id = StepId::new();
        assert_eq!(id.to_string().parse::<StepId>().unwrap(), id);
        assert!("not-a-uuid".parse::<AttemptId>().is_err());
    }
}
