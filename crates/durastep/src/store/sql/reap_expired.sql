-- Takes back runs whose lease expired, as a compare-and-set on the (id, epoch)
-- pairs $1, $2 the reaper saw: a run that finished or was claimed again since
-- is left alone. Over its lost-lease budget, a run fails.
--
-- The (run, epoch) pairs seen expired.
WITH c AS (SELECT * FROM unnest($1::uuid[], $2::bigint[]) AS t(id, epoch)),
-- Those still running and expired, locked in id order, with their budget.
l AS (SELECT r.id, (r.lease_losses >= coalesce(f.max_lease_losses, 10)) AS spent,
             coalesce(f.max_lease_losses, 10) AS budget
        FROM durastep.runs r JOIN c ON r.id = c.id AND r.lease_epoch = c.epoch
        LEFT JOIN durastep.functions f ON f.id = r.function_id
       WHERE r.state = 'running' AND r.lease_expires_at < durastep.now()
       ORDER BY r.id FOR NO KEY UPDATE OF r SKIP LOCKED)
-- Queued again with the next attempt, or failed over budget.
UPDATE durastep.runs r
   SET state = CASE WHEN l.spent THEN 'failed' ELSE 'queued' END,
       attempt = CASE WHEN l.spent THEN r.attempt ELSE r.attempt + 1 END,
       lease_losses = r.lease_losses + 1,
       finished_at = CASE WHEN l.spent THEN durastep.now() END,
       run_at = durastep.now(), lease_expires_at = NULL, worker_id = NULL,
       last_error = 'lease expired: the worker was lost during attempt ' || r.attempt
                    || CASE WHEN l.spent THEN ' (lost leases: ' || (r.lease_losses + 1)
                                             || ', over the budget of ' || l.budget || ')'
                            ELSE '' END,
       failed_step = NULL
  FROM l WHERE r.id = l.id
RETURNING r.id, r.state
