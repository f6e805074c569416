-- Permits as slots (issue 7). A permit occupies one of its operation class's `max_in_flight`
-- slots. Gateways take a free slot each with SKIP LOCKED instead of locking the one limit row
-- through COMMIT, so permits are no longer taken one COMMIT after another; the limit still
-- holds, since a slot has one permit at a time. `adapter_permits` stays the history.
CREATE TABLE adapter_permit_slots (
    adapter         text NOT NULL,
    operation_class text NOT NULL,
    slot            integer NOT NULL CHECK (slot >= 0),
    -- the permit occupying the slot; it counts until `expires_at`, then the slot is free
    permit_id       uuid,
    expires_at      timestamptz,
    PRIMARY KEY (adapter, operation_class, slot),
    FOREIGN KEY (adapter, operation_class) REFERENCES adapter_limits (adapter, operation_class),
    CHECK ((permit_id IS NULL) = (expires_at IS NULL))
) WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02);

ALTER TABLE adapter_permits ADD COLUMN slot integer;

INSERT INTO adapter_permit_slots (adapter, operation_class, slot)
SELECT adapter, operation_class, g
FROM adapter_limits, generate_series(0, max_in_flight - 1) AS g;

-- permits counting now occupy the first slots of their class
WITH counting AS (
    SELECT id, adapter, operation_class, expires_at,
           row_number() OVER (PARTITION BY adapter, operation_class ORDER BY acquired_at, id) - 1
               AS slot
    FROM adapter_permits
    WHERE state <> 'released' AND expires_at > now()
), placed AS (
    UPDATE adapter_permit_slots s
    SET permit_id = c.id, expires_at = c.expires_at
    FROM counting c
    WHERE s.adapter = c.adapter AND s.operation_class = c.operation_class AND s.slot = c.slot
    RETURNING s.permit_id, s.slot
)
UPDATE adapter_permits p SET slot = placed.slot FROM placed WHERE p.id = placed.permit_id;
