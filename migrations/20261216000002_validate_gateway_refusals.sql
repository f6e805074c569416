-- Validates the audit checks added NOT VALID, under a lock that lets reads and writes go on.
ALTER TABLE audit_log VALIDATE CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log VALIDATE CONSTRAINT audit_log_outcome_check;
