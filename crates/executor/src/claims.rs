//! The claim loop: how many ready steps the executor claims, and when. Every worker runs one
//! attempt at a time; while every worker is busy the loop claims a few steps ahead, which wait
//! leased and unbegun for the next worker that frees (no longer than [`patience`]). The
//! numbers are decided by [`Capacity`], a pure rule with unit tests; the loop applies them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use z29c_core::OwnerId;

use crate::attempt;
use crate::config::ExecutorConfig;

/// The executor's pool, as the claim loop sizes its claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Capacity {
    /// Workers: calls in flight at once.
    pub workers: usize,
    /// Steps claimed ahead while every worker is busy.
    pub ahead: usize,
    /// Steps one claim takes at most.
    pub batch: usize,
    /// While steps wait, how many free places a claim waits for (or `claim_gather_ms`), so
    /// that a claim is not a commit per step.
    pub gather: usize,
}

/// What the loop sees of its pool when it decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Free {
    /// Leases it may still take (workers' and claimed-ahead places together).
    pub leases: usize,
    /// Workers free.
    pub slots: usize,
}

impl Capacity {
    pub(crate) fn new(workers: usize, claim_ahead: Option<usize>, claim_batch: usize) -> Self {
        Self {
            workers,
            ahead: claim_ahead.unwrap_or(workers / 4),
            batch: claim_batch,
            gather: workers.div_ceil(4).clamp(1, claim_batch.max(1)),
        }
    }

    /// Leases held at most at once: every worker's, and the steps claimed ahead.
    pub(crate) fn leases(self) -> usize {
        self.workers + self.ahead
    }

    /// How many steps to claim now. With claiming ahead off, only as many as there are free
    /// workers not yet promised to a step already claimed.
    pub(crate) fn want(self, free: Free, ahead_on: bool) -> usize {
        let want = free.leases.min(self.batch);
        if ahead_on {
            return want;
        }
        let held = self.leases().saturating_sub(free.leases);
        let busy = self.workers.saturating_sub(free.slots);
        let promised = held.saturating_sub(busy);
        want.min(free.slots.saturating_sub(promised))
    }

    /// Whether to wait for more free places before claiming (for at most `claim_gather_ms`):
    /// only while steps wait (the last claim filled every place it asked for), and only with
    /// fewer than [`Capacity::gather`] to claim.
    pub(crate) fn may_gather(self, want: usize, backlog: bool) -> bool {
        want > 0 && want < self.gather && backlog
    }
}

/// How long a step claimed ahead waits for a worker before it is given back unbegun: half its
/// renewal interval, so its first renewal (a renewal interval after the attempt starts) still
/// comes well before the lease ends.
pub(crate) fn patience(renew_every: Duration) -> Duration {
    renew_every / 2
}

