-- The full claim: up to $2 due runs of the functions $1, with flow control
-- (concurrency, throttle, rate limit, back-pressure) decided in the same
-- statement. $3: the lease in seconds; $4: the claiming worker; $5: how long a
-- run parked by a concurrency rule waits before it is looked at again; $6, $7:
-- the (function, version) pairs the worker has a handler for. Returns one row
-- per claimed run, and the count of runs it parked, skipped, woke or expired
-- (`moved`; a row with a null id when it claimed none).
--
-- Two statements in one text, as claim_fast.sql: this one reads the due runs
-- first (sent after a short claim); without its lines that end with `-- few`
-- it walks `runs_due` alone (sent after a full claim).
--
-- Every parameter, read only through this CTE: a custom plan cannot see one,
-- so it costs exactly what the generic plan costs and Postgres keeps the
-- generic one after five executions. Read directly, a custom plan saw one
-- function where the generic plan assumed ten, always looked cheaper, and
-- the statement was planned again on every execution (1-1.5 ms per claim here
-- with other functions' runs queued: `benches/sql/plans.sh`,
-- docs/performance.md "Plans kept, the ping before each statement").
WITH p AS MATERIALIZED (
    SELECT $1::text[] AS functions, $2::bigint AS n, make_interval(secs => $3) AS lease, $4::uuid AS worker,
           make_interval(secs => $5) AS recheck, $6::text[] AS version_ids, $7::int[] AS versions),
-- After a short claim: every run this claim may take that is due now, in
-- due order, one more than the claim takes at most: an index scan of
-- `runs_next_due` ends at the first run not yet due, however many runs
-- sleep or wait behind it.
due AS MATERIALIZED (                                                                     -- few
    SELECT id FROM durastep.runs                                                          -- few
     WHERE state IN ('queued', 'sleeping', 'waiting') AND run_at <= durastep.now()        -- few
       AND function_id = ANY ((SELECT p.functions FROM p)::text[])                        -- few
       AND (function_id, version) IN (SELECT v.* FROM p, unnest(p.version_ids, p.versions) AS v) -- few
     ORDER BY run_at                                                                      -- few
     LIMIT (SELECT p.n FROM p) + 1),                                                      -- few
-- The due candidates, in priority then due order, skipping rows others hold:
-- after a full claim a walk of `runs_due`, which stops once it has the
-- claim's runs; after a short one, one of two ways as in claim_fast.sql (the
-- count of `due` decides; the other is never executed): all of them fit in
-- this claim, so the best of `due`, locked by id (state and due time checked
-- again on the row version the lock returns); or more are due: the walk.
cand AS MATERIALIZED (
    SELECT a.* FROM (                                                                     -- few
        SELECT id, function_id, event_id, priority, run_at,                               -- few
               (started_at IS NULL AND start_by < durastep.now()) AS late,                -- few
               (deadline_at < durastep.now()) AS overdue                                  -- few
          FROM durastep.runs                                                              -- few
         WHERE id IN (SELECT d.id FROM due d)                                             -- few
           AND (SELECT count(*) FROM due) <= (SELECT p.n FROM p)                          -- few
           AND state IN ('queued', 'sleeping', 'waiting') AND run_at <= durastep.now()    -- few
         ORDER BY priority DESC, run_at                                                   -- few
         LIMIT (SELECT p.n FROM p)                                                        -- few
         FOR UPDATE SKIP LOCKED) a                                                        -- few
    UNION ALL                                                                             -- few
    SELECT b.* FROM (                                                                     -- few
        SELECT id, function_id, event_id, priority, run_at,
               (started_at IS NULL AND start_by < durastep.now()) AS late,
               (deadline_at < durastep.now()) AS overdue
          FROM durastep.runs
         WHERE state IN ('queued', 'sleeping', 'waiting') AND run_at <= durastep.now()
           AND function_id = ANY ((SELECT p.functions FROM p)::text[])
           -- Versions: only runs of a (function, version) this worker has a handler for.
           AND (function_id, version) IN (SELECT v.* FROM p, unnest(p.version_ids, p.versions) AS v)
         ORDER BY priority DESC, run_at
         LIMIT (SELECT p.n FROM p)
         FOR UPDATE SKIP LOCKED
    ) b WHERE (SELECT count(*) FROM due) > (SELECT p.n FROM p)                               -- few
    ),
