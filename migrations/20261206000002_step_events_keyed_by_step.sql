-- A step's events are keyed by their step (issue 7).
--
-- A step writes six events on its happy path, and each went into two B-trees: the key on `id`
-- and `step_events_step (step_id, id)`, by which they are read. Nothing refers to an event by
-- its `id` alone (no foreign key, no query), and `id` comes from an identity, so the pair
-- `(step_id, id)` is the key and the second index goes: one B-tree insert per event instead of
-- two (the drain's WAL put 0.4 KB per step in `step_events_pkey`).
ALTER TABLE step_events
    DROP CONSTRAINT step_events_pkey,
    ADD CONSTRAINT step_events_pkey PRIMARY KEY (step_id, id);
DROP INDEX step_events_step;
