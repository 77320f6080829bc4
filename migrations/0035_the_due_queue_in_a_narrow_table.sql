-- The due queue in a narrow table of its own (issue 12, docs/scaling.md
-- "Claims and completions as HOT updates"). `runs_due (priority DESC,
-- run_at)` and `runs_next_due (run_at)`, both `WHERE state IN ('queued',
-- 'sleeping', 'waiting')`, were the last indexes of `runs` whose predicate a
-- claim changes: every claim took its run out of them, so no claim and no
-- completion could be a HOT update (Postgres keeps an update HOT only when
-- no indexed column, key or predicate, changes). Now the runs in those
-- states are rows of `run_queue`, and the two indexes are dropped: a claim
-- and a completion of a plain run change no index of `runs` and are HOT
-- wherever the page has room.
--
-- A run has exactly one `run_queue` row while it is queued, sleeping or
-- waiting, with its state, priority, due time, function and version, and
-- none otherwise. Kept so:
-- * the claims (`claim_fast.sql`, `claim.sql`) delete the rows of the runs
--   they start, in the same statement, and flip `runs.queue_noted`, which
--   keeps the trigger below quiet for them;
-- * every other write that puts a run into the queue, moves it in it or
--   takes it out (a send, a retry, a sleep, a wait, a wake-up, a park, a
--   cancel, the reaper, a replay, a handing send, an UPDATE by hand, the
--   claims of a process older than this migration) is followed by a row
--   trigger whose `WHEN` is true only for those changes: a completion and a
--   claim since 0035 never call it.
-- Its writes are serialized by the run's row lock: every change to a run's
-- queue row happens in the transaction that updates (so locks) the run.

CREATE TABLE durastep.run_queue (
    run_id uuid PRIMARY KEY,
    function_id text NOT NULL,
    version integer NOT NULL,
    -- 'queued', 'sleeping' or 'waiting', as the run's.
    state text NOT NULL,
    priority integer NOT NULL,
    run_at timestamptz NOT NULL
    -- Every run enters and leaves it: vacuumed as often as `runs` (0001).
) WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);
-- The claims' walk: highest priority first, then earliest due.
CREATE INDEX run_queue_due ON durastep.run_queue (priority DESC, run_at);
-- The earliest due time: the short claim's due runs, the next timer.
CREATE INDEX run_queue_next_due ON durastep.run_queue (run_at);

-- Set by the claims to the opposite of its old value: the claim wrote the
-- run's queue row itself (0020's `history_noted` works the same way).
ALTER TABLE durastep.runs ADD COLUMN queue_noted boolean NOT NULL DEFAULT false;

-- The queue row of one run, after a write that changed its membership or
-- its place. INSERT ... ON CONFLICT: a row is made right whatever it held.
CREATE FUNCTION durastep.queue_run() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' OR NEW.state NOT IN ('queued', 'sleeping', 'waiting') THEN
        DELETE FROM durastep.run_queue WHERE run_id = OLD.id;
    ELSE
        INSERT INTO durastep.run_queue (run_id, function_id, version, state, priority, run_at)
        VALUES (NEW.id, NEW.function_id, NEW.version, NEW.state, NEW.priority, NEW.run_at)
        ON CONFLICT (run_id) DO UPDATE
           SET function_id = EXCLUDED.function_id, version = EXCLUDED.version, state = EXCLUDED.state,
               priority = EXCLUDED.priority, run_at = EXCLUDED.run_at;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER runs_queue_entered AFTER INSERT ON durastep.runs
    FOR EACH ROW
    WHEN (NEW.state IN ('queued', 'sleeping', 'waiting'))
    EXECUTE FUNCTION durastep.queue_run();
CREATE TRIGGER runs_queue_moved AFTER UPDATE ON durastep.runs
    FOR EACH ROW
    WHEN ((OLD.state IN ('queued', 'sleeping', 'waiting') OR NEW.state IN ('queued', 'sleeping', 'waiting'))
          AND (OLD.state IS DISTINCT FROM NEW.state OR OLD.run_at IS DISTINCT FROM NEW.run_at
               OR OLD.priority IS DISTINCT FROM NEW.priority OR OLD.function_id IS DISTINCT FROM NEW.function_id
               OR OLD.version IS DISTINCT FROM NEW.version)
          AND NEW.queue_noted = OLD.queue_noted)
    EXECUTE FUNCTION durastep.queue_run();
