-- A replayed run whose cancelled attempt is still stopping (issue 11: found by
-- the randomized workload's soak tier as two bodies of one run at once).
--
-- Replaying a cancelled run used to clear its worker_id at once, which gave
-- back the slots its cancelled attempt still held and made the run claimable
-- while that attempt's body ran on: a new attempt of the same run could start
-- beside it (n+1 bodies on a concurrency key). Now the replay keeps worker_id
-- and the old lease: the row is 'queued' but still holds its slots, and is due
-- only when the old lease lapses. When the worker has dropped the cancelled
-- handler (`end_cancelled_attempt`) or the reaper finds the lease lapsed
-- (`release_lapsed_cancels`), worker_id is cleared, the slots are given back
-- and the run is due at once.
--
-- So a row holds its concurrency slots while it is 'running', and while it is
-- 'cancelled' or 'queued' with a worker_id (an attempt whose body may still run).
-- No other path leaves a 'queued' row with a worker_id.

CREATE OR REPLACE FUNCTION durastep.release_flow() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    rules text[];
    keys text[];
    ns integer[];
BEGIN
    PERFORM pg_notify('durastep_cancelled', n.id::text || ':' || n.lease_epoch)
       FROM new_runs n JOIN old_runs o ON o.id = n.id
      WHERE o.state = 'running' AND n.state = 'cancelled';
    SELECT array_agg(x.rule ORDER BY x.rule, x.key), array_agg(x.key ORDER BY x.rule, x.key),
           array_agg(x.n ORDER BY x.rule, x.key)
      INTO rules, keys, ns
      FROM (SELECT h->>0 AS rule, h->>1 AS key, count(*)::integer AS n
              FROM old_runs o
              LEFT JOIN new_runs n ON n.id = o.id
              CROSS JOIN LATERAL jsonb_array_elements(o.flow_held) AS h
             WHERE o.flow_held IS NOT NULL
               AND (o.state = 'running' OR (o.state IN ('cancelled', 'queued') AND o.worker_id IS NOT NULL))
               AND NOT (n.id IS NOT NULL AND n.lease_epoch = o.lease_epoch
                        AND (n.state = 'running'
                             OR (n.state IN ('cancelled', 'queued') AND n.worker_id IS NOT NULL)))
             GROUP BY 1, 2) x;
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
    UPDATE durastep.runs r SET run_at = durastep.now(), park_rule = NULL, park_key = NULL
     WHERE r.id IN (SELECT w.id FROM unnest(rules, keys, ns) AS u(rule, key, n)
                    CROSS JOIN LATERAL (
                        SELECT w.id FROM durastep.runs w
                         WHERE w.park_rule = u.rule AND w.park_key = u.key AND w.state = 'queued'
                         ORDER BY w.priority DESC, w.created_at
                         LIMIT u.n
                         FOR UPDATE SKIP LOCKED) w);
    IF FOUND THEN
        PERFORM pg_notify('durastep_wakeup', '');
    END IF;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION durastep.release_flow_deleted() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    k record;
BEGIN
    FOR k IN
        SELECT h->>0 AS rule, h->>1 AS key, count(*)::integer AS n
          FROM old_runs o CROSS JOIN LATERAL jsonb_array_elements(o.flow_held) AS h
         WHERE o.flow_held IS NOT NULL
           AND (o.state = 'running' OR (o.state IN ('cancelled', 'queued') AND o.worker_id IS NOT NULL))
         GROUP BY 1, 2
         ORDER BY 1, 2
    LOOP
        UPDATE durastep.flow_keys SET in_use = greatest(in_use - k.n, 0)
         WHERE rule = k.rule AND key = k.key;
    END LOOP;
    RETURN NULL;
END $$;

-- The reaper finds stopping attempts of replayed runs too.
DROP INDEX durastep.runs_cancel_stopping;
CREATE INDEX runs_attempt_stopping ON durastep.runs (id)
    WHERE state IN ('cancelled', 'queued') AND worker_id IS NOT NULL;