/// Claims and starts attempts until `shutdown` is cancelled. Each attempt is spawned on
/// `tracker` with a clone of `ctx`.
pub(crate) async fn run(
    config: &ExecutorConfig,
    owner: &OwnerId,
    ctx: attempt::Context,
    wake: Arc<Notify>,
    tracker: &TaskTracker,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let capacity = Capacity::new(config.workers, config.claim_ahead, config.claim_batch);
    let slots = Arc::new(Semaphore::new(capacity.workers));
    let leases = Arc::new(Semaphore::new(capacity.leases()));
    // answered steps whose receipts are being recorded: their workers have gone on to the
    // next call, so these hold leases beyond the ones above, at most one per worker
    let recording = Arc::new(Semaphore::new(capacity.workers));
    // claiming ahead pays while attempts are short; once a step claimed ahead had to be given
    // back (every worker stayed busy past its patience), claiming ahead would only claim and
    // give back again and again: it stays off until an attempt ends within that time
    let ahead_on = Arc::new(AtomicBool::new(true));
    // the last claim filled every free slot, so more steps may be waiting: a finished attempt
    // wakes the loop to claim again at once instead of at the next poll or hint
    let backlog = Arc::new(AtomicBool::new(false));
    let poll = Duration::from_millis(config.poll_ms);
    let gather_for = Duration::from_millis(config.claim_gather_ms);
    let mut gathering_since: Option<tokio::time::Instant> = None;
    while !shutdown.is_cancelled() {
        let free = Free {
            leases: leases.available_permits(),
            slots: slots.available_permits(),
        };
        let want = capacity.want(free, ahead_on.load(Ordering::Relaxed));
        let gathering = capacity.may_gather(want, backlog.load(Ordering::Relaxed))
            && gathering_since
                .get_or_insert_with(tokio::time::Instant::now)
                .elapsed()
                < gather_for;
        if want > 0 && !gathering {
            gathering_since = None;
            match ctx.store.claim(owner, want as i64).await {
                Ok(claimed) => {
                    let n = claimed.len();
                    z29c_telemetry::metrics::counter!(z29c_telemetry::LEASE_ACQUISITIONS)
                        .increment(n as u64);
                    let claimed_at = std::time::Instant::now();
                    for step in claimed {
                        let held = leases.clone().acquire_owned().await?;
                        let ctx = ctx.clone();
                        let (wake, backlog, slots, ahead_on, recording) = (
                            wake.clone(),
                            backlog.clone(),
                            slots.clone(),
                            ahead_on.clone(),
                            recording.clone(),
                        );
                        tracker.spawn(async move {
                            let patience = patience(step.policy.renew_every);
                            let slot = tokio::select! {
                                slot = slots.acquire_owned() => slot.ok(),
                                _ = tokio::time::sleep(patience) => None,
                                _ = ctx.stop.cancelled() => None,
                            };
                            match slot {
                                Some(slot) => {
                                    let began = std::time::Instant::now();
                                    let worker = attempt::Worker {
                                        slot,
                                        held,
                                        recording,
                                        wake: wake.clone(),
                                        backlog: backlog.clone(),
                                    };
                                    attempt::run(ctx, step, claimed_at, worker).await;
                                    if began.elapsed() < patience {
                                        ahead_on.store(true, Ordering::Relaxed);
                                    }
                                }
                                None => {
                                    // before the lease goes back, so the loop's next claim
                                    // already claims no further ahead
                                    ahead_on.store(false, Ordering::Relaxed);
                                    attempt::give_back(&ctx, &step).await;
                                    drop(held);
                                }
                            }
                            if backlog.load(Ordering::Relaxed) {
                                wake.notify_one();
                            }
                        });
                    }
                    let full = n == want;
                    backlog.store(full, Ordering::Relaxed);
                    if full {
                        continue; // more may be waiting: claim again at once
                    }
                }
                Err(e) => tracing::warn!(error = %e, "claim failed"),
            }
        }
        let until = match gathering_since {
            Some(since) if gathering => since + gather_for,
            _ => tokio::time::Instant::now() + poll,
        };
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = wake.notified() => {}
            _ = tokio::time::sleep_until(until) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_is_sized_from_the_configuration() {
        let c = Capacity::new(16, None, 8);
        assert_eq!((c.ahead, c.batch, c.gather, c.leases()), (4, 8, 4, 20));
        // an explicit claim-ahead wins
        let c = Capacity::new(3, Some(0), 1);
        assert_eq!((c.ahead, c.batch, c.gather, c.leases()), (0, 1, 1, 3));
        // gathering never waits for more than one claim takes
        assert_eq!(Capacity::new(64, None, 4).gather, 4);
    }

    #[test]
    fn a_claim_takes_no_more_than_the_free_leases_and_one_batch() {
        let c = Capacity::new(16, None, 8);
        let all_free = Free {
            leases: 20,
            slots: 16,
        };
        assert_eq!(c.want(all_free, true), 8);
        assert_eq!(
            c.want(
                Free {
                    leases: 3,
                    slots: 0
                },
                true
            ),
            3
        );
        assert_eq!(
            c.want(
                Free {
                    leases: 0,
                    slots: 0
                },
                true
            ),
            0
        );
    }

    #[test]
    fn with_claiming_ahead_off_only_unpromised_free_workers_are_claimed_for() {
        let c = Capacity::new(16, None, 8);
        // every worker busy: four leases free (the claim-ahead places), none claimed for
        assert_eq!(
            c.want(
                Free {
                    leases: 4,
                    slots: 0
                },
                false
            ),
            0
        );
        // two workers free, nothing waiting for them: claim two
        assert_eq!(
            c.want(
                Free {
                    leases: 6,
                    slots: 2
                },
                false
            ),
            2
        );
        // two workers free, but two steps claimed ahead are about to take them
        assert_eq!(
            c.want(
                Free {
                    leases: 4,
                    slots: 2
                },
                false
            ),
            0
        );
        // with it on, the same pool claims ahead
        assert_eq!(
            c.want(
                Free {
                    leases: 4,
                    slots: 0
                },
                true
            ),
            4
        );
    }

    #[test]
    fn the_loop_gathers_only_while_steps_wait_and_fewer_than_enough_places_are_free() {
        let c = Capacity::new(16, None, 8);
        assert!(c.may_gather(1, true));
        assert!(c.may_gather(c.gather - 1, true));
        // nothing waiting, or already enough places: claim now
        assert!(!c.may_gather(1, false));
        assert!(!c.may_gather(c.gather, true));
        // nothing to claim is not a gathering
        assert!(!c.may_gather(0, true));
    }

    #[test]
    fn a_step_claimed_ahead_waits_half_its_renewal_interval() {
        assert_eq!(
            patience(Duration::from_millis(1_000)),
            Duration::from_millis(500)
        );
        assert_eq!(patience(Duration::ZERO), Duration::ZERO);
    }
}
