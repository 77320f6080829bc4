-- Each run's (event, function) key in a table of its own, `run_keys`, written
-- once when the run is inserted (issue 12, docs/performance.md "The run's
-- key in a table of its own"). `runs` keeps its primary key as its only full
-- index.
--
-- Why: a claim and a completion are not HOT updates (each changes `state`,
-- which the due queue's indexes name), so each new row version went into
-- every full index of `runs`, `UNIQUE (event_id, function_id)` (0001)
-- included: an entry, a uniqueness check that visits the run's older
-- versions, and B-tree bottom-up deletion of the entries they leave.
-- Counted, that index was 14% of a claim's server instructions and 8% of a
-- flush of 16 checkpoints and 16 completions; a plain index on `event_id`
-- would keep most of it (the entries, not the check, are the cost). A key
-- row is written once per run and never updated by a claim or a completion.
--
-- What the key did and where it goes:
-- * one run per function per event: the primary key of `run_keys`, filled
--   by a statement trigger on every INSERT into `runs`, whatever inserts it
--   (the sends, invoke, failure handlers, tests): a second run of a function
--   for an event fails its statement as before, now on `run_keys_pkey`;
-- * the runs of an event (an event's run count, an idempotent send's
--   answer, pruning's check that no run needs an event): read from
--   `run_keys` by its key's prefix;
-- * a debounced run moves to its newest event (send_events_full's upsert
--   sets `event_id`): a row trigger on `UPDATE OF event_id, function_id`
--   moves its key, and only statements that set one of the two call it;
-- * the foreign key to `events` goes too: its `ON DELETE CASCADE` looked up
--   the runs of every deleted event by `event_id`, which no index of `runs`
--   serves any more, and its check locked the event of every inserted run.
--   Every run is inserted by the statement that inserted its event (only
--   for events that statement inserted), so no run can name an event
--   deleted under it; pruning deletes only events no key names. A delete
--   (or truncate) of events still takes their runs along, by trigger.

-- No run is inserted, updated or deleted between the copy and the triggers.
-- The exclusive lock the DDL below needs, taken first: a weaker one
-- upgraded later could deadlock with a transaction that read `runs` and
-- then waits to write it.
LOCK TABLE durastep.runs, durastep.events IN ACCESS EXCLUSIVE MODE;

CREATE TABLE durastep.run_keys (
    event_id    uuid NOT NULL,
    function_id text NOT NULL,
    run_id      uuid NOT NULL,
    PRIMARY KEY (event_id, function_id));

INSERT INTO durastep.run_keys (event_id, function_id, run_id)
SELECT r.event_id, r.function_id, r.id FROM durastep.runs r;

-- The keys' privileges follow those of runs: a role that inserts runs keys
-- them (the trigger runs with the inserting role's rights), one that updates
-- runs moves a debounced run's key, one that reads or deletes runs reads or
-- deletes their keys. Every grant of the schema is the owner's to give
-- (docs/security.md); these keep a running deployment's roles working
-- until the owner runs the grants of the new version.
DO $grants$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT DISTINCT a.privilege_type AS privilege,
               CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS grantee
          FROM pg_class c
         CROSS JOIN LATERAL aclexplode(c.relacl) a
          LEFT JOIN pg_roles r ON r.oid = a.grantee
         WHERE c.oid = 'durastep.runs'::regclass AND a.grantee <> c.relowner
           AND a.privilege_type IN ('SELECT', 'INSERT', 'UPDATE', 'DELETE')
    LOOP
        EXECUTE format('GRANT %s ON durastep.run_keys TO %s', g.privilege, g.grantee);
    END LOOP;
END
$grants$;

-- The keys of new runs: one statement trigger for every INSERT into runs.
CREATE FUNCTION durastep.key_new_runs() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO durastep.run_keys (event_id, function_id, run_id)
    SELECT n.event_id, n.function_id, n.id FROM new_runs n;
    RETURN NULL;
END $$;

CREATE TRIGGER runs_keyed AFTER INSERT ON durastep.runs
    REFERENCING NEW TABLE AS new_runs
    FOR EACH STATEMENT EXECUTE FUNCTION durastep.key_new_runs();

-- A run moved to another event (a debounced run to its newest one): its key
-- moves with it. Claims and completions never set these columns, so they
-- never read this trigger's condition.
CREATE FUNCTION durastep.rekey_run() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    UPDATE durastep.run_keys k SET event_id = NEW.event_id, function_id = NEW.function_id
     WHERE k.event_id = OLD.event_id AND k.function_id = OLD.function_id AND k.run_id = OLD.id;
    RETURN NULL;
END $$;

CREATE TRIGGER runs_rekeyed AFTER UPDATE OF event_id, function_id ON durastep.runs
    FOR EACH ROW
    WHEN (NEW.event_id IS DISTINCT FROM OLD.event_id OR NEW.function_id IS DISTINCT FROM OLD.function_id)
    EXECUTE FUNCTION durastep.rekey_run();

-- Deleted runs take their keys along (0016's text, and the keys).
CREATE OR REPLACE FUNCTION durastep.delete_run_records() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM durastep.step_results s USING old_runs o WHERE s.run_id = o.id;
    DELETE FROM durastep.step_journal j USING old_runs o WHERE j.run_id = o.id;
    DELETE FROM durastep.run_keys k USING old_runs o
     WHERE k.event_id = o.event_id AND k.function_id = o.function_id AND k.run_id = o.id;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION durastep.truncate_run_records() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    -- DELETE, not TRUNCATE: the same TRUNCATE statement may list these tables
    -- too, and a nested TRUNCATE of a table in use by it is refused.
    DELETE FROM durastep.step_results;
    DELETE FROM durastep.step_journal;
    DELETE FROM durastep.run_keys;
    RETURN NULL;
END $$;

-- The foreign key's cascade, by the keys: deleted events take their runs
-- along (and those their records, by the triggers above).
ALTER TABLE durastep.runs DROP CONSTRAINT runs_event_id_fkey;

CREATE FUNCTION durastep.delete_event_runs() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM durastep.runs r USING durastep.run_keys k, old_events o
     WHERE k.event_id = o.id AND r.id = k.run_id;
    RETURN NULL;
END $$;

CREATE TRIGGER events_delete_runs AFTER DELETE ON durastep.events
    REFERENCING OLD TABLE AS old_events
    FOR EACH STATEMENT EXECUTE FUNCTION durastep.delete_event_runs();

CREATE FUNCTION durastep.truncate_event_runs() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    -- DELETE, not TRUNCATE, as truncate_run_records says.
    DELETE FROM durastep.runs;
    RETURN NULL;
END $$;

CREATE TRIGGER events_truncate_runs AFTER TRUNCATE ON durastep.events
    FOR EACH STATEMENT EXECUTE FUNCTION durastep.truncate_event_runs();

ALTER TABLE durastep.runs DROP CONSTRAINT runs_event_id_function_id_key;

-- Pruning (0033's text): an event is pruned once no run's key names it.
CREATE OR REPLACE FUNCTION durastep.prune_batch(
    older_than_secs double precision,
    batch integer,
    after uuid DEFAULT NULL,
    OUT pruned_runs bigint,
    OUT pruned_events bigint,
    OUT pruned_flow_keys bigint,
    OUT last_run uuid)
    LANGUAGE plpgsql
    SET jit = off
AS $$
DECLARE
    bound timestamptz := durastep.now() - make_interval(secs => older_than_secs);
    run_ids uuid[];
    event_ids uuid[];
BEGIN
    -- Finished runs older than the bound, locked, skipping held rows. A
    -- cancelled attempt still stopping keeps its row (and slots) until it
    -- has stopped; a child of an unfinished parent is kept (the parent's
    -- invoke may still look for it). A run that finished before the bound
    -- was created before it: the time-ordered ones are found by a walk of
    -- the primary key, oldest first, from `after` (the `last_run` of the
    -- pass's batch before) up to `durastep.run_id_ceiling`, so that a pass
    -- steps over each unfinished run older than the bound (a long sleep)
    -- once, not once per batch.
    SELECT coalesce(array_agg(a.id ORDER BY a.id), '{}'), coalesce(array_agg(DISTINCT a.event_id), '{}')
      INTO run_ids, event_ids
      FROM (SELECT r.id, r.event_id FROM durastep.runs r
             WHERE r.id > coalesce(after, '00000000-0000-0000-0000-000000000000')
               AND r.id < durastep.run_id_ceiling(bound)
               AND r.finished_at < bound AND r.state IN ('completed', 'failed', 'cancelled', 'skipped')
               AND r.worker_id IS NULL
               AND NOT EXISTS (SELECT 1 FROM durastep.runs p WHERE p.id = r.parent_run_id
                                AND p.state IN ('queued', 'running', 'sleeping', 'waiting', 'diverged'))
             ORDER BY r.id LIMIT batch
             FOR UPDATE OF r SKIP LOCKED) a;
    last_run := coalesce(run_ids[cardinality(run_ids)], after);
    -- The runs with other ids (random ones), through `runs_created_legacy`,
    -- whose predicate this repeats word for word; from the start in every
    -- batch (no run an engine creates is one of them).
    SELECT run_ids || coalesce(array_agg(b.id), '{}'), event_ids || coalesce(array_agg(DISTINCT b.event_id), '{}')
      INTO run_ids, event_ids
      FROM (SELECT r.id, r.event_id FROM durastep.runs r
             WHERE ((get_byte(uuid_send(r.id), 6) >> 4) <> 7 OR r.id >= '03bb2cc3-d800-0000-0000-000000000000')
               AND r.created_at < bound AND r.id <> ALL (run_ids)
               AND r.finished_at < bound AND r.state IN ('completed', 'failed', 'cancelled', 'skipped')
               AND r.worker_id IS NULL
               AND NOT EXISTS (SELECT 1 FROM durastep.runs p WHERE p.id = r.parent_run_id
                                AND p.state IN ('queued', 'running', 'sleeping', 'waiting', 'diverged'))
             ORDER BY r.created_at LIMIT batch
             FOR UPDATE OF r SKIP LOCKED) b;
    DELETE FROM durastep.run_history h WHERE h.run_id = ANY (run_ids);
    DELETE FROM durastep.runs r WHERE r.id = ANY (run_ids);
    pruned_runs := cardinality(run_ids);

    -- No run deleted: look for events older than the bound that no run
    -- references (events that started no run; an event whose last run was
    -- pruned while another transaction held the event).
    IF pruned_runs = 0 THEN
        SELECT coalesce(array_agg(x.id), '{}') INTO event_ids
          FROM (SELECT x.id FROM durastep.events x
                 WHERE x.created_at < bound
                   AND NOT EXISTS (SELECT 1 FROM durastep.run_keys k WHERE k.event_id = x.id)
                   AND NOT EXISTS (SELECT 1 FROM durastep.debounced_events m WHERE m.event_id = x.id)
                 ORDER BY x.created_at LIMIT batch) x;
    END IF;
    -- The candidates older than the bound that no run references any more,
    -- neither as its event nor as an earlier event merged into a debounced
    -- run; locked, skipping held rows.
    WITH ev AS (
        SELECT e.id FROM durastep.events e
         WHERE e.id = ANY (event_ids) AND e.created_at < bound
           AND NOT EXISTS (SELECT 1 FROM durastep.run_keys k WHERE k.event_id = e.id)
           AND NOT EXISTS (SELECT 1 FROM durastep.debounced_events m WHERE m.event_id = e.id)
           FOR UPDATE OF e SKIP LOCKED)
    DELETE FROM durastep.events e USING ev WHERE e.id = ev.id;
    GET DIAGNOSTICS pruned_events = ROW_COUNT;

    -- Idle flow-control key rows: no slot in use, no throttle or rate state
    -- ahead, no pause, no run parked on them.
    WITH fk AS (
        SELECT f.rule, f.key FROM durastep.flow_keys f
         WHERE f.in_use = 0
           AND coalesce(f.tat, '-infinity') < durastep.now()
           AND coalesce(f.horizon, '-infinity') < durastep.now()
           AND coalesce(f.paused_until, '-infinity') < durastep.now()
           AND NOT EXISTS (SELECT 1 FROM durastep.runs r WHERE r.park_rule = f.rule AND r.park_key = f.key
                            AND r.state = 'queued')
         LIMIT batch
           FOR UPDATE OF f SKIP LOCKED)
    DELETE FROM durastep.flow_keys f USING fk WHERE f.rule = fk.rule AND f.key = fk.key;
    GET DIAGNOSTICS pruned_flow_keys = ROW_COUNT;
END $$;
