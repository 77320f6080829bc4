-- Cancels up to $1 runs past their finish deadline (any unfinished state) or
-- their start deadline (never started), skipping rows others hold; returns
-- how many.
--
-- Runs past a deadline, through the partial indexes `runs_deadline` and
-- `runs_start_by`, whose predicates these conditions restate (migration
-- 0038; `tests/plans.rs` checks the plan).
WITH c AS (
    (SELECT id FROM durastep.runs
      WHERE deadline_at < durastep.now() AND state IN ('queued', 'running', 'sleeping', 'waiting')
      LIMIT $1)
    UNION
    (SELECT id FROM durastep.runs
      WHERE start_by < durastep.now() AND started_at IS NULL AND state = 'queued' LIMIT $1)),
-- Of those, the rows still unfinished, locked in id order, skipping held
-- rows. Found by `id = ANY` of an array, which probes the primary key for
-- each: as a join with `c`, whose size a generic plan cannot know, Postgres
-- chose to read every unfinished run (and in a small table every run) once
-- per sweep, on every reaper tick (`tests/plans.rs`).
l AS (SELECT r.id FROM durastep.runs r
       WHERE r.id = ANY (ARRAY(SELECT c.id FROM c))
         AND r.state IN ('queued', 'running', 'sleeping', 'waiting')
       ORDER BY r.id FOR NO KEY UPDATE OF r SKIP LOCKED),
-- Cancelled, with the deadline as the reason.
u AS (
    UPDATE durastep.runs r
       SET state = 'cancelled', finished_at = durastep.now(),
           cancel_reason = CASE WHEN r.deadline_at < durastep.now()
                                THEN 'finish timeout: not finished by ' || r.deadline_at
                                ELSE 'start timeout: not started by ' || r.start_by END
      FROM l WHERE r.id = l.id
    RETURNING r.id),
-- And their waits removed.
d AS (DELETE FROM durastep.waits w WHERE w.run_id IN (SELECT id FROM u))
-- How many.
SELECT count(*) FROM u
