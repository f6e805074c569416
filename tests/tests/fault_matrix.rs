//! The fault matrix, in the test suite: every cell must hold every invariant, and
//! the checker must catch a deliberately broken build. The table is printed for the log.

#![allow(clippy::print_stdout)]

use anyhow::Result;
use z29c_core::AdapterCapability;
use z29c_scenarios::history::Invariant;
use z29c_scenarios::matrix::{self, Cap, Cell, Fault, Switches};

fn parallel() -> usize {
    std::env::var("Z29C_MATRIX_PARALLEL")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_cell_of_the_fault_matrix_holds_every_invariant() -> Result<()> {
    matrix::require_fault_build()?;
    let cells = matrix::cells();
    let n = cells.len();
    let results = matrix::run_cells(cells, parallel(), Switches::default(), |i, n, r| {
        println!(
            "[{i}/{n}] {} {} ({:.0}s)",
            if r.passed() { "ok  " } else { "FAIL" },
            r.cell,
            r.elapsed.as_secs_f64()
        );
        if !r.passed() {
            print!("{}", r.findings());
        }
        if let Some(why) = &r.setup_retried {
            println!("    second start; the first failed before any fault: {why}");
        }
    })
    .await;
    println!("{}", matrix::table(&results));
    assert_eq!(results.len(), n, "every cell ran");
    let failed: Vec<String> = results
        .iter()
        .filter(|r| !r.passed())
        .map(|r| r.cell.to_string())
        .collect();
    assert!(failed.is_empty(), "cells failed: {failed:?}");
    Ok(())
}

/// The receipt commit with its fencing check switched off (a test-only switch of the `faults`
/// build): a paused worker comes back after recovery took its step over, and commits. The
/// same cell passes on the real build (above); on the broken one the checker must say B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checker_catches_a_build_without_receipt_fencing() -> Result<()> {
    matrix::require_fault_build()?;
    let cell = Cell {
        fault: Fault::Pause,
        cap: Cap::One(AdapterCapability::Opaque),
    };
    let broken = matrix::run_cell(
        cell,
        Switches {
            break_receipt_fencing: true,
        },
    )
    .await;
    println!("{}", matrix::table(std::slice::from_ref(&broken)));
    assert!(
        broken
            .violations
            .iter()
            .any(|v| v.invariant == Invariant::NoStaleReceipt),
        "the stale receipt went unnoticed: {:?} {:?}",
        broken.violations,
        broken.expectations
    );
    // this failure was the point: its kept history is not evidence of anything to look at
    if let Some(dir) = &broken.kept {
        std::fs::remove_dir_all(dir)?;
    }
    Ok(())
}
