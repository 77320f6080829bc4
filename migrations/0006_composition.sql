-- Features that meet (issue 11): a run that cancels itself, debounce only into
-- runs that never started, and slots that a cancelled attempt keeps until its
-- body has stopped. Shipped migrations are never edited; later changes go in
-- new files.

-- A run cancelled by an event (cancel_on, or a singleton's CancelOld) records
-- the transaction that cancelled it. When that is the run's own `step_tx`
-- (a `ctx.send_event` matching its own rule), the step's checkpoint still
-- commits in that transaction and the attempt then ends: the run is cancelled
-- once the step commits, instead of the step being fenced by its own event.
ALTER TABLE durastep.runs ADD COLUMN cancelled_by_xact xid8;

-- Debounce merges an event only into a run that has never started: a run back
-- in 'queued' after an attempt (retry backoff, release at shutdown, reaping, a
-- wake-up) is not matched, so an event after the run started makes a new run.
DROP INDEX durastep.runs_debounce;
CREATE UNIQUE INDEX runs_debounce ON durastep.runs (function_id, debounce_key)
    WHERE state = 'queued' AND started_at IS NULL AND debounce_key IS NOT NULL;

-- Every event sent to a debounced function, and the run it went to (created or
-- merged into). A merged run carries only its latest event (runs.event_id), so
-- this is how a repeated send of an earlier event (same idempotency key) still
-- finds its run. Deleted with the event or the run.
CREATE TABLE durastep.debounced_events (
    event_id uuid NOT NULL REFERENCES durastep.events (id) ON DELETE CASCADE,
    run_id   uuid NOT NULL REFERENCES durastep.runs (id) ON DELETE CASCADE,
    PRIMARY KEY (event_id, run_id)
);
CREATE INDEX debounced_events_run ON durastep.debounced_events (run_id);
-- Runs merged before this migration: their current event is runs.event_id.

-- A running attempt that is cancelled (engine.cancel, cancel_on, a singleton's
-- CancelOld, a finish or invoke timeout) keeps its worker_id and lease, and so
-- its concurrency slots, until its worker has dropped the handler (it then
-- clears worker_id: `end_cancelled_attempt`) or its lease has lapsed (the
-- reaper clears it). This index finds those few rows for the reaper. It covers
-- neither lease_expires_at nor any column the heartbeat writes, so heartbeats
-- stay HOT updates.
CREATE INDEX runs_cancel_stopping ON durastep.runs (id) WHERE state = 'cancelled' AND worker_id IS NOT NULL;

-- Redefines 0004's release_flow. A row holds its concurrency slots (flow_held)
-- while it is 'running', and while it is 'cancelled' with a worker_id: a
-- cancelled attempt whose body may still run. Slots are given back by the
-- statement after which the row no longer holds them (completion, failure,
-- retry, suspension, release, reaping, a cancel of a run that was not running,
-- the end of a cancelled attempt, a lapsed cancelled lease), or whose claim
-- bumped the epoch; in that statement's transaction, behind its fencing.
-- Besides, every run that leaves 'running' for 'cancelled' is announced on
-- 'durastep_cancelled' (payload '<run id>:<lease epoch>'), at commit, so that
-- its worker drops the handler at once instead of at its next heartbeat.
CREATE OR REPLACE FUNCTION durastep.release_flow() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    rules text[];
    keys text[];
    ns integer[];
BEGIN
    PERFORM pg_notify('durastep_cancelled', n.id::text || ':' || n.lease_epoch)
       FROM new_runs n JOIN old_runs o ON o.id = n.id
      WHERE o.state = 'running' AND n.state = 'cancelled';
    SELECT array_agg(x.rule ORDER BY x.rule, x.key), array_agg(x.key ORDER BY x.rule, x.key),
           array_agg(x.n ORDER BY x.rule, x.key)
      INTO rules, keys, ns
      FROM (SELECT h->>0 AS rule, h->>1 AS key, count(*)::integer AS n
              FROM old_runs o
              LEFT JOIN new_runs n ON n.id = o.id
              CROSS JOIN LATERAL jsonb_array_elements(o.flow_held) AS h
             WHERE o.flow_held IS NOT NULL
               AND (o.state = 'running' OR (o.state = 'cancelled' AND o.worker_id IS NOT NULL))
               AND NOT (n.id IS NOT NULL AND n.lease_epoch = o.lease_epoch
                        AND (n.state = 'running' OR (n.state = 'cancelled' AND n.worker_id IS NOT NULL)))
             GROUP BY 1, 2) x;
    IF rules IS NULL THEN
        RETURN NULL;
    END IF;
    -- Lock in (rule, key) order, waiting for a claim that holds a row.
    PERFORM 1 FROM durastep.flow_keys f JOIN unnest(rules, keys) AS u(rule, key) ON f.rule = u.rule AND f.key = u.key
      ORDER BY f.rule, f.key FOR UPDATE OF f;
    UPDATE durastep.flow_keys f SET in_use = greatest(f.in_use - u.n, 0)
      FROM unnest(rules, keys, ns) AS u(rule, key, n)
     WHERE f.rule = u.rule AND f.key = u.key;
    -- A new statement, so a new snapshot: it sees every park committed by a claim that held a row.
    UPDATE durastep.runs r SET run_at = durastep.now(), park_rule = NULL, park_key = NULL
     WHERE r.id IN (SELECT w.id FROM unnest(rules, keys, ns) AS u(rule, key, n)
                    CROSS JOIN LATERAL (
                        SELECT w.id FROM durastep.runs w
                         WHERE w.park_rule = u.rule AND w.park_key = u.key AND w.state = 'queued'
                         ORDER BY w.priority DESC, w.created_at
                         LIMIT u.n
                         FOR UPDATE SKIP LOCKED) w);
    IF FOUND THEN
        PERFORM pg_notify('durastep_wakeup', '');
    END IF;
    RETURN NULL;
END $$;

-- Redefines 0004's release_flow_deleted: a deleted row that still held its
-- slots (running, or cancelled and still stopping) gives them back.
CREATE OR REPLACE FUNCTION durastep.release_flow_deleted() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    k record;
BEGIN
    FOR k IN
        SELECT h->>0 AS rule, h->>1 AS key, count(*)::integer AS n
          FROM old_runs o CROSS JOIN LATERAL jsonb_array_elements(o.flow_held) AS h
         WHERE o.flow_held IS NOT NULL
           AND (o.state = 'running' OR (o.state = 'cancelled' AND o.worker_id IS NOT NULL))
         GROUP BY 1, 2
         ORDER BY 1, 2
    LOOP
        UPDATE durastep.flow_keys SET in_use = greatest(in_use - k.n, 0)
         WHERE rule = k.rule AND key = k.key;
    END LOOP;
    RETURN NULL;
END $$;
