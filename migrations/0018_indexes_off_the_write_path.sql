-- Indexes off the write path (issue 12). `runs_function_state (function_id,
-- state, created_at)` (0001) and `runs_state_created (state, created_at DESC,
-- id DESC)` (0005) are full indexes with `state` in their keys, so every
-- state change of every run (insert, claim, completion, retry, sleep,
-- wake-up) wrote a new entry into each: two of the six index entries of a
-- claim or a completion, and the largest index of the table (about 205 MB per
-- million finished runs, docs/scaling.md). Both served only the inspection
-- API and the dashboard: counts now come from the `runs_function_state`
-- statistics object (0012, not an index) and, for unfinished states, the
-- partial indexes the engine already keeps (`runs_due`, `runs_running`,
-- `runs_diverged`); listings by creation time use `runs_created`.
DROP INDEX durastep.runs_function_state;
DROP INDEX durastep.runs_state_created;

-- Listings of the states a run reaches off the drain path (a sleep, a wait,
-- a failure, a cancel, a skip, a divergence), newest first. A run that is
-- claimed and completes never enters it; the states it does serve are those a
-- listing by creation time would have to dig for under millions of completed
-- runs (a run asleep for a month, the few failed ones).
CREATE INDEX runs_listed_by_state ON durastep.runs (state, created_at DESC, id DESC)
    WHERE state IN ('sleeping', 'waiting', 'failed', 'cancelled', 'skipped', 'diverged');
