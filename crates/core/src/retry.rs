//! How one step tries again and how long it may wait (docs/design.md §4, "Retries and
//! waiting"): the backoff before another attempt, which definite refusals are worth another
//! attempt under the same request identity, and how much waiting without sending (a rate
//! limit, no permit free, no gateway for the adapter, a request that never left) a step may do
//! before it ends. Nothing loops forever: attempts are bounded by `max_attempts`, waits by
//! `max_waits` and `max_wait_ms`.

use std::fmt;
use std::time::Duration;

use backon::BackoffBuilder;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::policy::{PlatformBounds, PolicyError, err, millis};

/// The first automatic retry waits at least this long by default; jitter adds up to as much
/// again.
pub const DEFAULT_INITIAL_BACKOFF: Duration = Duration::from_millis(250);
/// By default no automatic retry waits longer than this.
pub const DEFAULT_MAX_BACKOFF: Duration = Duration::from_secs(30);
/// By default a step may wait this long in all, sending nothing, before it ends.
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(3600);

/// A step's retry and waiting policy. Every field has a default, and a field left at its
/// default is left out of the serialized policy, so a submission that sets none has the digest
/// it had before these fields existed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RetryPolicy {
    /// The wait before the first retry; each later one is `backoff_multiplier` times longer,
    /// with jitter in `[d, 2d)`, never above `max_backoff`.
    #[serde(
        rename = "initial_backoff_ms",
        with = "millis",
        skip_serializing_if = "is_default_initial"
    )]
    pub initial_backoff: Duration,
    #[serde(
        rename = "max_backoff_ms",
        with = "millis",
        skip_serializing_if = "is_default_max"
    )]
    pub max_backoff: Duration,
    #[serde(skip_serializing_if = "Multiplier::is_default")]
    pub backoff_multiplier: Multiplier,
    /// Definite refusals (4xx statuses) that are tried again, under the same request identity,
    /// while attempts are left. Any other refusal ends the step at once.
    #[serde(skip_serializing_if = "StatusSet::is_empty")]
    pub retryable_statuses: StatusSet,
    /// How many times the step may be given back without sending before it ends; 0: no limit
    /// on the count (`max_wait_ms` still bounds it).
    #[serde(skip_serializing_if = "is_zero")]
    pub max_waits: u32,
    /// How long, in all, the step may wait without sending before it ends.
    #[serde(
        rename = "max_wait_ms",
        with = "millis",
        skip_serializing_if = "is_default_wait"
    )]
    pub max_wait: Duration,
}

fn is_default_initial(d: &Duration) -> bool {
    *d == DEFAULT_INITIAL_BACKOFF
}
fn is_default_max(d: &Duration) -> bool {
    *d == DEFAULT_MAX_BACKOFF
}
fn is_default_wait(d: &Duration) -> bool {
    *d == DEFAULT_MAX_WAIT
}
fn is_zero(v: &u32) -> bool {
    *v == 0
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            initial_backoff: DEFAULT_INITIAL_BACKOFF,
            max_backoff: DEFAULT_MAX_BACKOFF,
            backoff_multiplier: Multiplier::default(),
            retryable_statuses: StatusSet::default(),
            max_waits: 0,
            max_wait: DEFAULT_MAX_WAIT,
        }
    }
}

/// How much a step has waited so far without sending.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Waited {
    /// Times it was given back without sending.
    pub waits: u32,
    /// The waits asked for, added up.
    pub total: Duration,
}

/// What follows one more wait without sending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterWait {
    /// Within budget: the step is ready again after this wait.
    Wait { after: Duration },
    /// Past budget, and no attempt may have sent: the step fails, for this reason.
    Fail(String),
    /// Past budget, but an earlier attempt may have sent: its effect may exist, so a person
    /// decides, for this reason.
    Review(String),
}

/// What follows a definite refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterRefusal {
    /// Tried again, under the same request identity, after this backoff.
    Retry { after: Duration },
    /// The refusal is the step's outcome: its receipt says it failed.
    Final,
}

impl RetryPolicy {
    /// How long a step waits before the retry that follows its `attempts_made`-th attempt:
    /// `d`, then `d` times `backoff_multiplier` for each later one, with jitter in `[d, 2d)`,
    /// `d` starting at `initial_backoff` and growing no further than half of `max_backoff`, so
    /// that no wait passes `max_backoff` and waits at the cap still spread out. A storm of
    /// failing steps spreads out instead of retrying in lockstep.
    pub fn backoff(&self, attempts_made: u32) -> Duration {
        let cap = self.max_backoff / 2;
        backon::ExponentialBuilder::new()
            .with_min_delay(self.initial_backoff.min(cap))
            .with_max_delay(cap)
            .with_factor(self.backoff_multiplier.0 as f32)
            .with_jitter()
            .without_max_times()
            .build()
            .nth(attempts_made.saturating_sub(1) as usize)
            .unwrap_or(self.max_backoff)
            .min(self.max_backoff)
    }

