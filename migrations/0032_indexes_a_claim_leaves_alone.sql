-- Indexes that a claim and a completion leave alone (issue 12, the first
-- step of "Claims and completions as HOT updates", docs/scaling.md).
-- Postgres keeps an update HOT (no index entry written, the new row version
-- on the same page) only when no column that any index of the table names,
-- in its key or its partial predicate, changes value. Eight indexes of
-- `runs` named `state` in their predicate although a claim or a completion
-- of a run they do not hold (no singleton or debounce key, no deadline, not
-- parked, not stopping, never listed by state) leaves them as they are, and
-- `state` changes on every claim and every completion.
--
-- Seven of them now read a stored generated column instead (the eighth,
-- the parked runs' index, is below): the value the index is about while
-- the run is in the states it was for, NULL otherwise.
-- A plain run's claim and completion leave every one of them NULL (or, for
-- `attempt_stopping`, false), so none of these indexes keeps those updates
-- off HOT any more; a run they hold changes the column exactly when it
-- enters or leaves the index, as before. Postgres computes the columns on
-- every insert and update, whoever writes the row, so no writer can forget
-- one. What is left before claims and completions can be HOT: the due queue
-- (`runs_due`, `runs_next_due`), `runs_running` and `runs_finished`, whose
-- membership the claim and the completion change by their nature.
--
-- The parked runs' index keeps its column and drops `state` from its
-- predicate: every reader already tests `state = 'queued'`, and a claim
-- sets `park_rule` to NULL, which for a run never parked it already is. A
-- parked run cancelled before it is claimed keeps its entry until it is
-- pruned; the readers skip it.
--
-- Adding stored generated columns rewrites the table (under an ACCESS
-- EXCLUSIVE lock; docs/operations.md says how long).
ALTER TABLE durastep.runs
    -- The singleton key while the run is active (`runs_singleton`).
    ADD COLUMN singleton_active_key text GENERATED ALWAYS AS (
        CASE WHEN state IN ('queued', 'running', 'sleeping', 'waiting') THEN singleton_key END) STORED,
    -- The debounce key while the run is queued and was never started: the
    -- run later events of the key merge into (`runs_debounce`).
    ADD COLUMN debounce_open_key text GENERATED ALWAYS AS (
        CASE WHEN state = 'queued' AND started_at IS NULL THEN debounce_key END) STORED,
    -- The finish deadline while the run is unfinished (`runs_deadline`).
    ADD COLUMN deadline_open_at timestamptz GENERATED ALWAYS AS (
        CASE WHEN state IN ('queued', 'running', 'sleeping', 'waiting') THEN deadline_at END) STORED,
    -- The start deadline while the run is queued and was never started
    -- (`runs_start_by`).
    ADD COLUMN start_by_open_at timestamptz GENERATED ALWAYS AS (
        CASE WHEN state = 'queued' AND started_at IS NULL THEN start_by END) STORED,
    -- The state of a run listed by state (`runs_listed_by_state`,
    -- `runs_diverged`): queued and running runs are found through the due
    -- queue and `runs_running`, completed ones by id.
    ADD COLUMN listed_state text GENERATED ALWAYS AS (
        CASE WHEN state IN ('sleeping', 'waiting', 'failed', 'cancelled', 'skipped', 'diverged') THEN state END) STORED,
    -- An attempt cancelled while its worker still runs it (the run cancelled,
    -- or replayed and queued again since): it holds its concurrency slots
    -- until the worker has stopped it (`runs_attempt_stopping`).
    ADD COLUMN attempt_stopping boolean GENERATED ALWAYS AS (
        state IN ('cancelled', 'queued') AND worker_id IS NOT NULL) STORED;

DROP INDEX durastep.runs_singleton;
CREATE UNIQUE INDEX runs_singleton ON durastep.runs (function_id, singleton_active_key)
    WHERE singleton_active_key IS NOT NULL;
DROP INDEX durastep.runs_debounce;
CREATE UNIQUE INDEX runs_debounce ON durastep.runs (function_id, debounce_open_key)
    WHERE debounce_open_key IS NOT NULL;
DROP INDEX durastep.runs_deadline;
CREATE INDEX runs_deadline ON durastep.runs (deadline_open_at) WHERE deadline_open_at IS NOT NULL;
DROP INDEX durastep.runs_start_by;
CREATE INDEX runs_start_by ON durastep.runs (start_by_open_at) WHERE start_by_open_at IS NOT NULL;
DROP INDEX durastep.runs_listed_by_state;
CREATE INDEX runs_listed_by_state ON durastep.runs (listed_state, id DESC) WHERE listed_state IS NOT NULL;
DROP INDEX durastep.runs_diverged;
CREATE INDEX runs_diverged ON durastep.runs (function_id) WHERE listed_state = 'diverged';
DROP INDEX durastep.runs_attempt_stopping;
CREATE INDEX runs_attempt_stopping ON durastep.runs (id) WHERE attempt_stopping;
DROP INDEX durastep.runs_parked;
CREATE INDEX runs_parked ON durastep.runs (park_rule, park_key, priority DESC, created_at)
    WHERE park_rule IS NOT NULL;

-- The full fan-out (0028's text): its debounce and singleton arbiters, and
-- the walk of the active runs of a `cancel_old` singleton key, name the new
-- columns, as the indexes now do.
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
         ON CONFLICT (function_id, debounce_open_key) WHERE debounce_open_key IS NOT NULL
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
                 WHERE a.singleton_active_key IS NOT NULL
                   AND (a.function_id, a.singleton_active_key) IN
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
         ON CONFLICT (function_id, singleton_active_key) WHERE singleton_active_key IS NOT NULL
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
           JOIN durastep.runs cr ON cr.function_id = s.function_id
                                AND cr.state IN ('queued', 'running', 'sleeping', 'waiting')
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
