-- Puts the failed or cancelled runs $1 back in the queue with a fresh set of
-- attempts; with $2, their step results and journal are deleted first. Returns, per id,
-- its state before and whether it was replayed.
--
-- The runs, locked in id order, with their function's current settings.
WITH l AS (
    SELECT r.id, r.state, coalesce(f.max_attempts, r.max_attempts) AS fmax, f.finish_timeout_secs
      FROM durastep.runs r
      LEFT JOIN durastep.functions f ON f.id = r.function_id
     WHERE r.id = ANY ($1) ORDER BY r.id FOR NO KEY UPDATE OF r),
-- Those that may be replayed.
ok AS (SELECT * FROM l WHERE l.state IN ('failed', 'cancelled')),
-- With $2, their step results deleted, and with them the journal: a replay
-- from the start is new ground. Nothing stored is left that a changed path
-- could be handed, so nothing is checked against the path the run took
-- before (since migration 0029 the entries of steps are on their step rows
-- and go with them; the rest are in `step_journal`).
wiped AS (DELETE FROM durastep.step_results s USING ok WHERE $2 AND s.run_id = ok.id),
unjournaled AS (DELETE FROM durastep.step_journal j USING ok WHERE $2 AND j.run_id = ok.id),
-- Queued again.
u AS (
    UPDATE durastep.runs r
       SET state = 'queued', attempt = r.attempt + 1,
           -- A cancelled attempt still stopping keeps its worker, lease and
           -- slots (migration 0015): due when that lease lapses, or at once
           -- when its worker has dropped the handler.
           run_at = CASE WHEN r.worker_id IS NULL THEN durastep.now()
                         ELSE greatest(durastep.now(), coalesce(r.lease_expires_at, durastep.now())) END,
           max_attempts = r.attempt + ok.fmax, finished_at = NULL, output = NULL,
           cancel_reason = NULL, pauses = 0, lease_losses = 0, park_rule = NULL, park_key = NULL,
           cancelled_by_xact = NULL,
           debounce_key = NULL, debounce_deadline = NULL, start_by = NULL,
           deadline_at = CASE WHEN ok.finish_timeout_secs IS NULL THEN NULL
                              ELSE durastep.now() + make_interval(secs => ok.finish_timeout_secs) END
      FROM ok WHERE r.id = ok.id
    RETURNING r.id, r.function_id)
-- Per id asked: its state (none: no such run) and, when it was replayed, its
-- function (for the wake-up).
SELECT i.id, l.state, u.function_id
  FROM unnest($1::uuid[]) AS i(id)
  LEFT JOIN l ON l.id = i.id LEFT JOIN u ON u.id = i.id
