-- Every resolution of a review item is audited in the same transaction as the resolution:
-- who, what, when, why, and the state it replaced. An operator's word can declare that money
-- moved, so the record of it is append-only.
CREATE TABLE review_resolutions (
    id                 uuid PRIMARY KEY,
    item_id            uuid NOT NULL REFERENCES review_items (id),
    step_id            uuid NOT NULL REFERENCES steps (id),
    resolved_by        text NOT NULL CHECK (length(resolved_by) BETWEEN 1 AND 200),
    resolution         text NOT NULL CHECK (resolution IN ('succeeded', 'failed', 'retry_same_identity')),
    external_reference text,
    reason             text NOT NULL CHECK (length(reason) BETWEEN 1 AND 2000),
    prior_state        text NOT NULL,
    prior_version      bigint NOT NULL,
    resolved_at        timestamptz NOT NULL DEFAULT now(),
    CHECK (resolution <> 'succeeded' OR external_reference IS NOT NULL)
);
CREATE UNIQUE INDEX review_resolutions_once ON review_resolutions (item_id, prior_version);

CREATE TRIGGER review_resolutions_append_only BEFORE UPDATE OR DELETE ON review_resolutions
    FOR EACH ROW EXECUTE FUNCTION z29c_reject_mutation();
CREATE TRIGGER review_resolutions_no_truncate BEFORE TRUNCATE ON review_resolutions
    FOR EACH STATEMENT EXECUTE FUNCTION z29c_reject_mutation();

ALTER TABLE step_events DROP CONSTRAINT step_events_kind_check;
ALTER TABLE step_events ADD CONSTRAINT step_events_kind_check CHECK (kind IN (
    'lease_acquired', 'lease_renewed', 'lease_released', 'lease_expired',
    'recovery_lease_acquired', 'checkpoint', 'rate_limited', 'fenced_write_rejected',
    'late_observation', 'recovery_decision', 'review_opened', 'dependencies_met',
    'cancelled', 'failed_by_policy', 'review_resolved'
));
