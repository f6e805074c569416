//! `z29c dev` from nothing: throwaway PostgreSQL and NATS, every service, the demo workflow.

use std::process::Command;
use std::time::Instant;

#[test]
#[allow(clippy::print_stderr)] // prints the start-up time for the record
fn dev_starts_from_nothing_and_the_demo_completes() {
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_z29c"))
        .args(["dev", "--exit-after-demo"])
        // from nothing: no configured database or NATS
        .env_remove("Z29C_DATABASE_URL")
        .env_remove("Z29C_NATS_URL")
        .env("RUST_LOG", "warn")
        .output()
        .expect("run z29c dev");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "z29c dev failed\n{stdout}\n{stderr}");
    assert!(stdout.contains("demo delivery: Completed"), "{stdout}");
    assert!(
        stdout.contains("receipts match the destination's ledger"),
        "{stdout}"
    );
    assert_eq!(stdout.matches("receipt: succeeded").count(), 3, "{stdout}");
    // a figure for the record, not a timed assertion
    eprintln!(
        "z29c dev took {:.1} s from nothing to a finished demo",
        start.elapsed().as_secs_f64()
    );
}

#[test]
fn a_bad_workflow_file_names_the_field() {
    let dir = std::env::temp_dir().join(format!("z29c-wf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("bad.yaml");
    std::fs::write(
        &file,
        "name: x\nsteps:\n- {name: a, adapter: http, operation: o, policy: {lease: 1}}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_z29c"))
        .args(["submit"])
        .arg(&file)
        .args(["--server", "http://127.0.0.1:1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("steps[0].policy.lease"), "{stderr}");
    std::fs::remove_dir_all(dir).unwrap();
}
