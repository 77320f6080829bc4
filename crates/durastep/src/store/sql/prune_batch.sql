-- Deletes up to $2 finished runs older than $1 seconds, with their history,
-- the events no run references any more, and idle flow-control key rows;
-- skips rows others hold. Returns the counts of runs, events and key rows.
--
-- The age bound.
WITH t AS (SELECT durastep.now() - make_interval(secs => $1) AS bound),
-- Finished runs older than the bound, locked, skipping held rows.
doomed AS MATERIALIZED (
    SELECT r.id, r.event_id FROM durastep.runs r, t
     WHERE r.finished_at < t.bound AND r.state IN ('completed', 'failed', 'cancelled', 'skipped')
       -- A cancelled attempt still stopping keeps its row (and slots) until it has stopped.
       AND r.worker_id IS NULL
       AND NOT EXISTS (SELECT 1 FROM durastep.runs p WHERE p.id = r.parent_run_id
                        AND p.state IN ('queued', 'running', 'sleeping', 'waiting', 'diverged'))
     ORDER BY r.finished_at LIMIT $2
     FOR UPDATE OF r SKIP LOCKED),
-- Their history.
hist AS (DELETE FROM durastep.run_history h USING doomed d WHERE h.run_id = d.id),
-- The runs themselves (their step results and journal go with them: the
-- runs_delete_records trigger of migration 0016).
gone AS (DELETE FROM durastep.runs r USING doomed d WHERE r.id = d.id RETURNING r.id, r.event_id),
-- Events older than the bound that no remaining run references.
ev AS MATERIALIZED (
    SELECT e.id FROM durastep.events e, t
     WHERE e.created_at < t.bound
       AND (e.id IN (SELECT event_id FROM gone)
            OR e.id IN (SELECT x.id FROM durastep.events x
                         -- The bound read once, not from the outer row: a
                         -- reference to t here made this subquery correlated,
                         -- run again for every old event (quadratic: 183 s for
                         -- 4,000 finished runs, 1.7 s without).
                         WHERE x.created_at < (SELECT bound FROM t)
                           AND NOT EXISTS (SELECT 1 FROM durastep.runs r WHERE r.event_id = x.id)
                           AND NOT EXISTS (SELECT 1 FROM durastep.debounced_events m
                                            WHERE m.event_id = x.id AND m.run_id NOT IN (SELECT id FROM gone))
                         ORDER BY x.created_at LIMIT $2))
       AND NOT EXISTS (SELECT 1 FROM durastep.runs r
                        WHERE r.event_id = e.id AND r.id NOT IN (SELECT id FROM gone))
       -- An event merged into a debounced run is kept while that run is.
       AND NOT EXISTS (SELECT 1 FROM durastep.debounced_events m
                        WHERE m.event_id = e.id AND m.run_id NOT IN (SELECT id FROM gone))
     FOR UPDATE OF e SKIP LOCKED),
-- Deleted.
evd AS (DELETE FROM durastep.events e USING ev WHERE e.id = ev.id RETURNING e.id),
-- Idle flow-control key rows.
fk AS MATERIALIZED (
    SELECT f.rule, f.key FROM durastep.flow_keys f, t
     WHERE f.in_use = 0
       AND coalesce(f.tat, '-infinity') < durastep.now()
       AND coalesce(f.horizon, '-infinity') < durastep.now()
       AND coalesce(f.paused_until, '-infinity') < durastep.now()
       AND NOT EXISTS (SELECT 1 FROM durastep.runs r WHERE r.park_rule = f.rule AND r.park_key = f.key
                        AND r.state = 'queued')
     LIMIT $2
     FOR UPDATE OF f SKIP LOCKED),
-- Deleted.
fkd AS (DELETE FROM durastep.flow_keys f USING fk WHERE f.rule = fk.rule AND f.key = fk.key RETURNING 1)
-- What was deleted.
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM evd), (SELECT count(*) FROM fkd)
