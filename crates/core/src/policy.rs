//! Lease policy per step definition, the platform bounds it must sit within, and the four
//! deadlines (docs/design.md §4): adapter timeout (one call), attempt deadline (one worker's
//! authority), lease expiry (recovery after lost ownership), workflow deadline (usefulness of the
//! outcome). Lengthening one never repairs another, so each is its own field.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::retry::RetryPolicy;

/// A policy field outside platform bounds, named so a client can fix its input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct PolicyError {
    /// The offending field, as it is spelled in a workflow file (`lease_ms`, …).
    pub field: &'static str,
    pub reason: String,
}

pub(crate) fn err(field: &'static str, reason: impl Into<String>) -> PolicyError {
    PolicyError {
        field,
        reason: reason.into(),
    }
}

/// How a step's lease behaves. Set per step definition, checked against [`PlatformBounds`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeasePolicy {
    /// Initial lease duration, and what each renewal extends it to (from PostgreSQL's now).
    #[serde(rename = "lease_ms", with = "millis")]
    pub lease: Duration,
    /// How often the worker asks to renew.
    #[serde(rename = "renew_every_ms", with = "millis")]
    pub renew_every: Duration,
    /// The most time one attempt may hold authority. Renewal never extends past it.
    #[serde(rename = "attempt_deadline_ms", with = "millis")]
    pub attempt_deadline: Duration,
    /// Time kept back before the attempt deadline to persist a final observation (a timeout).
    #[serde(rename = "final_grace_ms", with = "millis")]
    pub final_grace: Duration,
    /// The longest one adapter call may wait.
    #[serde(rename = "adapter_timeout_ms", with = "millis")]
    pub adapter_timeout: Duration,
    /// Attempts allowed before the step fails (only where failing is known to be safe).
    pub max_attempts: u32,
    /// How long the step may wait, once ready, for an attempt to start its call; zero: no
    /// limit. Past it nothing was sent, so the step fails with that reason.
    /// Left out of the serialized policy when zero, so the digest of a submission that does
    /// not set it is what it was before the field existed.
    #[serde(
        rename = "schedule_to_start_ms",
        with = "millis",
        default,
        skip_serializing_if = "Duration::is_zero"
    )]
    pub schedule_to_start: Duration,
    /// Backoff, retryable refusals and the waiting budget (each field left out when default).
    #[serde(flatten)]
    pub retry: RetryPolicy,
}

impl Default for LeasePolicy {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(15),
            renew_every: Duration::from_secs(5),
            attempt_deadline: Duration::from_secs(60),
            final_grace: Duration::from_secs(2),
            adapter_timeout: Duration::from_secs(10),
            max_attempts: 5,
            schedule_to_start: Duration::ZERO,
            retry: RetryPolicy::default(),
        }
    }
}

/// How a service waits for a server it needs (PostgreSQL, NATS) that is not up yet: from
/// 100 ms, doubling, with jitter, at most 2 s apart, for `patience` in all.
pub fn connect_backoff(patience: Duration) -> backon::ExponentialBuilder {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(2))
        .with_jitter()
        .with_total_delay(Some(patience))
        .without_max_times()
}

/// Limits every step policy must respect, set by the operator of the platform.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PlatformBounds {
    #[serde(with = "millis")]
    pub min_lease: Duration,
    #[serde(with = "millis")]
    pub max_lease: Duration,
    #[serde(with = "millis")]
    pub max_attempt_deadline: Duration,
    #[serde(with = "millis")]
    pub max_final_grace: Duration,
    pub max_attempts: u32,
    #[serde(with = "millis")]
    pub max_schedule_to_start: Duration,
    /// The longest backoff a step may ask for between attempts.
    #[serde(with = "millis")]
    pub max_backoff: Duration,
    /// The longest a step may wait in all without sending (its `max_wait_ms`).
    #[serde(with = "millis")]
    pub max_wait: Duration,
}

