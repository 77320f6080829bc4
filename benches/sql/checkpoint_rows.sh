#!/usr/bin/env bash
# What a checkpoint's journal entry costs the server: one statement storing
# 256 steps of one run (as a group commit does), with the entry as a row of
# `step_journal` (before migration 0029) against the entry as the `position`
# and `kind` of the step row (since 0029). Statements per second and WAL bytes
# per step, alternated rounds, the tables emptied before each. Plain psql and
# pgbench; no Rust build. From the repository root:
#
#   bash benches/sql/checkpoint_rows.sh
#
# Needs a local Postgres (PGHOST/PGUSER as for psql; default 127.0.0.1 and
# postgres). Creates and drops the database durastep_checkpoint_rows. SECS
# (default 6) and ROUNDS (default 3) set each run's length and the rounds.
set -euo pipefail
. benches/sql/lib.sh
db=durastep_checkpoint_rows
secs="${SECS:-6}"
rounds="${ROUNDS:-3}"
trap 'psql -qc "DROP DATABASE IF EXISTS $db"' EXIT
migrated_db "$db"
tmp=$(mktemp -d)
cat >"$tmp/journal_row.sql" <<'SQL'
WITH r AS (SELECT gen_random_uuid() AS run_id),
steps AS (SELECT r.run_id, 's' || g AS step_key, g - 1 AS position FROM r, generate_series(1, 256) g),
ins AS (INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch, started_at, finished_at, attempt)
        SELECT run_id, step_key, '{"v":1}'::jsonb, 1, now(), now(), 1 FROM steps),
jr AS (INSERT INTO durastep.step_journal (run_id, position, kind, step_key)
       SELECT run_id, position, 'step', step_key FROM steps)
SELECT 1;
SQL
cat >"$tmp/on_step_row.sql" <<'SQL'
WITH r AS (SELECT gen_random_uuid() AS run_id),
steps AS (SELECT r.run_id, 's' || g AS step_key, g - 1 AS position FROM r, generate_series(1, 256) g),
ins AS (INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch, started_at, finished_at, attempt,
                                           position, kind)
        SELECT run_id, step_key, '{"v":1}'::jsonb, 1, now(), now(), 1, position, 'step' FROM steps)
SELECT 1;
SQL
for round in $(seq 1 "$rounds"); do
  for s in journal_row on_step_row; do
    psql -d "$db" -qc "TRUNCATE durastep.step_results, durastep.step_journal"
    start=$(psql -d "$db" -Atc "SELECT pg_current_wal_lsn()")
    out=$(pgbench -n -M prepared -T "$secs" -f "$tmp/$s.sql" "$db" 2>/dev/null)
    n=$(sed -n 's/^number of transactions actually processed: //p' <<<"$out")
    tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' <<<"$out")
    wal=$(psql -d "$db" -Atc "SELECT round(pg_wal_lsn_diff(pg_current_wal_lsn(), '$start') / ($n * 256.0))")
    echo "round $round: $s: $tps statements/s, $wal WAL bytes per step"
  done
done
rm -r "$tmp"
