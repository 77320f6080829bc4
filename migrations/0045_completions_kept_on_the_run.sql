-- A completion is kept on the run, not in a history row (issue 12;
-- docs/architecture.md "A completion kept on the run"; docs/performance.md
-- "A completion kept on the run").
--
-- Since 0044 a run of one attempt had one history row, written by the
-- completion's `fin_history`: counted, about 15,500 instructions per run
-- (the primary key's entry, the BRIN entry, the identity's nextval, the
-- heap insert), 5% of a run's claim and completion on the server. A
-- completed run is final (no path of the engine changes its state or lease
-- again; replay takes failed and cancelled runs only), and the run's own row
-- holds what that history row held: the end (`finished_at`, `attempt`,
-- `lease_epoch`) and the attempt's start (`attempt_claimed_at`, counted
-- while `attempt_claim_id` is `claim_id`, as in 0044). What it lacked is the
-- claiming worker, which the completion cleared: since 0045 a completion
-- keeps `worker_id` (the worker that ran the run's last attempt), and writes
-- no history row.
--
-- A completion the run carries is one without a `completed` row in its
-- history: runs completed before 0045, or by an earlier version during a
-- rolling upgrade, or by plain SQL (the trigger writes a row), have theirs,
-- and the timeline shows that row instead. The view takes the entries from
-- the run; the trigger writes the row, with its start, before plain SQL
-- changes a completed run's state or lease.
--
-- The per-minute counts of completions read the completions' rows by `at`
-- (0033). Runs the completion leaves without a row are counted in
-- `durastep.completions_per_minute` instead: one row per minute and server
-- process, which each completion statement adds its count to (its own row:
-- no two connections wait for each other).

CREATE TABLE durastep.completions_per_minute (
    minute    timestamptz NOT NULL,
    -- pg_backend_pid() of the server process that counted: one row per
    -- connection and minute, so that no flush waits for another's row lock
    -- (a count may be negative: the trigger takes a completion off its
    -- minute when it writes it as a row later).
    backend   integer NOT NULL,
    completed bigint NOT NULL,
    PRIMARY KEY (minute, backend)
) WITH (fillfactor = 50);

-- Pruning deletes the counts older than its bound, and a completed run
-- whose worker is still named (0045) like every other finished run.
CREATE OR REPLACE FUNCTION durastep.prune_batch(
    older_than_secs double precision,
    batch integer,
    after uuid DEFAULT NULL,
    OUT pruned_runs bigint,
    OUT pruned_events bigint,
    OUT pruned_flow_keys bigint,
    OUT last_run uuid)
    LANGUAGE plpgsql
    SET jit = off
AS $$
DECLARE
    bound timestamptz := durastep.now() - make_interval(secs => older_than_secs);
    run_ids uuid[];
    event_ids uuid[];
BEGIN
    -- Finished runs older than the bound, locked, skipping held rows. A
    -- cancelled attempt still stopping keeps its row (and slots) until it
    -- has stopped (a completed run keeps the worker that ran it: 0045); a
    -- child of an unfinished parent is kept (the parent's
    -- invoke may still look for it). A run that finished before the bound
    -- was created before it: the time-ordered ones are found by a walk of
    -- the primary key, oldest first, from `after` (the `last_run` of the
    -- pass's batch before) up to `durastep.run_id_ceiling`, so that a pass
    -- steps over each unfinished run older than the bound (a long sleep)
    -- once, not once per batch.
    SELECT coalesce(array_agg(a.id ORDER BY a.id), '{}'), coalesce(array_agg(DISTINCT a.event_id), '{}')
      INTO run_ids, event_ids
      FROM (SELECT r.id, r.event_id FROM durastep.runs r
             WHERE r.id > coalesce(after, '00000000-0000-0000-0000-000000000000')
               AND r.id < durastep.run_id_ceiling(bound)
               AND r.finished_at < bound AND r.state IN ('completed', 'failed', 'cancelled', 'skipped')
               AND (r.worker_id IS NULL OR r.state = 'completed')
               AND NOT EXISTS (SELECT 1 FROM durastep.runs p WHERE p.id = r.parent_run_id
                                AND p.state IN ('queued', 'running', 'sleeping', 'waiting', 'diverged'))
             ORDER BY r.id LIMIT batch
             FOR UPDATE OF r SKIP LOCKED) a;
    last_run := coalesce(run_ids[cardinality(run_ids)], after);
    -- The runs with other ids (random ones), through `runs_created_legacy`,
    -- whose predicate this repeats word for word; from the start in every
    -- batch (no run an engine creates is one of them).
    SELECT run_ids || coalesce(array_agg(b.id), '{}'), event_ids || coalesce(array_agg(DISTINCT b.event_id), '{}')
      INTO run_ids, event_ids
      FROM (SELECT r.id, r.event_id FROM durastep.runs r
             WHERE ((get_byte(uuid_send(r.id), 6) >> 4) <> 7 OR r.id >= '03bb2cc3-d800-0000-0000-000000000000')
               AND r.created_at < bound AND r.id <> ALL (run_ids)
               AND r.finished_at < bound AND r.state IN ('completed', 'failed', 'cancelled', 'skipped')
               AND (r.worker_id IS NULL OR r.state = 'completed')
               AND NOT EXISTS (SELECT 1 FROM durastep.runs p WHERE p.id = r.parent_run_id
                                AND p.state IN ('queued', 'running', 'sleeping', 'waiting', 'diverged'))
             ORDER BY r.created_at LIMIT batch
             FOR UPDATE OF r SKIP LOCKED) b;
    DELETE FROM durastep.run_history h WHERE h.run_id = ANY (run_ids);
    DELETE FROM durastep.completions_per_minute c WHERE c.minute < date_trunc('minute', bound);
    DELETE FROM durastep.runs r WHERE r.id = ANY (run_ids);
    pruned_runs := cardinality(run_ids);

    -- No run deleted: look for events older than the bound that no run
    -- references (events that started no run; an event whose last run was
    -- pruned while another transaction held the event).
    IF pruned_runs = 0 THEN
        SELECT coalesce(array_agg(x.id), '{}') INTO event_ids
          FROM (SELECT x.id FROM durastep.events x
                 WHERE x.created_at < bound
                   AND NOT EXISTS (SELECT 1 FROM durastep.run_keys k WHERE k.event_id = x.id)
                   AND NOT EXISTS (SELECT 1 FROM durastep.debounced_events m WHERE m.event_id = x.id)
                 ORDER BY x.created_at LIMIT batch) x;
    END IF;
    -- The candidates older than the bound that no run references any more,
    -- neither as its event nor as an earlier event merged into a debounced
    -- run; locked, skipping held rows.
    WITH ev AS (
        SELECT e.id FROM durastep.events e
         WHERE e.id = ANY (event_ids) AND e.created_at < bound
           AND NOT EXISTS (SELECT 1 FROM durastep.run_keys k WHERE k.event_id = e.id)
           AND NOT EXISTS (SELECT 1 FROM durastep.debounced_events m WHERE m.event_id = e.id)
           FOR UPDATE OF e SKIP LOCKED)
    DELETE FROM durastep.events e USING ev WHERE e.id = ev.id;
    GET DIAGNOSTICS pruned_events = ROW_COUNT;

    -- Idle flow-control key rows: no slot in use, no throttle or rate state
    -- ahead, no pause, no run parked on them.
    WITH fk AS (
        SELECT f.rule, f.key FROM durastep.flow_keys f
         WHERE f.in_use = 0
           AND coalesce(f.tat, '-infinity') < durastep.now()
           AND coalesce(f.horizon, '-infinity') < durastep.now()
           AND coalesce(f.paused_until, '-infinity') < durastep.now()
           AND NOT EXISTS (SELECT 1 FROM durastep.runs r WHERE r.park_rule = f.rule AND r.park_key = f.key
                            AND r.state = 'queued')
         LIMIT batch
           FOR UPDATE OF f SKIP LOCKED)
    DELETE FROM durastep.flow_keys f USING fk WHERE f.rule = fk.rule AND f.key = fk.key;
    GET DIAGNOSTICS pruned_flow_keys = ROW_COUNT;
END $$;

-- The row trigger of 0044 (its history part changed): a completion the run
-- carries is written as a row before plain SQL changes the run again.
CREATE OR REPLACE FUNCTION durastep.run_changed() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    handler_id text;
    ev uuid;
    handler_attempts integer;
    handler_version integer;
    failure boolean;
    started boolean;
BEGIN
    -- A child run finished (0003, 0028): its outcome is stored as the
    -- parent's step, and a waiting parent is woken.
    IF NEW.parent_run_id IS NOT NULL AND NEW.state IN ('completed', 'failed', 'cancelled')
       AND OLD.state NOT IN ('completed', 'failed', 'cancelled')
    THEN
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
            PERFORM durastep.wake_workers(ARRAY(SELECT p.function_id FROM durastep.runs p
                                                 WHERE p.id = NEW.parent_run_id));
        END IF;
    END IF;

    -- A run failed (0001, 0028): its function's on-failure handler, if it
    -- has one, gets an event and a run.
    IF NEW.state = 'failed' AND OLD.state <> 'failed' THEN
        handler_id := NEW.function_id || '/on-failure';
        SELECT f.max_attempts, f.version INTO handler_attempts, handler_version
          FROM durastep.functions f
         WHERE f.id = handler_id
           AND EXISTS (SELECT 1 FROM durastep.functions p WHERE p.id = NEW.function_id AND p.has_on_failure);
        IF FOUND THEN
            ev := durastep.uuid7();
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
                VALUES (durastep.uuid7(), handler_id, ev, 'queued', durastep.now(), handler_attempts,
                        handler_version);
                PERFORM durastep.wake_workers(ARRAY[handler_id]);
            END IF;
        END IF;
    END IF;

    -- The history row of a change of state or lease (0020), unless the
    -- statement wrote it itself (it toggles `history_noted`; since 0045 the
    -- completion writes none: the run carries it). An attempt's
    -- end carries its start (0044): the claim's time and worker, noted on
    -- the run by a claim of this version (its `attempt_claim_id` is the
    -- run's `claim_id`), and the attempt's number before it ended.
    IF (NEW.state <> OLD.state OR NEW.lease_epoch <> OLD.lease_epoch)
       AND NEW.history_noted = OLD.history_noted
    THEN
        -- The start noted on the run counts (0044): a claim of this version
        -- noted it, for the attempt that ended running or completed.
        started := OLD.attempt_claimed_at IS NOT NULL
            AND OLD.attempt_claim_id IS NOT DISTINCT FROM OLD.claim_id;
        -- A completion the run carries (0045) is written as a row before the
        -- run changes again, so that its timeline keeps it. No path of the
        -- engine changes a completed run's state or lease: plain SQL may.
        IF OLD.state = 'completed' AND NOT EXISTS (
               SELECT 1 FROM durastep.run_history c WHERE c.run_id = OLD.id AND c.state = 'completed')
        THEN
            INSERT INTO durastep.run_history (run_id, at, state, attempt, lease_epoch,
                                              started_at, started_attempt, started_by)
            VALUES (OLD.id, coalesce(OLD.finished_at, durastep.now()), 'completed', OLD.attempt, OLD.lease_epoch,
                    CASE WHEN started THEN OLD.attempt_claimed_at END,
                    CASE WHEN started THEN OLD.attempt END,
                    CASE WHEN started THEN OLD.worker_id END);
            -- Its minute counted it: the row counts it now (taken off in this
            -- connection's row of that minute, so that no other waits).
            IF OLD.finished_at IS NOT NULL THEN
                INSERT INTO durastep.completions_per_minute AS c (minute, backend, completed)
                VALUES (date_trunc('minute', OLD.finished_at), pg_backend_pid(), -1)
                ON CONFLICT (minute, backend) DO UPDATE SET completed = c.completed - 1;
            END IF;
        END IF;
        started := started AND OLD.state = 'running';
        IF NEW.state = 'running' THEN
            -- A running run under a new lease without a claim (a take-over by
            -- hand): the attempt it ends gets its start, the new one an
            -- entry of its own, as before 0044.
            IF started THEN
                INSERT INTO durastep.run_history (run_id, at, state, attempt, lease_epoch, worker_id)
                VALUES (OLD.id, OLD.attempt_claimed_at, 'running', OLD.attempt, OLD.lease_epoch, OLD.worker_id);
            END IF;
            started := false;
            -- The start noted by the last claim is not this attempt's (the
            -- claim record is the same): forgotten, so that neither the
            -- view nor this attempt's end takes it for this attempt's.
            UPDATE durastep.runs SET attempt_claimed_at = NULL
             WHERE id = NEW.id AND attempt_claimed_at IS NOT NULL;
        END IF;
        -- An attempt that ended in failure (retried, paused or failed), as
        -- opposed to a release at shutdown (same attempt, same error).
        failure := OLD.state = 'running' AND NEW.state IN ('queued', 'failed')
            AND (NEW.state = 'failed' OR NEW.attempt <> OLD.attempt OR NEW.pauses <> OLD.pauses
                 OR NEW.last_error IS DISTINCT FROM OLD.last_error);
        INSERT INTO durastep.run_history (run_id, at, state, attempt, lease_epoch, worker_id, error, step,
                                          started_at, started_attempt, started_by)
        VALUES (NEW.id, durastep.now(), NEW.state, NEW.attempt, NEW.lease_epoch, NEW.worker_id,
                CASE WHEN failure THEN NEW.last_error END,
                CASE WHEN failure THEN NEW.failed_step END,
                CASE WHEN started THEN OLD.attempt_claimed_at END,
                CASE WHEN started THEN OLD.attempt END,
                CASE WHEN started THEN OLD.worker_id END);
    END IF;

    -- A running run cancelled: its worker hears it (0026).
    IF OLD.state = 'running' AND NEW.state = 'cancelled' THEN
        PERFORM pg_notify('durastep_cancelled', NEW.id::text || ':' || NEW.lease_epoch);
    END IF;
    -- Flow slots given back (0026): a row holds its slots while it is
    -- 'running', and while it is 'cancelled' or 'queued' with a worker_id (an
    -- attempt whose body may still run; 0015). The statement trigger
    -- `runs_release_flow` reads what is noted here.
    IF OLD.flow_held IS NOT NULL
       AND (OLD.state = 'running' OR (OLD.state IN ('cancelled', 'queued') AND OLD.worker_id IS NOT NULL))
       AND NOT (NEW.lease_epoch = OLD.lease_epoch
                AND (NEW.state = 'running' OR (NEW.state IN ('cancelled', 'queued') AND NEW.worker_id IS NOT NULL)))
    THEN
        INSERT INTO durastep.flow_releases (depth, rule, key)
        SELECT pg_trigger_depth(), h->>0, h->>1 FROM jsonb_array_elements(OLD.flow_held) AS h;
        PERFORM set_config('durastep.flow_releases_' || pg_trigger_depth(), 'pending', true);
    END IF;

    -- A run made running under a new lease by a statement that lists no
    -- claim record for it (0034: an older process's claim, a take-over by
    -- hand): listed here, so that the reaper finds it.
    IF NEW.state = 'running' AND NEW.lease_epoch IS DISTINCT FROM OLD.lease_epoch
       AND NEW.claim_id IS NOT DISTINCT FROM OLD.claim_id
    THEN
        INSERT INTO durastep.run_claims (recheck_at, run_ids, epochs)
        VALUES (coalesce(NEW.lease_expires_at, durastep.now()), ARRAY[NEW.id], ARRAY[NEW.lease_epoch]);
    END IF;
    RETURN NULL;
END $$;

-- A run's entries (0044's view, and since 0045 a completion the run
-- carries): each attempt's start and each row of its history, in order. An
-- attempt's start comes from the row its end wrote, or from the run while
-- the attempt runs or when the run carries its completion (`seq` NULL:
-- after every row); `part` orders a start before its end. Read by one run's
-- id (the rows through the history's primary key, the run through its own).
CREATE OR REPLACE VIEW durastep.run_timeline AS
SELECT h.run_id, h.seq, 0 AS part, h.started_at AS at, 'running'::text AS state,
       h.started_attempt AS attempt, h.lease_epoch, h.started_by AS worker_id,
       NULL::text AS error, NULL::text AS step
  FROM durastep.run_history h
 WHERE h.started_at IS NOT NULL
UNION ALL
SELECT h.run_id, h.seq, 1, h.at, h.state, h.attempt, h.lease_epoch, h.worker_id, h.error, h.step
  FROM durastep.run_history h
UNION ALL
SELECT r.id, NULL::bigint, 0, r.attempt_claimed_at, 'running', r.attempt, r.lease_epoch, r.worker_id,
       NULL, NULL
  FROM durastep.runs r
 WHERE r.attempt_claimed_at IS NOT NULL AND r.attempt_claim_id IS NOT DISTINCT FROM r.claim_id
   AND (r.state = 'running'
        OR (r.state = 'completed'
            AND NOT EXISTS (SELECT 1 FROM durastep.run_history c WHERE c.run_id = r.id AND c.state = 'completed')))
UNION ALL
SELECT r.id, NULL::bigint, 1, r.finished_at, 'completed', r.attempt, r.lease_epoch, NULL::uuid, NULL, NULL
  FROM durastep.runs r
 WHERE r.state = 'completed'
   AND NOT EXISTS (SELECT 1 FROM durastep.run_history c WHERE c.run_id = r.id AND c.state = 'completed');

-- The counts' writers, readers and pruners are the history's: a role that
-- inserts into `run_history` may add to the counts (INSERT and UPDATE: an
-- upsert), one that reads or deletes from it may read or delete them
-- (docs/security.md), until the owner runs the grants of this version.
DO $grants$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS grantee,
               string_agg(DISTINCT CASE a.privilege_type WHEN 'INSERT' THEN 'INSERT, UPDATE'
                                                         ELSE a.privilege_type END, ', ') AS privileges
          FROM pg_class c
         CROSS JOIN LATERAL aclexplode(c.relacl) a
          LEFT JOIN pg_roles r ON r.oid = a.grantee
         WHERE c.oid = 'durastep.run_history'::regclass AND a.grantee <> c.relowner
           AND a.privilege_type IN ('SELECT', 'INSERT', 'DELETE')
         GROUP BY 1
    LOOP
        EXECUTE format('GRANT %s ON durastep.completions_per_minute TO %s', g.privileges, g.grantee);
    END LOOP;
END
$grants$;
