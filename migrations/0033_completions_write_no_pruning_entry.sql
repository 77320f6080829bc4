-- The completion writes no entry for pruning (issue 12, docs/scaling.md
-- "Claims and completions as HOT updates"). `runs_finished (finished_at)`
-- (0001) was the last index of `runs` that only the completion enters: every
-- completed run wrote an entry into it, for pruning by age and the
-- dashboard's per-minute counts of finished runs, which read it in the
-- background. It goes:
-- * pruning walks the runs by id, oldest first (time-ordered ids since
--   0021), up to the first id a run created at the bound could have, and
--   the runs with other ids by `created_at`: a run that finished before the
--   bound was created before it;
-- * the per-minute counts of finished runs read the run history, which
--   records every completion and failure with its time, through a BRIN
--   index on `at`: the history is appended in time order, and a BRIN index
--   costs an insert almost nothing (its summaries are made by VACUUM; the
--   newest pages, not yet summarized, are always read).

-- The smallest offset the test clock has had, beside 0031's largest: a run
-- created (by the database clock) before t has an id below the wall-clock
-- time t - offset_min. Kept by the same trigger; 0 in production, negative
-- after a test set the clock back. Its first value covers the runs already
-- stored.
ALTER TABLE durastep.clock ADD COLUMN offset_min interval NOT NULL DEFAULT '0';

CREATE OR REPLACE FUNCTION durastep.clock_offset_max() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    NEW.offset_max := greatest(OLD.offset_max, NEW.offset_max, NEW.offset_by);
    NEW.offset_min := least(OLD.offset_min, NEW.offset_min, NEW.offset_by);
    RETURN NEW;
END $$;

UPDATE durastep.clock c
   SET offset_min = least(c.offset_by, '0',
       (SELECT min(r.created_at - to_timestamp(
                   ('x' || substr(replace(r.id::text, '-', ''), 1, 12))::bit(48)::bigint / 1000.0))
          FROM durastep.runs r WHERE (get_byte(uuid_send(r.id), 6) >> 4) = 7));

-- An id above every time-ordered run created before `t` (by the database
-- clock): that of the wall-clock time t - offset_min, a minute later still
-- for ids minted by an application whose clock runs ahead of the
-- database's, and a millisecond more for the run minted in t's own
-- millisecond. The upper bound of pruning's walk of the primary key.
CREATE FUNCTION durastep.run_id_ceiling(t timestamptz) RETURNS uuid
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT durastep.uuid7_floor(t - c.offset_min + interval '1 minute 1 millisecond') FROM durastep.clock c $$;

CREATE INDEX run_history_at ON durastep.run_history USING brin (at);

DROP INDEX durastep.runs_finished;

-- Pruning (0017's text): the batch's runs found by id instead of by
-- `finished_at`, from where the pass's batch before stopped (a new
-- argument with a default, so that processes of an earlier version call it
-- as before, each batch then from the start; a new result column they do
-- not read).
DROP FUNCTION durastep.prune_batch(double precision, integer);
CREATE FUNCTION durastep.prune_batch(
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
                   AND NOT EXISTS (SELECT 1 FROM durastep.runs r WHERE r.event_id = x.id)
                   AND NOT EXISTS (SELECT 1 FROM durastep.debounced_events m WHERE m.event_id = x.id)
                 ORDER BY x.created_at LIMIT batch) x;
    END IF;
    -- The candidates older than the bound that no run references any more,
    -- neither as its event nor as an earlier event merged into a debounced
    -- run; locked, skipping held rows.
    WITH ev AS (
        SELECT e.id FROM durastep.events e
         WHERE e.id = ANY (event_ids) AND e.created_at < bound
           AND NOT EXISTS (SELECT 1 FROM durastep.runs r WHERE r.event_id = e.id)
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
