-- The gateway refuses a call that names no attempt, an attempt that does not exist, or a
-- request that is not the attempt's own (its identity, input, adapter or operation), and
-- audits each refusal: action `invoke`, outcome `refused`.
ALTER TABLE audit_log
    DROP CONSTRAINT audit_log_action_check,
    ADD CONSTRAINT audit_log_action_check
        CHECK (action IN ('read', 'submit', 'cancel', 'resolve', 'invoke')) NOT VALID,
    DROP CONSTRAINT audit_log_outcome_check,
    ADD CONSTRAINT audit_log_outcome_check
        CHECK (outcome IN ('allowed', 'unauthenticated', 'permission_denied', 'rate_limited',
                           'refused')) NOT VALID;
