-- A lean branch for sends that need none of the fan-out's rarer work. The
-- statement of `send_events` (0014, 0021) spends most of its time in CTEs for
-- debounce, singletons, `cancel_on` and waits that find nothing for a plain
-- event (pgbench, one event per rolled-back transaction: 0.92-1.39 ms against
-- 0.46 ms for its two inserts and the NOTIFY; docs/performance.md). That
-- function is kept, renamed `send_events_full`; `send_events` takes the topic
-- locks itself and then, in fresh statements, checks that none of the
-- events' functions has send-time options (debounce, singleton, priority from
-- the data) or flow keys, that no function cancels on one of the names, and
-- that no wait for one of the names exists. When all hold it inserts the
-- events and runs in one lean statement; otherwise it calls
-- `send_events_full`, which locks the same topic rows again (already held:
-- nothing waits) and does everything as before.
--
-- Why no wake-up is lost: the waits check runs after the topic rows are
-- locked FOR SHARE, in a statement with a fresh snapshot (the function is
-- VOLATILE, READ COMMITTED), exactly like the full statement's look at the
-- waits: a wait committed before the locks is seen (and the full path taken),
-- and a wait not yet committed must first update its topic row, which waits
-- for this transaction. Options, flow rules and `cancel_on` change only when
-- functions are registered.
--
-- The full fan-out keeps its text (0021) and its settings (jit, 0022's plan)
-- under a new name.
ALTER FUNCTION durastep.send_events(uuid[], text[], text[], text[], timestamptz[], integer[])
    RENAME TO send_events_full;

CREATE FUNCTION durastep.send_events(
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
             RETURNING id, event_id, run_at)
         SELECT i.ord, i.id, (ev.id IS NOT NULL) AS inserted,
                ARRAY(SELECT r.id FROM r WHERE r.event_id = i.id ORDER BY 1) AS run_ids,
                (SELECT pg_notify('durastep_wakeup', '')
                  WHERE EXISTS (SELECT 1 FROM r WHERE r.run_at <= durastep.now())) IS NULL AS _n,
                0::bigint AS _touched
           FROM input i LEFT JOIN ev ON ev.id = i.id
          ORDER BY i.ord;
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM durastep.send_events_full(p_ids, p_names, p_payloads, p_idems, p_starts, p_priorities);
END
$fn$;
