//! Metric names and their exposition. Names keep their level (DESIGN.md §8) so that worker
//! churn never reads as a result: `z29c_lease_*` is about who may work, `z29c_attempt_*` about
//! one try, `z29c_step_*` about what z29c knows of an external effect, `z29c_workflow_*` about
//! outcomes.

use std::net::SocketAddr;

pub use metrics;

/// Recovery decisions, labelled `category`, `decision` and `capability`.
pub const RECOVERY_DECISIONS: &str = "z29c_step_recovery_decisions_total";
/// Integrity conflicts on record: one request identity, two external references.
pub const INTEGRITY_CONFLICTS: &str = "z29c_step_integrity_conflicts";
/// Review items waiting for a person.
pub const REVIEW_ITEMS_OPEN: &str = "z29c_step_review_items_open";
/// Leases that expired and were taken over by recovery.
pub const LEASE_RECOVERIES: &str = "z29c_lease_recoveries_total";

/// Serves `/metrics` in the Prometheus text format on `listen`. Call from inside the runtime.
pub fn serve_prometheus(listen: SocketAddr) -> anyhow::Result<()> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(listen)
        .install()?;
    describe();
    Ok(())
}

fn describe() {
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
