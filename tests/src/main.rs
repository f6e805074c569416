//! `z29c-scenarios`: the fault matrix and the randomized soak, outside the test runner.
//!
//! ```text
//! cargo build -p z29c-cli -p z29c-scenarios      # one build: z29c gets its fault points
//! target/debug/z29c-scenarios matrix [--parallel 3] [--only crash]
//! target/debug/z29c-scenarios soak --seed 7 --duration 10m
//! ```

use std::time::Duration;

use anyhow::{Result, bail};
use clap::{Parser, Subcommand};
use z29c_scenarios::{matrix, say, soak, stop_signal};

#[derive(Parser)]
#[command(
    name = "z29c-scenarios",
    about = "z29c's fault matrix and soak, on real processes"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Runs the fault matrix and prints fault × capability → invariants held.
    Matrix {
        /// Cells run at once.
        #[arg(long, default_value_t = 3)]
        parallel: usize,
        /// Only cells whose name contains this text.
        #[arg(long)]
        only: Option<String>,
        /// Run the deliberately broken build (receipts unfenced): cells must fail.
        #[arg(long)]
        broken: bool,
    },
    /// Checks a saved history (`history.json` of a failed cell or soak) again.
    Check {
        history: std::path::PathBuf,
        /// Permits allowed in flight per adapter and operation class.
        #[arg(long, default_value_t = 6)]
        permit_limit: i64,
    },
    /// Runs a mixed load while killing and pausing random processes, then checks.
    Soak {
        /// Seed of the fault schedule; the same seed gives the same schedule.
        #[arg(long, num_args = 1.., default_values_t = [1u64])]
        seed: Vec<u64>,
        /// How long the load and faults last, e.g. `90s` or `10m`.
        #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
        duration: Duration,
        /// Run on a PostgreSQL server of the soak's own (initdb), not DATABASE_URL's.
        #[arg(long)]
        private_postgres: bool,
    },
}

#[tokio::main]
async fn main() -> Result<()> {
    let command = Cli::parse().command;
    // A signal drops the running command, and with it every process it started (all are
    // `kill_on_drop`): a stopped bench leaves no PostgreSQL or z29c service behind.
    tokio::select! {
        out = run(command) => out,
        signal = stop_signal() => bail!("stopped by {signal}; the processes it started were killed"),
    }
}

async fn run(command: Command) -> Result<()> {
    match command {
        Command::Matrix {
            parallel,
            only,
            broken,
        } => {
            let cells: Vec<_> = matrix::cells()
                .into_iter()
                .filter(|c| {
                    only.as_ref()
                        .is_none_or(|o| c.to_string().contains(o.as_str()))
                })
                .collect();
            if cells.is_empty() {
                bail!("--only {only:?} matches no cell");
            }
            matrix::require_fault_build()?;
            let switches = matrix::Switches {
                break_receipt_fencing: broken,
            };
            let results = matrix::run_cells(cells, parallel, switches, |i, n, r| {
                say(&format!(
                    "[{i}/{n}] {} {} ({:.0}s)",
                    if r.passed() { "ok  " } else { "FAIL" },
                    r.cell,
                    r.elapsed.as_secs_f64()
                ));
                if !r.passed() {
                    say(r.findings().trim_end());
                }
            })
            .await;
            say(&matrix::table(&results));
            if results.iter().any(|r| !r.passed()) {
                std::process::exit(1);
            }
        }
        Command::Check {
            history,
            permit_limit,
        } => {
            let h = z29c_scenarios::history::History::read(&history)?;
            let expect = z29c_scenarios::history::Expect {
                capabilities: z29c_core::AdapterCapability::ALL
                    .iter()
                    .map(|c| (format!("http-{c}"), *c))
                    .collect(),
                permit_limit,
                min_completed: h.steps.len() / 2,
            };
            let violations = h.check(&expect);
            let t = h.tally();
            say(&format!(
                "{}: {} steps, {} completed, {} in review, {} external effects · violations: {}",
                history.display(),
                t.steps,
                t.completed,
                t.in_review,
                t.effects,
                violations.len()
            ));
            for v in &violations {
                say(&format!("  violation {v}"));
            }
            if !violations.is_empty() {
                std::process::exit(1);
            }
        }
        Command::Soak {
            seed,
            duration,
            private_postgres,
        } => {
            let mut failed = false;
            for s in seed {
                let report = if private_postgres {
                    soak::soak_private(s, duration, |l| say(&l)).await?
                } else {
                    soak::soak(s, duration, |l| say(&l)).await?
                };
                say(&report.summary());
                for v in &report.violations {
                    say(&format!("  violation {v}"));
                }
                for v in &report.client_history_violations {
                    say(&format!("  client history: {v}"));
                }
                for e in &report.submit_errors {
                    say(&format!("  submission refused: {e}"));
                }
                if report.tally.completed == 0 {
                    say("  nothing completed");
                }
                failed |= !report.violations.is_empty()
                    || !report.client_history_violations.is_empty()
                    || !report.submit_errors.is_empty()
                    || report.tally.completed == 0;
            }
            if failed {
                std::process::exit(1);
            }
        }
    }
    Ok(())
}
