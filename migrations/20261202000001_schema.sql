-- z29c schema (DESIGN.md §4). PostgreSQL is the only authority for leases, attempts,
-- checkpoints and receipts; its clock decides expiry. The constraints below make the states
-- that must never happen impossible to write, whatever the code above them does.

CREATE TYPE workflow_state AS ENUM ('running', 'completed', 'failed', 'cancelled');
CREATE TYPE step_state AS ENUM (
    'blocked', 'ready', 'leased', 'recovering', 'needs_review', 'completed', 'failed', 'cancelled'
);
CREATE TYPE attempt_state AS ENUM ('active', 'succeeded', 'failed', 'released', 'expired');
-- declaration order is protocol order: `<` on this type compares checkpoints
CREATE TYPE checkpoint AS ENUM (
    'attempt_created', 'request_identity_persisted', 'invocation_began', 'response_observed',
    'receipt_committed'
);
CREATE TYPE outcome AS ENUM ('succeeded', 'failed');
CREATE TYPE verification AS ENUM ('direct', 'status_query', 'late_evidence', 'manual');
CREATE TYPE adapter_capability AS ENUM ('idempotent', 'queryable', 'opaque');
CREATE TYPE recovery_category AS ENUM (
    'no_request_identity', 'identity_not_invoked', 'invoked_idempotent', 'invoked_queryable',
    'invoked_opaque', 'result_observed', 'receipt_exists'
);
CREATE TYPE recovery_decision AS ENUM (
    'make_ready', 'retry', 'retry_same_identity', 'status_query', 'human_review', 'reconcile',
    'acknowledge_only', 'fail'
);

-- Append-only tables keep every observation and decision: nothing observed is thrown away.
CREATE FUNCTION z29c_reject_mutation() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only: % refused', TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'Z29A0';
END;
$$;

CREATE TABLE workflows (
    id                uuid PRIMARY KEY,
    client_key        text NOT NULL UNIQUE CHECK (length(client_key) BETWEEN 1 AND 200),
    submission_digest text NOT NULL CHECK (submission_digest ~ '^[0-9a-f]{64}$'),
    name              text NOT NULL CHECK (length(name) <= 200),
    state             workflow_state NOT NULL DEFAULT 'running',
    deadline          timestamptz,
    cancel_reason     text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    ended_at          timestamptz,
    CHECK ((state = 'running') = (ended_at IS NULL)),
    CHECK (state = 'cancelled' OR cancel_reason IS NULL)
);
CREATE INDEX workflows_created ON workflows (created_at DESC, id DESC);

