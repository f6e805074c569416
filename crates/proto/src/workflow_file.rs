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
    pub policy: BTreeMap<String, u64>,
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
                match k.as_str() {
                    "lease_ms" => policy.lease_ms = v,
                    "renew_every_ms" => policy.renew_every_ms = v,
                    "attempt_deadline_ms" => policy.attempt_deadline_ms = v,
                    "final_grace_ms" => policy.final_grace_ms = v,
                    "adapter_timeout_ms" => policy.adapter_timeout_ms = v,
                    "schedule_to_start_ms" => policy.schedule_to_start_ms = v,
                    "max_attempts" => {
                        policy.max_attempts = u32::try_from(v).map_err(|_| {
                            WorkflowFileError(format!("steps[{i}].policy.max_attempts: too large"))
                        })?
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
        Ok(pb::SubmitRequest {
            client_key,
            name: self.name,
            steps,
            deadline: None,
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
}
