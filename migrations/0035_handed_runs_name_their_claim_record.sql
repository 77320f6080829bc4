-- The runs a send hands to a worker of its own process name their claim
-- record (issue 12; docs/architecture.md "Running runs found by their
-- claims"). Migration 0034 gave the two handing sends a claim record of the
-- runs they hand on, but not its id: the worker could not count their
-- attempts down, so each record stayed until its first lease had passed
-- and the reaper deleted it, and every reader of the running runs walked
-- it meanwhile (under a trickle of handed sends, about a lease's worth of
-- sends: `cancel_on` reads every record's pairs). The two functions below
-- are 0034's with the record's id in one more column of their answer,
-- `claim` (NULL when nothing was handed on); the worker deletes the record
-- once the handed attempts have stored their ends, as it does a claim's.
--
-- New names, not the old functions redefined: a function's result type
-- cannot change under a statement a session has prepared (Postgres fails
-- every later execution of it with "cached plan must not change result
-- type"), and processes of an earlier version keep theirs prepared. So
-- `send_event_handing` and `send_event_handing_by_claim` stay as 0034
-- left them, for those processes, and a role that may execute them may
-- execute the new pair (their EXECUTE grants are copied below; PUBLIC
-- keeps or loses it on the new pair as on the old).

-- The send that hands its run to a worker of its own process: 0034's
-- `send_event_handing`, with the id of the claim record of the runs it
-- hands on.
CREATE FUNCTION durastep.send_event_to_worker(
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
            RETURNING id, function_id, version, event_id, attempt, lease_epoch, priority, run_at, state,
                      lease_expires_at),
        -- The history rows of the runs handed on (a claim's).
        h AS (
            INSERT INTO durastep.run_history (run_id, at, state, attempt, lease_epoch, worker_id)
            SELECT r.id, (SELECT now FROM t), 'running', r.attempt, r.lease_epoch, p_worker
              FROM r WHERE r.state = 'running'),
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
               (SELECT durastep.wake_workers(ARRAY(SELECT r.function_id FROM r WHERE r.state = 'queued'))) IS NULL,
               c.id, c.function_id, c.version, c.event_id, c.attempt, c.lease_epoch,
               p_payload::jsonb, NULL::uuid, NULL::text, (SELECT now FROM t), c.priority, c.run_at,
               '{}'::text[], '{}'::jsonb[], '{}'::int[], '{}'::text[], '{}'::text[], 0::bigint,
               (SELECT k.id FROM k)
          FROM (SELECT) AS one LEFT JOIN (SELECT * FROM r WHERE r.state = 'running') c ON true;
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM durastep.send_event_to_worker_by_claim(
        p_id, p_name, p_payload, p_idem, p_priority, p_worker, p_lease_s, p_version_ids, p_versions, p_slots);
END
$fn$;

-- The send that hands its run on by a claim: 0034's
-- `send_event_handing_by_claim`, with the id of the claim record of the
-- runs it claims.
CREATE FUNCTION durastep.send_event_to_worker_by_claim(
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
    s record;
BEGIN
    SELECT * INTO STRICT s
      FROM durastep.send_events(ARRAY[p_id], ARRAY[p_name], ARRAY[p_payload], ARRAY[p_idem],
                                ARRAY[NULL::timestamptz], ARRAY[p_priority]);
    RETURN QUERY
    WITH t AS MATERIALIZED (SELECT durastep.now() AS now),
    -- The id of this claim's record, drawn first: the runs carry it.
    kid AS MATERIALIZED (SELECT nextval('durastep.run_claims_id_seq') AS id),
    -- The runs handed on, under a new lease epoch (1 to 2^31 above the last).
    claimed AS (
        UPDATE durastep.runs r
           SET state = 'running', lease_epoch = r.lease_epoch + 1 + floor(random() * 2147483648)::bigint,
               lease_expires_at = (SELECT now FROM t) + make_interval(secs => p_lease_s),
               worker_id = p_worker, started_at = (SELECT now FROM t), history_noted = NOT r.history_noted,
               claim_id = (SELECT kid.id FROM kid)
         WHERE r.id = ANY (ARRAY(
                SELECT c.id FROM durastep.runs c
                 WHERE s.inserted AND c.id = ANY (s.run_ids) AND c.state = 'queued'
                   AND c.run_at <= (SELECT now FROM t)
                   AND (c.function_id, c.version) IN (SELECT v.* FROM unnest(p_version_ids, p_versions) AS v)
                   AND NOT EXISTS (SELECT 1 FROM durastep.function_flow ff WHERE ff.function_id = c.function_id)
                   AND (c.deadline_at IS NULL OR c.deadline_at >= (SELECT now FROM t))
                   AND (c.start_by IS NULL OR c.start_by >= (SELECT now FROM t))
                   -- Nothing else is due (the new runs are the queue's head):
                   -- the earliest other entry of `runs_next_due` is later.
                   -- Written as ORDER BY ... LIMIT 1 so that the generic plan
                   -- reads the index's first entries; as a NOT EXISTS with
                   -- `run_at <= now` it expected a third of the table to match
                   -- and scanned all of it (6 ms with 50,000 sleeping runs).
                   AND coalesce((SELECT d.run_at FROM durastep.runs d
                                  WHERE d.state IN ('queued', 'sleeping', 'waiting') AND d.id <> ALL (s.run_ids)
                                  ORDER BY d.run_at LIMIT 1) > (SELECT now FROM t), true)
                 ORDER BY c.id
                 LIMIT greatest(p_slots, 0)
                 FOR UPDATE OF c SKIP LOCKED))
        RETURNING r.id, r.function_id, r.version, r.event_id, r.attempt, r.lease_epoch, r.priority, r.run_at,
                  r.lease_expires_at),
    -- Their history rows.
    h AS (
        INSERT INTO durastep.run_history (run_id, at, state, attempt, lease_epoch, worker_id)
        SELECT c.id, (SELECT now FROM t), 'running', c.attempt, c.lease_epoch, p_worker FROM claimed c),
    -- Their claim record (0034), for the reaper.
    k AS (
        INSERT INTO durastep.run_claims (id, recheck_at, run_ids, epochs)
        SELECT (SELECT kid.id FROM kid), min(c.lease_expires_at), array_agg(c.id), array_agg(c.lease_epoch)
          FROM claimed c HAVING count(*) > 0
        RETURNING id)
    -- The send's answer, with one row per run handed on (a new run has no
    -- steps and no journal); one row with a null `id` when none was;
    -- `claim` the record of the runs handed on.
    SELECT s.id, s.inserted, s.run_ids, s._n,
           c.id, c.function_id, c.version, c.event_id, c.attempt, c.lease_epoch,
           p_payload::jsonb, NULL::uuid, NULL::text, (SELECT now FROM t), c.priority, c.run_at,
           '{}'::text[], '{}'::jsonb[], '{}'::int[], '{}'::text[], '{}'::text[], 0::bigint,
           (SELECT k.id FROM k)
      FROM (SELECT) AS one LEFT JOIN claimed c ON true;
END
$fn$;

-- The new pair's EXECUTE grants: those of the old pair, function by function.
-- Taken away from PUBLIC first (a new function is PUBLIC's by default), then
-- given to every grantee of the old one, PUBLIC included.
DO $grants$
DECLARE
    g record;
    sig constant text := '(uuid, text, text, text, integer, uuid, double precision, text[], integer[], integer)';
BEGIN
    EXECUTE format('REVOKE EXECUTE ON FUNCTION durastep.send_event_to_worker%s, '
                   'durastep.send_event_to_worker_by_claim%s FROM PUBLIC', sig, sig);
    FOR g IN
        SELECT replace(p.proname::text, 'send_event_handing', 'send_event_to_worker') AS fn,
               CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS grantee
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         CROSS JOIN LATERAL aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
          LEFT JOIN pg_roles r ON r.oid = a.grantee
         WHERE n.nspname = 'durastep' AND p.proname IN ('send_event_handing', 'send_event_handing_by_claim')
           AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION durastep.%I%s TO %s', g.fn, sig, g.grantee);
    END LOOP;
END
$grants$;
