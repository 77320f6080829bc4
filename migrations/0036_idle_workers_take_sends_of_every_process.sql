-- An idle worker takes the new runs of a one-event send made in any
-- process, not only in its own (issue 12: the wake-up across processes;
-- docs/architecture.md "The send hands its run to an idle worker of any
-- process").
--
-- Since 0024 a send hands its run to an idle worker of its own process: it
-- inserts the run claimed for that worker, which starts it without a claim
-- of its own. A worker in another process still learned of the run from the
-- NOTIFY and claimed it: one more round trip and commit between the send and
-- the first step body, about half of that path's time.
--
-- Now an idle worker that listens offers its free slots in `worker_offers`,
-- and a one-event send due now takes an offer: it sends as
-- `send_event_to_worker` does for a worker of its process (the same
-- function, called with the offer's worker), takes the slots it used from
-- the offer, and tells the worker on its secret channel which runs it holds
-- now, with what it needs to start them (their event's payload too, when
-- the notification stays under Postgres' 8,000 bytes; else the worker reads
-- them: a read, no commit). It starts them without a claim of its own.
--
-- An offer is good only while its worker listens: its listener connection
-- holds the advisory lock `lock_key` (a new random key per connection). A
-- send that can take that lock itself has found an offer of a worker that
-- stopped or lost its connection, which would never hear of the run: it
-- deletes the offer and looks further.
--
-- The worker's channel is a secret of its own (`channel`, a random name):
-- anyone connected may NOTIFY or LISTEN on any channel they can name, so a
-- hand-over is believed because it arrives on a channel only the roles that
-- may read this table know (docs/security.md: the reader role may not).
CREATE TABLE durastep.worker_offers (
    worker_id uuid PRIMARY KEY,
    -- The (function, version) pairs the worker runs by the fast claim.
    version_ids text[] NOT NULL,
    versions int[] NOT NULL,
    -- Runs it may be handed; each send takes the slots it used.
    slots int NOT NULL CHECK (slots >= 0),
    lease_s double precision NOT NULL,
    -- Held by the worker's listener connection while the offer is good.
    lock_key bigint NOT NULL,
    -- Where a send tells the worker of the runs it handed on.
    channel text NOT NULL,
    offered_at timestamptz NOT NULL DEFAULT now()
);

-- `send_events` (same parameters, same answer) for any batch; a batch of
-- one event due now goes to the oldest good offer of a worker that runs a
-- function it triggers, if any (SKIP LOCKED: a send never waits for
-- another's offer).
CREATE FUNCTION durastep.send_events_offered(
    p_ids uuid[], p_names text[], p_payloads text[], p_idems text[], p_starts timestamptz[], p_priorities int[])
    RETURNS TABLE (ord bigint, id uuid, inserted boolean, run_ids uuid[], _n boolean, _touched bigint)
    LANGUAGE plpgsql VOLATILE
    SET jit = off
    SET plan_cache_mode = force_generic_plan
    AS $fn$
#variable_conflict use_column
DECLARE
    o record;
    s record;
BEGIN
    IF cardinality(p_ids) = 1 AND p_starts[1] IS NULL THEN
        FOR o IN
            SELECT w.worker_id, w.version_ids, w.versions, w.slots, w.lease_s, w.lock_key, w.channel
              FROM durastep.worker_offers w
             WHERE w.slots > 0
               AND EXISTS (SELECT 1 FROM durastep.functions f
                            WHERE f.triggers @> p_names
                              AND (f.id, f.version) IN (SELECT v.* FROM unnest(w.version_ids, w.versions) AS v))
             ORDER BY w.offered_at
               FOR UPDATE OF w SKIP LOCKED
        LOOP
            IF pg_try_advisory_xact_lock(o.lock_key) THEN
                -- No listener holds its key: the worker would never hear of the run.
                DELETE FROM durastep.worker_offers w WHERE w.worker_id = o.worker_id;
                CONTINUE;
            END IF;
            -- The send, and what the worker needs to start the runs it handed on
            -- (a claim's answer for a new run: its event's payload, no steps).
            SELECT h.sent_id, h.sent_inserted, h.sent_run_ids, h.sent_n,
                   count(h.id) AS handed,
                   jsonb_build_object(
                       'claim', max(h.claim), 'now', max(h.db_now), 'event', h.sent_id,
                       'payload', (array_agg(h.payload))[1],
                       'runs', jsonb_agg(jsonb_build_object(
                           'id', h.id, 'epoch', h.lease_epoch, 'function', h.function_id, 'version', h.version,
                           'attempt', h.attempt, 'priority', h.priority, 'run_at', h.run_at)
                         ) FILTER (WHERE h.id IS NOT NULL)) AS notice
              INTO s
              FROM durastep.send_event_to_worker(p_ids[1], p_names[1], p_payloads[1], p_idems[1], p_priorities[1],
                       o.worker_id, o.lease_s, o.version_ids, o.versions, o.slots) h
             GROUP BY h.sent_id, h.sent_inserted, h.sent_run_ids, h.sent_n;
            IF s.handed > 0 THEN
                UPDATE durastep.worker_offers w SET slots = greatest(w.slots - s.handed, 0)
                 WHERE w.worker_id = o.worker_id;
                -- On the worker's channel; without the payload (`cut`) past 7,900 bytes.
                PERFORM pg_notify(o.channel,
                                  CASE WHEN octet_length(s.notice::text) <= 7900 THEN s.notice::text
                                       ELSE (s.notice - 'payload' || '{"cut": true}')::text END);
            END IF;
            RETURN QUERY SELECT 1::bigint, s.sent_id, s.sent_inserted, s.sent_run_ids, s.sent_n, 0::bigint;
            RETURN;
        END LOOP;
    END IF;
    RETURN QUERY SELECT * FROM durastep.send_events(p_ids, p_names, p_payloads, p_idems, p_starts, p_priorities);
END
$fn$;

-- A role that may send (execute send_events) may send this way; PUBLIC
-- keeps or loses EXECUTE on it as on send_events (as 0035 did for its pair).
-- The table's privileges are the owner's to grant (docs/security.md).
DO $do$
DECLARE
    g record;
BEGIN
    EXECUTE 'REVOKE EXECUTE ON FUNCTION durastep.send_events_offered(uuid[], text[], text[], text[], timestamptz[], integer[]) FROM PUBLIC';
    FOR g IN
        SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS grantee
          FROM pg_proc p, aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
          LEFT JOIN pg_roles r ON r.oid = a.grantee
         WHERE p.oid = 'durastep.send_events(uuid[], text[], text[], text[], timestamptz[], integer[])'::regprocedure
           AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION durastep.send_events_offered(uuid[], text[], text[], text[], timestamptz[], integer[]) TO %s', g.grantee);
    END LOOP;
END
$do$;