    /// Whether a definite refusal with `status` is tried again: only a status the policy names,
    /// and only while attempts are left (`attempts_used` counts this one). A refusal says the
    /// effect did not happen, so another request under the same identity cannot make two.
    pub fn after_refusal(
        &self,
        status: u16,
        attempts_used: u32,
        max_attempts: u32,
    ) -> AfterRefusal {
        if self.retryable_statuses.contains(status) && attempts_used < max_attempts {
            AfterRefusal::Retry {
                after: self.backoff(attempts_used),
            }
        } else {
            AfterRefusal::Final
        }
    }

    /// Whether a step given back without sending (`why`: rate limited, no permit, …) may wait
    /// `delay` more, having waited `so_far`. Every wait counts at least `initial_backoff` (a
    /// `Retry-After: 0`, or a date already past, would otherwise come back at once, for ever).
    /// Past `max_waits` waits, or when the wait would take it past `max_wait` in all, it ends
    /// now rather than wait for nothing: it fails when no attempt may have sent, and goes to
    /// review when one may have.
    pub fn after_wait(
        &self,
        so_far: Waited,
        delay: Duration,
        may_have_sent: bool,
        why: &str,
    ) -> AfterWait {
        let delay = delay.max(self.initial_backoff);
        let waits = so_far.waits.saturating_add(1);
        let total = so_far.total.saturating_add(delay);
        let past = if self.max_waits > 0 && waits > self.max_waits {
            format!(
                "{why}: given back {waits} times without sending, more than its max_waits ({})",
                self.max_waits
            )
        } else if total > self.max_wait {
            format!(
                "{why}: waiting {} ms more would make {} ms without sending, more than its max_wait_ms ({})",
                delay.as_millis(),
                total.as_millis(),
                self.max_wait.as_millis()
            )
        } else {
            return AfterWait::Wait { after: delay };
        };
        if may_have_sent {
            AfterWait::Review(format!(
                "{past}; an earlier attempt may have sent its request"
            ))
        } else {
            AfterWait::Fail(format!("{past}; nothing was sent"))
        }
    }

    /// Checks the policy against the bounds, naming the first offending field.
    pub fn validate(&self, bounds: &PlatformBounds) -> Result<(), PolicyError> {
        if self.initial_backoff.is_zero() || self.initial_backoff > self.max_backoff {
            // name the field the submission set: a max_backoff_ms below the default initial
            // backoff is the max's fault
            let field = if self.initial_backoff == DEFAULT_INITIAL_BACKOFF {
                "max_backoff_ms"
            } else {
                "initial_backoff_ms"
            };
            return Err(err(
                field,
                format!(
                    "initial_backoff_ms ({} ms) must be positive and at most max_backoff_ms ({} ms)",
                    self.initial_backoff.as_millis(),
                    self.max_backoff.as_millis()
                ),
            ));
        }
        if self.max_backoff > bounds.max_backoff {
            return Err(err(
                "max_backoff_ms",
                format!(
                    "{} ms is above the {} ms allowed",
                    self.max_backoff.as_millis(),
                    bounds.max_backoff.as_millis()
                ),
            ));
        }
        let m = self.backoff_multiplier.0;
        if !(1.0..=10.0).contains(&m) {
            return Err(err(
                "backoff_multiplier",
                format!("{m} must be within 1.0..=10.0"),
            ));
        }
        if self.max_wait.is_zero() || self.max_wait > bounds.max_wait {
            return Err(err(
                "max_wait_ms",
                format!(
                    "{} ms must be positive and at most {} ms",
                    self.max_wait.as_millis(),
                    bounds.max_wait.as_millis()
                ),
            ));
        }
        Ok(())
    }
}

/// The factor by which each backoff grows: a finite number in `1.0..=10.0` once validated.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Multiplier(pub f64);

impl Multiplier {
    pub const DEFAULT: Self = Self(2.0);
    fn is_default(&self) -> bool {
        *self == Self::DEFAULT
    }
}

