-- The lean checkpoint, second part (issue 12): a step's journal entry is
-- stored on its step_results row, written by the same insert, instead of as a
-- second row in step_journal. A checkpoint of the group commit (steps, sleeps,
-- sent events) then writes one row and one index entry instead of two and two.
--
-- The journal of a run is the union of
--   * step_results rows with a position (entries written with a checkpoint of
--     the group commit, from this migration on), and
--   * step_journal rows (entries recorded when first asked: waits, invokes,
--     `changed` markers; the entries of step_tx checkpoints; and every entry
--     written before this migration).
-- Readers take both (the claims, check_deploy's pages, the test kit's sent
-- events); discarding a diverged run's entries from a position deletes from both.
--
-- Positions stay unique per run without an index: a position is handed out
-- once per attempt by the journal, and an entry is written only where the
-- replay found nothing recorded at that position (else it diverged first).
ALTER TABLE durastep.step_results
    ADD COLUMN position integer,
    ADD COLUMN kind text;

-- NOT VALID: checked for every row written from now on; the existing rows
-- have neither column, which satisfies it, so they are not scanned.
ALTER TABLE durastep.step_results ADD CONSTRAINT step_results_entry_check CHECK (
    (position IS NULL) = (kind IS NULL)
    AND (position IS NULL OR position >= 0)
    AND (kind IS NULL OR kind IN ('step', 'step_tx', 'sleep', 'wait', 'send_event', 'invoke', 'changed'))
) NOT VALID;
