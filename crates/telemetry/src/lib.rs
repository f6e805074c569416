//! Metric names and their exposition. Names keep their level (DESIGN.md §8) so that worker
//! churn never reads as a result: `z29c_lease_*` is about who may work, `z29c_attempt_*` about
//! one try, `z29c_step_*` about what z29c knows of an external effect, `z29c_workflow_*` about
//! outcomes.

//!
//! [`trace`] sets up tracing and OpenTelemetry, and carries trace context between services.

use std::net::SocketAddr;

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
/// Results a worker observed after losing its lease, kept as evidence.
pub const ATTEMPT_LATE_OBSERVATIONS: &str = "z29c_attempt_late_observations_total";
/// Steps whose invocation ended without a known outcome (handed to recovery).
pub const STEP_UNKNOWN_OUTCOMES: &str = "z29c_step_unknown_outcomes_total";
/// Receipts committed, labelled `verification` and `outcome`.
pub const STEP_RECEIPTS: &str = "z29c_step_receipts_total";

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
}