impl Default for Multiplier {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl PartialEq for Multiplier {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}

impl Eq for Multiplier {}

/// A set of HTTP statuses a step retries: 4xx only, and neither 409 (a request with the same
/// key still in flight, which is not a refusal) nor 429 (a rate limit, which is waited out).
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct StatusSet(u128);

const FIRST: u16 = 400;
const LAST: u16 = 499;

impl StatusSet {
    /// The set of `statuses`, or the first that may not be in it, named.
    pub fn parse(statuses: impl IntoIterator<Item = u32>) -> Result<Self, PolicyError> {
        let mut set = 0u128;
        for s in statuses {
            let fits = u16::try_from(s)
                .ok()
                .filter(|s| (FIRST..=LAST).contains(s) && *s != 409 && *s != 429);
            let Some(s) = fits else {
                return Err(err(
                    "retryable_statuses",
                    format!(
                        "{s} is not a definite refusal that may be retried: use 4xx statuses other than 409 (in flight) and 429 (waited out)"
                    ),
                ));
            };
            set |= 1 << (s - FIRST);
        }
        Ok(Self(set))
    }

    pub fn contains(&self, status: u16) -> bool {
        (FIRST..=LAST).contains(&status) && self.0 & (1 << (status - FIRST)) != 0
    }

    pub fn is_empty(&self) -> bool {
        self.0 == 0
    }

    /// The statuses, lowest first.
    pub fn iter(&self) -> impl Iterator<Item = u16> + '_ {
        (FIRST..=LAST).filter(|s| self.contains(*s))
    }
}

impl fmt::Debug for StatusSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

impl Serialize for StatusSet {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for StatusSet {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Vec::<u32>::deserialize(d)?;
        Self::parse(v).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn backoffs_grow_by_the_multiplier_capped_with_jitter() {
        for (initial, max, m) in [(250, 30_000, 2.0), (100, 2_000, 3.0), (1_000, 1_000, 1.0)] {
            let p = RetryPolicy {
                initial_backoff: ms(initial),
                max_backoff: ms(max),
                backoff_multiplier: Multiplier(m),
                ..RetryPolicy::default()
            };
            for n in 1..12u32 {
                let exp = initial as f64 * m.powi(n as i32 - 1);
                let floor = ms(exp as u64).min(p.max_backoff / 2);
                let samples: Vec<Duration> = (0..30).map(|_| p.backoff(n)).collect();
                for d in &samples {
                    assert!(*d >= floor, "attempt {n}: {d:?} below {floor:?}");
                    assert!(
                        *d < floor * 2,
                        "attempt {n}: {d:?} not below {:?}",
                        floor * 2
                    );
                    assert!(*d <= p.max_backoff, "attempt {n}: {d:?} above the cap");
                }
                // waits spread out, at the cap too
                let distinct: std::collections::BTreeSet<_> = samples.iter().collect();
                assert!(distinct.len() > 1, "attempt {n}: no jitter in {samples:?}");
            }
        }
        assert!(RetryPolicy::default().backoff(0) >= DEFAULT_INITIAL_BACKOFF);
    }

    #[test]
    fn only_a_named_refusal_is_retried_and_only_while_attempts_are_left() {
        let p = RetryPolicy {
            retryable_statuses: StatusSet::parse([408, 425]).unwrap(),
            ..RetryPolicy::default()
        };
        for status in [400, 401, 403, 404, 422, 451] {
            assert_eq!(
                p.after_refusal(status, 1, 5),
                AfterRefusal::Final,
                "{status}"
            );
        }
        for status in [408, 425] {
            assert!(matches!(
                p.after_refusal(status, 1, 5),
                AfterRefusal::Retry { .. }
            ));
            assert!(matches!(
                p.after_refusal(status, 4, 5),
                AfterRefusal::Retry { .. }
            ));
            assert_eq!(p.after_refusal(status, 5, 5), AfterRefusal::Final);
            assert_eq!(p.after_refusal(status, 6, 5), AfterRefusal::Final);
        }
        // nothing is retried by default
        assert_eq!(
            RetryPolicy::default().after_refusal(408, 1, 5),
            AfterRefusal::Final
        );
    }

    #[test]
    fn a_status_set_holds_definite_refusals_only() {
        for bad in [200, 399, 409, 429, 500, 503, 70_000] {
            let e = StatusSet::parse([bad]).unwrap_err();
            assert_eq!(e.field, "retryable_statuses");
            assert!(e.reason.contains(&bad.to_string()), "{e}");
        }
        let s = StatusSet::parse([499, 400, 425, 425]).unwrap();
        assert_eq!(s.iter().collect::<Vec<_>>(), [400, 425, 499]);
        assert!(!s.contains(401) && !s.contains(500) && !s.contains(0));
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(json, "[400,425,499]");
        assert_eq!(serde_json::from_str::<StatusSet>(&json).unwrap(), s);
        assert!(serde_json::from_str::<StatusSet>("[429]").is_err());
    }

