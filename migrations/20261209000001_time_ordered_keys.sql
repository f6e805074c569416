-- Keys the hot path generates in SQL are time-ordered (issue 7).
--
-- The claim named each new attempt `gen_random_uuid()`, and every outbox message's msg_id
-- ended in one: random version-4 UUIDs, so each insert into `attempts_pkey` and
-- `outbox_msg_id_key` landed on a random leaf. As the history grows past shared_buffers,
-- nearly every such insert dirties a leaf not touched since the last checkpoint, and the WAL
-- carries a full 8 kB image of it. In a steady run at concurrency 32 (minute 8, PostgreSQL
-- 15, 128 MB of shared_buffers, pg_walinspect), these two indexes gave 1,935 of the minute's
-- ~10,500 full-page images. Everything else the services name is already a version-7 UUID
-- made in Rust (`Uuid::now_v7`).
--
-- PostgreSQL 15 has no `uuidv7()` (18 does), so this is RFC 9562's layout built on
-- `gen_random_uuid()`: the first 48 bits become Unix milliseconds and the version nibble
-- becomes 7 (bits 52 and 53 of the random version-4 value are set: 0100 -> 0111). The
-- variant bits and 74 random bits stay as `gen_random_uuid()` made them.
CREATE FUNCTION z29c_uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
    SELECT encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex')::uuid
$$;
