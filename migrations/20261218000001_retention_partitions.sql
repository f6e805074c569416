-- Retention by whole partitions.
--
-- Every table that grows with work is partitioned by range of the workflow's id, a
-- version-7 UUID whose first 48 bits are the Unix milliseconds it was made at. All the rows
-- of one workflow (its steps, attempts, receipts, events, observations, decisions, review
-- items) therefore live in the partitions of one period, and a period whose workflows have
-- all finished long enough ago is removed by dropping its partitions: no row is updated or
-- deleted to make room, so the history stays append-only. Gateway permits are partitioned
-- the same way by their own (version-7) id.
--
-- Partitions are made ahead of time and dropped by SECURITY DEFINER functions owned by the
-- migrating role, so the services' rows-only role never holds DDL: it may ask for the next
-- period and for the drop of an expired one, and the functions apply the rules.
--
-- The existing rows become the first period, which ends now.

-- the smallest version-7 UUID of the millisecond `t`: every id made at or after `t` is at
-- least this, every id made before is less
CREATE FUNCTION z29c_uuid_at(t timestamptz) RETURNS uuid
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT (lpad(to_hex(floor(extract(epoch FROM t) * 1000)::bigint), 12, '0')
            || '70008000000000000000')::uuid
$$;

-- `tbl`'s partition of `period`, if it exists: in z29c's schema only, never a temporary
-- table of the same name
CREATE FUNCTION z29c_partition(tbl text, period text) RETURNS regclass
LANGUAGE sql STABLE AS $$
    SELECT to_regclass(format('public.%I', tbl || '_' || period))
$$;

-- one row per period; its partitions are `<table>_<suffix>`
CREATE TABLE retention_periods (
    suffix text PRIMARY KEY CHECK (suffix ~ '^p[0-9]{8}t[0-9]{9}$' OR suffix = 'before'),
    starts_at timestamptz NOT NULL,
    ends_at timestamptz NOT NULL UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- when every table had its partition; until then the period is only reserved
    made_at timestamptz,
    dropped_at timestamptz,
    -- rows removed so far, per table, as its partitions are dropped
    removed jsonb NOT NULL DEFAULT '{}',
    CHECK (ends_at > starts_at)
);

-- The shortest retention a drop may be asked for. Only the owner changes it: a service that
-- asks for a drop cannot ask for a shorter one, so set it to the retention you run with
-- (`UPDATE retention_rules SET min_keep = '90 days'`) and a compromised service cannot drop
-- what is younger.
CREATE TABLE retention_rules (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    min_keep interval NOT NULL DEFAULT interval '1 second' CHECK (min_keep >= interval '1 second')
);
INSERT INTO retention_rules DEFAULT VALUES;

-- the partitioned tables, in the order their partitions are detached (what references a
-- table comes before it); `key` is the partition key, `options` the storage parameters each
-- partition gets, `append_only` whether its partitions refuse TRUNCATE like the table
CREATE TABLE retention_tables (
    name text PRIMARY KEY,
    detach_order integer NOT NULL UNIQUE,
    key text NOT NULL CHECK (key IN ('id', 'workflow_id')),
    options text NOT NULL DEFAULT '',
    append_only boolean NOT NULL
);
INSERT INTO retention_tables (name, detach_order, key, options, append_only) VALUES
    ('step_events',         1, 'workflow_id', '', true),
    ('step_receipts',       2, 'workflow_id', '', true),
    ('late_observations',   3, 'workflow_id', '', true),
    ('recovery_decisions',  4, 'workflow_id', '', true),
    ('integrity_conflicts', 5, 'workflow_id', '', true),
    ('review_resolutions',  6, 'workflow_id', '', true),
    ('review_items',        7, 'workflow_id', '', false),
    ('step_dependencies',   8, 'workflow_id', '', false),
    ('attempts',            9, 'workflow_id',
        'WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.05)', false),
    ('steps',              10, 'workflow_id',
        'WITH (fillfactor = 80, autovacuum_vacuum_scale_factor = 0.02)', false),
    ('workflows',          11, 'id', '', false),
    ('adapter_permits',    12, 'id', 'WITH (autovacuum_vacuum_scale_factor = 0.02)', false);

