-- A checkpoint's journal entry on its step row. Every checkpoint wrote two
-- rows: its result in `step_results` and its journal entry (position, kind,
-- key) in `step_journal`, each with its primary-key entry, and a claim read
-- both tables back to replay the run. Now a checkpoint's entry is the
-- `position` and `kind` of its step row: one row and one index entry per
-- checkpoint, and one scan per claim for the steps and their entries.
-- `step_journal` keeps the entries that are recorded before or without a step
-- row of their own (waits, invokes, `changed` markers), and every entry
-- written before this migration: a step row with no position has its entry
-- there. Nothing stored is moved (a large journal would make the upgrade
-- long); readers take the union, `durastep.run_journal`.
--
-- The journal's primary key kept two entries from one position of a run;
-- across the two tables nothing does. Positions are handed out by the
-- attempt that holds the run, one at a time, and every write of an entry is
-- fenced by that attempt's lease epoch, so two entries at one position would
-- take two attempts holding one run at once, which the fence excludes
-- (docs/guarantees.md "Divergence"). A replay matches what it asks at a
-- recorded position instead of recording it again.

ALTER TABLE durastep.step_results
    ADD COLUMN position integer,
    ADD COLUMN kind text,
    ADD CONSTRAINT step_results_entry CHECK (
        (position IS NULL AND kind IS NULL)
        OR (position >= 0 AND kind IN ('step', 'step_tx', 'sleep', 'wait', 'send_event', 'invoke', 'changed')));

-- A run's journal, wherever its entries are stored: for inspection, tests
-- and operators. The engine's claims read the two tables in their own scans
-- (`run_records.sql`), not through this view.
CREATE VIEW durastep.run_journal AS
SELECT j.run_id, j.position, j.kind, j.step_key FROM durastep.step_journal j
UNION ALL
SELECT s.run_id, s.position, s.kind, s.step_key FROM durastep.step_results s WHERE s.position IS NOT NULL;
