-- A schedule-to-start deadline per step: how long it may wait, once ready, for an attempt to
-- start its call (NULL: no limit). `start_by` is set when the step first becomes ready (at
-- submission, or when its dependencies are met); the scheduler fails a step still ready past
-- it, when nothing was sent.
ALTER TABLE steps
    ADD COLUMN schedule_to_start_ms z29c_positive_bigint,
    ADD COLUMN start_by timestamptz;
CREATE INDEX steps_start_by ON steps (start_by) WHERE state = 'ready' AND start_by IS NOT NULL;
