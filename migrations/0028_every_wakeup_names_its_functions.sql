-- Every wake-up names the functions it is for. Since 0027 the lean send's
-- NOTIFY on `durastep_wakeup` named the functions of the runs it made due,
-- and a worker claims only for the classes (fast claim, full claim) that run
-- one of them; every other notification still had an empty payload, which
-- wakes every class of every listening worker: the full fan-out (the first
-- send of a name, debounce, singletons, flow keys, `cancel_on`, waits), so
-- every send to a flow-limited function; the send that hands its run to a
-- worker of its own process, for the runs it leaves queued; a finished
-- child's parent made due; a failure handler's run; runs released by flow
-- control. Now each names its functions, through one function,
-- `durastep.wake_workers`, which also holds the payload's rule (ids separated
-- by a space, each once, sorted; over 7,000 bytes the payload goes empty,
-- which wakes every class: Postgres refuses 8,000). The lean send keeps its
-- own inline NOTIFY (0027, the same rule): it is the hot path, and a call of
-- a SQL function with a FROM clause is not inlined.
--
-- Left with an empty payload (every class of every worker): notifications
-- sent by the engine's code for many runs at once or for none in particular
-- (admin actions, the test clock moving), and by older engines. A wake-up is
-- a hint: a class not woken claims at its next due run or its poll interval,
-- and a run of a function a worker does not run is never its to claim
-- (docs/architecture.md "Wake-ups").
--
-- Each function below is its last migration's text with only the NOTIFY
-- changed (and what that needs: `r`, `created` and `upd` return the run's
-- function in the full fan-out; `release_flow` collects the functions of the
-- runs it makes due). In a statement's output list the call is a sub-select
-- of its own, as the NOTIFY was: an uncorrelated sub-select runs once per
-- statement, a volatile call in the output list once per output row (one
-- per event of a batch). `send_events_full` keeps its settings (jit, and 0022's
-- kept plan, which a CREATE OR REPLACE would otherwise drop).

-- Notifies `durastep_wakeup` naming `p_functions` (duplicates and NULLs
-- dropped) and returns true; does nothing and returns NULL when none is left.
CREATE FUNCTION durastep.wake_workers(p_functions text[]) RETURNS boolean
    LANGUAGE plpgsql VOLATILE
    AS $$
DECLARE
    names text;
BEGIN
    SELECT string_agg(DISTINCT f, ' ' ORDER BY f) INTO names FROM unnest(p_functions) AS f;
    IF names IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM pg_notify('durastep_wakeup', CASE WHEN octet_length(names) <= 7000 THEN names ELSE '' END);
    RETURN true;
END $$;

-- The full fan-out (0021's text, renamed by 0023).
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

-- The send that hands its run to a worker of its own process (0025).
CREATE OR REPLACE FUNCTION durastep.send_event_handing(
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
               (SELECT durastep.wake_workers(ARRAY(SELECT r.function_id FROM r WHERE r.state = 'queued'))) IS NULL,
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

-- The failure handler (0021).
CREATE OR REPLACE FUNCTION durastep.start_failure_handler() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    handler_id text := NEW.function_id || '/on-failure';
    ev uuid := durastep.uuid7();
    handler_attempts integer;
    handler_version integer;
BEGIN
    SELECT f.max_attempts, f.version INTO handler_attempts, handler_version
      FROM durastep.functions f
     WHERE f.id = handler_id
       AND EXISTS (SELECT 1 FROM durastep.functions p WHERE p.id = NEW.function_id AND p.has_on_failure);
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
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
        VALUES (durastep.uuid7(), handler_id, ev, 'queued', durastep.now(), handler_attempts, handler_version);
        PERFORM durastep.wake_workers(ARRAY[handler_id]);
    END IF;
    RETURN NULL;
END $$;

-- A finished child's parent (0003).
CREATE OR REPLACE FUNCTION durastep.resume_parent() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
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
        PERFORM durastep.wake_workers(ARRAY(SELECT p.function_id FROM durastep.runs p WHERE p.id = NEW.parent_run_id));
    END IF;
    RETURN NULL;
END $$;

-- Runs released by flow control made due (0026).
CREATE OR REPLACE FUNCTION durastep.release_flow() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    mark text := 'durastep.flow_releases_' || pg_trigger_depth();
    rules text[];
    keys text[];
    ns integer[];
    woken text[];
BEGIN
    -- No row of this statement gave slots back: nothing to read.
    IF coalesce(current_setting(mark, true), '') = '' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config(mark, '', true);
    WITH mine AS (
        DELETE FROM durastep.flow_releases r
         WHERE r.xact = pg_current_xact_id() AND r.depth = pg_trigger_depth()
        RETURNING r.rule, r.key)
    SELECT array_agg(x.rule ORDER BY x.rule, x.key), array_agg(x.key ORDER BY x.rule, x.key),
           array_agg(x.n ORDER BY x.rule, x.key)
      INTO rules, keys, ns
      FROM (SELECT m.rule, m.key, count(*)::integer AS n FROM mine m GROUP BY 1, 2) x;
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
    WITH due AS (
        UPDATE durastep.runs r SET run_at = durastep.now(), park_rule = NULL, park_key = NULL
         WHERE r.id IN (SELECT w.id FROM unnest(rules, keys, ns) AS u(rule, key, n)
                        CROSS JOIN LATERAL (
                            SELECT w.id FROM durastep.runs w
                             WHERE w.park_rule = u.rule AND w.park_key = u.key AND w.state = 'queued'
                             ORDER BY w.priority DESC, w.created_at
                             LIMIT u.n
                             FOR UPDATE SKIP LOCKED) w)
        RETURNING r.function_id)
    SELECT array_agg(due.function_id) INTO woken FROM due;
    IF woken IS NOT NULL THEN
        PERFORM durastep.wake_workers(woken);
    END IF;
    RETURN NULL;
END $$;