-- Candidates past their start or finish deadline are cancelled, not started.
expired AS (
    UPDATE durastep.runs x
       SET state = 'cancelled', finished_at = durastep.now(),
           cancel_reason = CASE WHEN cand.overdue THEN 'finish timeout: not finished by ' || x.deadline_at
                                ELSE 'start timeout: not started by ' || x.start_by END
      FROM cand WHERE x.id = cand.id AND (cand.late OR cand.overdue)
    RETURNING x.id),
-- And their waits removed.
gone AS (DELETE FROM durastep.waits w WHERE w.run_id IN (SELECT id FROM expired)),
-- The candidates that may start.
live AS MATERIALIZED (
    SELECT id, function_id, event_id, priority, run_at FROM cand
     WHERE NOT coalesce(cand.late, false) AND NOT coalesce(cand.overdue, false)),
-- The clock, read once.
t AS (SELECT durastep.now() AS now),
-- The id of this claim's record (migration 0034), drawn before the runs are
-- updated: each carries it in `claim_id`, which keeps the trigger that lists
-- the attempts of older claims quiet.
kid AS MATERIALIZED (SELECT nextval('durastep.run_claims_id_seq') AS id),
-- Each live candidate's flow keys, read from its event data.
ck AS MATERIALIZED (
    SELECT c.id, c.priority, c.run_at, ff.rule, fr.kind, fr.capacity, fr.burst,
           CASE WHEN fr.capacity > 0 THEN fr.period_s / fr.capacity ELSE 0 END AS emit_s,
           durastep.flow_key(e.payload, ff.key_path, false, c.function_id, ff.key_pointer) AS key
      FROM live c
      JOIN durastep.function_flow ff ON ff.function_id = c.function_id
      JOIN durastep.flow_rules fr ON fr.name = ff.rule
      JOIN durastep.events e ON e.id = c.event_id),
-- Key rows that do not exist yet are created.
newkeys AS (
    INSERT INTO durastep.flow_keys (rule, key)
    SELECT DISTINCT ck.rule, ck.key FROM ck
     WHERE NOT EXISTS (SELECT 1 FROM durastep.flow_keys f WHERE f.rule = ck.rule AND f.key = ck.key)
     ORDER BY 1, 2
    ON CONFLICT DO NOTHING),
-- The key rows, locked in order; a row another claimer holds is skipped.
fk AS MATERIALIZED (
    SELECT f.rule, f.key, f.in_use, f.tat, f.horizon, f.paused_until FROM durastep.flow_keys f
     WHERE (f.rule, f.key) IN (SELECT rule, key FROM ck)
     ORDER BY f.rule, f.key
     FOR UPDATE SKIP LOCKED),
-- Each candidate key with its locked row (locked = false: someone else holds it).
ckf AS MATERIALIZED (
    SELECT ck.*, (fk.rule IS NOT NULL) AS locked, fk.in_use, fk.tat, fk.horizon, fk.paused_until
      FROM ck LEFT JOIN fk ON fk.rule = ck.rule AND fk.key = ck.key),
-- Candidates all of whose key rows this statement holds.
lockable AS MATERIALIZED (
    SELECT c.id FROM live c
     WHERE NOT EXISTS (SELECT 1 FROM ckf WHERE ckf.id = c.id AND NOT ckf.locked)),
-- Per key, each candidate ranked and judged by its rule (not rate limits).
judged AS MATERIALIZED (
    SELECT x.*, greatest(coalesce(x.tat, t.now), t.now) AS base,
           CASE x.kind
             WHEN 'concurrency' THEN x.in_use + x.rn <= x.capacity
             WHEN 'throttle' THEN greatest(coalesce(x.tat, t.now), t.now)
                  + make_interval(secs => (x.rn - 1 - x.burst) * x.emit_s) <= t.now
             ELSE x.paused_until IS NULL OR x.paused_until <= t.now
           END AS ok
      FROM (SELECT ckf.*, row_number() OVER (PARTITION BY ckf.rule, ckf.key
                                             ORDER BY ckf.priority DESC, ckf.run_at, ckf.id) AS rn
              FROM ckf WHERE ckf.kind <> 'rate_limit' AND ckf.id IN (SELECT id FROM lockable)) x, t),
