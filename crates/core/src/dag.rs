//! Validation of a submitted workflow's step graph: unique names, known dependencies, no cycles.

use std::collections::{BTreeMap, VecDeque};

use crate::ids::StepName;

/// A graph problem, naming the field so a client can find it in its input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct DagError {
    /// e.g. `steps[2].depends_on[0]`.
    pub field: String,
    pub reason: String,
}

/// Checks the graph and returns the steps' indices in an order where every dependency comes
/// before its dependents.
pub fn validate(steps: &[(StepName, Vec<StepName>)]) -> Result<Vec<usize>, DagError> {
    if steps.is_empty() {
        return Err(DagError {
            field: "steps".into(),
            reason: "a workflow needs at least one step".into(),
        });
    }
    let mut index = BTreeMap::new();
    for (i, (name, _)) in steps.iter().enumerate() {
        if index.insert(name, i).is_some() {
            return Err(DagError {
                field: format!("steps[{i}].name"),
                reason: format!("duplicate step name \"{name}\""),
            });
        }
    }
    let mut indegree = vec![0usize; steps.len()];
    let mut dependents = vec![Vec::new(); steps.len()];
    for (i, (name, deps)) in steps.iter().enumerate() {
        for (j, dep) in deps.iter().enumerate() {
            let field = format!("steps[{i}].depends_on[{j}]");
            if dep == name {
                return Err(DagError {
                    field,
                    reason: "a step cannot depend on itself".into(),
                });
            }
            let Some(&d) = index.get(dep) else {
                return Err(DagError {
                    field,
                    reason: format!("unknown step \"{dep}\""),
                });
            };
            if deps[..j].contains(dep) {
                return Err(DagError {
                    field,
                    reason: format!("duplicate dependency \"{dep}\""),
                });
            }
            indegree[i] += 1;
            dependents[d].push(i);
        }
    }
    let mut queue: VecDeque<usize> = (0..steps.len()).filter(|&i| indegree[i] == 0).collect();
    let mut order = Vec::with_capacity(steps.len());
    while let Some(i) = queue.pop_front() {
        order.push(i);
        for &d in &dependents[i] {
            indegree[d] -= 1;
            if indegree[d] == 0 {
                queue.push_back(d);
            }
        }
    }
    if order.len() < steps.len() {
        let stuck: Vec<&str> = (0..steps.len())
            .filter(|&i| indegree[i] > 0)
            .map(|i| steps[i].0.as_str())
            .collect();
        return Err(DagError {
            field: "steps".into(),
            reason: format!("dependency cycle among {}", stuck.join(", ")),
        });
    }
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(spec: &[(&str, &[&str])]) -> Vec<(StepName, Vec<StepName>)> {
        spec.iter()
            .map(|(n, d)| {
                (
                    StepName::parse(*n).unwrap(),
                    d.iter().map(|x| StepName::parse(*x).unwrap()).collect(),
                )
            })
            .collect()
    }

    #[test]
    fn order_puts_dependencies_first() {
        let steps = g(&[("c", &["a", "b"]), ("a", &[]), ("b", &["a"])]);
        let order = validate(&steps).unwrap();
        let pos = |name: &str| {
            order
                .iter()
                .position(|&i| steps[i].0.as_str() == name)
                .unwrap()
        };
        assert!(pos("a") < pos("b") && pos("b") < pos("c"));
    }

    #[test]
    fn bad_graphs_name_the_field() {
        type Spec<'a> = &'a [(&'a str, &'a [&'a str])];
        let cases: &[(Spec<'_>, &str)] = &[
            (&[], "steps"),
            (&[("a", &[]), ("a", &[])], "steps[1].name"),
            (&[("a", &["a"])], "steps[0].depends_on[0]"),
            (&[("a", &[]), ("b", &["x"])], "steps[1].depends_on[0]"),
            (&[("a", &[]), ("b", &["a", "a"])], "steps[1].depends_on[1]"),
            (
                &[("a", &["c"]), ("b", &["a"]), ("c", &["b"]), ("d", &[])],
                "steps",
            ),
        ];
        for (spec, field) in cases {
            let e = validate(&g(spec)).unwrap_err();
            assert_eq!(&e.field, field, "{spec:?}: {e}");
        }
        let e = validate(&g(&[("a", &["b"]), ("b", &["a"])])).unwrap_err();
        assert!(e.reason.contains("cycle"), "{e}");
    }
}
