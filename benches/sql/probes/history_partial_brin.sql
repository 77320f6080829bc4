-- Probe for benches/sql/instructions.sh (VARIANT; the commands and the
-- counts are in docs/performance.md "What the run history costs, counted"):
-- the BRIN index on `at` made partial, over the finished runs' rows alone:
-- no entry for a claim's 'running' rows.
DROP INDEX durastep.run_history_at;
CREATE INDEX run_history_finished ON durastep.run_history USING brin (at) WHERE state IN ('completed', 'failed');
