//! Workflow files (YAML) and their conversion to a submission.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use serde::Deserialize;
use z29c_proto::v1 as pb;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct WorkflowFile {
    /// Idempotency key; a fresh one is made when absent.
    pub(crate) client_key: Option<String>,
    pub(crate) name: String,
    pub(crate) steps: Vec<StepFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct StepFile {
    pub(crate) name: String,
    pub(crate) adapter: String,
    pub(crate) operation: String,
    #[serde(default)]
    pub(crate) input: serde_json::Value,
    #[serde(default)]
    pub(crate) depends_on: Vec<String>,
    #[serde(default)]
    pub(crate) policy: BTreeMap<String, u64>,
}

pub(crate) fn read(path: &Path) -> anyhow::Result<WorkflowFile> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read workflow file {}", path.display()))?;
    parse(&text).with_context(|| format!("workflow file {}", path.display()))
}

pub(crate) fn parse(text: &str) -> anyhow::Result<WorkflowFile> {
    Ok(serde_yaml_ng::from_str(text)?)
}

impl WorkflowFile {
    pub(crate) fn into_request(self) -> anyhow::Result<pb::SubmitRequest> {
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
                    "max_attempts" => {
                        policy.max_attempts = u32::try_from(v)
                            .with_context(|| format!("steps[{i}].policy.max_attempts: too large"))?
                    }
                    "progress_observable" => policy.progress_observable = v != 0,
                    other => anyhow::bail!("steps[{i}].policy.{other}: unknown policy field"),
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