-- A workflow's client key is unique across periods, so it is kept apart: a key is taken
-- again only once its workflow's period has been dropped.
CREATE TABLE workflow_keys (
    client_key z29c_client_key PRIMARY KEY,
    workflow_id uuid NOT NULL
);
CREATE INDEX workflow_keys_workflow ON workflow_keys (workflow_id);
INSERT INTO workflow_keys (client_key, workflow_id) SELECT client_key, id FROM workflows;

-- The conversion: each table is renamed, a partitioned table of the same columns takes its
-- name, and its rows move into the first period. The attempt a step points at is no longer
-- a foreign key: a partition could never be detached while the step and the attempt
-- referenced each other. The claim writes both in one statement.
ALTER TABLE steps DROP CONSTRAINT steps_current_attempt;
ALTER TABLE step_events ALTER COLUMN id DROP IDENTITY;

DO $$
DECLARE
    t record;
    -- past every id already written, even one made by a clock ahead of the database's
    first_end timestamptz := greatest(
        now(),
        (SELECT to_timestamp((('x' || substr(replace(max(id::text), '-', ''), 1, 12))::bit(48)::bigint
                              + 1) / 1000.0)
         FROM (SELECT id FROM workflows UNION ALL SELECT id FROM adapter_permits) ids));
    boundary uuid := z29c_uuid_at(first_end);
BEGIN
    FOR t IN SELECT * FROM retention_tables ORDER BY detach_order LOOP
        EXECUTE format('ALTER TABLE %I RENAME TO %I', t.name, t.name || '_unpartitioned');
        -- two tables did not name their workflow and now do
        EXECUTE format(
            'CREATE TABLE %I (LIKE %I INCLUDING DEFAULTS INCLUDING CONSTRAINTS
                              INCLUDING STORAGE INCLUDING COMMENTS %s)
             PARTITION BY RANGE (%I)',
            t.name, t.name || '_unpartitioned',
            CASE WHEN t.name IN ('step_dependencies', 'review_resolutions')
                 THEN ', workflow_id uuid NOT NULL' ELSE '' END,
            t.key);
        EXECUTE format(
            'CREATE TABLE %I PARTITION OF %I FOR VALUES FROM (MINVALUE) TO (%L) %s',
            t.name || '_before', t.name, boundary, t.options);
    END LOOP;
    INSERT INTO retention_periods (suffix, starts_at, ends_at, made_at)
    VALUES ('before', '-infinity', first_end, now());
END
$$;

INSERT INTO workflows SELECT * FROM workflows_unpartitioned;
INSERT INTO steps SELECT * FROM steps_unpartitioned;
INSERT INTO step_dependencies (step_id, depends_on, workflow_id)
    SELECT d.step_id, d.depends_on, s.workflow_id
    FROM step_dependencies_unpartitioned d JOIN steps_unpartitioned s ON s.id = d.step_id;
INSERT INTO attempts SELECT * FROM attempts_unpartitioned;
INSERT INTO step_receipts SELECT * FROM step_receipts_unpartitioned;
INSERT INTO step_events SELECT * FROM step_events_unpartitioned;
INSERT INTO late_observations SELECT * FROM late_observations_unpartitioned;
INSERT INTO recovery_decisions SELECT * FROM recovery_decisions_unpartitioned;
INSERT INTO integrity_conflicts SELECT * FROM integrity_conflicts_unpartitioned;
INSERT INTO review_items SELECT * FROM review_items_unpartitioned;
INSERT INTO review_resolutions (id, item_id, step_id, resolved_by, resolution,
        external_reference, reason, prior_state, prior_version, resolved_at, workflow_id)
    SELECT r.id, r.item_id, r.step_id, r.resolved_by, r.resolution, r.external_reference,
           r.reason, r.prior_state, r.prior_version, r.resolved_at, s.workflow_id
    FROM review_resolutions_unpartitioned r JOIN steps_unpartitioned s ON s.id = r.step_id;
INSERT INTO adapter_permits SELECT * FROM adapter_permits_unpartitioned;

DROP TABLE step_events_unpartitioned, step_receipts_unpartitioned,
    late_observations_unpartitioned, recovery_decisions_unpartitioned,
    integrity_conflicts_unpartitioned, review_resolutions_unpartitioned,
    review_items_unpartitioned, step_dependencies_unpartitioned, attempts_unpartitioned,
    steps_unpartitioned, workflows_unpartitioned, adapter_permits_unpartitioned CASCADE;

