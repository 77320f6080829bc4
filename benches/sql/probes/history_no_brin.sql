-- Probe for benches/sql/instructions.sh (VARIANT; the commands and the
-- counts are in docs/performance.md "What the run history costs, counted"):
-- the history without its BRIN index on `at` (what each history row's entry
-- in it costs).
DROP INDEX durastep.run_history_at;
