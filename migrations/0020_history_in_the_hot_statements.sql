-- Run history written by the hot statements themselves. Until now a
-- statement-level trigger with transition tables (0005) wrote every history
-- row: each claim and each completion of a batch of runs paid for a PL/pgSQL
-- call and a join of the old and new rows (0.15-0.3 ms per statement of 32
-- runs, docs/performance.md). Now the claims (fast and full) and the group
-- commit's completion insert their history rows in a CTE over the rows they
-- changed, and flip `history_noted`; a row-level trigger writes the row for
-- every other update that changes a run's state or lease epoch (reaper,
-- cancel, timeouts, replay, failures, plain SQL) and does not fire for the
-- updates that flipped the mark, so each transition is still recorded once
-- whichever path made it.

-- Flipped by every UPDATE that writes its own history row (the trigger below
-- then stays quiet for it). Its value means nothing else.
ALTER TABLE durastep.runs ADD COLUMN history_noted boolean NOT NULL DEFAULT false;

DROP TRIGGER runs_history ON durastep.runs;

-- One changed run: the same row the statement trigger wrote.
CREATE OR REPLACE FUNCTION durastep.record_history() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    -- An attempt that ended in failure (retried, paused or failed), as
    -- opposed to a release at shutdown (same attempt, same error).
    failure boolean := OLD.state = 'running' AND NEW.state IN ('queued', 'failed')
        AND (NEW.state = 'failed' OR NEW.attempt <> OLD.attempt OR NEW.pauses <> OLD.pauses
             OR NEW.last_error IS DISTINCT FROM OLD.last_error);
BEGIN
    INSERT INTO durastep.run_history (run_id, at, state, attempt, lease_epoch, worker_id, error, step)
    VALUES (NEW.id, durastep.now(), NEW.state, NEW.attempt, NEW.lease_epoch, NEW.worker_id,
            CASE WHEN failure THEN NEW.last_error END,
            CASE WHEN failure THEN NEW.failed_step END);
    RETURN NULL;
END $$;

CREATE TRIGGER runs_history AFTER UPDATE ON durastep.runs
    FOR EACH ROW
    WHEN ((NEW.state <> OLD.state OR NEW.lease_epoch <> OLD.lease_epoch)
          AND NEW.history_noted = OLD.history_noted)
    EXECUTE FUNCTION durastep.record_history();
