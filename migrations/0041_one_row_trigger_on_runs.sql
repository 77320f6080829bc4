-- The five row triggers of `runs` that had a WHEN condition, as one trigger
-- with one short condition (issue 12; docs/architecture.md "One row trigger
-- on runs").
--
-- Postgres 15 reads each row trigger's stored WHEN condition again in every
-- statement that updates the table (each statement's executor state prepares
-- it afresh), before the first row, and evaluates every condition for every
-- row. The five conditions were 6,382 characters of stored expression;
-- counted with benches/sql/instructions.sh, reading and preparing them cost
-- each UPDATE of `runs` about 234,000 instructions, and evaluating them
-- about 3,400 per row: an eighth of a checkpoint flush of two steps and two
-- completions, 5% of a claim of 32 runs. None of the five fires for a claim
-- or a completion of the hot path (those write their history rows
-- themselves), so all of that bought nothing there.
--
-- Now one trigger, `runs_changed`, calls `durastep.run_changed()`, which
-- holds the five functions' bodies, each under its trigger's exact
-- condition, in the order the five fired (by trigger name, per row):
-- `runs_child_finished` (resume_parent), `runs_failed`
-- (start_failure_handler), `runs_history` (record_history),
-- `runs_note_flow_release` (note_flow_release), `runs_unlisted_attempt`
-- (list_unlisted_attempt). The trigger's own condition is a short superset
-- of the five (2,481 characters): it holds for every row one of them held
-- for, and for no claim or completion of a run without flow rules or a
-- parent, which toggle `history_noted`. A row it holds for where none of
-- the five would have fired costs one call that does nothing.
--
-- `UPDATE OF state, lease_epoch, worker_id`: each of the five needs one of
-- those columns changed to do anything (the history a state or lease epoch,
-- the flow release a state, lease epoch or worker, the others a state or
-- lease epoch), so a statement that sets none of them (the heartbeat's
-- lease extension, say) no longer reads any condition.
DROP TRIGGER runs_child_finished ON durastep.runs;
DROP TRIGGER runs_failed ON durastep.runs;
DROP TRIGGER runs_history ON durastep.runs;
DROP TRIGGER runs_note_flow_release ON durastep.runs;
DROP TRIGGER runs_unlisted_attempt ON durastep.runs;
DROP FUNCTION durastep.resume_parent();
DROP FUNCTION durastep.start_failure_handler();
DROP FUNCTION durastep.record_history();
DROP FUNCTION durastep.note_flow_release();
DROP FUNCTION durastep.list_unlisted_attempt();

CREATE FUNCTION durastep.run_changed() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    handler_id text;
    ev uuid;
    handler_attempts integer;
    handler_version integer;
    failure boolean;
BEGIN
    -- A child run finished (0003, 0028): its outcome is stored as the
    -- parent's step, and a waiting parent is woken.
    IF NEW.parent_run_id IS NOT NULL AND NEW.state IN ('completed', 'failed', 'cancelled')
       AND OLD.state NOT IN ('completed', 'failed', 'cancelled')
    THEN
        INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch)
        SELECT p.id, NEW.parent_step_key,
               jsonb_build_object('child_run_id', NEW.id, 'state', NEW.state, 'output', NEW.output,
                                  'error', coalesce(NEW.cancel_reason, NEW.last_error)),
               p.lease_epoch
          FROM durastep.runs p
         WHERE p.id = NEW.parent_run_id AND p.state IN ('queued', 'running', 'sleeping', 'waiting')
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            UPDATE durastep.runs SET state = 'queued', run_at = durastep.now()
             WHERE id = NEW.parent_run_id AND state = 'waiting';
            PERFORM durastep.wake_workers(ARRAY(SELECT p.function_id FROM durastep.runs p
                                                 WHERE p.id = NEW.parent_run_id));
        END IF;
    END IF;

    -- A run failed (0001, 0028): its function's on-failure handler, if it
    -- has one, gets an event and a run.
    IF NEW.state = 'failed' AND OLD.state <> 'failed' THEN
        handler_id := NEW.function_id || '/on-failure';
        SELECT f.max_attempts, f.version INTO handler_attempts, handler_version
          FROM durastep.functions f
         WHERE f.id = handler_id
           AND EXISTS (SELECT 1 FROM durastep.functions p WHERE p.id = NEW.function_id AND p.has_on_failure);
        IF FOUND THEN
            ev := durastep.uuid7();
            INSERT INTO durastep.events (id, name, payload, idempotency_key)
            SELECT ev, 'durastep/run.failed',
                   jsonb_build_object(
                       'run_id', NEW.id,
                       'function_id', NEW.function_id,
                       'error', NEW.last_error,
                       'attempts', NEW.attempt,
                       'event', e.payload),
                   NEW.id::text
              FROM durastep.events e WHERE e.id = NEW.event_id
            ON CONFLICT DO NOTHING;
            IF FOUND THEN
                INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, version)
                VALUES (durastep.uuid7(), handler_id, ev, 'queued', durastep.now(), handler_attempts,
                        handler_version);
                PERFORM durastep.wake_workers(ARRAY[handler_id]);
            END IF;
        END IF;
    END IF;

    -- The history row of a change of state or lease (0020), unless the
    -- statement wrote it itself (it toggles `history_noted`).
    IF (NEW.state <> OLD.state OR NEW.lease_epoch <> OLD.lease_epoch)
       AND NEW.history_noted = OLD.history_noted
    THEN
        -- An attempt that ended in failure (retried, paused or failed), as
        -- opposed to a release at shutdown (same attempt, same error).
        failure := OLD.state = 'running' AND NEW.state IN ('queued', 'failed')
            AND (NEW.state = 'failed' OR NEW.attempt <> OLD.attempt OR NEW.pauses <> OLD.pauses
                 OR NEW.last_error IS DISTINCT FROM OLD.last_error);
        INSERT INTO durastep.run_history (run_id, at, state, attempt, lease_epoch, worker_id, error, step)
        VALUES (NEW.id, durastep.now(), NEW.state, NEW.attempt, NEW.lease_epoch, NEW.worker_id,
                CASE WHEN failure THEN NEW.last_error END,
                CASE WHEN failure THEN NEW.failed_step END);
    END IF;

    -- A running run cancelled: its worker hears it (0026).
    IF OLD.state = 'running' AND NEW.state = 'cancelled' THEN
        PERFORM pg_notify('durastep_cancelled', NEW.id::text || ':' || NEW.lease_epoch);
    END IF;
    -- Flow slots given back (0026): a row holds its slots while it is
    -- 'running', and while it is 'cancelled' or 'queued' with a worker_id (an
    -- attempt whose body may still run; 0015). The statement trigger
    -- `runs_release_flow` reads what is noted here.
    IF OLD.flow_held IS NOT NULL
       AND (OLD.state = 'running' OR (OLD.state IN ('cancelled', 'queued') AND OLD.worker_id IS NOT NULL))
       AND NOT (NEW.lease_epoch = OLD.lease_epoch
                AND (NEW.state = 'running' OR (NEW.state IN ('cancelled', 'queued') AND NEW.worker_id IS NOT NULL)))
    THEN
        INSERT INTO durastep.flow_releases (depth, rule, key)
        SELECT pg_trigger_depth(), h->>0, h->>1 FROM jsonb_array_elements(OLD.flow_held) AS h;
        PERFORM set_config('durastep.flow_releases_' || pg_trigger_depth(), 'pending', true);
    END IF;

    -- A run made running under a new lease by a statement that lists no
    -- claim record for it (0034: an older process's claim, a take-over by
    -- hand): listed here, so that the reaper finds it.
    IF NEW.state = 'running' AND NEW.lease_epoch IS DISTINCT FROM OLD.lease_epoch
       AND NEW.claim_id IS NOT DISTINCT FROM OLD.claim_id
    THEN
        INSERT INTO durastep.run_claims (recheck_at, run_ids, epochs)
        VALUES (coalesce(NEW.lease_expires_at, durastep.now()), ARRAY[NEW.id], ARRAY[NEW.lease_epoch]);
    END IF;
    RETURN NULL;
END $$;

-- The superset, clause by clause: the history (its noted flag unchanged);
-- the flow release (slots held before); the child (a parent); the failure
-- handler (failed); the cancel notice (cancelled); the unlisted attempt
-- (running, the claim record unchanged).
CREATE TRIGGER runs_changed AFTER UPDATE OF state, lease_epoch, worker_id ON durastep.runs
    FOR EACH ROW
    WHEN (NEW.history_noted = OLD.history_noted
          OR OLD.flow_held IS NOT NULL
          OR NEW.parent_run_id IS NOT NULL
          OR NEW.state = 'failed'
          OR NEW.state = 'cancelled'
          OR (NEW.state = 'running' AND NEW.claim_id IS NOT DISTINCT FROM OLD.claim_id))
    EXECUTE FUNCTION durastep.run_changed();
