-- Whether one attempt may have sent its request: it began its invocation and was never told
-- "not performed" (released after a 429, a refused connection or no permit). The step's
-- question, z29c_may_have_sent, asks it of every attempt; the review queue shows it per
-- attempt. One home for the rule, used by both.
CREATE FUNCTION z29c_attempt_may_have_sent(cp checkpoint, st attempt_state) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT cp >= 'invocation_began' AND st <> 'released'
$$;

CREATE OR REPLACE FUNCTION z29c_may_have_sent(step uuid) RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT EXISTS (
        SELECT 1 FROM attempts a
        WHERE a.step_id = step AND z29c_attempt_may_have_sent(a.checkpoint, a.state)
    )
$$;
