-- A worker finds the runs handed to it through its offer whose notice its
-- listener never read (issue 12; docs/architecture.md "A lost hand-over
-- notice").
--
-- Since 0036 a one-event send of any process may take an idle worker's
-- offer: it inserts the new runs claimed for that worker, lists them in a
-- claim record, and names them on the worker's secret channel. A notice is
-- lost when the listener's connection dies with it unread (Postgres
-- delivers a notification only to the sessions listening when its
-- transaction commits). Until now the runs then waited for their lease to
-- lapse (30 s by default) and for a reaper to queue them again.
--
-- Now the send marks the claim record with the worker it handed the runs
-- to (`offered_to`), and a worker whose listener has connected again lists
-- the records marked for it and starts the runs of those whose notice it
-- never read. The column is NULL for every other record (a claim's, a send's
-- to a worker of its own process), and nothing indexes it: the worker reads
-- the few records left after a reconnect by a scan, and the send's update of
-- a row it inserted in the same transaction is a HOT update.
ALTER TABLE durastep.run_claims ADD COLUMN offered_to uuid;

-- `send_events_offered` as in 0036, marking the record of the runs it
-- handed on.
CREATE OR REPLACE FUNCTION durastep.send_events_offered(
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
                   count(h.id) AS handed, max(h.claim) AS claim,
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
                -- The record of the runs says whose offer they were handed through:
                -- a worker whose listener lost this notice finds them by it.
                UPDATE durastep.run_claims c SET offered_to = o.worker_id WHERE c.id = s.claim;
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
