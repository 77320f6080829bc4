-- Inspection: a run's state history, step timings, the step a failed attempt
-- ended at, "why is this run not running" as a view, and the indexes that keep
-- listing pages fast with many runs.

-- The step whose failure ended the run's last failed attempt (NULL when the
-- attempt failed outside a step: the handler itself, a panic, a lost lease).
ALTER TABLE durastep.runs ADD COLUMN failed_step text;

-- When a step ran, by the database clock as the worker knew it (the claim's
-- database time plus the time elapsed since), and in which attempt. NULL on
-- rows stored before this migration.
ALTER TABLE durastep.step_results
    ADD COLUMN started_at  timestamptz,
    ADD COLUMN finished_at timestamptz,
    ADD COLUMN attempt     integer;

-- One row per state change of a run, and per claim (a new lease epoch). Written
-- by the statement trigger below, whichever path (worker, reaper, cancel,
-- timeout, replay, plain SQL) changed the run. No foreign key: a per-row
-- referential check would cost every claim and completion a lookup;
-- durastep.prune removes a pruned run's history with it.
CREATE TABLE durastep.run_history (
    run_id      uuid NOT NULL,
    seq         bigint GENERATED ALWAYS AS IDENTITY,
    at          timestamptz NOT NULL,
    state       text NOT NULL,
    attempt     integer NOT NULL,
    lease_epoch bigint NOT NULL,
    worker_id   uuid,
    -- The run's last_error when it changed in this transition (a failed attempt).
    error       text,
    -- The step that failed, for a failed attempt that ended at a step.
    step        text,
    PRIMARY KEY (run_id, seq)
);

CREATE FUNCTION durastep.record_history() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO durastep.run_history (run_id, at, state, attempt, lease_epoch, worker_id, error, step)
    SELECT x.id, durastep.now(), x.state, x.attempt, x.lease_epoch, x.worker_id,
           CASE WHEN x.failure THEN x.last_error END,
           CASE WHEN x.failure THEN x.failed_step END
      FROM (SELECT n.*,
                   -- An attempt that ended in failure (retried, paused or failed), as
                   -- opposed to a release at shutdown (same attempt, same error).
                   (o.state = 'running' AND n.state IN ('queued', 'failed')
                    AND (n.state = 'failed' OR n.attempt <> o.attempt OR n.pauses <> o.pauses
                         OR n.last_error IS DISTINCT FROM o.last_error)) AS failure
              FROM new_runs n JOIN old_runs o ON o.id = n.id
             WHERE n.state <> o.state OR n.lease_epoch <> o.lease_epoch) x
     ORDER BY x.id;
    RETURN NULL;
END $$;

CREATE TRIGGER runs_history AFTER UPDATE ON durastep.runs
    REFERENCING OLD TABLE AS old_runs NEW TABLE AS new_runs
    FOR EACH STATEMENT EXECUTE FUNCTION durastep.record_history();

-- Listing pages: newest first, over all runs and per state.
CREATE INDEX runs_created ON durastep.runs (created_at DESC, id DESC);
CREATE INDEX runs_state_created ON durastep.runs (state, created_at DESC, id DESC);
-- Runs per minute: finished_at already has runs_finished; starts and creations:
CREATE INDEX events_name_created ON durastep.events (name, created_at DESC);

-- Why is this run not running? One row for every unfinished run that is not
-- running, with what holds it:
--   concurrency / throttle / rate_limit / backpressure: parked by flow control
--     (rule, key, in_use of limit, next possible start);
--   debounce: waiting for the debounce window of its key to close;
--   sleep: a durable sleep until run_at;
--   wait_for_event: waiting for an event (detail: the event name), until run_at;
--   invoke: waiting for a child run (detail: the child's id);
--   retry_backoff: a failed attempt's backoff until run_at;
--   scheduled: a delayed start (Event::start_at) until run_at;
--   ready: due now; no worker has claimed it yet (are workers running that
--     register this function?).
CREATE VIEW durastep.run_blockers AS
SELECT r.id AS run_id, r.function_id, r.state,
       CASE
         WHEN r.state = 'queued' AND r.park_rule IS NOT NULL THEN fr.kind
         WHEN r.state = 'queued' AND r.debounce_key IS NOT NULL AND r.started_at IS NULL
              AND r.run_at > durastep.now() THEN 'debounce'
         WHEN r.state = 'sleeping' THEN 'sleep'
         WHEN r.state = 'waiting' AND w.event_name IS NOT NULL THEN 'wait_for_event'
         WHEN r.state = 'waiting' THEN 'invoke'
         WHEN r.run_at > durastep.now() AND r.last_error IS NOT NULL THEN 'retry_backoff'
         WHEN r.run_at > durastep.now() THEN 'scheduled'
         ELSE 'ready'
       END AS blocker,
       CASE WHEN r.state = 'queued' AND r.park_rule IS NOT NULL THEN r.park_rule
            WHEN r.state = 'queued' AND r.debounce_key IS NOT NULL THEN 'debounce' END AS rule,
       CASE WHEN r.state = 'queued' AND r.park_rule IS NOT NULL THEN r.park_key
            WHEN r.state = 'queued' AND r.debounce_key IS NOT NULL THEN r.debounce_key END AS key,
       CASE WHEN r.park_rule IS NOT NULL AND fr.kind = 'concurrency' THEN fk.in_use END AS in_use,
       CASE WHEN r.park_rule IS NOT NULL THEN fr.capacity END AS "limit",
       CASE WHEN r.park_rule IS NOT NULL AND fr.kind = 'concurrency' THEN NULL
            WHEN r.run_at = 'infinity' THEN NULL
            ELSE greatest(r.run_at, durastep.now()) END AS next_possible_start,
       CASE WHEN r.state = 'waiting' AND w.event_name IS NOT NULL THEN w.event_name
            WHEN r.state = 'waiting' THEN (SELECT c.id::text FROM durastep.runs c
                                            WHERE c.parent_run_id = r.id
                                              AND c.state IN ('queued', 'running', 'sleeping', 'waiting')
                                            LIMIT 1)
            WHEN r.run_at > durastep.now() AND r.last_error IS NOT NULL THEN r.last_error END AS detail,
       r.run_at, r.attempt, r.created_at
  FROM durastep.runs r
  LEFT JOIN durastep.flow_rules fr ON fr.name = r.park_rule
  LEFT JOIN durastep.flow_keys fk ON fk.rule = r.park_rule AND fk.key = r.park_key
  LEFT JOIN LATERAL (SELECT x.event_name FROM durastep.waits x WHERE x.run_id = r.id
                      ORDER BY x.created_at LIMIT 1) w ON r.state = 'waiting'
 WHERE r.state IN ('queued', 'sleeping', 'waiting');