CREATE TABLE steps (
    id                  uuid PRIMARY KEY,
    workflow_id         uuid NOT NULL REFERENCES workflows (id),
    name                text NOT NULL CHECK (name ~ '^[A-Za-z0-9._-]{1,64}$'),
    position            integer NOT NULL CHECK (position >= 0),
    adapter             text NOT NULL CHECK (length(adapter) BETWEEN 1 AND 100),
    operation           text NOT NULL CHECK (length(operation) BETWEEN 1 AND 100),
    input               jsonb NOT NULL,
    input_digest        text NOT NULL CHECK (input_digest ~ '^[0-9a-f]{64}$'),
    -- lease policy, validated against platform bounds before insert
    lease_ms            integer NOT NULL CHECK (lease_ms > 0),
    renew_every_ms      integer NOT NULL CHECK (renew_every_ms > 0 AND renew_every_ms * 2 <= lease_ms),
    attempt_deadline_ms integer NOT NULL CHECK (attempt_deadline_ms >= lease_ms),
    final_grace_ms      integer NOT NULL CHECK (final_grace_ms > 0 AND final_grace_ms < lease_ms),
    adapter_timeout_ms  integer NOT NULL CHECK (adapter_timeout_ms > 0),
    progress_observable boolean NOT NULL,
    max_attempts        integer NOT NULL CHECK (max_attempts > 0),
    state               step_state NOT NULL,
    pending_deps        integer NOT NULL DEFAULT 0 CHECK (pending_deps >= 0),
    next_eligible_at    timestamptz NOT NULL DEFAULT now(),
    -- stable across attempts of one logical effect; never changes once set
    request_identity    text,
    -- the lease: who may work on this step now. Never evidence of what happened.
    lease_owner         text,
    lease_version       bigint NOT NULL DEFAULT 0 CHECK (lease_version >= 0),
    leased_at           timestamptz,
    expires_at          timestamptz,
    attempt_deadline    timestamptz,
    current_attempt_id  uuid,
    -- bumped by every fenced checkpoint; renewal must carry the latest value
    checkpoint_version  bigint NOT NULL DEFAULT 0,
    attempts_made       integer NOT NULL DEFAULT 0 CHECK (attempts_made >= 0),
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    UNIQUE (workflow_id, name),
    -- exactly the leased and recovering states hold a lease
    CHECK ((state IN ('leased', 'recovering'))
           = (lease_owner IS NOT NULL AND leased_at IS NOT NULL AND expires_at IS NOT NULL)),
    CHECK (state <> 'leased' OR (current_attempt_id IS NOT NULL AND attempt_deadline IS NOT NULL)),
    CHECK (expires_at IS NULL OR expires_at > leased_at),
    CHECK ((state = 'blocked') = (pending_deps > 0) OR state IN ('cancelled', 'failed'))
);
CREATE INDEX steps_ready ON steps (next_eligible_at, id) WHERE state = 'ready';
CREATE INDEX steps_leases ON steps (expires_at) WHERE state IN ('leased', 'recovering');
CREATE INDEX steps_workflow ON steps (workflow_id, position);

CREATE TABLE step_dependencies (
    step_id    uuid NOT NULL REFERENCES steps (id),
    depends_on uuid NOT NULL REFERENCES steps (id),
    PRIMARY KEY (step_id, depends_on),
    CHECK (step_id <> depends_on)
);
CREATE INDEX step_dependencies_reverse ON step_dependencies (depends_on);

CREATE TABLE attempts (
    id                   uuid PRIMARY KEY,
    step_id              uuid NOT NULL REFERENCES steps (id),
    workflow_id          uuid NOT NULL REFERENCES workflows (id),
    number               integer NOT NULL CHECK (number > 0),
    lease_version        bigint NOT NULL CHECK (lease_version > 0),
    owner                text NOT NULL,
    state                attempt_state NOT NULL DEFAULT 'active',
    checkpoint           checkpoint NOT NULL DEFAULT 'attempt_created',
    request_identity     text,
    input_digest         text NOT NULL,
    adapter              text NOT NULL,
    adapter_version      text,
    attempt_deadline     timestamptz NOT NULL,
    observed_result      jsonb,
    created_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now(),
    invocation_began_at  timestamptz,
    response_observed_at timestamptz,
    UNIQUE (step_id, number),
    UNIQUE (step_id, lease_version),
    -- invariant 4: the request identity is durable before any invocation
    CHECK (checkpoint < 'request_identity_persisted' OR request_identity IS NOT NULL),
    CHECK (checkpoint < 'invocation_began' OR invocation_began_at IS NOT NULL),
    CHECK (state IN ('active', 'released', 'expired') OR checkpoint = 'receipt_committed')
);
-- one current attempt per step
CREATE UNIQUE INDEX attempts_one_active ON attempts (step_id) WHERE state = 'active';

ALTER TABLE steps ADD CONSTRAINT steps_current_attempt
    FOREIGN KEY (current_attempt_id) REFERENCES attempts (id) DEFERRABLE INITIALLY DEFERRED;

-- the receipt: what happened. One per step (invariant 5), never updated, never deleted.
CREATE TABLE step_receipts (
    id                 uuid PRIMARY KEY,
    step_id            uuid NOT NULL UNIQUE REFERENCES steps (id),
    workflow_id        uuid NOT NULL REFERENCES workflows (id),
    attempt_id         uuid REFERENCES attempts (id),
    lease_version      bigint NOT NULL,
    input_digest       text NOT NULL,
    adapter            text NOT NULL,
    adapter_version    text NOT NULL,
    request_identity   text NOT NULL,
    external_reference text,
    outcome            outcome NOT NULL,
    observed_result    jsonb NOT NULL,
    verification       verification NOT NULL,
    committed_at       timestamptz NOT NULL DEFAULT now(),
    CHECK (outcome = 'failed' OR external_reference IS NOT NULL)
);
CREATE INDEX step_receipts_reference ON step_receipts (external_reference);