CREATE TRIGGER runs_queue_left AFTER DELETE ON durastep.runs
    FOR EACH ROW
    WHEN (OLD.state IN ('queued', 'sleeping', 'waiting'))
    EXECUTE FUNCTION durastep.queue_run();

-- A TRUNCATE of `runs` takes the queue rows along, as it takes the step
-- records (0016).
CREATE OR REPLACE FUNCTION durastep.truncate_run_records() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    -- DELETE, not TRUNCATE: the same TRUNCATE statement may list these tables
    -- too, and a nested TRUNCATE of a table in use by it is refused.
    DELETE FROM durastep.step_results;
    DELETE FROM durastep.step_journal;
    DELETE FROM durastep.run_queue;
    RETURN NULL;
END $$;

-- The runs in the queue now. The triggers above were created first, in this
-- transaction: CREATE TRIGGER holds a lock that keeps every other writer of
-- `runs` waiting until this migration commits, so none is missed.
INSERT INTO durastep.run_queue (run_id, function_id, version, state, priority, run_at)
SELECT id, function_id, version, state, priority, run_at
  FROM durastep.runs WHERE state IN ('queued', 'sleeping', 'waiting');

DROP INDEX durastep.runs_due;
DROP INDEX durastep.runs_next_due;

-- Room on each page for a run's next versions, which a HOT update needs on
-- the same page: the claim's and the completion's. New pages are filled to
-- half (benches/sql/hot_ceiling.sh: 72% of updates HOT at 50, 49% at 80);
-- existing pages keep what they hold. No rewrite.
ALTER TABLE durastep.runs SET (fillfactor = 50);

-- What holds the runs that are not running (0005), read from the due queue:
-- a listing in due order walks `run_queue_next_due` (its `run_at` is the
-- queue row's, equal to the run's) instead of scanning `runs`.
CREATE OR REPLACE VIEW durastep.run_blockers AS
SELECT r.id AS run_id, r.function_id, r.state,
       CASE
         WHEN r.state = 'queued' AND r.park_rule IS NOT NULL THEN fr.kind
         WHEN r.state = 'queued' AND r.debounce_key IS NOT NULL AND r.started_at IS NULL
              AND r.run_at > durastep.now() THEN 'debounce'
         WHEN r.state = 'sleeping' THEN 'sleep'
         WHEN r.state = 'waiting' AND w.event_name IS NOT NULL THEN 'wait_for_event'
         WHEN r.state = 'waiting' THEN 'invoke'
         WHEN r.run_at > durastep.now() AND r.last_error IS NOT NULL THEN 'retry_backoff'
         WHEN r.run_at > durastep.now() THEN 'scheduled'
         ELSE 'ready'
       END AS blocker,
       CASE WHEN r.state = 'queued' AND r.park_rule IS NOT NULL THEN r.park_rule
            WHEN r.state = 'queued' AND r.debounce_key IS NOT NULL THEN 'debounce' END AS rule,
       CASE WHEN r.state = 'queued' AND r.park_rule IS NOT NULL THEN r.park_key
            WHEN r.state = 'queued' AND r.debounce_key IS NOT NULL THEN r.debounce_key END AS key,
       CASE WHEN r.park_rule IS NOT NULL AND fr.kind = 'concurrency' THEN fk.in_use END AS in_use,
       CASE WHEN r.park_rule IS NOT NULL THEN fr.capacity END AS "limit",
       CASE WHEN r.park_rule IS NOT NULL AND fr.kind = 'concurrency' THEN NULL
            WHEN r.run_at = 'infinity' THEN NULL
            ELSE greatest(r.run_at, durastep.now()) END AS next_possible_start,
       CASE WHEN r.state = 'waiting' AND w.event_name IS NOT NULL THEN w.event_name
            WHEN r.state = 'waiting' THEN (SELECT c.id::text FROM durastep.runs c
                                            WHERE c.parent_run_id = r.id
                                              AND c.state IN ('queued', 'running', 'sleeping', 'waiting')
                                            LIMIT 1)
            WHEN r.run_at > durastep.now() AND r.last_error IS NOT NULL THEN r.last_error END AS detail,
       q.run_at, r.attempt, r.created_at
  FROM durastep.run_queue q
  JOIN durastep.runs r ON r.id = q.run_id
  LEFT JOIN durastep.flow_rules fr ON fr.name = r.park_rule
  LEFT JOIN durastep.flow_keys fk ON fk.rule = r.park_rule AND fk.key = r.park_key
  LEFT JOIN LATERAL (SELECT x.event_name FROM durastep.waits x WHERE x.run_id = r.id
                      ORDER BY x.created_at LIMIT 1) w ON r.state = 'waiting'
 WHERE r.state IN ('queued', 'sleeping', 'waiting');

