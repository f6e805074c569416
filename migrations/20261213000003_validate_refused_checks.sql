-- The checks that admit refused attempts and retry_scheduled events were added NOT VALID (no
-- table scan under an exclusive lock); validating them takes a lock that lets reads and
-- writes go on.
ALTER TABLE attempts VALIDATE CONSTRAINT attempts_receipt_or_unfinished;
ALTER TABLE step_events VALIDATE CONSTRAINT step_events_kind_check;
