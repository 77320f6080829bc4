-- A handing send inserts the run it hands on already claimed. Until now
-- (0024) `send_event_handing` inserted the new run `queued` (with its
-- entries in `runs_due`, `runs_next_due` and `runs_start_by`) and then, in
-- the same transaction, claimed it by an UPDATE: a second row version with
-- an entry in every index of `runs`, and the statement triggers' transition
-- tables, for a row no other transaction ever saw queued.
--
-- Now, when the send needs none of the fan-out's rarer work (the checks of
-- `send_events`' lean branch, 0023) and no run is due (the head of
-- `runs_next_due`, as 0024 checks it, now read before the insert), one
-- statement inserts the event and its runs, the runs the worker takes
-- already `running` under their lease, with the fast claim's writes
-- (claim_fast.sql): a lease epoch 1 to 2^31 above 0, the lease, the worker,
-- the start time, the history row. The others are inserted `queued` and the
-- workers notified, as before; when every new run was handed on, no NOTIFY
-- goes out (nothing is queued for another worker).
--
-- The conditions are those of 0024, in the same order of statements: the
-- topic row is locked FOR SHARE first, so the look at the waits and at the
-- queue's head has a fresh snapshot taken after the lock (the function is
-- VOLATILE, READ COMMITTED). A run is handed on only when its (function,
-- version) is one the worker runs, its function has no flow rule (the lean
-- branch requires that for all of the event's functions), and it is due now
-- (a one-event send without a start time). A new run is inside its deadlines
-- (start and finish timeouts are not negative), so no deadline check is
-- needed. Any other case goes through 0024's function, unchanged, renamed
-- `send_event_handing_by_claim`.
ALTER FUNCTION durastep.send_event_handing(uuid, text, text, text, integer, uuid, double precision, text[], integer[], integer)
    RENAME TO send_event_handing_by_claim;

CREATE FUNCTION durastep.send_event_handing(
    p_id uuid, p_name text, p_payload text, p_idem text, p_priority int,
    p_worker uuid, p_lease_s double precision, p_version_ids text[], p_versions int[], p_slots int)
    RETURNS TABLE (sent_id uuid, sent_inserted boolean, sent_run_ids uuid[], sent_n boolean,
                   id uuid, function_id text, version int, event_id uuid, attempt int, lease_epoch bigint,
                   payload jsonb, parent_run_id uuid, parent_step_key text, db_now timestamptz,
                   priority int, run_at timestamptz, step_keys text[], step_outputs jsonb[],
                   journal_positions int[], journal_kinds text[], journal_keys text[], moved bigint)
    LANGUAGE plpgsql VOLATILE
    SET jit = off
    SET plan_cache_mode = force_generic_plan
    AS $fn$
#variable_conflict use_column
DECLARE
    locked integer;
BEGIN
    -- The topic row FOR SHARE, as send_events takes it; a missing row is
    -- left to send_events_full (through the function below), which creates it.
    SELECT count(*) INTO locked
      FROM (SELECT t.name FROM durastep.topics t WHERE t.name = p_name FOR SHARE) l;
    IF p_slots > 0 AND locked = 1
       -- No function of this event has send-time options or flow keys,
       AND NOT EXISTS (
           SELECT 1 FROM durastep.functions f JOIN durastep.function_options o ON o.function_id = f.id
            WHERE f.triggers @> ARRAY[p_name]
              AND (o.debounce_s IS NOT NULL OR o.singleton_mode IS NOT NULL OR o.priority_path IS NOT NULL))
       AND NOT EXISTS (
           SELECT 1 FROM durastep.functions f JOIN durastep.function_flow ff ON ff.function_id = f.id
            WHERE f.triggers @> ARRAY[p_name])
       -- no function cancels on this name,
       AND NOT EXISTS (
           SELECT 1 FROM durastep.functions f, jsonb_array_elements(f.cancel_on) c
            WHERE f.cancel_on <> '[]' AND c->>'event' = p_name)
       -- no wait for it exists (a fresh snapshot, after the lock),
       AND NOT EXISTS (SELECT 1 FROM durastep.waits w WHERE w.event_name = p_name)
       -- and no run is due: the first entry of `runs_next_due` is later
       -- (an ORDER BY ... LIMIT 1 probe, as 0024 reads it).
       AND coalesce((SELECT d.run_at FROM durastep.runs d
                      WHERE d.state IN ('queued', 'sleeping', 'waiting')
                      ORDER BY d.run_at LIMIT 1) > durastep.now(), true)
    THEN
        RETURN QUERY
        WITH t AS MATERIALIZED (SELECT durastep.now() AS now),
        -- The event; a stored (name, idempotency key) inserts nothing.
        ev AS (
            INSERT INTO durastep.events (id, name, payload, idempotency_key)
            VALUES (p_id, p_name, p_payload::jsonb, p_idem)
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
                                       lease_epoch, lease_expires_at, worker_id, started_at)
            SELECT k.id, k.function_id, p_id, CASE WHEN k.hand THEN 'running' ELSE 'queued' END, t.now,
                   k.max_attempts, p_priority,
                   t.now + make_interval(secs => k.start_timeout_secs),
                   t.now + make_interval(secs => k.finish_timeout_secs), k.version,
                   CASE WHEN k.hand THEN 1 + floor(random() * 2147483648)::bigint ELSE 0 END,
                   CASE WHEN k.hand THEN t.now + make_interval(secs => p_lease_s) END,
                   CASE WHEN k.hand THEN p_worker END,
                   CASE WHEN k.hand THEN t.now END
              FROM pick k, t
            RETURNING id, function_id, version, event_id, attempt, lease_epoch, priority, run_at, state),
        -- The history rows of the runs handed on (a claim's).
        h AS (
            INSERT INTO durastep.run_history (run_id, at, state, attempt, lease_epoch, worker_id)
            SELECT r.id, (SELECT now FROM t), 'running', r.attempt, r.lease_epoch, p_worker
              FROM r WHERE r.state = 'running')
        -- The send's answer, as 0024 gives it: one row per run handed on
        -- (a new run has no steps and no journal), one row with a null `id`
        -- when none was; `sent_n` is false when the workers were notified.
        SELECT p_id, EXISTS (SELECT 1 FROM ev), ARRAY(SELECT r.id FROM r ORDER BY 1),
               (SELECT pg_notify('durastep_wakeup', '') WHERE EXISTS (SELECT 1 FROM r WHERE r.state = 'queued')) IS NULL,
               c.id, c.function_id, c.version, c.event_id, c.attempt, c.lease_epoch,
               p_payload::jsonb, NULL::uuid, NULL::text, (SELECT now FROM t), c.priority, c.run_at,
               '{}'::text[], '{}'::jsonb[], '{}'::int[], '{}'::text[], '{}'::text[], 0::bigint
          FROM (SELECT) AS one LEFT JOIN (SELECT * FROM r WHERE r.state = 'running') c ON true;
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM durastep.send_event_handing_by_claim(
        p_id, p_name, p_payload, p_idem, p_priority, p_worker, p_lease_s, p_version_ids, p_versions, p_slots);
END
$fn$;
