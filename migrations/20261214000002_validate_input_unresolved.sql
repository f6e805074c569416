-- Validates the event kinds' check added NOT VALID, under a lock that lets reads and writes
-- go on.
ALTER TABLE step_events VALIDATE CONSTRAINT step_events_kind_check;
