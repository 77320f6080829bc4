-- The fast claim: up to $2 due runs of the functions $1, none of which has a
-- claim-time flow rule (concurrency, throttle, rate limit, back-pressure).
-- $3: the lease in seconds; $4: the claiming worker; $5, $6: the (function,
-- version) pairs the worker has a handler for (a run started under another
-- version is left to a worker that has one).
--
-- Two statements in one text (`store::Queue`). This text is the claim a
-- worker sends after a claim of its class came back short: it reads the due
-- runs first. The claim it sends after a full one, expecting a backlog, is
-- this text without its lines that end with `-- few` (`store::claim`): the
-- walk of `runs_due` alone, the statement every claim was before
-- 2026-12-04. Two statements, not one with the hint as a parameter: the one
-- statement with both ways cost busy drains 5-10% (planning it, and starting
-- both branches' nodes on every execution), although a backlog runs only
-- the walk (docs/performance.md "Two claim statements").
--
-- Written for a generic plan (Postgres plans it once per connection): the candidates are an
-- array built by a sub-select that walks `runs_due` in priority then due
-- order and stops at the limit, and the UPDATE finds its rows by `id = ANY`.
-- The clock is read once (an InitPlan), not per row.
--
-- Guards, so that a run this statement may not handle is left for the full
-- claim or for maintenance instead of being started wrongly:
-- * a function with rows in `function_flow` (another build registered rules
--   for it) is skipped: only the full claim takes its runs;
-- * a run past its start or finish deadline is skipped: maintenance
--   (`expire_timeouts`) cancels it with its reason, as the full claim would.
--
-- The claim writes no history row: it notes each attempt's start on its run
-- (`attempt_claimed_at`, `attempt_claim_id`), and the row that ends the
-- attempt carries it (migration 0044). It flips `history_noted`, so that
-- the `runs_changed` trigger stays quiet for it (migration 0020).
--
-- Every parameter, read only through this CTE, so that a custom plan cannot
-- see one and costs exactly what the generic plan costs (Postgres then keeps
-- the generic plan after five executions): read directly, a custom plan
-- looked a little cheaper (the lease's interval folded into a constant, the
-- arrays' lengths known), and a worker's claims were planned again on every
-- execution (`tests/plans.rs`).
WITH p AS MATERIALIZED (
    SELECT $1::text[] AS functions, $2::bigint AS n, make_interval(secs => $3) AS lease, $4::uuid AS worker,
           $5::text[] AS version_ids, $6::int[] AS versions),
-- The clock, read once; and this claim's commit made asynchronous (it does
-- not wait for its WAL flush). Safe because every claim moves the lease epoch
-- forward by a random amount: a claim lost in a crash and made again by
-- another worker sets another epoch, so the first attempt's writes stay
-- fenced out; and any write that attempt makes durable (a synchronous commit)
-- flushes the WAL past the claim first (docs/architecture.md "The claim's
-- commit").
t AS MATERIALIZED (SELECT durastep.now() AS now, set_config('synchronous_commit', 'off', true) AS commit_mode),
-- The id of this claim's record (migration 0034), drawn before the runs are
-- updated: each carries it in `claim_id`, which keeps the trigger that lists
-- the attempts of older claims quiet.
kid AS MATERIALIZED (SELECT nextval('durastep.run_claims_id_seq') AS id),
-- After a short claim: every run this claim may take that is due now, in
-- due order, one more than the claim takes at most: an index scan of
-- `runs_next_due` (ordered by `run_at` alone) ends at the first run not yet
-- due, however many runs sleep or wait behind it. Its conditions are the
-- walk's below, which must stay alike: a run one of them admits and the
-- other not would be claimed or left depending on the way taken.
due AS MATERIALIZED (                                                                     -- few
    SELECT c.id FROM durastep.runs c                                                      -- few
     WHERE c.state IN ('queued', 'sleeping', 'waiting') AND c.run_at <= (SELECT now FROM t) -- few
       AND c.function_id = ANY ((SELECT p.functions FROM p)::text[])                      -- few
       AND (c.function_id, c.version) IN (SELECT v.* FROM p, unnest(p.version_ids, p.versions) AS v) -- few
       AND NOT EXISTS (SELECT 1 FROM durastep.function_flow ff WHERE ff.function_id = c.function_id) -- few
       AND (c.deadline_at IS NULL OR c.deadline_at >= (SELECT now FROM t))                -- few
       AND (c.start_by IS NULL OR c.started_at IS NOT NULL OR c.start_by >= (SELECT now FROM t)) -- few
     ORDER BY c.run_at                                                                    -- few
     LIMIT (SELECT p.n FROM p) + 1),                                                      -- few
-- The due runs, under a new lease epoch: 1 to 2^31 above the last one, at
-- random. Highest priority first, then earliest due. After a full claim: a
-- walk of `runs_due` in priority then due order, which stops once it has
-- the claim's runs. After a short one, one of two ways (the count of `due`
-- decides; the other is never executed):
-- * all of them fit in this claim: the best of `due`, locked by id (the
--   state and due time checked again on the row version the lock returns);
-- * more are due: the walk. (It walks every sleeping and waiting run's
--   entry when fewer runs are due than the claim asks for: docs/scaling.md
--   "Sleeping runs". Under a backlog the walk alone reads least.)
claimed AS (
    UPDATE durastep.runs r
       SET state = 'running', lease_epoch = r.lease_epoch + 1 + floor(random() * 2147483648)::bigint,
           lease_expires_at = (SELECT now FROM t) + (SELECT p.lease FROM p),
           worker_id = (SELECT p.worker FROM p), started_at = coalesce(r.started_at, (SELECT now FROM t)),
           park_rule = NULL, park_key = NULL, flow_held = NULL, history_noted = NOT r.history_noted,
           claim_id = (SELECT k.id FROM kid k),
           attempt_claimed_at = (SELECT now FROM t), attempt_claim_id = (SELECT k.id FROM kid k)
     WHERE r.id = ANY (ARRAY(
            SELECT a.id FROM (                                                            -- few
                SELECT c.id FROM durastep.runs c                                          -- few
                 WHERE c.id IN (SELECT d.id FROM due d)                                   -- few
                   AND (SELECT count(*) FROM due) <= (SELECT p.n FROM p)                  -- few
                   AND c.state IN ('queued', 'sleeping', 'waiting') AND c.run_at <= (SELECT now FROM t) -- few
                 ORDER BY c.priority DESC, c.run_at                                       -- few
                 LIMIT (SELECT p.n FROM p)                                                -- few
                 FOR UPDATE OF c SKIP LOCKED) a                                           -- few
            UNION ALL                                                                     -- few
            SELECT b.id FROM (                                                            -- few
            SELECT c.id FROM durastep.runs c
             WHERE c.state IN ('queued', 'sleeping', 'waiting') AND c.run_at <= (SELECT now FROM t)
               AND c.function_id = ANY ((SELECT p.functions FROM p)::text[])
               AND (c.function_id, c.version) IN (SELECT v.* FROM p, unnest(p.version_ids, p.versions) AS v)
               AND NOT EXISTS (SELECT 1 FROM durastep.function_flow ff WHERE ff.function_id = c.function_id)
               AND (c.deadline_at IS NULL OR c.deadline_at >= (SELECT now FROM t))
               AND (c.start_by IS NULL OR c.started_at IS NOT NULL OR c.start_by >= (SELECT now FROM t))
             ORDER BY c.priority DESC, c.run_at
             LIMIT (SELECT p.n FROM p)
             FOR UPDATE OF c SKIP LOCKED
            ) b WHERE (SELECT count(*) FROM due) > (SELECT p.n FROM p)                    -- few
            ))
    RETURNING r.id, r.function_id, r.version, r.event_id, r.attempt, r.lease_epoch, r.parent_run_id, r.parent_step_key,
              r.priority, r.run_at, r.lease_expires_at),
-- Their claim record, for the reaper: one row for the whole claim
-- (migration 0034; a running run is found through it, not an index of `runs`).
claim AS (
    INSERT INTO durastep.run_claims (id, recheck_at, run_ids, epochs)
    SELECT (SELECT k.id FROM kid k), min(c.lease_expires_at), array_agg(c.id), array_agg(c.lease_epoch)
      FROM claimed c HAVING count(*) > 0
    RETURNING id)
-- Each claimed run with its input; its steps and journal are joined by
-- run_records.sql, which the code appends.
SELECT c.id, c.function_id, c.version, c.event_id, c.attempt, c.lease_epoch,
          (SELECT e.payload FROM durastep.events e WHERE e.id = c.event_id) AS payload,
          c.parent_run_id, c.parent_step_key, (SELECT now FROM t) AS db_now, c.priority, c.run_at,
          st.step_keys, st.step_outputs, st.step_positions, st.step_kinds, jr.journal_positions, jr.journal_kinds, jr.journal_keys,
          (SELECT k.id FROM claim k) AS claim, 0::bigint AS moved
  FROM claimed c
