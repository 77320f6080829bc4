-- Pruning at scale (issue 12). The prune statement of the store (one
-- statement of CTEs, run in batches of 500) read every event older than the
-- retention bound in every batch to look for orphans (events no run
-- references), and its estimates made Postgres hash the whole `runs` and
-- `events` tables to check the events of the deleted runs: at 716,000
-- finished runs one batch took 1.5 s (EXPLAIN ANALYZE), so deleting them
-- would take about 36 minutes, and each batch was costed above the default
-- `jit_above_cost`, so a pool with JIT on also compiled it every time.
--
-- Now a function, in steps, each an index lookup by the ids of the step
-- before: the batch of runs (locked, skipping held rows), their history, the
-- runs (their step results and journal go with them, by the
-- `runs_delete_records` trigger of 0016; merged debounce events by their
-- foreign key), then the events of those runs that no run references any
-- more. Orphan events are looked for only in a batch that deleted no run
-- (the last batch of a pass), once per pass instead of once per batch. The
-- function carries its own `jit = off`: no JIT setting of the caller's pool
-- matters. Each statement of a volatile function takes a fresh snapshot, so
-- the runs this batch deleted are gone for the event checks after them.
CREATE FUNCTION durastep.prune_batch(
    older_than_secs double precision,
    batch integer,
    OUT pruned_runs bigint,
    OUT pruned_events bigint,
    OUT pruned_flow_keys bigint)
    LANGUAGE plpgsql
    SET jit = off
AS $$
DECLARE
    bound timestamptz := durastep.now() - make_interval(secs => older_than_secs);
    run_ids uuid[];
    event_ids uuid[];
BEGIN
    -- Finished runs older than the bound, oldest first, locked, skipping held
    -- rows. A cancelled attempt still stopping keeps its row (and slots)
    -- until it has stopped; a child of an unfinished parent is kept (the
    -- parent's invoke may still look for it).
    SELECT coalesce(array_agg(d.id), '{}'), coalesce(array_agg(DISTINCT d.event_id), '{}')
      INTO run_ids, event_ids
      FROM (SELECT r.id, r.event_id FROM durastep.runs r
             WHERE r.finished_at < bound AND r.state IN ('completed', 'failed', 'cancelled', 'skipped')
               AND r.worker_id IS NULL
               AND NOT EXISTS (SELECT 1 FROM durastep.runs p WHERE p.id = r.parent_run_id
                                AND p.state IN ('queued', 'running', 'sleeping', 'waiting', 'diverged'))
             ORDER BY r.finished_at LIMIT batch
             FOR UPDATE OF r SKIP LOCKED) d;
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
