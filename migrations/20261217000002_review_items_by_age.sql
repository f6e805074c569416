-- The review queue pages newest first by (created_at, id): an index in that order reads one
-- page instead of sorting every item.
CREATE INDEX review_items_by_age ON review_items (created_at DESC, id DESC);