-- what a worker learned after it lost its lease: evidence, never current state
CREATE TABLE late_observations (
    id                 uuid PRIMARY KEY,
    step_id            uuid NOT NULL REFERENCES steps (id),
    workflow_id        uuid NOT NULL REFERENCES workflows (id),
    attempt_id         uuid NOT NULL REFERENCES attempts (id),
    lease_version      bigint NOT NULL,
    owner              text NOT NULL,
    request_identity   text NOT NULL,
    input_digest       text NOT NULL,
    adapter_version    text NOT NULL,
    external_reference text,
    outcome            outcome NOT NULL,
    observed_result    jsonb NOT NULL,
    fence_reason       jsonb NOT NULL,
    observed_at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX late_observations_step ON late_observations (step_id, observed_at);

CREATE TABLE recovery_decisions (
    id            uuid PRIMARY KEY,
    step_id       uuid NOT NULL REFERENCES steps (id),
    workflow_id   uuid NOT NULL REFERENCES workflows (id),
    attempt_id    uuid REFERENCES attempts (id),
    lease_version bigint NOT NULL,
    owner         text NOT NULL,
    category      recovery_category NOT NULL,
    decision      recovery_decision NOT NULL,
    capability    adapter_capability NOT NULL,
    checkpoint    checkpoint,
    detail        jsonb NOT NULL DEFAULT '{}',
    decided_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX recovery_decisions_step ON recovery_decisions (step_id, decided_at);

CREATE TABLE review_items (
    id                uuid PRIMARY KEY,
    step_id           uuid NOT NULL REFERENCES steps (id),
    workflow_id       uuid NOT NULL REFERENCES workflows (id),
    request_identity  text,
    reason            text NOT NULL,
    state             text NOT NULL DEFAULT 'open' CHECK (state IN ('open', 'resolved')),
    version           bigint NOT NULL DEFAULT 1,
    created_at        timestamptz NOT NULL DEFAULT now(),
    resolved_at       timestamptz,
    CHECK ((state = 'resolved') = (resolved_at IS NOT NULL))
);
CREATE UNIQUE INDEX review_items_one_open ON review_items (step_id) WHERE state = 'open';

CREATE TABLE integrity_conflicts (
    id                 uuid PRIMARY KEY,
    step_id            uuid NOT NULL REFERENCES steps (id),
    workflow_id        uuid NOT NULL REFERENCES workflows (id),
    request_identity   text NOT NULL,
    known_reference    text,
    observed_reference text,
    source             text NOT NULL,
    detail             jsonb NOT NULL DEFAULT '{}',
    detected_at        timestamptz NOT NULL DEFAULT now()
);

-- the lease history and checkpoints: an operator's "technical details"
CREATE TABLE step_events (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    workflow_id   uuid NOT NULL REFERENCES workflows (id),
    step_id       uuid NOT NULL REFERENCES steps (id),
    attempt_id    uuid,
    lease_version bigint NOT NULL,
    owner         text,
    kind          text NOT NULL CHECK (kind IN (
        'lease_acquired', 'lease_renewed', 'lease_released', 'lease_expired',
        'recovery_lease_acquired', 'checkpoint', 'rate_limited', 'fenced_write_rejected',
        'late_observation', 'recovery_decision', 'review_opened', 'dependencies_met',
        'cancelled', 'failed_by_policy'
    )),
    detail        jsonb NOT NULL DEFAULT '{}',
    at            timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX step_events_step ON step_events (step_id, id);

-- messages leave PostgreSQL through this table, written in the same transaction as the state
-- change they announce; the relay publishes with Nats-Msg-Id = msg_id
CREATE TABLE outbox (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    msg_id        text NOT NULL UNIQUE,
    kind          text NOT NULL CHECK (kind IN (
        'step_ready', 'step_completed', 'late_evidence', 'workflow_changed'
    )),
    workflow_id   uuid NOT NULL,
    step_id       uuid,
    payload       jsonb NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    claimed_by    text,
    claimed_until timestamptz,
    sent_at       timestamptz
);
CREATE INDEX outbox_unsent ON outbox (id) WHERE sent_at IS NULL;

-- adapter concurrency: owned by the gateway, separate from step leases
CREATE TABLE adapter_limits (
    adapter         text NOT NULL,
    operation_class text NOT NULL,
    max_in_flight   integer NOT NULL CHECK (max_in_flight > 0),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (adapter, operation_class)
);

CREATE TABLE adapter_permits (
    id               uuid PRIMARY KEY,
    adapter          text NOT NULL,
    operation_class  text NOT NULL,
    attempt_id       uuid,
    request_identity text NOT NULL,
    gateway          text NOT NULL,
    state            text NOT NULL DEFAULT 'held' CHECK (state IN ('held', 'unknown', 'released')),
    acquired_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- a held permit counts until released or expired; an unknown outcome keeps it counting
    -- until resolution or the adapter's safety window
    expires_at       timestamptz NOT NULL,
    released_at      timestamptz,
    release_reason   text,
    FOREIGN KEY (adapter, operation_class) REFERENCES adapter_limits (adapter, operation_class),
    CHECK ((state = 'released') = (released_at IS NOT NULL)),
    CHECK (expires_at > acquired_at)
);
CREATE INDEX adapter_permits_counting ON adapter_permits (adapter, operation_class, expires_at)
    WHERE state <> 'released';

CREATE TRIGGER step_receipts_append_only BEFORE UPDATE OR DELETE ON step_receipts
    FOR EACH ROW EXECUTE FUNCTION z29c_reject_mutation();
CREATE TRIGGER late_observations_append_only BEFORE UPDATE OR DELETE ON late_observations
    FOR EACH ROW EXECUTE FUNCTION z29c_reject_mutation();
CREATE TRIGGER recovery_decisions_append_only BEFORE UPDATE OR DELETE ON recovery_decisions
    FOR EACH ROW EXECUTE FUNCTION z29c_reject_mutation();
CREATE TRIGGER integrity_conflicts_append_only BEFORE UPDATE OR DELETE ON integrity_conflicts
    FOR EACH ROW EXECUTE FUNCTION z29c_reject_mutation();
CREATE TRIGGER step_events_append_only BEFORE UPDATE OR DELETE ON step_events
    FOR EACH ROW EXECUTE FUNCTION z29c_reject_mutation();
CREATE TRIGGER step_receipts_no_truncate BEFORE TRUNCATE ON step_receipts
    FOR EACH STATEMENT EXECUTE FUNCTION z29c_reject_mutation();
CREATE TRIGGER late_observations_no_truncate BEFORE TRUNCATE ON late_observations
    FOR EACH STATEMENT EXECUTE FUNCTION z29c_reject_mutation();
CREATE TRIGGER recovery_decisions_no_truncate BEFORE TRUNCATE ON recovery_decisions
    FOR EACH STATEMENT EXECUTE FUNCTION z29c_reject_mutation();
CREATE TRIGGER integrity_conflicts_no_truncate BEFORE TRUNCATE ON integrity_conflicts
    FOR EACH STATEMENT EXECUTE FUNCTION z29c_reject_mutation();
CREATE TRIGGER step_events_no_truncate BEFORE TRUNCATE ON step_events
    FOR EACH STATEMENT EXECUTE FUNCTION z29c_reject_mutation();

-- hot, frequently updated tables: vacuum early so dead tuples do not slow the claim scan
ALTER TABLE steps SET (autovacuum_vacuum_scale_factor = 0.02, fillfactor = 80);
ALTER TABLE outbox SET (autovacuum_vacuum_scale_factor = 0.02);
