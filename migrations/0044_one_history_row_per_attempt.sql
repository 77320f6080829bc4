-- One history row per attempt, written when the attempt ends (issue 12;
-- docs/architecture.md "One history row per attempt"; docs/performance.md
-- "One history row per attempt").
--
-- Until now every claim wrote a `running` row into `run_history` and every
-- end of an attempt (completion, failure, sleep, wait, cancel, reaping,
-- release) a second row. Counted with benches/sql/instructions.sh, the
-- history was 9% of a run's claim and completion on the server, a claim's
-- row about 10,000 instructions (its primary-key entry, its BRIN entry, the
-- identity's nextval, the heap insert), and no cheaper way of indexing the
-- same rows paid (docs/performance.md "What the run history costs,
-- counted"). Now a claim writes no row: it notes the attempt's start on the
-- run (`attempt_claimed_at`, and `attempt_claim_id`, the claim record it set
-- in `claim_id`), and the row that ends the attempt carries the start beside
-- its end: `started_at`, `started_attempt` (the attempt's number, which a
-- retry's end moves on) and `started_by` (the claiming worker; the end's
-- own `worker_id` is the run's after the end, as before). An attempt still
-- running has no row; its start is on the run.
--
-- `durastep.run_timeline` gives the entries as before: an attempt's start
-- (from its end's row, or from the run while it runs) and every row, in
-- order (`seq`, then `part`: a start before its end). Every reader of a
-- run's entries reads it (the inspection API's timeline, the test kit).
--
-- A start noted on the run counts only while `attempt_claim_id` is the
-- run's `claim_id`: a claim of an earlier version (during a rolling
-- upgrade) sets a new `claim_id` without noting its start, and writes its
-- own `running` row as before; its attempt's end then carries no start.
-- Rows written before this migration carry none either: their starts are
-- their own `running` rows. Both read the same through the view.
ALTER TABLE durastep.runs
    ADD COLUMN attempt_claimed_at timestamptz,
    ADD COLUMN attempt_claim_id bigint;

ALTER TABLE durastep.run_history
    ADD COLUMN started_at timestamptz,
    ADD COLUMN started_attempt integer,
    ADD COLUMN started_by uuid;

-- The row trigger of 0041 (its history part changed): an attempt's end
-- carries its start; a run made running under a new lease by hand (its
-- claim record unchanged) writes the start of the attempt it ends, and its
-- own entry, as rows, and forgets the start noted on the run.
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
    -- statement wrote it itself (it toggles `history_noted`). An attempt's
    -- end carries its start (0044): the claim's time and worker, noted on
    -- the run by a claim of this version (its `attempt_claim_id` is the
    -- run's `claim_id`), and the attempt's number before it ended.
    IF (NEW.state <> OLD.state OR NEW.lease_epoch <> OLD.lease_epoch)
       AND NEW.history_noted = OLD.history_noted
    THEN
        started := OLD.state = 'running' AND OLD.attempt_claimed_at IS NOT NULL
            AND OLD.attempt_claim_id IS NOT DISTINCT FROM OLD.claim_id;
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

-- The two handing sends of 0035, without their history rows: the runs they
-- hand on note their attempt's start instead (a run inserted claimed has no
-- `claim_id`, and no `attempt_claim_id`).
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

CREATE OR REPLACE FUNCTION durastep.send_event_to_worker_by_claim(
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
               claim_id = (SELECT kid.id FROM kid),
               -- The attempt's start, for its history row (0044).
               attempt_claimed_at = (SELECT now FROM t), attempt_claim_id = (SELECT kid.id FROM kid)
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

-- A run's entries: each attempt's start and each row of its history, in
-- order. An attempt's start comes from the row its end wrote, or from the
-- run while the attempt runs (`seq` NULL: after every row); `part` orders a
-- start before its end's row. Read by one run's id (the first two parts
-- through the history's primary key, the last through the run's).
CREATE VIEW durastep.run_timeline AS
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
 WHERE r.state = 'running' AND r.attempt_claimed_at IS NOT NULL
   AND r.attempt_claim_id IS NOT DISTINCT FROM r.claim_id;

-- The view's readers are the history's: every role that reads
-- `run_history` reads it (docs/security.md), until the owner runs the
-- grants of this version.
DO $grants$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS grantee
          FROM pg_class c
         CROSS JOIN LATERAL aclexplode(c.relacl) a
          LEFT JOIN pg_roles r ON r.oid = a.grantee
         WHERE c.oid = 'durastep.run_history'::regclass AND a.grantee <> c.relowner
           AND a.privilege_type = 'SELECT'
    LOOP
        EXECUTE format('GRANT SELECT ON durastep.run_timeline TO %s', g.grantee);
    END LOOP;
END
$grants$;
