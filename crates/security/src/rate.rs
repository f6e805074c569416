//! Per-caller rate limits: each caller (a token's subject, or an address for the
//! unauthenticated) has its own budget, so one noisy client cannot starve the others.

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota};

/// A keyed limiter: `per_second` sustained, `burst` at once.
#[derive(Debug)]
pub struct PerCaller {
    limiter: DefaultKeyedRateLimiter<String>,
    clock: DefaultClock,
}

impl PerCaller {
    /// `None` when `per_second` is 0 (no limit).
    pub fn new(per_second: u32, burst: u32) -> Option<Self> {
        let rate = NonZeroU32::new(per_second)?;
        let burst = NonZeroU32::new(burst.max(1)).unwrap_or(rate);
        Some(Self {
            limiter: DefaultKeyedRateLimiter::keyed(Quota::per_second(rate).allow_burst(burst)),
            clock: DefaultClock::default(),
        })
    }

    /// `Ok` if `caller` may go on now, else how long until it may.
    pub fn check(&self, caller: &str) -> Result<(), Duration> {
        // forget idle callers now and then, so the map does not grow with every caller ever seen
        if self.limiter.len() > 10_000 {
            self.limiter.retain_recent();
        }
        self.limiter
            .check_key(&caller.to_owned())
            .map_err(|not_until| not_until.wait_time_from(self.clock.now()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_refused_with_a_wait_and_callers_are_apart() {
        let limit = PerCaller::new(1, 3).unwrap();
        for _ in 0..3 {
            limit.check("alice").unwrap();
        }
        let wait = limit.check("alice").unwrap_err();
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_secs(1),
            "{wait:?}"
        );
        limit.check("bob").unwrap();
    }

    #[test]
    fn zero_is_no_limit() {
        assert!(PerCaller::new(0, 10).is_none());
    }
}
