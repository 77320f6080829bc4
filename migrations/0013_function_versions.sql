-- Function versions (issue 14): workers run old and new handlers side by side
-- until the old runs drain.
--
-- `functions.version` is the version new runs of the function start under:
-- the newest version the engine that registered last registers (0 for a
-- function without `.version(n)`). `runs.version` is the version a run
-- started under, for good: a worker claims a run only if it registers a
-- handler for that (function, version).
ALTER TABLE durastep.functions ADD COLUMN version integer NOT NULL DEFAULT 0 CHECK (version >= 0);

-- A constant default: no table rewrite. Runs from before this migration are
-- version 0, as are the functions that registered them. No CHECK here (it
-- would scan the table); the value is always copied from functions.version.
ALTER TABLE durastep.runs ADD COLUMN version integer NOT NULL DEFAULT 0;

-- The failure handler of 0001, its run now started under the version of the
-- `<function>/on-failure` function row.
CREATE OR REPLACE FUNCTION durastep.start_failure_handler() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    handler_id text := NEW.function_id || '/on-failure';
    ev uuid := gen_random_uuid();
    handler_attempts integer;
    handler_version integer;
BEGIN
    SELECT f.max_attempts, f.version INTO handler_attempts, handler_version
      FROM durastep.functions f
     WHERE f.id = handler_id
       AND EXISTS (SELECT 1 FROM durastep.functions p WHERE p.id = NEW.function_id AND p.has_on_failure);
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    INSERT INTO durastep.events (id, name, payload, idempotency_key)
    SELECT ev, 'durastep/run.failed',
           jsonb_build_object(
               'run_id', NEW.id,
               'function_id', NEW.function_id,
               'error', NEW.last_error,
               'attempts', NEW.attempt,
               'event', e.payload),
           NEW.id::text
      FROM durastep.events e WHERE e.id = NEW.event_id
    ON CONFLICT DO NOTHING;
    IF FOUND THEN
        INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, version)
        VALUES (gen_random_uuid(), handler_id, ev, 'queued', durastep.now(), handler_attempts, handler_version);
        PERFORM pg_notify('durastep_wakeup', '');
    END IF;
    RETURN NULL;
END $$;
