-- The generated columns of migration 0032 undone (issue 12;
-- docs/performance.md "Counted instructions"). 0032 moved seven indexes of
-- `runs` off `state` onto six stored generated columns, the first step of
-- claims and completions as HOT updates. The step that would have made
-- them HOT (the due queue out of `state`) was built and not kept, so the
-- columns bought nothing on the hot path, and they cost every statement
-- that writes a run: Postgres 15 parses and plans each generated column's
-- expression again in every such statement and computes it for every row.
-- Counted under callgrind (`benches/sql/instructions.sh`, before and
-- after this migration): a one-event send does 16-18% fewer server
-- instructions, a claim of 32 runs 6.5% and their completion 11% fewer.
--
-- The columns are dropped (no rewrite: Postgres marks them dropped; their
-- indexes go with them) and the seven indexes are made again as migration
-- 0031 left them, on predicates over `state`. `runs_parked` keeps 0032's
-- predicate (no `state`: every reader tests `state = 'queued'`). The full
-- fan-out's debounce and singleton arbiters and its walk of a singleton
-- key's active runs name the predicates again, as before 0032; the
-- statements of the store that read the columns read `state` again.
ALTER TABLE durastep.runs
    DROP COLUMN singleton_active_key,
    DROP COLUMN debounce_open_key,
    DROP COLUMN deadline_open_at,
    DROP COLUMN start_by_open_at,
    DROP COLUMN listed_state,
    DROP COLUMN attempt_stopping;

-- Their indexes, as 0031 left them.
CREATE UNIQUE INDEX runs_singleton ON durastep.runs (function_id, singleton_key)
    WHERE state IN ('queued', 'running', 'sleeping', 'waiting') AND singleton_key IS NOT NULL;
CREATE UNIQUE INDEX runs_debounce ON durastep.runs (function_id, debounce_key)
    WHERE state = 'queued' AND started_at IS NULL AND debounce_key IS NOT NULL;
CREATE INDEX runs_deadline ON durastep.runs (deadline_at)
    WHERE deadline_at IS NOT NULL AND state IN ('queued', 'running', 'sleeping', 'waiting');
CREATE INDEX runs_start_by ON durastep.runs (start_by)
    WHERE start_by IS NOT NULL AND started_at IS NULL AND state = 'queued';
CREATE INDEX runs_listed_by_state ON durastep.runs (state, id DESC)
    WHERE state IN ('sleeping', 'waiting', 'failed', 'cancelled', 'skipped', 'diverged');
CREATE INDEX runs_diverged ON durastep.runs (function_id) WHERE state = 'diverged';
CREATE INDEX runs_attempt_stopping ON durastep.runs (id)
    WHERE state IN ('cancelled', 'queued') AND worker_id IS NOT NULL;