-- Candidates every concurrency, throttle and back-pressure rule admits.
pre AS MATERIALIZED (
    SELECT l.id FROM lockable l
     WHERE NOT EXISTS (SELECT 1 FROM judged j WHERE j.id = l.id AND NOT j.ok)),
-- Of those, each judged by its rate limits (GCRA on the rank).
rated AS MATERIALIZED (
    SELECT x.*, greatest(coalesce(x.tat, t.now), t.now)
                + make_interval(secs => (x.rn - 1 - x.burst) * x.emit_s) <= t.now AS ok
      FROM (SELECT ckf.*, row_number() OVER (PARTITION BY ckf.rule, ckf.key
                                             ORDER BY ckf.priority DESC, ckf.run_at, ckf.id) AS rn
              FROM ckf WHERE ckf.kind = 'rate_limit' AND ckf.id IN (SELECT id FROM pre)) x, t),
-- The candidates to start.
admit AS MATERIALIZED (
    SELECT p.id FROM pre p WHERE NOT EXISTS (SELECT 1 FROM rated r WHERE r.id = p.id AND NOT r.ok)),
-- Candidates a rate limit refuses: skipped, with the reason.
skip AS MATERIALIZED (
    SELECT r.id, min(format('rate limit %s: over %s per %s s for key %s',
                            r.rule, r.capacity, r.emit_s * r.capacity, r.key)) AS reason
      FROM rated r WHERE NOT r.ok GROUP BY r.id),
-- Refused by another rule: when it could start next.
refused AS MATERIALIZED (
    SELECT j.id, j.rule, j.key, j.kind,
           CASE j.kind
             WHEN 'concurrency' THEN t.now + (SELECT p.recheck FROM p)
             WHEN 'throttle' THEN greatest(
                  j.base + make_interval(secs => (j.rn - 1 - j.burst) * j.emit_s),
                  coalesce(j.horizon, '-infinity'::timestamptz)
                    + make_interval(secs => (row_number() OVER (PARTITION BY j.rule, j.key ORDER BY j.rn)) * j.emit_s))
             ELSE j.paused_until
           END AS next_at
      FROM judged j, t WHERE NOT j.ok),
-- One park record per refused run: the rule it waits for, and until when.
park AS MATERIALIZED (
    SELECT r.id,
           (array_agg(r.rule ORDER BY (r.kind = 'concurrency') DESC, r.next_at DESC))[1] AS rule,
           (array_agg(r.key ORDER BY (r.kind = 'concurrency') DESC, r.next_at DESC))[1] AS key,
           max(r.next_at) AS run_at
      FROM refused r GROUP BY r.id),
-- Per locked key: how many it admitted, and the throttle horizon.
per_key AS (
    SELECT k.rule, k.key, k.kind, k.emit_s, k.capacity, k.in_use,
           (SELECT count(*) FROM ckf a WHERE a.rule = k.rule AND a.key = k.key
               AND a.id IN (SELECT id FROM admit)) AS n,
           (SELECT max(r.next_at) FROM refused r
             WHERE r.rule = k.rule AND r.key = k.key AND r.kind = 'throttle') AS horizon
      FROM (SELECT DISTINCT rule, key, kind, emit_s, capacity, in_use FROM ckf WHERE locked) k),
-- The key rows updated (slots in use, GCRA time, horizon).
counted AS (
    UPDATE durastep.flow_keys f
       SET in_use = f.in_use + CASE WHEN p.kind = 'concurrency' THEN p.n ELSE 0 END,
           tat = CASE WHEN p.kind IN ('throttle', 'rate_limit') AND p.n > 0
                      THEN greatest(coalesce(f.tat, t.now), t.now) + make_interval(secs => p.n * p.emit_s)
                      ELSE f.tat END,
           horizon = CASE WHEN p.horizon IS NULL THEN f.horizon
                          ELSE greatest(coalesce(f.horizon, p.horizon), p.horizon) END
      FROM per_key p, t
     WHERE f.rule = p.rule AND f.key = p.key AND p.kind <> 'backpressure'
       AND (p.n > 0 OR p.horizon IS NOT NULL)),
