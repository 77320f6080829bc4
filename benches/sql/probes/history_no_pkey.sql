-- Probe for benches/sql/instructions.sh (VARIANT; the commands and the
-- counts are in docs/performance.md "What the run history costs, counted"):
-- the history without its primary key (run_id, seq) (what each row's
-- unique entry costs; the identity is kept).
ALTER TABLE durastep.run_history DROP CONSTRAINT run_history_pkey;
