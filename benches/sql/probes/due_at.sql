-- Probe for benches/sql/instructions.sh (VARIANT, with CLAIM_SQL the fast
-- claim that walks `due_at`; the command is in docs/performance.md
-- "Counted instructions"): the due queue's two indexes on a stored
-- generated column that holds `run_at` while the run is queued, sleeping or
-- waiting and is NULL otherwise, instead of a predicate on `state`. A
-- completion (running to finished: NULL to NULL) then changes no indexed
-- column and may be HOT; a claim still leaves the queue.
ALTER TABLE durastep.runs ADD COLUMN due_at timestamptz
    GENERATED ALWAYS AS (CASE WHEN state IN ('queued', 'sleeping', 'waiting') THEN run_at END) STORED;
DROP INDEX durastep.runs_due, durastep.runs_next_due;
CREATE INDEX runs_due ON durastep.runs (priority DESC, due_at) WHERE due_at IS NOT NULL;
CREATE INDEX runs_next_due ON durastep.runs (due_at) WHERE due_at IS NOT NULL;
