-- Probe for benches/sql/instructions.sh (VARIANT; the commands and the
-- counts are in docs/performance.md "What the run history costs, counted"):
-- the history's seq without its identity (no nextval per row) and its
-- primary key replaced by a plain index on run_id (what the sequence and the
-- uniqueness cost beyond an entry per row).
ALTER TABLE durastep.run_history ALTER COLUMN seq DROP IDENTITY;
ALTER TABLE durastep.run_history ALTER COLUMN seq SET DEFAULT 0;
ALTER TABLE durastep.run_history DROP CONSTRAINT run_history_pkey;
CREATE INDEX run_history_run ON durastep.run_history (run_id);
