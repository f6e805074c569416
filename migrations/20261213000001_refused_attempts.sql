-- An attempt answered with a definite refusal that its step's policy retries ends `refused`:
-- nothing happened, and the next attempt sends under the same request identity. Its own
-- migration, so the value is committed before anything uses it.
ALTER TYPE attempt_state ADD VALUE IF NOT EXISTS 'refused';