ALTER TABLE step_events ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY;
SELECT setval(pg_get_serial_sequence('step_events', 'id'),
              coalesce((SELECT max(id) FROM step_events), 0) + 1, false);

-- References between these tables are checked by triggers, not foreign keys. A foreign key
-- between two partitioned tables ties their partitions together: detaching or dropping
-- either side's partition takes ACCESS EXCLUSIVE on the other table too, and under a steady
-- load a drop that needs two busy tables' locks at once never got them (each table's
-- statements wait for the other's). A trigger checks each row written as the key did, at the
-- statement's end (so a statement may write a step and its history together), refusing a
-- missing row with SQLSTATE 23503 and the key's name. The rows named are never deleted and
-- their keys never change (triggers below refuse both), so no lock on them is needed.
-- `TG_ARGV[0]` names the check, `TG_ARGV[1]` the column whose row must be there.
CREATE FUNCTION z29c_references() RETURNS trigger
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
DECLARE
    there boolean;
    named uuid;
BEGIN
    CASE TG_ARGV[1]
    WHEN 'workflow_id' THEN
        named := NEW.workflow_id;
        there := EXISTS (SELECT 1 FROM workflows WHERE id = NEW.workflow_id);
    WHEN 'step_id' THEN
        named := NEW.step_id;
        there := EXISTS (SELECT 1 FROM steps
                         WHERE workflow_id = NEW.workflow_id AND id = NEW.step_id);
    WHEN 'depends_on' THEN
        named := NEW.depends_on;
        there := EXISTS (SELECT 1 FROM steps
                         WHERE workflow_id = NEW.workflow_id AND id = NEW.depends_on);
    WHEN 'attempt_id' THEN
        named := NEW.attempt_id;
        there := NEW.attempt_id IS NULL OR EXISTS (
            SELECT 1 FROM attempts WHERE workflow_id = NEW.workflow_id AND id = NEW.attempt_id);
    WHEN 'item_id' THEN
        named := NEW.item_id;
        there := EXISTS (SELECT 1 FROM review_items
                         WHERE workflow_id = NEW.workflow_id AND id = NEW.item_id);
    END CASE;
    IF NOT there THEN
        RAISE EXCEPTION '% % of workflow % is not there', TG_ARGV[1], named, NEW.workflow_id
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = TG_ARGV[0],
                  TABLE = TG_TABLE_NAME;
    END IF;
    RETURN NULL;
END
$$;

-- Keys and indexes. A unique key must hold the partition key; it comes last, so that a
-- lookup by the leading columns alone (an id, a step) reads the index as before, in every
-- partition.
ALTER TABLE workflows ADD PRIMARY KEY (id);
CREATE INDEX workflows_created ON workflows (created_at DESC, id DESC);
CREATE INDEX workflows_overdue ON workflows (deadline)
    WHERE state = 'running' AND deadline IS NOT NULL;
CREATE INDEX workflows_client_key ON workflows (client_key);
-- the unfinished workflows, which keep their period
CREATE INDEX workflows_running ON workflows (id) WHERE state = 'running';

ALTER TABLE steps ADD PRIMARY KEY (id, workflow_id);
ALTER TABLE steps ADD CONSTRAINT steps_workflow_id_name_key UNIQUE (workflow_id, name);
CREATE UNIQUE INDEX steps_of_workflow ON steps (workflow_id, id);
CREATE INDEX steps_leases ON steps (expires_at) WHERE state IN ('leased', 'recovering');
CREATE INDEX steps_ready ON steps (next_eligible_at, id) WHERE state = 'ready';
CREATE INDEX steps_start_by ON steps (start_by) WHERE state = 'ready' AND start_by IS NOT NULL;
CREATE INDEX steps_unfinished ON steps (workflow_id) WHERE state <> 'completed';
CREATE TRIGGER steps_workflow_id_fkey AFTER INSERT OR UPDATE OF workflow_id
    ON steps FOR EACH ROW
    EXECUTE FUNCTION z29c_references('steps_workflow_id_fkey', 'workflow_id');

ALTER TABLE step_dependencies ADD PRIMARY KEY (step_id, depends_on, workflow_id);
CREATE INDEX step_dependencies_reverse ON step_dependencies (depends_on);
CREATE TRIGGER step_dependencies_step_id_fkey AFTER INSERT OR UPDATE OF workflow_id, step_id
    ON step_dependencies FOR EACH ROW
    EXECUTE FUNCTION z29c_references('step_dependencies_step_id_fkey', 'step_id');
