-- Schedules and waiting: cancellation, waiting for events (and, later in this
-- file, cron schedules, child runs and timeouts).
-- Shipped migrations are never edited; later changes go in new files.

-- A run suspended in ctx.wait_for_event is 'waiting': run_at is its timeout
-- ('infinity' when it has none), and the claim takes it once that has passed.
ALTER TABLE durastep.runs DROP CONSTRAINT runs_state_check;
ALTER TABLE durastep.runs ADD CONSTRAINT runs_state_check CHECK (state IN
    ('queued', 'running', 'sleeping', 'waiting', 'completed', 'failed', 'cancelled'));

-- Why a cancelled run was cancelled (engine.cancel's reason, the cancelling
-- event, a timeout). last_error keeps the last failure, as before.
ALTER TABLE durastep.runs ADD COLUMN cancel_reason text;

-- The claim's partial indexes cover every state the claim takes.
DROP INDEX durastep.runs_due;
CREATE INDEX runs_due ON durastep.runs (priority DESC, run_at)
    WHERE state IN ('queued', 'sleeping', 'waiting');
DROP INDEX durastep.runs_next_due;
CREATE INDEX runs_next_due ON durastep.runs (run_at)
    WHERE state IN ('queued', 'sleeping', 'waiting');

-- Function.cancel_on: [{"event": name, "event_path": [...], "run_path": [...]}].
ALTER TABLE durastep.functions ADD COLUMN cancel_on jsonb NOT NULL DEFAULT '[]';

-- One row per event name that was ever sent or waited for: the rendezvous that
-- makes wake-ups lossless. A sender locks its names' rows FOR SHARE before it
-- looks for waits; a waiter UPDATEs its name's row before it records its wait.
-- The two locks conflict, so one transaction commits before the other looks,
-- and an event that commits after a wait is recorded always sees that wait.
CREATE TABLE durastep.topics (
    name  text PRIMARY KEY,
    waits bigint NOT NULL DEFAULT 0
);

-- What a waiting run waits for. Deleted when the wait is resolved (an event
-- arrived, it timed out) or its run is cancelled.
CREATE TABLE durastep.waits (
    run_id      uuid NOT NULL REFERENCES durastep.runs (id) ON DELETE CASCADE,
    step_key    text NOT NULL,
    event_name  text NOT NULL,
    -- The JSON pointer as a path (#> operand); NULL matches any event of the name.
    match_path  text[],
    match_value jsonb,
    expires_at  timestamptz NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT durastep.now(),
    PRIMARY KEY (run_id, step_key)
);
CREATE INDEX waits_event ON durastep.waits (event_name);

-- Cron schedules: one row per function with on_cron, upserted at registration.
-- Every worker that has the function ticks it: it locks the row FOR UPDATE SKIP
-- LOCKED when next_fire_at has passed, sends one event per fire time to fire
-- (name 'durastep/cron:<function id>', idempotency key = the fire time, so each
-- fire time makes one run however many workers tick), and moves
-- last_tick_at/next_fire_at on, in one transaction.
CREATE TABLE durastep.schedules (
    function_id  text PRIMARY KEY,
    expr         text NOT NULL,
    tz           text NOT NULL,
    -- How many missed fire times to run after an outage (the latest ones): 1 is
    -- "skip to the latest".
    catch_up     integer NOT NULL CHECK (catch_up >= 1),
    -- Fire times up to here are handled; NULL until the first tick.
    last_tick_at timestamptz,
    next_fire_at timestamptz,
    updated_at   timestamptz NOT NULL DEFAULT now()
);
