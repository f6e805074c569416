-- W3C trace context (`traceparent`) of the submission, so that one workflow run is one trace
-- across services that find their work in PostgreSQL rather than in a request: executors and
-- recovery parent their spans on it, and outbox messages carry it as a NATS header.
ALTER TABLE workflows ADD COLUMN trace_context text
    CHECK (trace_context IS NULL OR length(trace_context) <= 256);
ALTER TABLE outbox ADD COLUMN trace_context text;
