-- Probe for benches/sql/instructions.sh (VARIANT; the command is in
-- docs/performance.md "The clock inlined, names checked by enum types"): the
-- schema as it was before migrations 0039 and 0040, restored over them:
-- durastep.now() in PL/pgSQL, reading the clock on every call (migration
-- 0019 itself, included), and the CHECK constraints with their lists of
-- names as 0009 and 0029 made them. For counting what the two migrations
-- changed.
\ir ../../../migrations/0019_clock_in_plpgsql.sql
ALTER TABLE durastep.runs DROP CONSTRAINT runs_state_check, ADD CONSTRAINT runs_state_check CHECK (state IN
    ('queued', 'running', 'sleeping', 'waiting', 'completed', 'failed', 'cancelled', 'skipped', 'diverged'));
ALTER TABLE durastep.step_results DROP CONSTRAINT step_results_entry, ADD CONSTRAINT step_results_entry CHECK (
        (position IS NULL AND kind IS NULL)
        OR (position >= 0 AND kind IN ('step', 'step_tx', 'sleep', 'wait', 'send_event', 'invoke', 'changed')));
