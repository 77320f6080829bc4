-- Durastep core schema: functions, events, runs, step_results and the clock.
-- Shipped migrations are never edited; later changes go in new files.

CREATE SCHEMA IF NOT EXISTS durastep;

-- The clock every due-ness decision uses. `offset_by` is zero in production;
-- tests move it forward instead of sleeping (durastep::testing::advance_clock).
CREATE TABLE durastep.clock (
    id        boolean PRIMARY KEY DEFAULT true CHECK (id),
    offset_by interval NOT NULL DEFAULT '0'
);
INSERT INTO durastep.clock DEFAULT VALUES;

-- Transaction time plus the offset. Every statement Durastep runs is its own short
-- transaction, so transaction time is statement time.
CREATE FUNCTION durastep.now() RETURNS timestamptz
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT now() + (SELECT offset_by FROM durastep.clock) $$;

-- Function definitions, upserted by every engine that registers them, so that a
-- process which only sends events still fans out to the right functions.
CREATE TABLE durastep.functions (
    id             text PRIMARY KEY,
    triggers       text[] NOT NULL DEFAULT '{}',
    max_attempts   integer NOT NULL CHECK (max_attempts >= 1),
    has_on_failure boolean NOT NULL DEFAULT false,
    updated_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX functions_triggers ON durastep.functions USING gin (triggers);

CREATE TABLE durastep.events (
    id              uuid PRIMARY KEY,
    name            text NOT NULL,
    payload         jsonb NOT NULL,
    idempotency_key text,
    created_at      timestamptz NOT NULL DEFAULT durastep.now()
);
-- An idempotency key is unique per event name for as long as the event is kept
-- (until it is pruned with its finished runs).
CREATE UNIQUE INDEX events_idempotency ON durastep.events (name, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX events_created ON durastep.events (created_at);

-- One row per run. Kept narrow: the input lives in events, step outputs in
-- step_results. The heartbeat updates lease_expires_at only, which no index
-- covers, so heartbeats stay HOT updates.
CREATE TABLE durastep.runs (
    id               uuid PRIMARY KEY,
    function_id      text NOT NULL,
    event_id         uuid NOT NULL REFERENCES durastep.events (id) ON DELETE CASCADE,
    state            text NOT NULL CHECK (state IN
                         ('queued', 'running', 'sleeping', 'completed', 'failed', 'cancelled')),
    priority         integer NOT NULL DEFAULT 0,
    run_at           timestamptz NOT NULL,
    attempt          integer NOT NULL DEFAULT 1,
    max_attempts     integer NOT NULL CHECK (max_attempts >= 1),
    -- Bumped on every claim; every write by a worker compares it (fencing).
    lease_epoch      bigint NOT NULL DEFAULT 0,
    lease_expires_at timestamptz,
    worker_id        uuid,
    last_error       text,
    output           jsonb,
    created_at       timestamptz NOT NULL DEFAULT durastep.now(),
    started_at       timestamptz,
    finished_at      timestamptz,
    UNIQUE (event_id, function_id)
) WITH (fillfactor = 80, autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);

-- The claim reads only runnable rows.
CREATE INDEX runs_due ON durastep.runs (priority DESC, run_at)
    WHERE state IN ('queued', 'sleeping');
-- The reaper reads only running rows (few: bounded by the workers' capacity).
CREATE INDEX runs_running ON durastep.runs (function_id) WHERE state = 'running';
CREATE INDEX runs_function_state ON durastep.runs (function_id, state, created_at);
CREATE INDEX runs_finished ON durastep.runs (finished_at) WHERE finished_at IS NOT NULL;

CREATE TABLE durastep.step_results (
    run_id      uuid NOT NULL REFERENCES durastep.runs (id) ON DELETE CASCADE,
    step_key    text NOT NULL,
    output      jsonb NOT NULL,
    -- The lease epoch of the attempt that stored it: lets a writer whose commit
    -- was ambiguous recognise its own row.
    lease_epoch bigint NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (run_id, step_key)
) WITH (autovacuum_vacuum_scale_factor = 0.05);

-- When a run of a function that has an on_failure handler becomes failed, a run
-- of its failure handler is created in the same transaction, whichever path
-- (worker or reaper) failed it. The failure handler's function id is
-- '<id>/on-failure'; '/' is not allowed in user function ids.
CREATE FUNCTION durastep.start_failure_handler() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    handler_id text := NEW.function_id || '/on-failure';
    ev uuid := gen_random_uuid();
    handler_attempts integer;
BEGIN
    SELECT f.max_attempts INTO handler_attempts
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
        INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts)
        VALUES (gen_random_uuid(), handler_id, ev, 'queued', durastep.now(), handler_attempts);
        PERFORM pg_notify('durastep_wakeup', '');
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER runs_failed AFTER UPDATE OF state ON durastep.runs
    FOR EACH ROW WHEN (NEW.state = 'failed' AND OLD.state <> 'failed')
    EXECUTE FUNCTION durastep.start_failure_handler();
