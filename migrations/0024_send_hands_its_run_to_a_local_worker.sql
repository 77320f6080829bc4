-- A send that hands its new run to an idle worker of the sender's own
-- process, in the same transaction. Until now a run sent through
-- `Engine::send` started after the send committed, the worker was woken and
-- its claim came back: one more round trip and one more commit between the
-- event and the first step (about 1.1 ms of the 3.2 ms from `send` to the
-- first step body here; docs/performance.md "The send hands its run to a
-- worker of its own process").
--
-- `send_event_handing` sends one event as `send_events` does (it calls it:
-- the topic locks, the checks and both branches stay where they are), then,
-- in a statement with a fresh snapshot, claims up to `p_slots` of the runs it
-- created for the worker `p_worker`, exactly as the fast claim would
-- (claim_fast.sql): a new lease epoch, the lease, the history row. A run is
-- handed only when
-- * the event was new (a duplicate creates no run) and the run is due now,
-- * the worker has a handler for its (function, version),
-- * its function has no claim-time flow rule (those runs take the full
--   claim) and it is inside its deadlines, and
-- * no other run of any function is due: then the new run is at the head of
--   the queue, and handing it on passes no run that a claim would have taken
--   first (G26). The check reads the first entries of `runs_next_due` (a
--   probe, whatever the number of sleeping runs); it does not see runs that
--   other transactions have not committed yet, as a claim racing this send
--   would not.
-- Nothing else about the send changes: its NOTIFY still goes out (other
-- workers wake and find nothing due), and a run not handed stays queued for
-- any worker.
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
    s record;
BEGIN
    SELECT * INTO STRICT s
      FROM durastep.send_events(ARRAY[p_id], ARRAY[p_name], ARRAY[p_payload], ARRAY[p_idem],
                                ARRAY[NULL::timestamptz], ARRAY[p_priority]);
    RETURN QUERY
    WITH t AS MATERIALIZED (SELECT durastep.now() AS now),
    -- The runs handed on, under a new lease epoch (1 to 2^31 above the last).
    claimed AS (
        UPDATE durastep.runs r
           SET state = 'running', lease_epoch = r.lease_epoch + 1 + floor(random() * 2147483648)::bigint,
               lease_expires_at = (SELECT now FROM t) + make_interval(secs => p_lease_s),
               worker_id = p_worker, started_at = (SELECT now FROM t), history_noted = NOT r.history_noted
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
        RETURNING r.id, r.function_id, r.version, r.event_id, r.attempt, r.lease_epoch, r.priority, r.run_at),
    -- Their history rows.
    h AS (
        INSERT INTO durastep.run_history (run_id, at, state, attempt, lease_epoch, worker_id)
        SELECT c.id, (SELECT now FROM t), 'running', c.attempt, c.lease_epoch, p_worker FROM claimed c)
    -- The send's answer, with one row per run handed on (a new run has no
    -- steps and no journal); one row with a null `id` when none was.
    SELECT s.id, s.inserted, s.run_ids, s._n,
           c.id, c.function_id, c.version, c.event_id, c.attempt, c.lease_epoch,
           p_payload::jsonb, NULL::uuid, NULL::text, (SELECT now FROM t), c.priority, c.run_at,
           '{}'::text[], '{}'::jsonb[], '{}'::int[], '{}'::text[], '{}'::text[], 0::bigint
      FROM (SELECT) AS one LEFT JOIN claimed c ON true;
END
$fn$;
