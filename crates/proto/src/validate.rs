//! Requests from the network, checked field by field before anything acts on them. The
//! services map a [`FieldError`] to `INVALID_ARGUMENT` naming the field; the fuzz targets call
//! the same functions.

use z29c_core::{AttemptId, LeaseClaim, LeaseKind, LeaseVersion, OwnerId, RequestIdentity, StepId};

use crate::v1::InvokeRequest;

/// A field that was refused, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct FieldError {
    pub field: &'static str,
    pub reason: String,
}

impl FieldError {
    fn new(field: &'static str, reason: impl Into<String>) -> Self {
        Self {
            field,
            reason: reason.into(),
        }
    }
}

impl From<FieldError> for tonic::Status {
    fn from(e: FieldError) -> Self {
        tonic::Status::invalid_argument(e.to_string())
    }
}

/// An operation (class) name: 1 to 100 letters, digits, `-`, `_` or `.`. It becomes a URL path
/// segment at the adapter and a permit class, so nothing else gets through.
pub fn operation(op: &str) -> Result<(), FieldError> {
    let ok = !op.is_empty()
        && op.len() <= 100
        && op
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(FieldError::new(
            "operation",
            "use 1 to 100 letters, digits, '-', '_' or '.'",
        ))
    }
}

/// The parts of an `Invoke` that are checked without knowing the gateway's adapters.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidInvoke {
    pub operation: String,
    pub identity: RequestIdentity,
    pub input: serde_json::Value,
    pub attempt: Option<AttemptId>,
    /// The attempt's lease, when the call names an attempt: under it the gateway commits
    /// *invocation began*.
    pub lease: Option<LeaseClaim>,
}

/// Checks an `Invoke` request: its operation, request identity, input (JSON) and attempt id.
pub fn invoke(req: &InvokeRequest) -> Result<ValidInvoke, FieldError> {
    operation(&req.operation)?;
    let identity = RequestIdentity::parse(req.request_identity.clone())
        .map_err(|e| FieldError::new("request_identity", e.reason))?;
    let input = serde_json::from_str(&req.input_json)
        .map_err(|e| FieldError::new("input_json", e.to_string()))?;
    let attempt = if req.attempt_id.is_empty() {
        None
    } else {
        Some(
            req.attempt_id
                .parse::<AttemptId>()
                .map_err(|e| FieldError::new("attempt_id", e.reason))?,
        )
    };
    let lease = match attempt {
        None => None,
        Some(attempt) => Some(LeaseClaim {
            step: req
                .step_id
                .parse::<StepId>()
                .map_err(|e| FieldError::new("step_id", e.reason))?,
            attempt,
            owner: OwnerId::parse(req.lease_owner.clone())
                .map_err(|e| FieldError::new("lease_owner", e.reason))?,
            version: LeaseVersion::new(req.lease_version)
                .ok()
                .filter(|v| *v != LeaseVersion::NEVER_LEASED)
                .ok_or_else(|| {
                    FieldError::new("lease_version", "must be a leased version (> 0)")
                })?,
            kind: LeaseKind::Execution,
        }),
    };
    Ok(ValidInvoke {
        operation: req.operation.clone(),
        identity,
        input,
        attempt,
        lease,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> InvokeRequest {
        InvokeRequest {
            adapter: "http".into(),
            operation: "ship".into(),
            request_identity: "z29c:w:s".into(),
            input_json: "{\"n\":1}".into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_good_request_passes() {
        let v = invoke(&req()).unwrap();
        assert_eq!(v.operation, "ship");
        assert_eq!(v.input["n"], 1);
        assert_eq!(v.attempt, None);
        assert_eq!(v.lease, None);
    }

    #[test]
    fn a_call_under_a_lease_names_the_whole_lease() {
        let mut r = req();
        r.attempt_id = AttemptId::new().to_string();
        r.step_id = StepId::new().to_string();
        r.lease_owner = "executor-1".into();
        r.lease_version = 3;
        let lease = invoke(&r).unwrap().lease.unwrap();
        assert_eq!(lease.version.get(), 3);
        assert_eq!(lease.owner.as_str(), "executor-1");
        assert_eq!(lease.kind, LeaseKind::Execution);
        let spoils: [(&str, fn(&mut InvokeRequest)); 4] = [
            ("step_id", |r| r.step_id = String::new()),
            ("lease_owner", |r| r.lease_owner = String::new()),
            ("lease_version", |r| r.lease_version = 0),
            ("lease_version", |r| r.lease_version = -1),
        ];
        for (field, spoil) in spoils {
            let mut bad = r.clone();
            spoil(&mut bad);
            assert_eq!(invoke(&bad).unwrap_err().field, field);
        }
    }

    #[test]
    fn each_bad_field_is_named() {
        let cases: [(&str, fn(&mut InvokeRequest)); 6] = [
            ("operation", |r| r.operation = "ship; DROP TABLE x".into()),
            ("operation", |r| r.operation = String::new()),
            ("operation", |r| r.operation = "../admin".into()),
            ("request_identity", |r| r.request_identity = String::new()),
            ("input_json", |r| r.input_json = "{".into()),
            ("attempt_id", |r| r.attempt_id = "not-a-uuid".into()),
        ];
        for (field, spoil) in cases {
            let mut r = req();
            spoil(&mut r);
            assert_eq!(invoke(&r).unwrap_err().field, field);
        }
    }
}