CREATE TRIGGER step_dependencies_depends_on_fkey AFTER INSERT OR UPDATE OF workflow_id, depends_on
    ON step_dependencies FOR EACH ROW
    EXECUTE FUNCTION z29c_references('step_dependencies_depends_on_fkey', 'depends_on');

ALTER TABLE attempts ADD PRIMARY KEY (id, workflow_id);
ALTER TABLE attempts ADD CONSTRAINT attempts_step_id_lease_version_key
    UNIQUE (step_id, lease_version, workflow_id);
ALTER TABLE attempts ADD CONSTRAINT attempts_step_id_number_key
    UNIQUE (step_id, number, workflow_id);
CREATE UNIQUE INDEX attempts_one_active ON attempts (step_id, workflow_id)
    WHERE state = 'active';
CREATE TRIGGER attempts_step_fkey AFTER INSERT OR UPDATE OF workflow_id, step_id
    ON attempts FOR EACH ROW
    EXECUTE FUNCTION z29c_references('attempts_step_fkey', 'step_id');

ALTER TABLE step_receipts ADD PRIMARY KEY (id, workflow_id);
ALTER TABLE step_receipts ADD CONSTRAINT step_receipts_step_id_key
    UNIQUE (step_id, workflow_id);
CREATE INDEX step_receipts_reference ON step_receipts (external_reference);
CREATE TRIGGER step_receipts_step_fkey AFTER INSERT OR UPDATE OF workflow_id, step_id
    ON step_receipts FOR EACH ROW
    EXECUTE FUNCTION z29c_references('step_receipts_step_fkey', 'step_id');
CREATE TRIGGER step_receipts_attempt_id_fkey AFTER INSERT OR UPDATE OF workflow_id, attempt_id
    ON step_receipts FOR EACH ROW
    EXECUTE FUNCTION z29c_references('step_receipts_attempt_id_fkey', 'attempt_id');

ALTER TABLE step_events ADD PRIMARY KEY (step_id, id, workflow_id);
CREATE TRIGGER step_events_step_fkey AFTER INSERT OR UPDATE OF workflow_id, step_id
    ON step_events FOR EACH ROW
    EXECUTE FUNCTION z29c_references('step_events_step_fkey', 'step_id');

ALTER TABLE late_observations ADD PRIMARY KEY (id, workflow_id);
CREATE INDEX late_observations_step ON late_observations (step_id, observed_at);
CREATE TRIGGER late_observations_step_fkey AFTER INSERT OR UPDATE OF workflow_id, step_id
    ON late_observations FOR EACH ROW
    EXECUTE FUNCTION z29c_references('late_observations_step_fkey', 'step_id');
CREATE TRIGGER late_observations_attempt_id_fkey AFTER INSERT OR UPDATE OF workflow_id, attempt_id
    ON late_observations FOR EACH ROW
    EXECUTE FUNCTION z29c_references('late_observations_attempt_id_fkey', 'attempt_id');

ALTER TABLE recovery_decisions ADD PRIMARY KEY (id, workflow_id);
CREATE INDEX recovery_decisions_step ON recovery_decisions (step_id, decided_at);
CREATE TRIGGER recovery_decisions_step_fkey AFTER INSERT OR UPDATE OF workflow_id, step_id
    ON recovery_decisions FOR EACH ROW
    EXECUTE FUNCTION z29c_references('recovery_decisions_step_fkey', 'step_id');
CREATE TRIGGER recovery_decisions_attempt_id_fkey AFTER INSERT OR UPDATE OF workflow_id, attempt_id
    ON recovery_decisions FOR EACH ROW
    EXECUTE FUNCTION z29c_references('recovery_decisions_attempt_id_fkey', 'attempt_id');

ALTER TABLE integrity_conflicts ADD PRIMARY KEY (id, workflow_id);
CREATE TRIGGER integrity_conflicts_step_fkey AFTER INSERT OR UPDATE OF workflow_id, step_id
    ON integrity_conflicts FOR EACH ROW
    EXECUTE FUNCTION z29c_references('integrity_conflicts_step_fkey', 'step_id');