-- The fan-out's rarer work (0034), with `cancel_on` finding the queued,
-- sleeping and waiting runs it cancels through their queue rows.
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
           -- Per cancelling function: its queued, sleeping and waiting runs
           -- through their queue rows (0035), and its running runs through
           -- their claim records (0034): no index of `runs` holds either.
           CROSS JOIN LATERAL (
               SELECT q.id, q.event_id FROM durastep.run_queue rq JOIN durastep.runs q ON q.id = rq.run_id
                WHERE rq.function_id = s.function_id
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

-- The send that hands its run to a worker of its own process (0034), with
-- its check that no run is due read from the due queue's table.
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
       -- and no run is due: the first entry of `run_queue_next_due` is
       -- later (an ORDER BY ... LIMIT 1 probe, as 0024 reads it).
       AND coalesce((SELECT d.run_at FROM durastep.run_queue d
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
              FROM r WHERE r.state = 'running' HAVING count(*) > 0)
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

-- The send that hands its run on by a claim (0034), with its check that
-- nothing else is due read from the due queue's table, and the queue rows
-- of the runs it claims deleted as the claims delete theirs.
CREATE OR REPLACE FUNCTION durastep.send_event_handing_by_claim(
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
               claim_id = (SELECT kid.id FROM kid), queue_noted = NOT r.queue_noted
         WHERE r.id = ANY (ARRAY(
                SELECT c.id FROM durastep.runs c
                 WHERE s.inserted AND c.id = ANY (s.run_ids) AND c.state = 'queued'
                   AND c.run_at <= (SELECT now FROM t)
                   AND (c.function_id, c.version) IN (SELECT v.* FROM unnest(p_version_ids, p_versions) AS v)
                   AND NOT EXISTS (SELECT 1 FROM durastep.function_flow ff WHERE ff.function_id = c.function_id)
                   AND (c.deadline_at IS NULL OR c.deadline_at >= (SELECT now FROM t))
                   AND (c.start_by IS NULL OR c.start_by >= (SELECT now FROM t))
                   -- Nothing else is due (the new runs are the queue's head):
                   -- the earliest other entry of `run_queue_next_due` is later.
                   -- Written as ORDER BY ... LIMIT 1 so that the generic plan
                   -- reads the index's first entries; as a NOT EXISTS with
                   -- `run_at <= now` it expected a third of the table to match
                   -- and scanned all of it (6 ms with 50,000 sleeping runs).
                   AND coalesce((SELECT d.run_at FROM durastep.run_queue d
                                  WHERE d.run_id <> ALL (s.run_ids)
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
    -- Their queue rows, which `queue_noted` kept the trigger from deleting.
    dq AS (DELETE FROM durastep.run_queue q WHERE q.run_id IN (SELECT c.id FROM claimed c)),
    -- Their claim record (0034), for the reaper.
    k AS (
        INSERT INTO durastep.run_claims (id, recheck_at, run_ids, epochs)
        SELECT (SELECT kid.id FROM kid), min(c.lease_expires_at), array_agg(c.id), array_agg(c.lease_epoch)
          FROM claimed c HAVING count(*) > 0)
    -- The send's answer, with one row per run handed on (a new run has no
    -- steps and no journal); one row with a null `id` when none was.
    SELECT s.id, s.inserted, s.run_ids, s._n,
           c.id, c.function_id, c.version, c.event_id, c.attempt, c.lease_epoch,
           p_payload::jsonb, NULL::uuid, NULL::text, (SELECT now FROM t), c.priority, c.run_at,
           '{}'::text[], '{}'::jsonb[], '{}'::int[], '{}'::text[], '{}'::text[], 0::bigint
      FROM (SELECT) AS one LEFT JOIN claimed c ON true;
END
$fn$;
