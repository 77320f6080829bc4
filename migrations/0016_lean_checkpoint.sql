-- A leaner checkpoint (issue 12, hot-path item 2): no foreign-key check per
-- stored step result or journal entry.
--
-- Every insert into step_results and step_journal is fenced: it joins the run's
-- row locked FOR NO KEY UPDATE (checkpoints, step_tx, sleeps, waits, invokes,
-- send_event) or FOR NO KEY UPDATE in the sender's statement (wait results),
-- and checks that the run is running under the writer's lease epoch. Such a
-- lock conflicts with DELETE, so no row is ever stored for a run that is being
-- or has been deleted; the foreign key's own check (a FOR KEY SHARE lock on the
-- run per inserted row, one SPI call each) proved nothing more and cost about a
-- quarter of a checkpoint row's server time. What ON DELETE CASCADE did is done
-- by a statement trigger on runs: whatever deletes runs (pruning, an event's
-- cascade, an operator's DELETE) deletes their step results and journal with
-- them, and a TRUNCATE of runs truncates them too.

ALTER TABLE durastep.step_results DROP CONSTRAINT step_results_run_id_fkey;
ALTER TABLE durastep.step_journal DROP CONSTRAINT step_journal_run_id_fkey;

CREATE FUNCTION durastep.delete_run_records() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM durastep.step_results s USING old_runs o WHERE s.run_id = o.id;
    DELETE FROM durastep.step_journal j USING old_runs o WHERE j.run_id = o.id;
    RETURN NULL;
END $$;

CREATE TRIGGER runs_delete_records AFTER DELETE ON durastep.runs
    REFERENCING OLD TABLE AS old_runs
    FOR EACH STATEMENT EXECUTE FUNCTION durastep.delete_run_records();

CREATE FUNCTION durastep.truncate_run_records() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    -- DELETE, not TRUNCATE: the same TRUNCATE statement may list these tables
    -- too, and a nested TRUNCATE of a table in use by it is refused.
    DELETE FROM durastep.step_results;
    DELETE FROM durastep.step_journal;
    RETURN NULL;
END $$;

CREATE TRIGGER runs_truncate_records AFTER TRUNCATE ON durastep.runs
    FOR EACH STATEMENT EXECUTE FUNCTION durastep.truncate_run_records();
