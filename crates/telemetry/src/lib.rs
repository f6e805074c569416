//! Metric names and their exposition. Names keep their level (docs/design.md §7) so that worker
//! churn never reads as a result: `z29c_lease_*` is about who may work, `z29c_attempt_*` about
//! one try, `z29c_step_*` about what z29c knows of an external effect, `z29c_workflow_*` about
//! outcomes.

//!
//! [`trace`] sets up tracing and OpenTelemetry, and carries trace context between services.

use std::net::SocketAddr;
use std::time::Duration;

pub use metrics;

pub mod trace;

/// Recovery decisions, labelled `category`, `decision` and `capability`.
pub const RECOVERY_DECISIONS: &str = "z29c_step_recovery_decisions_total";
/// Integrity conflicts on record: one request identity, two external references.
pub const INTEGRITY_CONFLICTS: &str = "z29c_step_integrity_conflicts";
/// Review items waiting for a person.
pub const REVIEW_ITEMS_OPEN: &str = "z29c_step_review_items_open";
/// Leases that expired and were taken over by recovery.
pub const LEASE_RECOVERIES: &str = "z29c_lease_recoveries_total";
/// How long past `expires_at` a lease was when recovery took it (seconds).
pub const LEASE_EXPIRY_AGE: &str = "z29c_lease_expiry_age_seconds";
/// Leases acquired for routine execution (claims).
pub const LEASE_ACQUISITIONS: &str = "z29c_lease_acquisitions_total";
/// Renewals refused or failed: the worker is about to lose, or has lost, its lease.
pub const LEASE_RENEWAL_FAILURES: &str = "z29c_lease_renewal_failures_total";
/// Writes refused because the lease presented was no longer current.
pub const ATTEMPT_FENCING_REJECTIONS: &str = "z29c_attempt_fencing_rejections_total";
/// Calls a gateway handled, labelled `adapter` and `result` (`succeeded`, `rejected`,
/// `rate_limited`, `not_sent`, `unknown`, `no_permit`).
pub const ATTEMPT_INVOCATIONS: &str = "z29c_attempt_invocations_total";
/// Workflows submitted to a scheduler, labelled `created` (false: an idempotent repeat).
pub const WORKFLOW_SUBMISSIONS: &str = "z29c_workflow_submissions_total";
/// Results a worker observed after losing its lease, kept as evidence.
pub const ATTEMPT_LATE_OBSERVATIONS: &str = "z29c_attempt_late_observations_total";
/// Steps whose invocation ended without a known outcome (handed to recovery).
pub const STEP_UNKNOWN_OUTCOMES: &str = "z29c_step_unknown_outcomes_total";
/// Receipts committed, labelled `verification` and `outcome`.
pub const STEP_RECEIPTS: &str = "z29c_step_receipts_total";
/// From submission to a receipt z29c established itself (seconds), labelled `verification`.
pub const STEP_TIME_TO_RECEIPT: &str = "z29c_step_time_to_receipt_seconds";
/// From a review item's opening to a person's resolution (seconds), labelled `resolution`.
pub const STEP_TIME_TO_MANUAL_RESOLUTION: &str = "z29c_step_time_to_manual_resolution_seconds";
/// External references named by more than one receipt: each is a duplicate external effect.
pub const STEP_DUPLICATE_REFERENCES: &str = "z29c_step_duplicate_external_references";
/// Workflows by state (`running`, `completed`, `failed`, `cancelled`), labelled `state`.
pub const WORKFLOWS: &str = "z29c_workflows";
/// Bytes on disk of each z29c table with its indexes (`table` label).
pub const STORAGE_TABLE_BYTES: &str = "z29c_storage_table_bytes";
/// Age of the oldest workflow the database keeps.
pub const STORAGE_OLDEST_WORKFLOW_AGE: &str = "z29c_storage_oldest_workflow_age_seconds";
/// Calls the public services refused, labelled `service` and `outcome` (`unauthenticated`,
/// `permission_denied`, `rate_limited`).
pub const CALLS_REFUSED: &str = "z29c_calls_refused_total";
/// Refusals not written to the audit log because its queue was full (a flood).
pub const AUDIT_DROPPED: &str = "z29c_audit_dropped_total";
/// NATS messages a consumer terminated as poison, labelled `consumer` and `reason`.
pub const POISON_MESSAGES: &str = "z29c_poison_messages_total";

/// Counts a committed receipt and how long after submission it came.
pub fn receipt_committed(verification: &str, outcome: &str, since_submission: Duration) {
    metrics::counter!(
        STEP_RECEIPTS,
        "verification" => verification.to_owned(),
        "outcome" => outcome.to_owned()
    )
    .increment(1);
    metrics::histogram!(STEP_TIME_TO_RECEIPT, "verification" => verification.to_owned())
        .record(since_submission.as_secs_f64());
}

/// Counts a person's resolution of a review item and how long the item waited for it; a
/// resolution that declares an outcome is also a receipt (verification `manual`).
pub fn review_resolved(resolution: &str, receipt_outcome: Option<&str>, waited: Duration) {
    metrics::histogram!(STEP_TIME_TO_MANUAL_RESOLUTION, "resolution" => resolution.to_owned())
        .record(waited.as_secs_f64());
    if let Some(outcome) = receipt_outcome {
        metrics::counter!(
            STEP_RECEIPTS,
            "verification" => "manual",
            "outcome" => outcome.to_owned()
        )
        .increment(1);
    }
}