ALTER TABLE review_items ADD PRIMARY KEY (id, workflow_id);
CREATE INDEX review_items_by_age ON review_items (created_at DESC, id DESC);
CREATE UNIQUE INDEX review_items_one_open ON review_items (step_id, workflow_id)
    WHERE state = 'open';
CREATE TRIGGER review_items_step_fkey AFTER INSERT OR UPDATE OF workflow_id, step_id
    ON review_items FOR EACH ROW
    EXECUTE FUNCTION z29c_references('review_items_step_fkey', 'step_id');

ALTER TABLE review_resolutions ADD PRIMARY KEY (id, workflow_id);
CREATE UNIQUE INDEX review_resolutions_once
    ON review_resolutions (item_id, prior_version, workflow_id);
CREATE TRIGGER review_resolutions_item_id_fkey AFTER INSERT OR UPDATE OF workflow_id, item_id
    ON review_resolutions FOR EACH ROW
    EXECUTE FUNCTION z29c_references('review_resolutions_item_id_fkey', 'item_id');
CREATE TRIGGER review_resolutions_step_id_fkey AFTER INSERT OR UPDATE OF workflow_id, step_id
    ON review_resolutions FOR EACH ROW
    EXECUTE FUNCTION z29c_references('review_resolutions_step_id_fkey', 'step_id');

-- What history names keeps its key and is never deleted, as the keys made sure: a row goes
-- only with its whole partition, which fires no row trigger.
CREATE FUNCTION z29c_reject_unkeying() RETURNS trigger
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
BEGIN
    RAISE EXCEPTION '% rows keep their keys and go only with their period: % refused',
        TG_TABLE_NAME, TG_OP USING ERRCODE = 'Z29A0';
END
$$;
CREATE TRIGGER workflows_kept BEFORE DELETE OR UPDATE OF id ON workflows
    FOR EACH ROW EXECUTE FUNCTION z29c_reject_unkeying();
CREATE TRIGGER steps_kept BEFORE DELETE OR UPDATE OF id, workflow_id ON steps
    FOR EACH ROW EXECUTE FUNCTION z29c_reject_unkeying();
CREATE TRIGGER attempts_kept BEFORE DELETE OR UPDATE OF id, workflow_id ON attempts
    FOR EACH ROW EXECUTE FUNCTION z29c_reject_unkeying();
CREATE TRIGGER review_items_kept BEFORE DELETE OR UPDATE OF id, workflow_id ON review_items
    FOR EACH ROW EXECUTE FUNCTION z29c_reject_unkeying();

ALTER TABLE adapter_permits ADD PRIMARY KEY (id);
CREATE INDEX adapter_permits_counting ON adapter_permits (adapter, operation_class, expires_at)
    WHERE state <> 'released';

-- the history refuses row edits as before (a row trigger on a partitioned table is made on
-- every partition); TRUNCATE is refused per partition, as each is made
CREATE TRIGGER step_events_append_only BEFORE UPDATE OR DELETE ON step_events
    FOR EACH ROW EXECUTE FUNCTION z29c_reject_mutation();
CREATE TRIGGER step_receipts_append_only BEFORE UPDATE OR DELETE ON step_receipts
    FOR EACH ROW EXECUTE FUNCTION z29c_reject_mutation();
CREATE TRIGGER late_observations_append_only BEFORE UPDATE OR DELETE ON late_observations
    FOR EACH ROW EXECUTE FUNCTION z29c_reject_mutation();
CREATE TRIGGER recovery_decisions_append_only BEFORE UPDATE OR DELETE ON recovery_decisions
    FOR EACH ROW EXECUTE FUNCTION z29c_reject_mutation();
CREATE TRIGGER integrity_conflicts_append_only BEFORE UPDATE OR DELETE ON integrity_conflicts
    FOR EACH ROW EXECUTE FUNCTION z29c_reject_mutation();
CREATE TRIGGER review_resolutions_append_only BEFORE UPDATE OR DELETE ON review_resolutions
    FOR EACH ROW EXECUTE FUNCTION z29c_reject_mutation();
DO $$
DECLARE
    t record;
BEGIN
    FOR t IN SELECT name FROM retention_tables WHERE append_only LOOP
        EXECUTE format('CREATE TRIGGER %I BEFORE TRUNCATE ON %I
                        FOR EACH STATEMENT EXECUTE FUNCTION z29c_reject_mutation()',
                       t.name || '_no_truncate', t.name);
        EXECUTE format('CREATE TRIGGER %I BEFORE TRUNCATE ON %I
                        FOR EACH STATEMENT EXECUTE FUNCTION z29c_reject_mutation()',
                       t.name || '_no_truncate', t.name || '_before');
    END LOOP;