-- The admitted runs, under a new lease epoch (1 to 2^31 above the last one,
-- at random, as in the fast claim, which commits asynchronously), with their input.
claimed AS (
    UPDATE durastep.runs r
       SET state = 'running', lease_epoch = r.lease_epoch + 1 + floor(random() * 2147483648)::bigint,
           lease_expires_at = durastep.now() + (SELECT p.lease FROM p),
           worker_id = (SELECT p.worker FROM p), started_at = coalesce(r.started_at, durastep.now()),
           park_rule = NULL, park_key = NULL, history_noted = NOT r.history_noted,
           claim_id = (SELECT k.id FROM kid k),
           -- The attempt's start, which its end's history row carries (0044).
           attempt_claimed_at = durastep.now(), attempt_claim_id = (SELECT k.id FROM kid k),
           flow_held = (SELECT jsonb_agg(jsonb_build_array(j.rule, j.key)) FROM judged j
                         WHERE j.id = r.id AND j.kind = 'concurrency')
      FROM admit, durastep.events e
     WHERE r.id = admit.id AND e.id = r.event_id
    RETURNING r.id, r.function_id, r.version, r.event_id, r.attempt, r.lease_epoch, e.payload,
              r.parent_run_id, r.parent_step_key, durastep.now() AS db_now, r.priority, r.run_at, r.lease_expires_at),
-- Their claim record, for the reaper: one row for the whole claim
-- (migration 0034; a running run is found through it, not an index of `runs`).
claim AS (
    INSERT INTO durastep.run_claims (id, recheck_at, run_ids, epochs)
    SELECT (SELECT k.id FROM kid k), min(c.lease_expires_at), array_agg(c.id), array_agg(c.lease_epoch)
      FROM claimed c HAVING count(*) > 0
    RETURNING id),
-- Refused runs parked until their next possible start.
parked AS (
    UPDATE durastep.runs r SET state = 'queued', run_at = p.run_at, park_rule = p.rule, park_key = p.key
      FROM park p WHERE r.id = p.id
    RETURNING r.id),
-- Rate-limited runs skipped.
skipped AS (
    UPDATE durastep.runs r
       SET state = 'skipped', finished_at = durastep.now(), last_error = s.reason,
           park_rule = NULL, park_key = NULL
      FROM skip s WHERE r.id = s.id
    RETURNING r.id),
-- Parked runs of concurrency keys left with free slots are made due.
woken AS (
    UPDATE durastep.runs r SET run_at = durastep.now(), park_rule = NULL, park_key = NULL
     WHERE r.id IN (
           SELECT w.id FROM per_key p CROSS JOIN LATERAL (
               SELECT w.id FROM durastep.runs w
                WHERE w.park_rule = p.rule AND w.park_key = p.key AND w.state = 'queued'
                  AND w.id NOT IN (SELECT id FROM cand)
                ORDER BY w.priority DESC, w.created_at
                LIMIT greatest(p.capacity - p.in_use - p.n, 0)
                FOR UPDATE SKIP LOCKED) w
            WHERE p.kind = 'concurrency' AND p.capacity - p.in_use - p.n > 0)
    RETURNING r.id)
-- The claimed runs, and how many runs were moved; their steps and journal
-- are joined by run_records.sql, which the code appends.
SELECT c.id, c.function_id, c.version, c.event_id, c.attempt, c.lease_epoch, c.payload, c.db_now,
       st.step_keys, st.step_outputs, st.step_positions, st.step_kinds, jr.journal_positions, jr.journal_kinds, jr.journal_keys,
       c.parent_run_id, c.parent_step_key, c.priority, c.run_at, (SELECT k.id FROM claim k) AS claim,
       (SELECT count(*) FROM parked) + (SELECT count(*) FROM skipped) + (SELECT count(*) FROM woken)
         + (SELECT count(*) FROM expired) AS moved
  FROM (SELECT 1) AS one LEFT JOIN claimed c ON true
