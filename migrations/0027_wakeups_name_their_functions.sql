-- A wake-up names the functions it is for. The lean send (0023) notified
-- `durastep_wakeup` with an empty payload, so every worker that LISTENs
-- claimed at each send, whatever functions it runs; and a worker with
-- functions of both claim classes (fast claim, and the full claim of
-- flow-limited functions or those with timeouts) ended the hold of both at
-- each wake-up, so the full claim's statement ran beside the fast one's
-- at every send of a plain function (docs/performance.md "Wake-ups that
-- name their functions").
--
-- Now its payload is the ids of the functions whose new runs are due now,
-- separated by a space (a function id holds ASCII letters, digits, `-_.:`
-- and `/`, never a space), each once. A worker claims only for a class it
-- runs one of those functions in, and not at all for a wake-up that names
-- none of its functions. A list longer than 7,000 bytes (Postgres refuses a
-- payload of 8,000) goes as an empty payload, which, like every other
-- notification on the channel (the full fan-out, the handing send, waits,
-- wakes of parked runs), still wakes every class of every worker.
--
-- Nothing else about the send changes: the function below is 0023's text
-- with the NOTIFY's payload, and `r` returning the run's function.
CREATE OR REPLACE FUNCTION durastep.send_events(
    p_ids uuid[], p_names text[], p_payloads text[], p_idems text[], p_starts timestamptz[], p_priorities int[])
    RETURNS TABLE (ord bigint, id uuid, inserted boolean, run_ids uuid[], _n boolean, _touched bigint)
    LANGUAGE plpgsql VOLATILE
    SET jit = off
    SET plan_cache_mode = force_generic_plan
    AS $fn$
#variable_conflict use_column
DECLARE
    v_names text[] := ARRAY(SELECT DISTINCT n FROM unnest(p_names) AS n ORDER BY n);
    locked integer;
BEGIN
    -- The rendezvous rows of these names, FOR SHARE, as send_events_full
    -- takes them; a missing row is left to it (it creates them).
    SELECT count(*) INTO locked
      FROM (SELECT t.name FROM durastep.topics t WHERE t.name = ANY (v_names) ORDER BY t.name FOR SHARE) l;
    IF locked = cardinality(v_names)
       -- No function of these events has send-time options or flow keys,
       AND NOT EXISTS (
           SELECT 1 FROM durastep.functions f JOIN durastep.function_options o ON o.function_id = f.id
            WHERE f.triggers && v_names
              AND (o.debounce_s IS NOT NULL OR o.singleton_mode IS NOT NULL OR o.priority_path IS NOT NULL))
       AND NOT EXISTS (
           SELECT 1 FROM durastep.functions f JOIN durastep.function_flow ff ON ff.function_id = f.id
            WHERE f.triggers && v_names)
       -- no function cancels on one of the names,
       AND NOT EXISTS (
           SELECT 1 FROM durastep.functions f, jsonb_array_elements(f.cancel_on) c
            WHERE f.cancel_on <> '[]' AND c->>'event' = ANY (v_names))
       -- and no wait for one of them exists (a fresh snapshot, after the locks).
       AND NOT EXISTS (SELECT 1 FROM durastep.waits w WHERE w.event_name = ANY (v_names))
    THEN
        RETURN QUERY
        WITH input AS (
             SELECT * FROM unnest(p_ids, p_names, p_payloads, p_idems, p_starts, p_priorities)
                 WITH ORDINALITY AS t(id, name, payload, idem, start_at, priority, ord)),
         -- The events; one whose (name, idempotency key) is stored is not inserted.
         ev AS (
             INSERT INTO durastep.events (id, name, payload, idempotency_key)
             SELECT id, name, payload::jsonb, idem FROM input ORDER BY name, idem, ord
             ON CONFLICT DO NOTHING
             RETURNING id),
         -- One run per function each new event triggers.
         r AS (
             INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, priority,
                                        start_by, deadline_at, version)
             SELECT durastep.uuid7(), f.id, i.id, 'queued', s.start_at, f.max_attempts, i.priority,
                    s.start_at + make_interval(secs => f.start_timeout_secs),
                    s.start_at + make_interval(secs => f.finish_timeout_secs), f.version
               FROM input i JOIN ev ON ev.id = i.id
               CROSS JOIN LATERAL (SELECT coalesce(i.start_at, durastep.now()) AS start_at) s
               JOIN durastep.functions f ON f.triggers @> ARRAY[i.name]
             RETURNING id, event_id, run_at, function_id)
         SELECT i.ord, i.id, (ev.id IS NOT NULL) AS inserted,
                ARRAY(SELECT r.id FROM r WHERE r.event_id = i.id ORDER BY 1) AS run_ids,
                -- The wake-up names the functions of the runs due now
                -- (ids hold no space); a list past 7,000 bytes goes as ''.
                (SELECT pg_notify('durastep_wakeup', CASE WHEN octet_length(w.f) <= 7000 THEN w.f ELSE '' END)
                   FROM (SELECT string_agg(DISTINCT r.function_id, ' ') AS f FROM r WHERE r.run_at <= durastep.now()) w
                  WHERE w.f IS NOT NULL) IS NULL AS _n,
                0::bigint AS _touched
           FROM input i LEFT JOIN ev ON ev.id = i.id
          ORDER BY i.ord;
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM durastep.send_events_full(p_ids, p_names, p_payloads, p_idems, p_starts, p_priorities);
END
$fn$;
