-- The outbox is keyed once (issue 7).
--
-- A published message is deleted (`mark_outbox_sent`), not marked: every row in the table is
-- unsent, and `sent_at` is never written. The partial index `outbox_unsent (id) WHERE sent_at
-- IS NULL` therefore held exactly the primary key's entries: one more entry written for each
-- of a job's three messages, and one more dead entry left for the relay's claim to skip and
-- for vacuum to clear after the delete. The relay's claim walks the primary key instead, in
-- the same order (`plans::outbox_claims_walk_the_primary_key_however_bloated_the_table`).
DROP INDEX outbox_unsent;
ALTER TABLE outbox DROP COLUMN sent_at;