-- The full fan-out: 0034's text, its debounce and singleton arbiters and
-- the walk of the active runs of a `cancel_old` singleton key as before 0032.
CREATE OR REPLACE FUNCTION durastep.send_events_full(
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
    -- The rendezvous rows of these names, FOR SHARE: no wait for one of them
    -- can be recorded until this transaction ends. Usually every row exists
    -- (one statement); missing ones are created (this transaction then owns
    -- them, or waited for the concurrent sender that created them) and a
    -- fresh statement locks them too. Three rounds always suffice.
    FOR round IN 0..2 LOOP
        IF round > 0 THEN
            INSERT INTO durastep.topics (name) SELECT unnest(v_names) ORDER BY 1 ON CONFLICT DO NOTHING;
        END IF;
        SELECT count(*) INTO locked
          FROM (SELECT t.name FROM durastep.topics t WHERE t.name = ANY (v_names) ORDER BY t.name FOR SHARE) l;
        EXIT WHEN locked = cardinality(v_names);
    END LOOP;
    IF locked <> cardinality(v_names) THEN
        -- Only if topic rows were deleted meanwhile: refuse rather than risk a lost wake-up.
        RAISE EXCEPTION 'durastep.topics rows for the sent event names could not be locked';
    END IF;
    -- A new statement, so a new snapshot: it sees every wait recorded before the locks.
    RETURN QUERY
    WITH input AS (
         SELECT * FROM unnest(p_ids, p_names, p_payloads, p_idems, p_starts, p_priorities)
             WITH ORDINALITY AS t(id, name, payload, idem, start_at, priority, ord)),
     ev AS (
         INSERT INTO durastep.events (id, name, payload, idempotency_key)
         SELECT id, name, payload::jsonb, idem FROM input ORDER BY name, idem, ord
         ON CONFLICT DO NOTHING
         RETURNING id),
     fan AS MATERIALIZED (
         SELECT i.id AS event_id, i.ord, f.id AS function_id, f.max_attempts, f.version,
                i.payload::jsonb AS payload,
                coalesce(i.start_at, durastep.now()) AS start_at,
                CASE WHEN o.priority_path IS NULL THEN i.priority
                     ELSE durastep.flow_priority_clamped(i.payload::jsonb, o.priority_path, i.priority,
                                                         o.priority_min, o.priority_max) END AS priority,
                o.debounce_s, o.debounce_max_s, o.singleton_mode,
                f.start_timeout_secs, f.finish_timeout_secs,
                CASE WHEN o.debounce_s IS NOT NULL THEN durastep.flow_key(
                    i.payload::jsonb, o.debounce_path, true, f.id, o.debounce_pointer) END AS dkey,
                CASE WHEN o.singleton_mode IS NOT NULL THEN durastep.flow_key(
                    i.payload::jsonb, o.singleton_path, true, f.id, o.singleton_pointer) END AS skey
           FROM input i JOIN ev ON ev.id = i.id
           JOIN durastep.functions f ON f.triggers @> ARRAY[i.name]
           LEFT JOIN durastep.function_options o ON o.function_id = f.id),
     keys AS (
         INSERT INTO durastep.flow_keys (rule, key)
         SELECT DISTINCT ff.rule, durastep.flow_key(x.payload, ff.key_path, true, x.function_id, ff.key_pointer)
           FROM fan x JOIN durastep.function_flow ff ON ff.function_id = x.function_id
          ORDER BY 1, 2
         ON CONFLICT DO NOTHING),
     r AS (
         INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, priority,
                                    start_by, deadline_at, version)
         SELECT durastep.uuid7(), x.function_id, x.event_id, 'queued', x.start_at, x.max_attempts, x.priority,
                x.start_at + make_interval(secs => x.start_timeout_secs),
                x.start_at + make_interval(secs => x.finish_timeout_secs), x.version
           FROM fan x WHERE x.debounce_s IS NULL AND x.singleton_mode IS NULL
         RETURNING id, event_id, run_at, function_id),
     dr AS (
         INSERT INTO durastep.runs AS old (id, function_id, event_id, state, run_at, max_attempts, priority,
                                           debounce_key, debounce_deadline, start_by, deadline_at, version)
         SELECT DISTINCT ON (x.function_id, x.dkey) durastep.uuid7(), x.function_id, x.event_id, 'queued',
                x.start_at + make_interval(secs => x.debounce_s), x.max_attempts, x.priority, x.dkey,
                x.start_at + make_interval(secs => x.debounce_max_s),
                x.start_at + make_interval(secs => x.debounce_s + x.start_timeout_secs),
                x.start_at + make_interval(secs => x.debounce_s + x.finish_timeout_secs), x.version
           FROM fan x WHERE x.debounce_s IS NOT NULL
          ORDER BY x.function_id, x.dkey, x.ord DESC
         ON CONFLICT (function_id, debounce_key)
            WHERE state = 'queued' AND started_at IS NULL AND debounce_key IS NOT NULL
         DO UPDATE SET event_id = EXCLUDED.event_id, priority = EXCLUDED.priority, version = EXCLUDED.version,
                       run_at = least(EXCLUDED.run_at, old.debounce_deadline), park_rule = NULL, park_key = NULL
         RETURNING id, event_id, run_at, function_id, debounce_key),
     dm AS (
         INSERT INTO durastep.debounced_events (event_id, run_id)
         SELECT x.event_id, d.id FROM fan x
           JOIN dr d ON d.function_id = x.function_id AND d.debounce_key = x.dkey
          WHERE x.debounce_s IS NOT NULL
          ORDER BY 1, 2
         ON CONFLICT DO NOTHING),
     sc AS (
         UPDATE durastep.runs o
            SET state = 'cancelled', finished_at = durastep.now(), cancelled_by_xact = pg_current_xact_id(),
                last_error = 'cancelled: a newer event arrived for singleton key ' || o.singleton_key,
                cancel_reason = 'a newer event arrived for singleton key ' || o.singleton_key
          WHERE o.id IN (
                SELECT a.id FROM durastep.runs a
                 WHERE a.state IN ('queued', 'running', 'sleeping', 'waiting') AND a.singleton_key IS NOT NULL
                   AND (a.function_id, a.singleton_key) IN
                       (SELECT function_id, skey FROM fan WHERE singleton_mode = 'cancel_old')
                 ORDER BY a.id FOR UPDATE)
            AND o.state IN ('queued', 'running', 'sleeping', 'waiting')
         RETURNING o.id),
     sr AS (
         INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, priority, singleton_key,
                                    start_by, deadline_at, version)
         SELECT DISTINCT ON (x.function_id, x.skey) durastep.uuid7(), x.function_id, x.event_id, 'queued',
                x.start_at, x.max_attempts, x.priority, x.skey,
                x.start_at + make_interval(secs => x.start_timeout_secs),
                x.start_at + make_interval(secs => x.finish_timeout_secs), x.version
           FROM fan x WHERE x.singleton_mode IS NOT NULL AND (SELECT count(*) FROM sc) >= 0
          ORDER BY x.function_id, x.skey, CASE WHEN x.singleton_mode = 'cancel_old' THEN -x.ord ELSE x.ord END
         ON CONFLICT (function_id, singleton_key)
            WHERE state IN ('queued', 'running', 'sleeping', 'waiting') AND singleton_key IS NOT NULL
         DO NOTHING
         RETURNING id, event_id, run_at, function_id),
     sk AS (
         INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, priority,
                                    singleton_key, last_error, finished_at, version)
         SELECT durastep.uuid7(), x.function_id, x.event_id, 'skipped', x.start_at, x.max_attempts, x.priority,
                x.skey, 'singleton: another run is active for key ' || x.skey, durastep.now(), x.version
           FROM fan x WHERE x.singleton_mode IS NOT NULL
            AND NOT EXISTS (SELECT 1 FROM sr WHERE sr.event_id = x.event_id AND sr.function_id = x.function_id)
         RETURNING id, event_id),
     created AS (
         SELECT id, event_id, run_at, function_id FROM r
         UNION ALL SELECT id, event_id, run_at, function_id FROM dr
         UNION ALL SELECT id, event_id, run_at, function_id FROM sr),
     merged AS (
         SELECT x.event_id, d.id FROM fan x
           JOIN dr d ON d.function_id = x.function_id AND d.debounce_key = x.dkey
          WHERE x.debounce_s IS NOT NULL AND d.event_id <> x.event_id),
     fresh AS (
         SELECT i.id, i.name, i.payload::jsonb AS payload, i.ord FROM input i JOIN ev ON ev.id = i.id),
     cspec AS (
         SELECT f.id AS function_id, fr.name,
                fr.payload #> ARRAY(SELECT jsonb_array_elements_text(c->'event_path')) AS want,
                ARRAY(SELECT jsonb_array_elements_text(c->'run_path')) AS run_path
           FROM fresh fr, durastep.functions f, jsonb_array_elements(f.cancel_on) c
          WHERE f.cancel_on <> '[]' AND c->>'event' = fr.name),
     cx AS (
         SELECT DISTINCT ON (cr.id) cr.id, s.name
           FROM cspec s
           -- Per cancelling function: its queued, sleeping and waiting runs
           -- (the due queue's entries), and its running runs through their
           -- claim records (0034: no index of `runs` holds the running runs).
           CROSS JOIN LATERAL (
               SELECT q.id, q.event_id FROM durastep.runs q
                WHERE q.function_id = s.function_id AND q.state IN ('queued', 'sleeping', 'waiting')
               UNION ALL
               SELECT r.id, r.event_id FROM durastep.run_claims rc
                      CROSS JOIN LATERAL unnest(rc.run_ids, rc.epochs) AS rcu(run_id, epoch)
                      JOIN durastep.runs r ON r.id = rcu.run_id AND r.lease_epoch = rcu.epoch
                WHERE r.state = 'running' AND r.function_id = s.function_id) cr
           JOIN durastep.events ce ON ce.id = cr.event_id
          WHERE s.want IS NOT NULL AND (ce.payload #> s.run_path) = s.want
          ORDER BY cr.id),
     dx AS (
         SELECT DISTINCT ON (w.run_id, w.step_key) w.run_id, w.step_key, fr.id AS event_id, fr.payload
           FROM fresh fr JOIN durastep.waits w ON w.event_name = fr.name
          WHERE w.match_path IS NULL OR (fr.payload #> w.match_path) = w.match_value
          ORDER BY w.run_id, w.step_key, fr.ord),
     lk AS (
         SELECT l.id, l.state, l.lease_epoch FROM durastep.runs l
          WHERE l.id IN (SELECT id FROM cx UNION SELECT run_id FROM dx)
            AND l.state IN ('queued', 'running', 'sleeping', 'waiting')
          ORDER BY l.id FOR NO KEY UPDATE),
     upd AS (
         UPDATE durastep.runs u
            SET state = CASE WHEN cx.id IS NOT NULL THEN 'cancelled' ELSE 'queued' END,
                run_at = CASE WHEN cx.id IS NOT NULL THEN u.run_at ELSE durastep.now() END,
                finished_at = CASE WHEN cx.id IS NOT NULL THEN durastep.now() END,
                cancel_reason = CASE WHEN cx.id IS NOT NULL THEN 'cancelled by event ' || cx.name
                                     ELSE u.cancel_reason END,
                cancelled_by_xact = CASE WHEN cx.id IS NOT NULL THEN pg_current_xact_id()
                                         ELSE u.cancelled_by_xact END
           FROM lk LEFT JOIN cx ON cx.id = lk.id
          WHERE u.id = lk.id AND (cx.id IS NOT NULL OR lk.state = 'waiting')
         RETURNING u.id, u.state, u.function_id),
     res AS (
         INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch)
         SELECT dx.run_id, dx.step_key, jsonb_build_object('event_id', dx.event_id, 'data', dx.payload),
                lk.lease_epoch
           FROM dx JOIN lk ON lk.id = dx.run_id
          WHERE dx.run_id NOT IN (SELECT id FROM cx)
         ON CONFLICT DO NOTHING
         RETURNING run_id),
     del AS (
         DELETE FROM durastep.waits w
          WHERE w.run_id IN (SELECT lk.id FROM lk JOIN cx ON cx.id = lk.id)
             OR w.run_id IN (SELECT id FROM sc)
             OR (w.run_id, w.step_key) IN (SELECT dx.run_id, dx.step_key FROM dx JOIN lk ON lk.id = dx.run_id)
         RETURNING w.run_id)
     SELECT i.ord, i.id, (ev.id IS NOT NULL) AS inserted,
            ARRAY(SELECT c.id FROM created c WHERE c.event_id = i.id
                  UNION SELECT k.id FROM sk k WHERE k.event_id = i.id
                  UNION SELECT m.id FROM merged m WHERE m.event_id = i.id ORDER BY 1) AS run_ids,
            (SELECT durastep.wake_workers(ARRAY(
                SELECT c.function_id FROM created c WHERE c.run_at <= durastep.now()
                UNION SELECT upd.function_id FROM upd WHERE upd.state = 'queued'))) IS NULL AS _n,
            (SELECT count(*) FROM res) + (SELECT count(*) FROM del) AS _touched
       FROM input i LEFT JOIN ev ON ev.id = i.id
      ORDER BY i.ord;
END
$fn$;
