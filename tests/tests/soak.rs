//! A short randomized soak in the suite (the long ones run from the `z29c-scenarios` binary):
//! random kills, pauses and destination faults over a mixed load (a scheduler of the two among
//! the processes), then the invariants and what the client was told.

#![allow(clippy::print_stdout)]

use std::time::Duration;

use anyhow::Result;
use z29c_scenarios::soak;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_seeded_soak_finds_no_violation() -> Result<()> {
    let seed = std::env::var("Z29C_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20261202);
    let report = soak::soak(seed, Duration::from_secs(45), |l| println!("{l}")).await?;
    println!("{}", report.summary());
    assert!(
        report.faults >= 8,
        "too few faults landed: {}",
        report.faults
    );
    assert!(report.kills >= 1, "no process was killed");
    assert!(
        report.submit_errors.is_empty(),
        "submissions refused: {:?}",
        report.submit_errors
    );
    assert!(
        report.scheduler_faults >= 2,
        "a scheduler was neither killed nor paused: {}",
        report.scheduler_faults
    );
    assert!(
        report.client_history_violations.is_empty(),
        "what the client was told: {:#?}",
        report.client_history_violations
    );
    assert!(report.tally.completed > 0, "nothing completed");
    assert!(
        report.retriable_not_completed.is_empty(),
        "idempotent and queryable steps must complete once every fault healed: {:?}",
        report.retriable_not_completed
    );
    assert!(
        report.violations.is_empty(),
        "violations: {:#?}",
        report.violations
    );
    Ok(())
}

#[test]
fn the_seed_names_the_fault_schedule() {
    let a = serde_json::to_string(&soak::schedule(7, Duration::from_secs(600))).unwrap();
    let b = serde_json::to_string(&soak::schedule(7, Duration::from_secs(600))).unwrap();
    let c = serde_json::to_string(&soak::schedule(8, Duration::from_secs(600))).unwrap();
    assert_eq!(a, b, "same seed, same schedule");
    assert_ne!(a, c, "another seed, another schedule");
}
