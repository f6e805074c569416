-- Whether any attempt of a step may have sent its request to the external system: it began
-- its invocation and was never told "not performed" (an attempt released after a 429, a
-- refused connection or no permit). Every claim makes a new current attempt, so the question
-- is asked of all of them: an earlier attempt's request may have an effect that a later
-- attempt's crash before its own invocation must not hide. Cancellation, releases in an ended
-- workflow and recovery's evidence and decisions all ask it here, so the rule has one home.
CREATE FUNCTION z29c_may_have_sent(step uuid) RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT EXISTS (
        SELECT 1 FROM attempts a
        WHERE a.step_id = step
          AND a.checkpoint >= 'invocation_began'
          AND a.state <> 'released'
    )
$$;