    #[test]
    fn waiting_ends_past_either_budget_failing_or_in_review() {
        let p = RetryPolicy {
            max_waits: 3,
            max_wait: ms(10_000),
            ..RetryPolicy::default()
        };
        let w = |waits, total| Waited {
            waits,
            total: ms(total),
        };
        let wait = |after| AfterWait::Wait { after: ms(after) };
        assert_eq!(
            p.after_wait(w(0, 0), ms(1_000), false, "rate limited"),
            wait(1_000)
        );
        assert_eq!(
            p.after_wait(w(2, 2_000), ms(1_000), true, "rate limited"),
            wait(1_000)
        );
        // a wait of nothing counts the initial backoff: coming back at once, for ever, is not
        // waiting
        assert_eq!(
            p.after_wait(w(0, 0), ms(0), false, "rate limited"),
            wait(250)
        );
        // the fourth wait is past max_waits
        let AfterWait::Fail(why) = p.after_wait(w(3, 3_000), ms(1_000), false, "rate limited")
        else {
            panic!("expected a failure")
        };
        assert!(
            why.contains("max_waits (3)") && why.contains("nothing was sent"),
            "{why}"
        );
        let AfterWait::Review(why) = p.after_wait(w(3, 3_000), ms(1_000), true, "no permit") else {
            panic!("expected a review")
        };
        assert!(
            why.starts_with("no permit") && why.contains("may have sent"),
            "{why}"
        );
        // a wait that would go past max_wait ends the step now, not after the wait
        assert!(matches!(
            p.after_wait(w(1, 9_000), ms(1_001), false, "rate limited"),
            AfterWait::Fail(why) if why.contains("max_wait_ms (10000)")
        ));
        assert_eq!(
            p.after_wait(w(1, 9_000), ms(1_000), false, "x"),
            wait(1_000)
        );
        // no count limit by default; the total still bounds it
        let d = RetryPolicy::default();
        assert_eq!(
            d.after_wait(w(1_000_000, 0), ms(300), false, "x"),
            wait(300)
        );
        // waits of nothing add up to the budget all the same
        assert!(matches!(
            d.after_wait(w(14_400, 3_600_000), ms(0), false, "x"),
            AfterWait::Fail(_)
        ));
        assert!(matches!(
            d.after_wait(w(1, 0), ms(7_200_000), false, "x"),
            AfterWait::Fail(_)
        ));
    }

    #[test]
    fn each_field_out_of_bounds_is_named() {
        let b = PlatformBounds::default();
        RetryPolicy::default().validate(&b).unwrap();
        let base = RetryPolicy::default();
        let cases = [
            (
                "max_backoff_ms",
                RetryPolicy {
                    max_backoff: ms(100),
                    ..base
                },
            ),
            (
                "initial_backoff_ms",
                RetryPolicy {
                    initial_backoff: ms(0),
                    ..base
                },
            ),
            (
                "initial_backoff_ms",
                RetryPolicy {
                    initial_backoff: ms(40_000),
                    ..base
                },
            ),
            (
                "max_backoff_ms",
                RetryPolicy {
                    max_backoff: b.max_backoff + ms(1),
                    ..base
                },
            ),
            (
                "backoff_multiplier",
                RetryPolicy {
                    backoff_multiplier: Multiplier(0.5),
                    ..base
                },
            ),
            (
                "backoff_multiplier",
                RetryPolicy {
                    backoff_multiplier: Multiplier(f64::NAN),
                    ..base
                },
            ),
            (
                "backoff_multiplier",
                RetryPolicy {
                    backoff_multiplier: Multiplier(11.0),
                    ..base
                },
            ),
            (
                "max_wait_ms",
                RetryPolicy {
                    max_wait: ms(0),
                    ..base
                },
            ),
            (
                "max_wait_ms",
                RetryPolicy {
                    max_wait: b.max_wait + ms(1),
                    ..base
                },
            ),
        ];
        for (field, p) in cases {
            assert_eq!(p.validate(&b).unwrap_err().field, field, "{p:?}");
        }
    }

    #[test]
    fn a_default_policy_serializes_to_nothing_and_reads_back() {
        assert_eq!(
            serde_json::to_string(&RetryPolicy::default()).unwrap(),
            "{}"
        );
        let p: RetryPolicy = serde_json::from_str("{}").unwrap();
        assert_eq!(p, RetryPolicy::default());
        let set = RetryPolicy {
            initial_backoff: ms(100),
            max_backoff: ms(5_000),
            backoff_multiplier: Multiplier(1.5),
            retryable_statuses: StatusSet::parse([408]).unwrap(),
            max_waits: 7,
            max_wait: ms(60_000),
        };
        let json = serde_json::to_value(set).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "initial_backoff_ms": 100, "max_backoff_ms": 5000, "backoff_multiplier": 1.5,
                "retryable_statuses": [408], "max_waits": 7, "max_wait_ms": 60000
            })
        );
        assert_eq!(serde_json::from_value::<RetryPolicy>(json).unwrap(), set);
    }
}
