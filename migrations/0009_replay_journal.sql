-- Divergence detection (issue 14): per run, the sequence of what the handler
-- asked for (kind and step key, by position), and the 'diverged' run state.

-- One row per entry the handler asked for, at its position in the run (0, 1,
-- 2 ... in the order the handler called ctx.step, ctx.sleep, ...). Written with
-- the entry's checkpoint (steps, step_tx, send_event, sleeps) or when the entry
-- is first asked (waits, invokes, `changed` markers), behind the fencing check.
-- A replay compares what the new code asks at each position with this row.
-- Runs from before this migration have no rows: they are not checked.
CREATE TABLE durastep.step_journal (
    run_id   uuid NOT NULL REFERENCES durastep.runs (id) ON DELETE CASCADE,
    position integer NOT NULL CHECK (position >= 0),
    kind     text NOT NULL CHECK (kind IN
                 ('step', 'step_tx', 'sleep', 'wait', 'send_event', 'invoke', 'changed')),
    step_key text NOT NULL,
    PRIMARY KEY (run_id, position)
) WITH (autovacuum_vacuum_scale_factor = 0.05);

-- A run whose replay asked for something other than what it recorded is
-- parked 'diverged' (not claimed, not retried, not failed) until an operator
-- resumes it (after fixing the code) or discards its entries from a position.
-- `divergence` holds what was found: {"position", "recorded", "asked"}.
ALTER TABLE durastep.runs ADD COLUMN divergence jsonb;

-- The run states of 0004 plus 'diverged'. Redefines runs_state_check.
ALTER TABLE durastep.runs DROP CONSTRAINT IF EXISTS runs_state_check;
ALTER TABLE durastep.runs ADD CONSTRAINT runs_state_check CHECK (state IN
    ('queued', 'running', 'sleeping', 'waiting', 'completed', 'failed', 'cancelled', 'skipped', 'diverged'));

CREATE INDEX runs_diverged ON durastep.runs (function_id) WHERE state = 'diverged';
