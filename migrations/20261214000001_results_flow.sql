-- A step's input may refer to the results of the steps it depends on. `input_template` keeps
-- the input as submitted, references and all (NULL: it has none); `input` and `input_digest`
-- are rewritten once, when the last dependency has succeeded, to the resolved input every
-- attempt sends. A step whose references cannot be resolved fails with `input_unresolved`.
ALTER TABLE steps ADD COLUMN input_template jsonb;

ALTER TABLE step_events
    DROP CONSTRAINT step_events_kind_check,
    ADD CONSTRAINT step_events_kind_check CHECK (kind IN (
        'lease_acquired', 'lease_renewed', 'lease_released', 'lease_expired',
        'recovery_lease_acquired', 'checkpoint', 'rate_limited', 'fenced_write_rejected',
        'late_observation', 'recovery_decision', 'review_opened', 'dependencies_met',
        'cancelled', 'failed_by_policy', 'review_resolved', 'retry_scheduled',
        'input_unresolved'
    )) NOT VALID;
