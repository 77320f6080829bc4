-- The flow-release trigger without transition tables. `runs_release_flow`
-- (0004, redefined by 0006 and 0015) was a statement trigger with transition
-- tables: Postgres copied the old and the new version of every row of every
-- UPDATE of `runs` into them, also in the claims and the group commit's
-- completions, whose runs hold no flow slots (the fast claim takes only
-- runs of functions without flow rules). In the one-process drain of the
-- throughput bench the trigger cost about 10% of the CPU per run
-- (docs/performance.md "Flow slots given back without transition tables").
--
-- Now a row trigger, `runs_note_flow_release`, fires only for the rows that
-- matter (`WHEN` the old row held slots, or the run went from running to
-- cancelled): it announces a cancelled attempt on `durastep_cancelled` and,
-- for a row that held its slots before the update and does not after it
-- (or got a new epoch), writes its (rule, key) pairs to
-- `durastep.flow_releases`, tagged with the transaction and the trigger
-- depth, and marks that depth in a transaction-local setting. The statement
-- trigger, fired after all row triggers of its statement at the same depth,
-- returns at once when its depth is not marked; otherwise it takes its
-- statement's pairs out of `flow_releases` and gives the slots back exactly
-- as before: the key rows locked in (rule, key) order, `in_use` decremented,
-- parked runs woken in a new statement. A statement run inside a trigger
-- (the parent's resume when a child ends) has a greater depth, so each
-- statement gives back its own rows' slots, as with transition tables.
--
-- `flow_releases` holds rows only inside the transaction that wrote them
-- (the statement trigger deletes them), so it is UNLOGGED: a crash loses
-- nothing that outlives a transaction. A savepoint rolled back takes its
-- rows and its mark with it. Disabling `runs_release_flow` alone (never
-- done by Durastep) would leave rows behind; disable both triggers, or
-- neither.
CREATE UNLOGGED TABLE durastep.flow_releases (
    xact  xid8 NOT NULL DEFAULT pg_current_xact_id(),
    depth integer NOT NULL,
    rule  text NOT NULL,
    key   text NOT NULL
);
CREATE INDEX flow_releases_statement ON durastep.flow_releases (xact, depth);

CREATE FUNCTION durastep.note_flow_release() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.state = 'running' AND NEW.state = 'cancelled' THEN
        PERFORM pg_notify('durastep_cancelled', NEW.id::text || ':' || NEW.lease_epoch);
    END IF;
    -- A row holds its slots while it is 'running', and while it is
    -- 'cancelled' or 'queued' with a worker_id (an attempt whose body may
    -- still run; 0015).
    IF OLD.flow_held IS NOT NULL
       AND (OLD.state = 'running' OR (OLD.state IN ('cancelled', 'queued') AND OLD.worker_id IS NOT NULL))
       AND NOT (NEW.lease_epoch = OLD.lease_epoch
                AND (NEW.state = 'running' OR (NEW.state IN ('cancelled', 'queued') AND NEW.worker_id IS NOT NULL)))
    THEN
        INSERT INTO durastep.flow_releases (depth, rule, key)
        SELECT pg_trigger_depth(), h->>0, h->>1 FROM jsonb_array_elements(OLD.flow_held) AS h;
        PERFORM set_config('durastep.flow_releases_' || pg_trigger_depth(), 'pending', true);
    END IF;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION durastep.release_flow() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    mark text := 'durastep.flow_releases_' || pg_trigger_depth();
    rules text[];
    keys text[];
    ns integer[];
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

DROP TRIGGER runs_release_flow ON durastep.runs;
CREATE TRIGGER runs_release_flow AFTER UPDATE ON durastep.runs
    FOR EACH STATEMENT EXECUTE FUNCTION durastep.release_flow();
CREATE TRIGGER runs_note_flow_release AFTER UPDATE ON durastep.runs
    FOR EACH ROW
    WHEN (OLD.flow_held IS NOT NULL OR (OLD.state = 'running' AND NEW.state = 'cancelled'))
    EXECUTE FUNCTION durastep.note_flow_release();