impl Default for PlatformBounds {
    fn default() -> Self {
        Self {
            min_lease: Duration::from_secs(1),
            max_lease: Duration::from_secs(600),
            max_attempt_deadline: Duration::from_secs(3600),
            max_final_grace: Duration::from_secs(60),
            max_attempts: 100,
            max_schedule_to_start: Duration::from_secs(7 * 24 * 3600),
            max_backoff: Duration::from_secs(3600),
            max_wait: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

impl LeasePolicy {
    /// Checks that a gateway that lets one call run at most `max_call` can give this policy's
    /// adapter timeout in full: a longer one would be cut short there, silently, and the step
    /// retried at the cut again and again.
    pub fn fits_call_limit(&self, max_call: Duration) -> Result<(), PolicyError> {
        if self.adapter_timeout > max_call {
            return Err(err(
                "adapter_timeout_ms",
                format!(
                    "{} ms is longer than the {} ms a gateway serving this adapter lets one call run (its grpc.max_deadline_ms)",
                    self.adapter_timeout.as_millis(),
                    max_call.as_millis()
                ),
            ));
        }
        Ok(())
    }

    /// Checks the policy against the bounds and against itself. The first offending field is
    /// named; a policy that passes leaves room for at least two renewals per lease, a final
    /// observation inside the lease, and an adapter call that ends before the grace period.
    pub fn validate(&self, bounds: &PlatformBounds) -> Result<(), PolicyError> {
        if self.lease < bounds.min_lease || self.lease > bounds.max_lease {
            return Err(err(
                "lease_ms",
                format!(
                    "{} ms is outside {}..={} ms",
                    self.lease.as_millis(),
                    bounds.min_lease.as_millis(),
                    bounds.max_lease.as_millis()
                ),
            ));
        }
        if self.renew_every.is_zero() || self.renew_every * 2 > self.lease {
            return Err(err(
                "renew_every_ms",
                format!(
                    "{} ms must be positive and at most half of lease_ms ({} ms)",
                    self.renew_every.as_millis(),
                    self.lease.as_millis()
                ),
            ));
        }
        if self.attempt_deadline < self.lease || self.attempt_deadline > bounds.max_attempt_deadline
        {
            return Err(err(
                "attempt_deadline_ms",
                format!(
                    "{} ms must be at least lease_ms ({} ms) and at most {} ms",
                    self.attempt_deadline.as_millis(),
                    self.lease.as_millis(),
                    bounds.max_attempt_deadline.as_millis()
                ),
            ));
        }
        if self.final_grace.is_zero()
            || self.final_grace >= self.lease
            || self.final_grace > bounds.max_final_grace
        {
            return Err(err(
                "final_grace_ms",
                format!(
                    "{} ms must be positive, below lease_ms ({} ms) and at most {} ms",
                    self.final_grace.as_millis(),
                    self.lease.as_millis(),
                    bounds.max_final_grace.as_millis()
                ),
            ));
        }
        let call_room = self.attempt_deadline - self.final_grace;
        if self.adapter_timeout.is_zero() || self.adapter_timeout > call_room {
            return Err(err(
                "adapter_timeout_ms",
                format!(
                    "{} ms must be positive and at most attempt_deadline_ms - final_grace_ms ({} ms)",
                    self.adapter_timeout.as_millis(),
                    call_room.as_millis()
                ),
            ));
        }
        if self.schedule_to_start > bounds.max_schedule_to_start {
            return Err(err(
                "schedule_to_start_ms",
                format!(
                    "{} ms is above the {} ms allowed (0: no limit)",
                    self.schedule_to_start.as_millis(),
                    bounds.max_schedule_to_start.as_millis()
                ),
            ));
        }
        if self.max_attempts == 0 || self.max_attempts > bounds.max_attempts {
            return Err(err(
                "max_attempts",
                format!(
                    "{} must be within 1..={}",
                    self.max_attempts, bounds.max_attempts
                ),
            ));
        }
        self.retry.validate(bounds)
    }

    /// Whether PostgreSQL should grant a renewal at `now` (its clock, never a worker's) for an
    /// attempt whose authority ends at `attempt_deadline`.
    ///
    /// Renewal stops once less than `final_grace` remains, so the worker still has time to
    /// record a timeout, and a granted expiry never passes the attempt deadline: a worker cannot
    /// renew its way around a stalled call.
    pub fn renewal(&self, now: DateTime<Utc>, attempt_deadline: DateTime<Utc>) -> RenewalDecision {
        let grace = chrono::Duration::from_std(self.final_grace).unwrap_or(chrono::Duration::MAX);
        if now + grace >= attempt_deadline {
            return RenewalDecision::Refuse;
        }
        let lease = chrono::Duration::from_std(self.lease).unwrap_or(chrono::Duration::MAX);
        RenewalDecision::Grant {
            expires_at: (now + lease).min(attempt_deadline),
        }
    }
}

/// The answer to a renewal request, decided on PostgreSQL's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenewalDecision {
    Grant { expires_at: DateTime<Utc> },
    Refuse,
}

/// Time left on the deadlines that bound a call, as seen by one worker. Computed from the times
/// PostgreSQL returned plus the worker's monotonic clock, never from its wall clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// The adapter timeout of the step policy.
    pub adapter_timeout: Duration,
    /// Time left until the attempt deadline.
    pub attempt_left: Duration,
    /// Time left until the workflow deadline, if it has one.
    pub workflow_left: Option<Duration>,
    /// The grace kept back to record a final observation.
    pub final_grace: Duration,
}

impl Deadlines {
    /// The deadline to give one adapter call, as the worker begins it: no longer than the
    /// adapter timeout, and ending `final_grace` before the attempt runs out (so the answer,
    /// or the timeout, can still be committed under it) and by the workflow's deadline.
    ///
    /// The lease is not a limit: it is short so that a dead worker is found quickly, and the
    /// worker renews it while the call runs. A call outlives its lease only when renewals
    /// stop (the worker dead, paused or cut off); recovery then has the step, and the answer,
    /// when it comes, is kept as a late observation. `None` means there is no room for a
    /// call: do not begin an invocation.
    pub fn call_budget(&self) -> Option<Duration> {
        let mut budget = self
            .adapter_timeout
            .min(self.attempt_left.checked_sub(self.final_grace)?);
        if let Some(workflow_left) = self.workflow_left {
            budget = budget.min(workflow_left);
        }
        (!budget.is_zero()).then_some(budget)
    }
}

/// A duration as whole milliseconds, the unit of every policy field (`serde(with)`).
pub(crate) mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_millis)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn an_adapter_timeout_a_gateway_would_cut_is_refused_naming_the_bound() {
        let p = LeasePolicy {
            adapter_timeout: ms(280_000),
            ..LeasePolicy::default()
        };
        let e = p.fits_call_limit(ms(60_000)).unwrap_err();
        assert_eq!(e.field, "adapter_timeout_ms");
        assert!(
            e.reason.contains("280000 ms") && e.reason.contains("60000 ms"),
            "{e}"
        );
        // exactly the limit fits; so does anything shorter
        p.fits_call_limit(ms(280_000)).unwrap();
        LeasePolicy::default().fits_call_limit(ms(60_000)).unwrap();
    }

    #[test]
    fn default_policy_is_within_default_bounds() {
        LeasePolicy::default()
            .validate(&PlatformBounds::default())
            .unwrap();
    }

    #[test]
    fn each_policy_field_out_of_bounds_is_named() {
        let b = PlatformBounds::default();
        let base = LeasePolicy::default();
        let cases: Vec<(&str, LeasePolicy)> = vec![
            (
                "lease_ms",
                LeasePolicy {
                    lease: ms(999),
                    ..base
                },
            ),
            (
                "lease_ms",
                LeasePolicy {
                    lease: ms(600_001),
                    ..base
                },
            ),
            (
                "renew_every_ms",
                LeasePolicy {
                    renew_every: ms(0),
                    ..base
                },
            ),
            (
                "schedule_to_start_ms",
                LeasePolicy {
                    schedule_to_start: b.max_schedule_to_start + ms(1),
                    ..base
                },
            ),
            (
                "renew_every_ms",
                LeasePolicy {
                    renew_every: ms(7_501),
                    ..base
                },
            ),
            (
                "attempt_deadline_ms",
                LeasePolicy {
                    attempt_deadline: ms(14_999),
                    ..base
                },
            ),
            (
                "attempt_deadline_ms",
                LeasePolicy {
                    attempt_deadline: ms(3_600_001),
                    ..base
                },
            ),
            (
                "final_grace_ms",
                LeasePolicy {
                    final_grace: ms(0),
                    ..base
                },
            ),
            (
                "final_grace_ms",
                LeasePolicy {
                    final_grace: ms(15_000),
                    ..base
                },
            ),
            (
                "final_grace_ms",
                LeasePolicy {
                    lease: ms(120_000),
                    renew_every: ms(10_000),
                    attempt_deadline: ms(600_000),
                    final_grace: ms(60_001),
                    ..base
                },
            ),
            (
                "adapter_timeout_ms",
                LeasePolicy {
                    adapter_timeout: ms(0),
                    ..base
                },
            ),
            (
                "adapter_timeout_ms",
                LeasePolicy {
                    adapter_timeout: ms(58_001),
                    ..base
                },
            ),
            (
                "max_attempts",
                LeasePolicy {
                    max_attempts: 0,
                    ..base
                },
            ),
            (
                "max_attempts",
                LeasePolicy {
                    max_attempts: 101,
                    ..base
                },
            ),
        ];
        for (field, policy) in cases {
            let e = policy.validate(&b).unwrap_err();
            assert_eq!(e.field, field, "{policy:?}: {e}");
        }
        // the boundaries themselves are allowed
        LeasePolicy {
            lease: ms(1_000),
            renew_every: ms(500),
            final_grace: ms(999),
            attempt_deadline: ms(1_000),
            adapter_timeout: ms(1),
            ..base
        }
        .validate(&b)
        .unwrap();
        LeasePolicy {
            adapter_timeout: ms(58_000),
            ..base
        }
        .validate(&b)
        .unwrap();
    }

    #[test]
    fn policy_serialises_in_milliseconds() {
        let json = serde_json::to_value(LeasePolicy::default()).unwrap();
        assert_eq!(json["lease_ms"], 15_000);
        assert_eq!(json["adapter_timeout_ms"], 10_000);
        let back: LeasePolicy = serde_json::from_value(json).unwrap();
        assert_eq!(back, LeasePolicy::default());
    }

    #[test]
    fn renewal_is_capped_at_the_attempt_deadline_and_stops_before_it() {
        let p = LeasePolicy::default(); // lease 15 s, grace 2 s
        let t0 = DateTime::parse_from_rfc3339("2026-01-01T00:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let deadline = t0 + chrono::Duration::seconds(60);
        assert_eq!(
            p.renewal(t0, deadline),
            RenewalDecision::Grant {
                expires_at: t0 + chrono::Duration::seconds(15)
            }
        );
        // close to the deadline the grant is cut to the deadline, never beyond it
        let late = deadline - chrono::Duration::seconds(5);
        assert_eq!(
            p.renewal(late, deadline),
            RenewalDecision::Grant {
                expires_at: deadline
            }
        );
        // within the final grace nothing is granted
        for s in [2, 1, 0, -1] {
            let at = deadline - chrono::Duration::seconds(s);
            assert_eq!(
                p.renewal(at, deadline),
                RenewalDecision::Refuse,
                "{s} s before"
            );
        }
    }

    #[test]
    fn call_budget_ends_before_the_attempt_by_the_grace_and_by_the_workflow() {
        let d = Deadlines {
            adapter_timeout: ms(10_000),
            attempt_left: ms(60_000),
            workflow_left: None,
            final_grace: ms(2_000),
        };
        // a call longer than any lease: the worker renews beside it
        assert_eq!(d.call_budget(), Some(ms(10_000)));
        let cases = [
            (ms(4_000), None, Some(ms(2_000))),
            (ms(12_000), None, Some(ms(10_000))),
            (ms(60_000), Some(ms(700)), Some(ms(700))),
            (ms(2_001), Some(ms(700)), Some(ms(1))),
            (ms(2_000), None, None),
            (ms(1_000), None, None),
            (ms(0), None, None),
            (ms(60_000), Some(ms(0)), None),
        ];
        for (attempt_left, workflow_left, want) in cases {
            let got = Deadlines {
                attempt_left,
                workflow_left,
                ..d
            }
            .call_budget();
            assert_eq!(
                got, want,
                "attempt {attempt_left:?}, workflow {workflow_left:?}"
            );
        }
    }
}
