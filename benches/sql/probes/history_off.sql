-- Probe for benches/sql/instructions.sh (VARIANT; the commands and the
-- counts are in docs/performance.md "What the run history costs, counted"):
-- the run history as the throughput bench switches it off (BENCH_HISTORY=off):
-- an unlogged table without indexes or identity in its place, so that its
-- rows are still inserted but write no WAL and no index entry.
ALTER TABLE durastep.run_history RENAME TO run_history_kept;
CREATE UNLOGGED TABLE durastep.run_history (
    run_id uuid, at timestamptz, state text, attempt integer, lease_epoch bigint,
    worker_id uuid, error text, step text, started_at timestamptz,
    started_attempt integer, started_by uuid);
