-- A step's history names its step by the pair (workflow, step) (issue 7).
--
-- The tables that record what happened to a step (attempts, receipts, events, late
-- observations, recovery decisions, review items, integrity conflicts) each carried two
-- foreign keys: `step_id` → steps and `workflow_id` → workflows. Together they did not say
-- that the two belong together, and every insert took a KEY SHARE lock on the workflow's row.
-- A fan-out's steps all insert under the same workflow at once, so those locks became shared
-- multixacts: the drain profile counted ten workflow-key checks per step (`pg_stat_statements`)
-- and 0.9 KB of WAL per step in row-lock and multixact records (`pg_walinspect`).
--
-- One composite key, (workflow_id, step_id) → steps (workflow_id, id), replaces both. It says
-- more (the history's workflow is its step's workflow) and checks the step's row, which the
-- writing transaction has already locked by updating it under its lease. The workflow is still
-- a real one: `steps.workflow_id` references it.
--
-- The key needs a unique index on steps (workflow_id, id). It takes the place of
-- steps (workflow_id, position), so a step's update maintains as many indexes as before; a
-- workflow's steps are read by that index and sorted by position (a workflow has at most a few
-- hundred steps).
--
-- On an existing database, adding each key reads its table once to validate it.

CREATE UNIQUE INDEX steps_of_workflow ON steps (workflow_id, id);
DROP INDEX steps_workflow;

ALTER TABLE attempts
    DROP CONSTRAINT attempts_step_id_fkey,
    DROP CONSTRAINT attempts_workflow_id_fkey,
    ADD CONSTRAINT attempts_step_fkey
        FOREIGN KEY (workflow_id, step_id) REFERENCES steps (workflow_id, id);
ALTER TABLE step_receipts
    DROP CONSTRAINT step_receipts_step_id_fkey,
    DROP CONSTRAINT step_receipts_workflow_id_fkey,
    ADD CONSTRAINT step_receipts_step_fkey
        FOREIGN KEY (workflow_id, step_id) REFERENCES steps (workflow_id, id);
ALTER TABLE step_events
    DROP CONSTRAINT step_events_step_id_fkey,
    DROP CONSTRAINT step_events_workflow_id_fkey,
    ADD CONSTRAINT step_events_step_fkey
        FOREIGN KEY (workflow_id, step_id) REFERENCES steps (workflow_id, id);
ALTER TABLE late_observations
    DROP CONSTRAINT late_observations_step_id_fkey,
    DROP CONSTRAINT late_observations_workflow_id_fkey,
    ADD CONSTRAINT late_observations_step_fkey
        FOREIGN KEY (workflow_id, step_id) REFERENCES steps (workflow_id, id);
ALTER TABLE recovery_decisions
    DROP CONSTRAINT recovery_decisions_step_id_fkey,
    DROP CONSTRAINT recovery_decisions_workflow_id_fkey,
    ADD CONSTRAINT recovery_decisions_step_fkey
        FOREIGN KEY (workflow_id, step_id) REFERENCES steps (workflow_id, id);
ALTER TABLE review_items
    DROP CONSTRAINT review_items_step_id_fkey,
    DROP CONSTRAINT review_items_workflow_id_fkey,
    ADD CONSTRAINT review_items_step_fkey
        FOREIGN KEY (workflow_id, step_id) REFERENCES steps (workflow_id, id);
ALTER TABLE integrity_conflicts
    DROP CONSTRAINT integrity_conflicts_step_id_fkey,
    DROP CONSTRAINT integrity_conflicts_workflow_id_fkey,
    ADD CONSTRAINT integrity_conflicts_step_fkey
        FOREIGN KEY (workflow_id, step_id) REFERENCES steps (workflow_id, id);
