//! Workflow files (YAML), as `z29c submit` and `z29c dev --workflow` read them, and their
//! conversion to a submission. Errors name the field; the scheduler checks the rest.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::v1 as pb;

/// A workflow file that could not be read, naming where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct WorkflowFileError(String);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkflowFile {
    /// Idempotency key; a fresh one is made when absent.
    pub client_key: Option<String>,
    pub name: String,
    /// When the workflow's outcome stops being useful (RFC 3339, e.g.
    /// `2026-12-24T18:00:00Z`): past it, steps not yet started are cancelled.
    pub deadline: Option<String>,
    pub steps: Vec<StepFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepFile {
    pub name: String,
    pub adapter: String,
    pub operation: String,
    #[serde(default)]
    pub input: serde_json::Value,
    #[serde(default)]
    pub depends_on: Vec<String>,
    #[serde(default)]
    pub policy: BTreeMap<String, serde_json::Value>,
}

pub fn parse(text: &str) -> Result<WorkflowFile, WorkflowFileError> {
    serde_yaml_ng::from_str(text).map_err(|e| WorkflowFileError(e.to_string()))
}

impl WorkflowFile {
    pub fn into_request(self) -> Result<pb::SubmitRequest, WorkflowFileError> {
        let client_key = self
            .client_key
            .unwrap_or_else(|| format!("cli-{}", uuid::Uuid::now_v7()));
        let mut steps = Vec::new();
        for (i, s) in self.steps.into_iter().enumerate() {
            let mut policy = pb::LeasePolicy::default();
            for (k, v) in s.policy {
                let field = |what: &str| {
                    WorkflowFileError(format!("steps[{i}].policy.{k}: {what}, not {v}"))
                };
                let millis = || {
                    v.as_u64()
                        .ok_or_else(|| field("a whole number of milliseconds"))
                };
                let count = || {
                    v.as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(|| field("a whole number up to 4294967295"))
                };
                match k.as_str() {
                    "lease_ms" => policy.lease_ms = millis()?,
                    "renew_every_ms" => policy.renew_every_ms = millis()?,
                    "attempt_deadline_ms" => policy.attempt_deadline_ms = millis()?,
                    "final_grace_ms" => policy.final_grace_ms = millis()?,
                    "adapter_timeout_ms" => policy.adapter_timeout_ms = millis()?,
                    "schedule_to_start_ms" => policy.schedule_to_start_ms = millis()?,
                    "initial_backoff_ms" => policy.initial_backoff_ms = millis()?,
                    "max_backoff_ms" => policy.max_backoff_ms = millis()?,
                    "max_wait_ms" => policy.max_wait_ms = millis()?,
                    "max_attempts" => policy.max_attempts = count()?,
                    "max_waits" => policy.max_waits = count()?,
                    "backoff_multiplier" => {
                        policy.backoff_multiplier = v.as_f64().ok_or_else(|| field("a number"))?
                    }
                    "retryable_statuses" => {
                        policy.retryable_statuses = v
                            .as_array()
                            .and_then(|a| {
                                a.iter()
                                    .map(|s| s.as_u64().and_then(|s| u32::try_from(s).ok()))
                                    .collect::<Option<Vec<_>>>()
                            })
                            .ok_or_else(|| field("a list of HTTP statuses"))?
                    }
                    other => {
                        return Err(WorkflowFileError(format!(
                            "steps[{i}].policy.{other}: unknown policy field"
                        )));
                    }
                }
            }
            steps.push(pb::StepDefinition {
                name: s.name,
                adapter: s.adapter,
                operation: s.operation,
                input_json: s.input.to_string(),
                depends_on: s.depends_on,
                policy: Some(policy),
            });
        }
        let deadline = self
            .deadline
            .map(|d| {
                chrono::DateTime::parse_from_rfc3339(d.trim())
                    .map(|t| prost_types::Timestamp {
                        seconds: t.timestamp(),
                        nanos: t.timestamp_subsec_nanos() as i32,
                    })
                    .map_err(|e| {
                        WorkflowFileError(format!(
                            "deadline: {d:?} is not an RFC 3339 time such as 2026-12-24T18:00:00Z ({e})"
                        ))
                    })
            })
            .transpose()?;
        Ok(pb::SubmitRequest {
            client_key,
            name: self.name,
            steps,
            deadline,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_demo_file_parses() {
        let wf = parse(include_str!("../../../examples/demo.yaml")).unwrap();
        assert_eq!(wf.steps.len(), 3);
        let req = wf.into_request().unwrap();
        assert_eq!(req.steps[2].depends_on, ["charge"]);
        assert_eq!(req.steps[2].policy.as_ref().unwrap().lease_ms, 10_000);
    }

    #[test]
    fn a_deadline_is_an_rfc_3339_time_and_a_bad_one_is_named() {
        let wf = parse("name: x\ndeadline: 2026-12-24T18:00:00+01:00\nsteps: []\n").unwrap();
        let t = wf.into_request().unwrap().deadline.unwrap();
        assert_eq!((t.seconds, t.nanos), (1_798_131_600, 0));
        let wf = parse("name: x\nsteps: []\n").unwrap();
        assert_eq!(wf.into_request().unwrap().deadline, None);
        let wf = parse("name: x\ndeadline: tomorrow\nsteps: []\n").unwrap();
        let e = wf.into_request().unwrap_err().to_string();
        assert!(
            e.starts_with("deadline: \"tomorrow\" is not an RFC 3339 time"),
            "{e}"
        );
    }

    #[test]
    fn unknown_fields_are_named() {
        let e = parse("name: x\nsteps: []\nstepz: 1\n").unwrap_err();
        assert!(e.to_string().contains("stepz"), "{e}");
        let wf = parse(
            "name: x\nsteps:\n- {name: a, adapter: http, operation: o, policy: {lease: 1}}\n",
        )
        .unwrap();
        let e = wf.into_request().unwrap_err();
        assert!(e.to_string().contains("steps[0].policy.lease"), "{e}");
    }

    #[test]
    fn retry_fields_are_read_with_their_types_and_a_wrong_type_is_named() {
        let wf = parse(
            "name: x\nsteps:\n- name: a\n  adapter: http\n  operation: o\n  policy:\n    max_attempts: 4\n    initial_backoff_ms: 100\n    backoff_multiplier: 1.5\n    retryable_statuses: [408, 425]\n    max_waits: 3\n    max_wait_ms: 60000\n",
        )
        .unwrap();
        let req = wf.into_request().unwrap();
        let p = req.steps[0].policy.as_ref().unwrap();
        assert_eq!(
            (p.max_attempts, p.initial_backoff_ms, p.backoff_multiplier),
            (4, 100, 1.5)
        );
        assert_eq!(p.retryable_statuses, [408, 425]);
        assert_eq!((p.max_waits, p.max_wait_ms), (3, 60_000));
        for (line, named) in [
            (
                "retryable_statuses: 408",
                "steps[0].policy.retryable_statuses",
            ),
            ("lease_ms: 1.5", "steps[0].policy.lease_ms"),
            (
                "backoff_multiplier: fast",
                "steps[0].policy.backoff_multiplier",
            ),
        ] {
            let wf = parse(&format!(
                "name: x\nsteps:\n- {{name: a, adapter: http, operation: o, policy: {{{line}}}}}\n"
            ))
            .unwrap();
            let e = wf.into_request().unwrap_err();
            assert!(e.to_string().contains(named), "{e}");
        }
    }
}
