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

-- Child runs (ctx.invoke): the parent run and its step that waits for this one.
-- At most one child per parent step: a parent that re-executes its invoke
-- (after a crash, a retry) finds its child instead of starting a second one.
ALTER TABLE durastep.runs ADD COLUMN parent_run_id uuid, ADD COLUMN parent_step_key text;
CREATE UNIQUE INDEX runs_parent ON durastep.runs (parent_run_id, parent_step_key)
    WHERE parent_run_id IS NOT NULL;

-- When a child run finishes (completed, failed or cancelled), by whatever path
-- (group commit, failed attempt, reaper, cancel, timeout), its outcome is stored
-- as the parent's step result and a waiting parent is made due, in the same
-- transaction. The output is copied as stored (sealed, when encryption is on:
-- the parent opens it with the child's key binding).
CREATE FUNCTION durastep.resume_parent() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch)
    SELECT p.id, NEW.parent_step_key,
           jsonb_build_object('child_run_id', NEW.id, 'state', NEW.state, 'output', NEW.output,
                              'error', coalesce(NEW.cancel_reason, NEW.last_error)),
           p.lease_epoch
      FROM durastep.runs p
     WHERE p.id = NEW.parent_run_id AND p.state IN ('queued', 'running', 'sleeping', 'waiting')
    ON CONFLICT DO NOTHING;
    IF FOUND THEN
        UPDATE durastep.runs SET state = 'queued', run_at = durastep.now()
         WHERE id = NEW.parent_run_id AND state = 'waiting';
        PERFORM pg_notify('durastep_wakeup', '');
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER runs_child_finished AFTER UPDATE OF state ON durastep.runs
    FOR EACH ROW WHEN (NEW.parent_run_id IS NOT NULL
                       AND NEW.state IN ('completed', 'failed', 'cancelled')
                       AND OLD.state NOT IN ('completed', 'failed', 'cancelled'))
    EXECUTE FUNCTION durastep.resume_parent();

-- Timeouts (FunctionBuilder::start_timeout / finish_timeout), in seconds.
ALTER TABLE durastep.functions ADD COLUMN start_timeout_secs float8, ADD COLUMN finish_timeout_secs float8;
-- Per run, fixed at creation from its first due time: start_by (a run not
-- started by then is cancelled instead: the claim and the reaper's sweep check
-- it) and deadline_at (a run not finished by then is cancelled, running or not).
ALTER TABLE durastep.runs ADD COLUMN start_by timestamptz, ADD COLUMN deadline_at timestamptz;
CREATE INDEX runs_deadline ON durastep.runs (deadline_at)
    WHERE deadline_at IS NOT NULL AND state IN ('queued', 'running', 'sleeping', 'waiting');
CREATE INDEX runs_start_by ON durastep.runs (start_by)
    WHERE start_by IS NOT NULL AND started_at IS NULL AND state = 'queued';
