-- no-transaction
-- The deadline sweep finds overdue workflows by an index (issue 7).
--
-- Every scheduler asks, every 500 ms, for running workflows whose deadline has passed, oldest
-- deadline first. No index served it: each ask read the whole `workflows` table, every workflow
-- that ever ran (93 buffers at 3,000 workflows in the latency benchmark; at a million, some
-- 30,000 buffers twice a second per scheduler). The partial index holds only running
-- workflows that have a deadline, so the sweep reads the overdue ones and stops.
--
-- `state` in the predicate makes a workflow's change of state a non-HOT update (about three
-- index entries more, once per workflow, when it ends). Built CONCURRENTLY, outside a
-- transaction, so that an upgrade does not stop writes to `workflows` while it builds.
CREATE INDEX CONCURRENTLY IF NOT EXISTS workflows_overdue ON workflows (deadline)
    WHERE state = 'running' AND deadline IS NOT NULL;
