-- Probe for benches/sql/instructions.sh (VARIANT; the commands and the
-- counts are in docs/performance.md "What the run history costs, counted"):
-- the BRIN index on `at` replaced by a B-tree on `at` over the finished
-- runs' rows alone (what the per-minute counts read): no entry for a
-- claim's 'running' rows.
DROP INDEX durastep.run_history_at;
CREATE INDEX run_history_finished ON durastep.run_history (at) WHERE state IN ('completed', 'failed');
