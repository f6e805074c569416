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
