-- The send that hands its run to an idle worker in two statements instead of
-- four (issue 12; docs/performance.md "The handing send in two statements").
--
-- `send_event_to_worker` (0024, last replaced by 0044) is the send of the
-- wake-up in the same process, and of every send through another process's
-- offer (`send_events_offered`, 0036, calls it). It ran four statements
-- before its answer: the topic row's lock (an aggregate over a locking
-- subquery), the guard (its own statement, so that its check for waits ran
-- in a snapshot taken after the lock), the inserts, and inside them a call
-- of `wake_workers`, whose aggregate ran even when every new run was handed
-- on and nothing was queued. Each statement pays executor start-up, which is
-- about two fifths of the send's server work (docs/performance.md "Counted
-- instructions").
--
-- Now the lock and the parts of the guard that only read the registry
-- (send-time options, flow keys, `cancel_on`) are one statement: the
-- registry is not written under the topic row's lock, so reading it before
-- or after the lock is the same. The parts that need the snapshot after the
-- lock (no wait for the event, no run due before the new one) move into the
-- statement that inserts, whose snapshot is taken after the lock as the
-- guard's was: if either fails, that statement writes nothing and answers
-- nothing, and the send goes on by the full path
-- (`send_event_to_worker_by_claim`) as before. `wake_workers` is called only
-- when a new run was queued. What the send writes, answers and notifies is
-- unchanged.
--
-- `send_events` (the send of runs for the queue) has the same shape, but
-- the same change made it dearer, counted (its lock is an aggregate over
-- several names, and the gate is one more node): it stays as 0027 left it.

CREATE OR REPLACE FUNCTION durastep.send_event_to_worker(
    p_id uuid, p_name text, p_payload text, p_idem text, p_priority int,
    p_worker uuid, p_lease_s double precision, p_version_ids text[], p_versions int[], p_slots int)
    RETURNS TABLE (sent_id uuid, sent_inserted boolean, sent_run_ids uuid[], sent_n boolean,
                   id uuid, function_id text, version int, event_id uuid, attempt int, lease_epoch bigint,
                   payload jsonb, parent_run_id uuid, parent_step_key text, db_now timestamptz,
                   priority int, run_at timestamptz, step_keys text[], step_outputs jsonb[],
                   journal_positions int[], journal_kinds text[], journal_keys text[], moved bigint,
                   claim bigint)
    LANGUAGE plpgsql VOLATILE
    SET jit = off
    SET plan_cache_mode = force_generic_plan
    AS $fn$
#variable_conflict use_column
DECLARE
    plain boolean;
