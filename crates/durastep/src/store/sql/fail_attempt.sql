-- The end of a failed attempt, fenced on ($1 run, $2 epoch, running). $3: the
-- error; $4: permanent; $5: the retry delay in seconds; $6: pause the run's
-- back-pressure keys; $7: free pauses; $8: the failed step.
--
-- Retry or fail the run (fenced).
WITH u AS (
    UPDATE durastep.runs
       SET state = CASE WHEN $4 OR (attempt - lease_losses >= max_attempts AND NOT ($6 AND pauses < $7))
                        THEN 'failed' ELSE 'queued' END,
           finished_at = CASE WHEN $4 OR (attempt - lease_losses >= max_attempts AND NOT ($6 AND pauses < $7))
                              THEN durastep.now() END,
           run_at = CASE WHEN $4 OR (attempt - lease_losses >= max_attempts AND NOT ($6 AND pauses < $7))
                         THEN run_at ELSE durastep.now() + make_interval(secs => $5) END,
           attempt = CASE WHEN $4 OR attempt - lease_losses >= max_attempts OR ($6 AND pauses < $7)
                          THEN attempt ELSE attempt + 1 END,
           pauses = CASE WHEN NOT $4 AND $6 AND pauses < $7 THEN pauses + 1 ELSE pauses END,
           last_error = $3, failed_step = $8, lease_expires_at = NULL, worker_id = NULL
     WHERE id = $1 AND lease_epoch = $2 AND state = 'running'
    RETURNING state, function_id, event_id),
-- With $6, pause the failed run's back-pressure keys until the retry.
bp AS (
    INSERT INTO durastep.flow_keys AS f (rule, key, paused_until)
    SELECT ff.rule, durastep.flow_key(e.payload, ff.key_path, false, u.function_id, ff.key_pointer),
           durastep.now() + make_interval(secs => $5)
      FROM u
      JOIN durastep.function_flow ff ON ff.function_id = u.function_id
      JOIN durastep.flow_rules fr ON fr.name = ff.rule AND fr.kind = 'backpressure'
      JOIN durastep.events e ON e.id = u.event_id
     WHERE $6
     ORDER BY 1, 2
    ON CONFLICT (rule, key) DO UPDATE
       SET paused_until = greatest(coalesce(f.paused_until, EXCLUDED.paused_until), EXCLUDED.paused_until))
-- The new state (no row: fenced).
SELECT state FROM u