END
$$;

-- the audit log records each drop
ALTER TABLE audit_log DROP CONSTRAINT audit_log_action_check;
ALTER TABLE audit_log ADD CONSTRAINT audit_log_action_check
    CHECK (action IN ('read', 'submit', 'cancel', 'resolve', 'invoke', 'drop'));

-- Partitions are made and dropped one table at a time, each in a transaction of its own,
-- because that is the only way to get their locks while the services work. Attaching or
-- detaching a partition takes ACCESS EXCLUSIVE on its partitioned table. Taking that on all
-- twelve tables at once never succeeded under a steady load: while it held some and waited
-- for the next, the services' transactions that held the next were waiting for the ones it
-- held. One table at a time, it waits only for that table's current statements.

-- Takes ACCESS EXCLUSIVE on the partitioned table `parent` alone (ONLY: not its other
-- partitions) and on `part` when given, in that order, the order in which every statement
-- takes them. A lock another transaction holds is waited for at most 100 ms; then both are
-- let go (the block is a subtransaction) and asked for again after a pause, up to `tries`
-- times, so this is never still waiting when PostgreSQL would look for a deadlock (after
-- `deadlock_timeout`, a second by default). Returns whether it holds them.
CREATE FUNCTION z29c_lock_for_partition(parent text, part text, tries integer)
RETURNS boolean
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
BEGIN
    FOR attempt IN 1..tries LOOP
        BEGIN
            SET LOCAL lock_timeout = '100ms';
            EXECUTE format('LOCK TABLE ONLY %I IN ACCESS EXCLUSIVE MODE', parent);
            IF part IS NOT NULL THEN
                EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', part);
            END IF;
            RETURN true;
        EXCEPTION WHEN lock_not_available THEN
            PERFORM pg_sleep(0.02 + random() * 0.1);
        END;
    END LOOP;
    RETURN false;
END
$$;

