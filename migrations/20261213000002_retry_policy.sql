-- Retries and waiting per step. `retry_policy` holds the fields a submission set (backoff,
-- retryable statuses, the waiting budget; NULL: every default); `waits` and `waited_ms` count
-- the times the step was given back without sending and the waits asked for, against that
-- budget.
ALTER TABLE steps
    ADD COLUMN retry_policy jsonb,
    ADD COLUMN waits integer NOT NULL DEFAULT 0,
    ADD COLUMN waited_ms bigint NOT NULL DEFAULT 0;

-- A refused attempt sent nothing that took effect, as a released one sent nothing at all.
CREATE OR REPLACE FUNCTION z29c_attempt_may_have_sent(cp checkpoint, st attempt_state)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT cp >= 'invocation_began' AND st NOT IN ('released', 'refused')
$$;

-- A refused attempt ends without a receipt, as a released or expired one does. Every row
-- already met the stricter check it replaces, so only new rows need checking.
ALTER TABLE attempts
    DROP CONSTRAINT attempts_check2,
    ADD CONSTRAINT attempts_receipt_or_unfinished
        CHECK (state IN ('active', 'released', 'expired', 'refused')
               OR checkpoint = 'receipt_committed') NOT VALID;

-- A retry after a refusal the policy names is in the step's history.
ALTER TABLE step_events
    DROP CONSTRAINT step_events_kind_check,
    ADD CONSTRAINT step_events_kind_check CHECK (kind IN (
        'lease_acquired', 'lease_renewed', 'lease_released', 'lease_expired',
        'recovery_lease_acquired', 'checkpoint', 'rate_limited', 'fenced_write_rejected',
        'late_observation', 'recovery_decision', 'review_opened', 'dependencies_met',
        'cancelled', 'failed_by_policy', 'review_resolved', 'retry_scheduled'
    )) NOT VALID;
