-- A slot given back wakes its parked run also when another transaction
-- holds that run's row for a moment. `release_flow` (0026, 0028) woke the
-- parked runs of the keys it gave slots back to with FOR UPDATE SKIP
-- LOCKED, so a parked run whose row someone else held at that moment stayed
-- parked until its recheck (30 s for a full concurrency key), although its
-- key had a free slot. Claims hold such rows: a claim whose snapshot was
-- taken before another claim parked the run reads it as due, and its
-- FOR UPDATE SKIP LOCKED then locks the row's newest version, finds it no
-- longer due and skips it, but keeps the lock until it commits. That is
-- what a claim racing the claim that parks the run does, at the moment a
-- slot frees (the worker that freed it claims again at once): a test that
-- cancels a limited run and sends the next one failed about once in thirty
-- runs under load, the next run parked for 30 s (docs/architecture.md
-- "Flow control", "Slots given back").
--
-- Now, when the first pass woke fewer runs of a key than the slots it gave
-- back while runs parked on that key are left that it did not take (so
-- held by another transaction), a second pass waits for them, for at most
-- half of `deadlock_timeout` (`lock_timeout` set for that statement only, in
-- a block that catches its expiry; then the recheck stays the safety net).
-- The wait is bounded because a transaction that holds a parked run may
-- wait for this one: a statement that cancels a key's parked run and a
-- running run of the same key locks the parked row, then waits in its own
-- release for the key row this one holds; giving up before Postgres's
-- deadlock check runs lets that statement go on instead of aborting it. A
-- user's transaction that holds a parked run (a `send_in` whose singleton
-- cancels it) costs the statement giving slots back that wait, once. The
-- common releases are unchanged: no parked run left means no second pass
-- and no subtransaction.
--
-- The rest is 0028's text.
CREATE OR REPLACE FUNCTION durastep.release_flow() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    mark text := 'durastep.flow_releases_' || pg_trigger_depth();
    rules text[];
    keys text[];
    ns integer[];
    woken text[];
    -- Per key with a run left that the first pass could not lock: how many
    -- slots it gave back that woke no run.
    short_rules text[];
    short_keys text[];
    short_ns integer[];
    lock_wait text;
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
    -- A new statement, so a new snapshot: it sees every park committed by a
    -- claim that held a row. Rows another transaction holds are skipped here
    -- and counted: the keys left short, with a parked run not taken.
    WITH pick AS MATERIALIZED (
        SELECT w.id, u.rule, u.key FROM unnest(rules, keys, ns) AS u(rule, key, n)
         CROSS JOIN LATERAL (
             SELECT w.id FROM durastep.runs w
              WHERE w.park_rule = u.rule AND w.park_key = u.key AND w.state = 'queued'
              ORDER BY w.priority DESC, w.created_at
              LIMIT u.n
              FOR UPDATE SKIP LOCKED) w),
    due AS (
        UPDATE durastep.runs r SET run_at = durastep.now(), park_rule = NULL, park_key = NULL
          FROM pick WHERE r.id = pick.id
        RETURNING r.function_id),
    short AS (
        SELECT u.rule, u.key, u.n - (SELECT count(*) FROM pick WHERE pick.rule = u.rule AND pick.key = u.key) AS n
          FROM unnest(rules, keys, ns) AS u(rule, key, n))
    SELECT (SELECT array_agg(due.function_id) FROM due),
           array_agg(s.rule ORDER BY s.rule, s.key), array_agg(s.key ORDER BY s.rule, s.key),
           array_agg(s.n::integer ORDER BY s.rule, s.key)
      INTO woken, short_rules, short_keys, short_ns
      FROM short s
     WHERE s.n > 0
       AND EXISTS (SELECT 1 FROM durastep.runs w
                    WHERE w.park_rule = s.rule AND w.park_key = s.key AND w.state = 'queued'
                      AND w.id NOT IN (SELECT pick.id FROM pick));
    IF short_rules IS NOT NULL THEN
        -- Wait for the rows held, at most half of deadlock_timeout (at least
        -- 1 ms: 0 would mean no bound), and no longer than the session's own
        -- lock_timeout, if it has one.
        lock_wait := greatest((extract(epoch FROM current_setting('deadlock_timeout')::interval) * 500)::bigint, 1)::text;
        IF current_setting('lock_timeout') <> '0' THEN
            lock_wait := least(lock_wait::bigint,
                               (extract(epoch FROM current_setting('lock_timeout')::interval) * 1000)::bigint)::text;
        END IF;
        DECLARE
            saved text := current_setting('lock_timeout');
            late text[];
        BEGIN
            PERFORM set_config('lock_timeout', lock_wait, true);
            WITH due AS (
                UPDATE durastep.runs r SET run_at = durastep.now(), park_rule = NULL, park_key = NULL
                 WHERE r.id IN (SELECT w.id FROM unnest(short_rules, short_keys, short_ns) AS u(rule, key, n)
                                CROSS JOIN LATERAL (
                                    SELECT w.id FROM durastep.runs w
                                     WHERE w.park_rule = u.rule AND w.park_key = u.key AND w.state = 'queued'
                                     ORDER BY w.priority DESC, w.created_at
                                     LIMIT u.n
                                     FOR UPDATE) w)
                RETURNING r.function_id)
            SELECT array_agg(due.function_id) INTO late FROM due;
            PERFORM set_config('lock_timeout', saved, true);
            woken := woken || late;
        EXCEPTION WHEN lock_not_available THEN
            -- Still held: the recheck wakes it. The block's setting is undone.
            NULL;
        END;
    END IF;
    IF woken IS NOT NULL THEN
        PERFORM durastep.wake_workers(woken);
    END IF;
    RETURN NULL;
END $$;
