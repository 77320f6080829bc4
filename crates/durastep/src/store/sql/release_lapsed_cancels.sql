-- Gives back the slots of up to $1 cancelled attempts whose lease has lapsed
-- (their worker is gone or stalled): clears the run's worker and lease, as
-- the worker's own end of a cancelled attempt does (`end_cancelled_attempt`).
-- A run given back to the queue unstarted (`queued` with a worker) is due at
-- once. Skips rows others hold.
--
-- The attempts still to end, through the partial index
-- `runs_attempt_stopping` (in id order), whose predicate the first two
-- conditions restate (migration 0038); `tests/plans.rs` checks the plan.
WITH l AS (SELECT r.id FROM durastep.runs r
            WHERE r.state IN ('cancelled', 'queued') AND r.worker_id IS NOT NULL
              AND coalesce(r.lease_expires_at < durastep.now(), true)
            ORDER BY r.id LIMIT $1 FOR NO KEY UPDATE SKIP LOCKED)
UPDATE durastep.runs r
   SET worker_id = NULL, lease_expires_at = NULL,
       run_at = CASE WHEN r.state = 'queued' THEN least(r.run_at, durastep.now()) ELSE r.run_at END
  FROM l WHERE r.id = l.id
