-- Checks of columns that never change after their row is inserted (issue 7).
--
-- PostgreSQL evaluates every table CHECK constraint on every UPDATE of a row, whichever columns
-- the UPDATE sets, and reads each constraint's expression back from the catalog and plans it
-- again for every statement. `steps` had 18 of them and is updated about four times per step
-- (claim, invocation began, receipt, the step's end): the drain profile (`perf`) put 13 % of
-- PostgreSQL's CPU in `ExecConstraints`.
--
-- The same rules, as domains, hold where a value enters a column (an INSERT, or an UPDATE that
-- sets that column) and cost nothing on updates of other columns. Nothing updates these
-- columns, so what the database accepts is unchanged. The checks of columns that do change
-- (lease version, pending dependencies, attempts made) and the lease invariants stay table
-- constraints: they are what an UPDATE must not break. The three cross-column rules of the
-- lease policy become one constraint.

CREATE DOMAIN z29c_sha256_hex AS text
    CONSTRAINT sha256_hex CHECK (VALUE ~ '^[0-9a-f]{64}$');
CREATE DOMAIN z29c_step_name AS text
    CONSTRAINT step_name CHECK (VALUE ~ '^[A-Za-z0-9._-]{1,64}$');
CREATE DOMAIN z29c_short_name AS text
    CONSTRAINT short_name CHECK (length(VALUE) BETWEEN 1 AND 100);
CREATE DOMAIN z29c_client_key AS text
    CONSTRAINT client_key CHECK (length(VALUE) BETWEEN 1 AND 200);
CREATE DOMAIN z29c_label AS text
    CONSTRAINT label CHECK (length(VALUE) <= 200);
CREATE DOMAIN z29c_trace_context AS text
    CONSTRAINT trace_context CHECK (length(VALUE) <= 256);
CREATE DOMAIN z29c_non_negative AS integer
    CONSTRAINT non_negative CHECK (VALUE >= 0);
CREATE DOMAIN z29c_positive AS integer
    CONSTRAINT positive CHECK (VALUE > 0);
CREATE DOMAIN z29c_positive_bigint AS bigint
    CONSTRAINT positive CHECK (VALUE > 0);

ALTER TABLE workflows
    DROP CONSTRAINT workflows_client_key_check,
    DROP CONSTRAINT workflows_submission_digest_check,
    DROP CONSTRAINT workflows_name_check,
    DROP CONSTRAINT workflows_trace_context_check,
    ALTER COLUMN client_key TYPE z29c_client_key,
    ALTER COLUMN submission_digest TYPE z29c_sha256_hex,
    ALTER COLUMN name TYPE z29c_label,
    ALTER COLUMN trace_context TYPE z29c_trace_context;

ALTER TABLE steps
    DROP CONSTRAINT steps_name_check,
    DROP CONSTRAINT steps_position_check,
    DROP CONSTRAINT steps_adapter_check,
    DROP CONSTRAINT steps_operation_check,
    DROP CONSTRAINT steps_input_digest_check,
    DROP CONSTRAINT steps_lease_ms_check,
    DROP CONSTRAINT steps_adapter_timeout_ms_check,
    DROP CONSTRAINT steps_max_attempts_check,
    DROP CONSTRAINT steps_check,
    DROP CONSTRAINT steps_check1,
    DROP CONSTRAINT steps_check2,
    ALTER COLUMN name TYPE z29c_step_name,
    ALTER COLUMN position TYPE z29c_non_negative,
    ALTER COLUMN adapter TYPE z29c_short_name,
    ALTER COLUMN operation TYPE z29c_short_name,
    ALTER COLUMN input_digest TYPE z29c_sha256_hex,
    ALTER COLUMN lease_ms TYPE z29c_positive,
    ALTER COLUMN renew_every_ms TYPE z29c_positive,
    ALTER COLUMN attempt_deadline_ms TYPE z29c_positive,
    ALTER COLUMN final_grace_ms TYPE z29c_positive,
    ALTER COLUMN adapter_timeout_ms TYPE z29c_positive,
    ALTER COLUMN max_attempts TYPE z29c_positive,
    ADD CONSTRAINT steps_policy_check CHECK (
        renew_every_ms * 2 <= lease_ms
        AND attempt_deadline_ms >= lease_ms
        AND final_grace_ms < lease_ms
    );

ALTER TABLE attempts
    DROP CONSTRAINT attempts_number_check,
    DROP CONSTRAINT attempts_lease_version_check,
    ALTER COLUMN number TYPE z29c_positive,
    ALTER COLUMN lease_version TYPE z29c_positive_bigint;

ALTER TABLE adapter_permit_slots
    DROP CONSTRAINT adapter_permit_slots_slot_check,
    ALTER COLUMN slot TYPE z29c_non_negative;