-- The next period to make so that one ends after `until`, or no row when one does. It
-- starts where the last one ends and lasts `width`; a gap since the last period's end is
-- folded into it. Without a width, the last period's is used (a day after the first): a
-- service that only needs the partition for an id it is about to write need not know how
-- long periods are. The period is reserved here, bounds and all, one caller at a time, so
-- every caller makes the same partitions; a reserved period not made yet is answered first,
-- for the caller to finish.
CREATE FUNCTION z29c_next_period(until timestamptz, width interval DEFAULT NULL)
RETURNS TABLE (suffix text, starts_at timestamptz, ends_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    last retention_periods;
BEGIN
    LOCK TABLE retention_periods IN EXCLUSIVE MODE;
    SELECT * INTO last FROM retention_periods ORDER BY retention_periods.ends_at DESC LIMIT 1;
    IF last.made_at IS NULL THEN
        suffix := last.suffix;
        starts_at := last.starts_at;
        ends_at := last.ends_at;
        RETURN NEXT;
        RETURN;
    END IF;
    IF last.ends_at > until THEN
        RETURN;
    END IF;
    IF width IS NULL THEN
        width := CASE WHEN last.starts_at = '-infinity' THEN interval '1 day'
                      ELSE last.ends_at - last.starts_at END;
    END IF;
    IF width < interval '1 second' OR width > interval '366 days' THEN
        RAISE EXCEPTION 'a retention period of % is not between a second and a year', width
            USING ERRCODE = '22023';
    END IF;
    suffix := 'p' || to_char(last.ends_at AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISSMS');
    starts_at := last.ends_at;
    ends_at := greatest(last.ends_at, now()) + width;
    INSERT INTO retention_periods (suffix, starts_at, ends_at)
    VALUES (suffix, starts_at, ends_at);
    RETURN NEXT;
END
$$;

-- Makes `tbl`'s partition of `period`, which `z29c_next_period` reserved, with the bounds it
-- reserved: one table, in the caller's transaction. Making one that exists is a no-op.
-- SQLSTATE 55P03 when the table stayed busy (try again later).
CREATE FUNCTION z29c_make_partition(tbl text, period text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    t retention_tables;
    p retention_periods;
BEGIN
    SELECT * INTO t FROM retention_tables WHERE name = tbl;
    IF t.name IS NULL THEN
        RAISE EXCEPTION '% is not a partitioned table of z29c', tbl USING ERRCODE = '22023';
    END IF;
    SELECT * INTO p FROM retention_periods WHERE suffix = period;
    IF p.suffix IS NULL THEN
        RAISE EXCEPTION 'period % was not reserved', period USING ERRCODE = '22023';
    END IF;
    -- made already (by another caller, who may have recorded the period too)
    IF p.made_at IS NOT NULL OR z29c_partition(tbl, period) IS NOT NULL THEN
        RETURN;
    END IF;
    IF NOT z29c_lock_for_partition(tbl, NULL, 30) THEN
        RAISE EXCEPTION '% stayed busy; its next partition is made later', tbl
            USING ERRCODE = '55P03';
    END IF;
    -- another caller may have made it while this one waited for the lock
    IF z29c_partition(tbl, period) IS NOT NULL THEN
        RETURN;
    END IF;
    EXECUTE format('CREATE TABLE %I PARTITION OF %I FOR VALUES FROM (%L) TO (%L) %s',
                   tbl || '_' || period, tbl, z29c_uuid_at(p.starts_at),
                   z29c_uuid_at(p.ends_at), t.options);
    IF t.append_only THEN
        EXECUTE format('CREATE TRIGGER %I BEFORE TRUNCATE ON %I
                        FOR EACH STATEMENT EXECUTE FUNCTION z29c_reject_mutation()',
                       tbl || '_no_truncate', tbl || '_' || period);
    END IF;
END
$$;

-- Marks the reserved period made once every table has its partition, and returns the end
-- of the last period made.
CREATE FUNCTION z29c_record_period(period text)
RETURNS timestamptz
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM retention_tables t
               WHERE z29c_partition(t.name, period) IS NULL) THEN
        RAISE EXCEPTION 'period % lacks partitions', period USING ERRCODE = '55000';
    END IF;
    UPDATE retention_periods SET made_at = now() WHERE suffix = period AND made_at IS NULL;
    RETURN (SELECT max(p.ends_at) FROM retention_periods p WHERE p.made_at IS NOT NULL);
END
$$;

-- Drops `tbl`'s partition of `period` when the period may go: it ended more than `keep`
-- ago, each of its workflows has finished and did so more than `keep` ago, none of its steps
-- is leased or waiting for a person, none of its attempts is active, none of its review items
-- is open, and none of its permits is still held. `keep` is at least
-- `retention_rules.min_keep`. Tables go in `detach_order` (what references a table goes
-- before it), each in a transaction of its own; the rule is checked on what is left of the
-- period each time. Returns the rows removed (0 when the partition is gone already), or NULL
-- when the period may not go (yet), or the table stayed busy. The last table's drop marks the
-- period dropped, frees its client keys and writes the audit log row, with the rows removed
-- per table and `exported_to`, in its transaction.
CREATE FUNCTION z29c_drop_partition(period text, tbl text, keep interval, exported_to text)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    p retention_periods;
    t retention_tables;
    n bigint;
    blocked boolean := false;
    part text := tbl || '_' || period;
BEGIN
    IF keep IS NULL OR keep < (SELECT min_keep FROM retention_rules) THEN
        RAISE EXCEPTION 'a retention of % is shorter than retention_rules.min_keep (%)',
            keep, (SELECT min_keep FROM retention_rules)
            USING ERRCODE = '22023';
    END IF;
    SELECT * INTO t FROM retention_tables WHERE name = tbl;
    IF t.name IS NULL THEN
        RAISE EXCEPTION '% is not a partitioned table of z29c', tbl USING ERRCODE = '22023';
    END IF;
    SELECT * INTO p FROM retention_periods WHERE suffix = period;
    IF p.suffix IS NULL OR p.made_at IS NULL OR p.dropped_at IS NOT NULL
       OR p.ends_at > now() - keep THEN
        RETURN NULL;
    END IF;
    IF z29c_partition(tbl, period) IS NULL THEN
        RETURN 0;
    END IF;
    IF EXISTS (SELECT 1 FROM retention_tables r
               WHERE r.detach_order < t.detach_order
                 AND z29c_partition(r.name, period) IS NOT NULL) THEN
        RAISE EXCEPTION 'the partitions of % go in order; % comes too early', period, tbl
            USING ERRCODE = '55000';
    END IF;
    IF NOT z29c_lock_for_partition(tbl, part, 30) THEN
        RETURN NULL;
    END IF;
    -- another caller may have dropped it, and the period, while this one waited
    SELECT * INTO p FROM retention_periods WHERE suffix = period;
    IF p.dropped_at IS NOT NULL OR z29c_partition(tbl, period) IS NULL THEN
        RETURN 0;
    END IF;
    -- the rule, on what is left of the period; a step still leased may yet report what its
    -- call did (a cancelled workflow's, say)
    IF z29c_partition('workflows', period) IS NOT NULL THEN
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I
                                       WHERE state = ''running'' OR ended_at > now() - %L::interval)',
                       'workflows_' || period, keep)
        INTO blocked;
    END IF;
    IF NOT blocked AND z29c_partition('steps', period) IS NOT NULL THEN
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I
                                       WHERE state IN (''leased'', ''recovering'', ''needs_review''))',
                       'steps_' || period)
        INTO blocked;
    END IF;
    IF NOT blocked AND z29c_partition('attempts', period) IS NOT NULL THEN
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I WHERE state = ''active'')',
                       'attempts_' || period)
        INTO blocked;
    END IF;
    IF NOT blocked AND z29c_partition('review_items', period) IS NOT NULL THEN
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I WHERE state = ''open'')',
                       'review_items_' || period)
        INTO blocked;
    END IF;
    IF NOT blocked AND z29c_partition('adapter_permits', period) IS NOT NULL THEN
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I
                                       WHERE state <> ''released'' AND expires_at > now())',
                       'adapter_permits_' || period)
        INTO blocked;
    END IF;
    IF blocked THEN
        RETURN NULL;
    END IF;
    EXECUTE format('SELECT count(*) FROM %I', part) INTO n;
    -- no other table's lock is needed (no foreign key ties this one to another); still,
    -- never waited for for good (then the next round tries again)
    BEGIN
        SET LOCAL lock_timeout = '500ms';
        EXECUTE format('ALTER TABLE %I DETACH PARTITION %I', tbl, part);
        EXECUTE format('DROP TABLE %I', part);
    EXCEPTION WHEN lock_not_available THEN
        RETURN NULL;
    END;
    UPDATE retention_periods SET removed = removed || jsonb_build_object(tbl, n)
    WHERE suffix = period
    RETURNING * INTO p;
    IF NOT EXISTS (SELECT 1 FROM retention_tables r
                   WHERE z29c_partition(r.name, period) IS NOT NULL) THEN
        IF p.starts_at = '-infinity' THEN
            DELETE FROM workflow_keys WHERE workflow_id < z29c_uuid_at(p.ends_at);
        ELSE
            DELETE FROM workflow_keys
            WHERE workflow_id >= z29c_uuid_at(p.starts_at)
              AND workflow_id < z29c_uuid_at(p.ends_at);
        END IF;
        UPDATE retention_periods SET dropped_at = now() WHERE suffix = period;
        INSERT INTO audit_log (service, method, subject, action, outcome, detail)
        VALUES ('recovery', 'retention', 'period ' || period, 'drop', 'allowed',
                left(jsonb_build_object('starts_at', p.starts_at, 'ends_at', p.ends_at,
                                        'keep', keep::text, 'removed', p.removed,
                                        'exported_to', exported_to)::text, 2000));
    END IF;
    RETURN n;
END
$$;

-- the services may ask, not do: they read the periods and call these functions
REVOKE ALL ON FUNCTION z29c_lock_for_partition(text, text, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION z29c_next_period(timestamptz, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION z29c_make_partition(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION z29c_record_period(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION z29c_drop_partition(text, text, interval, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION z29c_next_period(timestamptz, interval) TO z29c_service;
GRANT EXECUTE ON FUNCTION z29c_make_partition(text, text) TO z29c_service;
GRANT EXECUTE ON FUNCTION z29c_record_period(text) TO z29c_service;
GRANT EXECUTE ON FUNCTION z29c_drop_partition(text, text, interval, text) TO z29c_service;
REVOKE INSERT, UPDATE, DELETE ON retention_periods, retention_tables, retention_rules
    FROM z29c_service;
-- a service takes a key; only a drop frees one
REVOKE UPDATE, DELETE ON workflow_keys FROM z29c_service;