BEGIN
    -- The topic row FOR SHARE, as send_events takes it (a missing row is
    -- left to send_events_full, through the function below, which creates
    -- it), and whether the event needs none of the fan-out's rarer work: no
    -- function of this event has send-time options or flow keys, and no
    -- function cancels on this name. Registration does not take the topic
    -- row, so these need no snapshot after the lock.
    SELECT p_slots > 0
           AND NOT EXISTS (
               SELECT 1 FROM durastep.functions f JOIN durastep.function_options o ON o.function_id = f.id
                WHERE f.triggers @> ARRAY[p_name]
                  AND (o.debounce_s IS NOT NULL OR o.singleton_mode IS NOT NULL OR o.priority_path IS NOT NULL))
           AND NOT EXISTS (
               SELECT 1 FROM durastep.functions f JOIN durastep.function_flow ff ON ff.function_id = f.id
                WHERE f.triggers @> ARRAY[p_name])
           AND NOT EXISTS (
               SELECT 1 FROM durastep.functions f, jsonb_array_elements(f.cancel_on) c
                WHERE f.cancel_on <> '[]' AND c->>'event' = p_name)
      INTO plain
      FROM durastep.topics t WHERE t.name = p_name FOR SHARE OF t;
    IF plain THEN
        RETURN QUERY
        -- The clock, and the rest of the guard, in this statement's snapshot
        -- (taken after the lock): no wait for the event exists, and no run
        -- is due (the first entry of `runs_next_due` is later; an ORDER BY
        -- ... LIMIT 1 probe, as 0024 reads it). Else nothing is written
        -- and the answer is empty.
        WITH t AS MATERIALIZED (
            SELECT durastep.now() AS now,
                   NOT EXISTS (SELECT 1 FROM durastep.waits w WHERE w.event_name = p_name)
                   AND coalesce((SELECT d.run_at FROM durastep.runs d
                                  WHERE d.state IN ('queued', 'sleeping', 'waiting')
                                  ORDER BY d.run_at LIMIT 1) > durastep.now(), true) AS ok),
        -- The event; a stored (name, idempotency key) inserts nothing.
        ev AS (
            INSERT INTO durastep.events (id, name, payload, idempotency_key)
            SELECT p_id, p_name, p_payload::jsonb, p_idem FROM t WHERE t.ok
            ON CONFLICT DO NOTHING
            RETURNING id),
        -- One run per function the new event triggers, and whether the worker runs it.
        nr AS MATERIALIZED (
            SELECT durastep.uuid7() AS id, f.id AS function_id, f.version, f.max_attempts,
                   f.start_timeout_secs, f.finish_timeout_secs,
                   (f.id, f.version) IN (SELECT v.* FROM unnest(p_version_ids, p_versions) AS v) AS handled
              FROM ev JOIN durastep.functions f ON f.triggers @> ARRAY[p_name]),
        -- Up to p_slots of those the worker runs are handed on (in id order, as 0024 chose them).
        pick AS (
            SELECT nr.*, nr.handled AND row_number() OVER (PARTITION BY nr.handled ORDER BY nr.id) <= p_slots AS hand
              FROM nr),
        r AS (
            INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, priority,
                                       start_by, deadline_at, version,
                                       lease_epoch, lease_expires_at, worker_id, started_at,
                                       attempt_claimed_at)
            SELECT k.id, k.function_id, p_id, CASE WHEN k.hand THEN 'running' ELSE 'queued' END, t.now,
                   k.max_attempts, p_priority,
                   t.now + make_interval(secs => k.start_timeout_secs),
                   t.now + make_interval(secs => k.finish_timeout_secs), k.version,
                   CASE WHEN k.hand THEN 1 + floor(random() * 2147483648)::bigint ELSE 0 END,
                   CASE WHEN k.hand THEN t.now + make_interval(secs => p_lease_s) END,
                   CASE WHEN k.hand THEN p_worker END,
                   CASE WHEN k.hand THEN t.now END,
                   -- The attempt's start, for its history row (0044).
                   CASE WHEN k.hand THEN t.now END
              FROM pick k, t
            RETURNING id, function_id, version, event_id, attempt, lease_epoch, priority, run_at, state,
                      lease_expires_at),
        -- The claim record of the runs handed on (0034), for the reaper.
        k AS (
            INSERT INTO durastep.run_claims (recheck_at, run_ids, epochs)
            SELECT min(r.lease_expires_at), array_agg(r.id), array_agg(r.lease_epoch)
              FROM r WHERE r.state = 'running' HAVING count(*) > 0
            RETURNING id)
        -- The send's answer, as 0024 gives it: one row per run handed on
        -- (a new run has no steps and no journal), one row with a null `id`
        -- when none was; `sent_n` is false when the workers were notified;
        -- `claim` the record of the runs handed on.
        SELECT p_id, EXISTS (SELECT 1 FROM ev), ARRAY(SELECT r.id FROM r ORDER BY 1),
               CASE WHEN EXISTS (SELECT 1 FROM r WHERE r.state = 'queued')
                    THEN durastep.wake_workers(ARRAY(SELECT r.function_id FROM r WHERE r.state = 'queued')) END IS NULL,
               c.id, c.function_id, c.version, c.event_id, c.attempt, c.lease_epoch,
               p_payload::jsonb, NULL::uuid, NULL::text, (SELECT now FROM t), c.priority, c.run_at,
               '{}'::text[], '{}'::jsonb[], '{}'::int[], '{}'::text[], '{}'::text[], 0::bigint,
               (SELECT k.id FROM k)
          FROM t LEFT JOIN (SELECT * FROM r WHERE r.state = 'running') c ON true
         WHERE t.ok;
        IF FOUND THEN
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM durastep.send_event_to_worker_by_claim(
        p_id, p_name, p_payload, p_idem, p_priority, p_worker, p_lease_s, p_version_ids, p_versions, p_slots);
END
$fn$;
