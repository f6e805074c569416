-- Who tried to do what at the public services: every refused call (no or bad credentials, a
-- missing role, over the rate) and every allowed change (submit, cancel, resolve). Append-only,
-- like the resolutions it sits beside: the record of an operator's action is not edited.
CREATE TABLE audit_log (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at       timestamptz NOT NULL DEFAULT now(),
    service  text NOT NULL CHECK (length(service) BETWEEN 1 AND 100),
    method   text NOT NULL CHECK (length(method) BETWEEN 1 AND 200),
    subject  text CHECK (length(subject) <= 200),
    action   text NOT NULL CHECK (action IN ('read', 'submit', 'cancel', 'resolve')),
    outcome  text NOT NULL CHECK (outcome IN ('allowed', 'unauthenticated', 'permission_denied', 'rate_limited')),
    detail   text NOT NULL DEFAULT '' CHECK (length(detail) <= 2000),
    peer     text CHECK (length(peer) <= 200)
);
CREATE INDEX audit_log_at ON audit_log (at);

CREATE TRIGGER audit_log_append_only BEFORE UPDATE OR DELETE ON audit_log
    FOR EACH ROW EXECUTE FUNCTION z29c_reject_mutation();

-- NATS messages a consumer refused (not an envelope, a body it does not know, redelivered past
-- its limit) and terminated so they are not delivered forever. Nothing is lost by this: a
-- message only hints at PostgreSQL state, which polling picks up.
CREATE TABLE poison_messages (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at              timestamptz NOT NULL DEFAULT now(),
    consumer        text NOT NULL CHECK (length(consumer) BETWEEN 1 AND 200),
    subject         text NOT NULL CHECK (length(subject) <= 500),
    stream_sequence bigint,
    deliveries      bigint,
    reason          text NOT NULL CHECK (length(reason) BETWEEN 1 AND 2000),
    -- the first bytes, enough to recognise the sender; never the whole of a hostile payload
    payload_head    bytea NOT NULL CHECK (length(payload_head) <= 256)
);
CREATE INDEX poison_messages_at ON poison_messages (at);
