-- Probe for benches/sql/instructions.sh (VARIANT): migration 0032 undone.
-- Its six stored generated columns dropped (with their indexes), and its
-- seven indexes back on predicates over `state`, as 0031 left them.
ALTER TABLE durastep.runs DROP COLUMN singleton_active_key, DROP COLUMN debounce_open_key, DROP COLUMN deadline_open_at,
    DROP COLUMN start_by_open_at, DROP COLUMN listed_state, DROP COLUMN attempt_stopping;
CREATE UNIQUE INDEX runs_singleton ON durastep.runs (function_id, singleton_key)
    WHERE state IN ('queued', 'running', 'sleeping', 'waiting') AND singleton_key IS NOT NULL;
CREATE UNIQUE INDEX runs_debounce ON durastep.runs (function_id, debounce_key)
    WHERE state = 'queued' AND started_at IS NULL AND debounce_key IS NOT NULL;
CREATE INDEX runs_deadline ON durastep.runs (deadline_at)
    WHERE deadline_at IS NOT NULL AND state IN ('queued', 'running', 'sleeping', 'waiting');
CREATE INDEX runs_start_by ON durastep.runs (start_by) WHERE start_by IS NOT NULL AND started_at IS NULL AND state = 'queued';
CREATE INDEX runs_listed_by_state ON durastep.runs (state, id DESC)
    WHERE state IN ('sleeping', 'waiting', 'failed', 'cancelled', 'skipped', 'diverged');
CREATE INDEX runs_diverged ON durastep.runs (function_id) WHERE state = 'diverged';
CREATE INDEX runs_attempt_stopping ON durastep.runs (id) WHERE state IN ('cancelled', 'queued') AND worker_id IS NOT NULL;
