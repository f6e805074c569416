-- The deadline sweep finds overdue workflows by an index (issue 7).
--
-- Every scheduler asks, every 500 ms, for running workflows whose deadline has passed, oldest
-- deadline first. No index served it: each ask read the whole `workflows` table, every workflow
-- that ever ran (93 buffers at 3,000 workflows in the latency benchmark; at a million, some
-- 30,000 buffers twice a second per scheduler). The partial index holds only running
-- workflows that have a deadline, so the sweep reads the overdue ones and stops.
--
-- `state` in the predicate makes a workflow's change of state a non-HOT update (about three
-- index entries more, once per workflow, when it ends).
--
-- Not CONCURRENTLY: services that start together each run the migrations, serialised by
-- sqlx's advisory lock, and a concurrent build waits for every older snapshot, the other
-- migrators' included, while they wait for its lock: PostgreSQL calls that a deadlock
-- (test migrations::concurrent_starts_migrate_once_and_the_database_is_dropped_after). The
-- build holds writes to `workflows` for as long as one scan of it takes.
CREATE INDEX workflows_overdue ON workflows (deadline)
    WHERE state = 'running' AND deadline IS NOT NULL;
