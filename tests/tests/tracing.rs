//! One workflow run is one trace across scheduler, executor, gateway and recovery: spans are
//! exported over OTLP by the real service processes to a receiver in this test, and their
//! parent links cross the NATS hop (outbox relay → executor hint), the gRPC hops (executor →
//! gateway, recovery → gateway) and the PostgreSQL hop (submission → attempt, → recovery).

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use z29c_proto::v1::{self as pb};
use z29c_scenarios::cluster::{Cluster, Topology, chain};
use z29c_scenarios::otlp::{CollectedSpan, Collector};

const SCHEDULER: &str = "z29c-scheduler";
const EXECUTOR: &str = "z29c-executor";
const GATEWAY: &str = "z29c-adapter-gateway";
const RECOVERY: &str = "z29c-recovery";

fn find<'a>(spans: &'a [CollectedSpan], service: &str, name: &str) -> Vec<&'a CollectedSpan> {
    spans
        .iter()
        .filter(|s| s.service == service && s.name == name)
        .collect()
}

/// Whether some span `child` (service, name) has a parent among spans `parent` (service, name).
fn linked(spans: &[CollectedSpan], child: (&str, &str), parent: (&str, &str)) -> bool {
    let parents: Vec<&str> = find(spans, parent.0, parent.1)
        .iter()
        .map(|s| s.span_id.as_str())
        .collect();
    find(spans, child.0, child.1)
        .iter()
        .any(|c| parents.contains(&c.parent_span_id.as_str()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_workflow_is_one_trace_across_all_services() -> Result<()> {
    let (collector, endpoint) = Collector::start().await?;
    let mut cluster = Cluster::start_with(Topology {
        gateways: 0,
        recoveries: 1,
        capability: "queryable",
        env: vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), endpoint),
            ("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into()),
            ("Z29C_LOG_JSON".into(), "1".into()),
        ],
        ..Topology::default()
    })
    .await?;
    // the gateway dies right after the first step's invocation began: recovery asks the
    // restarted gateway; the second step runs normally through it
    cluster
        .add_gateway_with(16, &[("Z29C_FAULT_CRASH", "after_invocation_began")])
        .await?;
    let mut req = chain("traced", "traced", 2);
    for s in &mut req.steps {
        s.policy = Some(pb::LeasePolicy {
            lease_ms: 1_500,
            renew_every_ms: 500,
            attempt_deadline_ms: 8_000,
            final_grace_ms: 500,
            adapter_timeout_ms: 1_000,
            max_attempts: 3,
            ..Default::default()
        });
    }
    let wf = cluster
        .client()
        .await?
        .submit(req)
        .await?
        .into_inner()
        .workflow
        .expect("workflow");
    cluster
        .wait_exited("gateway-1", Duration::from_secs(20))
        .await?;
    cluster.restart("gateway-1", &["Z29C_FAULT_CRASH"]).await?;
    cluster
        .wait_all_ended(std::slice::from_ref(&wf.id), Duration::from_secs(60))
        .await?;

    // spans arrive in batches; wait until every hop has been seen
    let hops = [
        ((EXECUTOR, "attempt"), (SCHEDULER, "workflow.submit")),
        (
            (SCHEDULER, "outbox.publish"),
            (SCHEDULER, "workflow.submit"),
        ),
        ((EXECUTOR, "step.ready.hint"), (SCHEDULER, "outbox.publish")),
        ((GATEWAY, "gateway.invoke"), (EXECUTOR, "gateway.invoke")),
        (
            (RECOVERY, "recovery.decide"),
            (SCHEDULER, "workflow.submit"),
        ),
        ((GATEWAY, "gateway.query"), (RECOVERY, "recovery.decide")),
    ];
    let start = Instant::now();
    let spans = loop {
        let all = collector.spans();
        let submit = find(&all, SCHEDULER, "workflow.submit")
            .into_iter()
            .find(|s| s.attributes.get("workflow") == Some(&wf.id))
            .map(|s| s.trace_id.clone());
        let trace: Vec<CollectedSpan> = match &submit {
            Some(t) => all.into_iter().filter(|s| &s.trace_id == t).collect(),
            None => Vec::new(),
        };
        if hops.iter().all(|(c, p)| linked(&trace, *c, *p)) {
            break trace;
        }
        if start.elapsed() > Duration::from_secs(30) {
            let missing: Vec<_> = hops
                .iter()
                .filter(|(c, p)| !linked(&trace, *c, *p))
                .collect();
            let seen: Vec<(String, String)> = trace
                .iter()
                .map(|s| (s.service.clone(), s.name.clone()))
                .collect();
            bail!("links missing {missing:?}; spans of the trace: {seen:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let services: std::collections::BTreeSet<&str> =
        spans.iter().map(|s| s.service.as_str()).collect();
    for s in [SCHEDULER, EXECUTOR, GATEWAY, RECOVERY] {
        assert!(
            services.contains(s),
            "{s} has no span in the trace: {services:?}"
        );
    }
    // the submission is the root: nothing of this workflow started a second trace
    let roots: Vec<&CollectedSpan> = spans
        .iter()
        .filter(|s| s.parent_span_id.is_empty())
        .collect();
    assert_eq!(roots.len(), 1, "one root span: {roots:?}");
    assert_eq!(roots[0].name, "workflow.submit");

    // the JSON logs name the same trace in every service that logged about the workflow
    let trace = roots[0].trace_id.clone();
    let logged: std::collections::BTreeSet<String> = json_log_lines(cluster.dir())?
        .into_iter()
        .filter(|(_, line)| line["span"]["trace_id"] == trace.as_str())
        .map(|(file, line)| {
            format!(
                "{} {}",
                file.split('.').next().unwrap_or_default(),
                line["fields"]["message"].as_str().unwrap_or_default()
            )
        })
        .collect();
    for want in [
        "scheduler workflow submitted",
        "executor-1 receipt committed",
        "recovery-1 recovery decision",
    ] {
        assert!(
            logged.contains(want),
            "no {want:?} log line with trace id {trace}: {logged:?}"
        );
    }
    cluster.stop().await
}

/// Every JSON line of every service log in `dir`, with the log's file name.
fn json_log_lines(dir: &std::path::Path) -> Result<Vec<(String, serde_json::Value)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "log") {
            continue;
        }
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        for line in std::fs::read_to_string(&path)?.lines() {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
                out.push((name.clone(), v));
            }
        }
    }
    Ok(out)
}
