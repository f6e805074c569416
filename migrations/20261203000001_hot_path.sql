-- The hot path of issue 7's benchmark.
--
-- A finishing step asks whether its workflow has any other step left unfinished; with this
-- index that is one probe instead of a scan of the workflow's steps.
CREATE INDEX steps_unfinished ON steps (workflow_id) WHERE state <> 'completed';

-- Permits and attempts are written several times per step: vacuum them as often as steps.
ALTER TABLE adapter_permits SET (autovacuum_vacuum_scale_factor = 0.02);
ALTER TABLE attempts SET (autovacuum_vacuum_scale_factor = 0.05);

-- Room on each page for an update to stay there (a HOT update: no new index entries). A
-- step's attempt is updated at every checkpoint; an outbox message is claimed by a relay and
-- then deleted once published, so its pages need room for the claim only.
ALTER TABLE attempts SET (fillfactor = 70);
ALTER TABLE outbox SET (fillfactor = 50);