/// Serves `/metrics` in the Prometheus text format on `listen`. Call from inside the runtime.
pub fn serve_prometheus(listen: SocketAddr) -> anyhow::Result<()> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(listen)
        // histograms as buckets, so they aggregate across instances
        .set_buckets(&[
            0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
        ])?
        .install()?;
    describe();
    Ok(())
}

/// Every counter starts at zero on `/metrics`, so "none happened" reads as 0, not as absent.
pub fn zero_counters(names: &[&'static str]) {
    for n in names {
        metrics::counter!(*n).absolute(0);
    }
}

fn describe() {
    metrics::describe_histogram!(
        LEASE_EXPIRY_AGE,
        metrics::Unit::Seconds,
        "how long past expiry a lease was when recovery took it"
    );
    metrics::describe_counter!(LEASE_ACQUISITIONS, "leases acquired for routine execution");
    metrics::describe_counter!(LEASE_RENEWAL_FAILURES, "lease renewals refused or failed");
    metrics::describe_counter!(
        ATTEMPT_FENCING_REJECTIONS,
        "writes refused because the presented lease was no longer current"
    );
    metrics::describe_counter!(
        ATTEMPT_LATE_OBSERVATIONS,
        "results observed after the lease was lost, kept as evidence"
    );
    metrics::describe_counter!(
        STEP_UNKNOWN_OUTCOMES,
        "invocations that ended without a known outcome"
    );
    metrics::describe_counter!(
        STEP_RECEIPTS,
        "receipts committed, by verification and outcome"
    );
    metrics::describe_counter!(
        RECOVERY_DECISIONS,
        "recovery decisions by category, decision and adapter capability"
    );
    metrics::describe_gauge!(
        INTEGRITY_CONFLICTS,
        "integrity conflicts on record (one request identity, two external references)"
    );
    metrics::describe_gauge!(REVIEW_ITEMS_OPEN, "review items waiting for a person");
    metrics::describe_counter!(LEASE_RECOVERIES, "expired leases taken over by recovery");
    metrics::describe_histogram!(
        STEP_TIME_TO_RECEIPT,
        metrics::Unit::Seconds,
        "from submission to a receipt z29c established itself, by verification"
    );
    metrics::describe_histogram!(
        STEP_TIME_TO_MANUAL_RESOLUTION,
        metrics::Unit::Seconds,
        "from a review item's opening to a person's resolution"
    );
    metrics::describe_gauge!(
        STEP_DUPLICATE_REFERENCES,
        "external references named by more than one receipt"
    );
    metrics::describe_gauge!(WORKFLOWS, "workflows by state");
    metrics::describe_gauge!(
        STORAGE_TABLE_BYTES,
        metrics::Unit::Bytes,
        "bytes on disk of each z29c table, its indexes and TOAST included"
    );
    metrics::describe_gauge!(
        STORAGE_OLDEST_WORKFLOW_AGE,
        metrics::Unit::Seconds,
        "how long ago the oldest workflow the database keeps was submitted"
    );
    metrics::describe_counter!(
        CALLS_REFUSED,
        "calls refused: no or bad credentials, no role, over the rate"
    );
    metrics::describe_counter!(
        AUDIT_DROPPED,
        "refusals not audited because the audit queue was full"
    );
    metrics::describe_counter!(POISON_MESSAGES, "NATS messages terminated as poison");
    metrics::describe_counter!(ATTEMPT_INVOCATIONS, "gateway calls by adapter and result");
    metrics::describe_counter!(
        WORKFLOW_SUBMISSIONS,
        "workflows submitted, by whether created"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAMES: &[&str] = &[
        RECOVERY_DECISIONS,
        INTEGRITY_CONFLICTS,
        REVIEW_ITEMS_OPEN,
        LEASE_RECOVERIES,
        LEASE_EXPIRY_AGE,
        LEASE_ACQUISITIONS,
        LEASE_RENEWAL_FAILURES,
        ATTEMPT_FENCING_REJECTIONS,
        ATTEMPT_INVOCATIONS,
        ATTEMPT_LATE_OBSERVATIONS,
        STEP_UNKNOWN_OUTCOMES,
        STEP_RECEIPTS,
        STEP_TIME_TO_RECEIPT,
        STEP_TIME_TO_MANUAL_RESOLUTION,
        STEP_DUPLICATE_REFERENCES,
        WORKFLOWS,
        WORKFLOW_SUBMISSIONS,
    ];

    #[test]
    fn every_name_keeps_its_level() {
        for n in NAMES {
            let level = [
                "z29c_lease_",
                "z29c_attempt_",
                "z29c_step_",
                "z29c_workflow",
            ]
            .iter()
            .filter(|p| n.starts_with(*p))
            .count();
            assert_eq!(level, 1, "{n} names no level");
        }
    }

    /// The Grafana dashboard queries only metrics the services expose.
    #[test]
    fn the_dashboard_is_built_on_these_names() {
        let dashboard = include_str!("../../../deploy/grafana/z29c-dashboard.json");
        let mut used = 0;
        for (i, _) in dashboard.match_indices("z29c_") {
            let rest: String = dashboard[i + "z29c_".len()..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            let name = format!("z29c_{rest}");
            let base = name.strip_suffix("_bucket").unwrap_or(&name);
            assert!(
                NAMES.contains(&base),
                "the dashboard queries {name}, which nothing exposes"
            );
            used += 1;
        }
        assert!(used >= NAMES.len(), "only {used} queries");
    }
}
