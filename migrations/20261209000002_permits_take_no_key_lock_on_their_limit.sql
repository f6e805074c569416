-- A permit takes no key lock on its limit's row (issue 7).
--
-- `adapter_permits (adapter, operation_class)` referenced `adapter_limits`. Its check ran on
-- every permit: `SELECT … FOR KEY SHARE` of the class's one row, by every gateway, for every
-- call. Concurrent holders of that lock share it through a MultiXact: in a steady run at
-- concurrency 32 (pg_walinspect, 10 s) the row took 7,212 lock records, 5,497 of them
-- MultiXacts, one lock per permit and a MultiXact for three in four; all of them rewrite the
-- same tuple, under an exclusive lock on the same buffer.
--
-- What the key guarded still holds without it:
-- - a permit is only ever inserted from the slot it takes (`take_free_slot`: `INSERT …
--   SELECT … FROM taken`), and a slot references its limit (`adapter_permit_slots`'s foreign
--   key, checked when slots are made, never on the hot path);
-- - a limit is never removed: nothing in z29c deletes one, and from here the database refuses
--   to (`DELETE` and `TRUNCATE` raise Z29A0), so a permit's adapter and class always name a
--   limit that exists.
ALTER TABLE adapter_permits DROP CONSTRAINT adapter_permits_adapter_operation_class_fkey;

CREATE FUNCTION z29c_keep_limit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'adapter limits are never removed (permits name them): % refused', TG_OP
        USING ERRCODE = 'Z29A0';
END;
$$;
CREATE TRIGGER adapter_limits_kept BEFORE DELETE ON adapter_limits
    FOR EACH ROW EXECUTE FUNCTION z29c_keep_limit();
CREATE TRIGGER adapter_limits_no_truncate BEFORE TRUNCATE ON adapter_limits
    FOR EACH STATEMENT EXECUTE FUNCTION z29c_keep_limit();
