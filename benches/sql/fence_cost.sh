#!/usr/bin/env bash
# What fencing a checkpoint costs the server, before anyone builds a cheaper
# fence (docs/performance.md "Warm workers, and each statement's work per
# run"; hot-path option 3). Each pgbench client owns BATCH running runs and
# stores one step for each of them per transaction, as a group commit of
# checkpoints does, four ways:
#   raw:       the step rows alone, no fence (the floor);
#   row_lock:  as the engine does today: one statement that locks the runs'
#              rows (FOR NO KEY UPDATE, in id order), checks state and epoch
#              on the locked versions and inserts;
#   advisory:  a PL/pgSQL function that takes each run's transaction-level
#              advisory lock in shared mode (id order), then, in a second
#              statement with a snapshot taken after those locks, checks
#              state and epoch without a row lock and inserts. Safe only if
#              every write that ends a claim (a takeover, a cancel, a
#              timeout, the worker's own end of the attempt) first takes the
#              same lock in exclusive mode in its transaction; not measured
#              here (rare next to checkpoints);
#   engine:    the engine's own group-commit statement for checkpoints
#              (`flush_sql!`, cut out of the Rust source by
#              checkpoint_flush.py): the
#              row-lock fence plus everything else it does (twelve arrays in,
#              one row out per write, the outcome of each).
# Prints statements/s, the machine's busy CPU per 1,000 checkpoints (pgbench
# included) and WAL bytes per checkpoint, alternated rounds. Plain psql and
# pgbench (and python3, to cut the engine's statement out of its source); no
# Rust build. From the repository root:
#
#   bash benches/sql/fence_cost.sh
#
# Needs a local Postgres (PGHOST/PGUSER as for psql; default 127.0.0.1 and
# postgres). Creates and drops the database durastep_fence_cost. SECS
# (default 5), ROUNDS (default 3), CLIENTS (default 2) and BATCH (default
# 128) set each run's length, the alternated rounds, the concurrency and the
# checkpoints per statement.
set -euo pipefail
. benches/sql/lib.sh
export PGOPTIONS="-c client_min_messages=warning"
db=durastep_fence_cost
secs="${SECS:-5}"
rounds="${ROUNDS:-3}"
clients="${CLIENTS:-2}"
batch="${BATCH:-128}"
trap 'psql -qc "DROP DATABASE IF EXISTS $db"' EXIT
migrated_db "$db"
tmp=$(mktemp -d)
# BATCH running runs per client (pgbench numbers its clients from 0), and the
# function of the advisory variant.
psql -d "$db" -v ON_ERROR_STOP=1 -q <<SQL
CREATE SEQUENCE public.step_seq;
CREATE TABLE public.owned (client int NOT NULL, ids uuid[] NOT NULL);
INSERT INTO durastep.events (id, name, payload)
    SELECT durastep.uuid7(), 'bench', '{}' FROM generate_series(1, $clients * $batch);
INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, lease_epoch, started_at)
    SELECT durastep.uuid7(), 'f', id, 'running', now(), 3, 1, now() FROM durastep.events;
INSERT INTO public.owned
    SELECT (n - 1) / $batch, array_agg(id ORDER BY id)
      FROM (SELECT id, row_number() OVER (ORDER BY id) AS n FROM durastep.runs) r GROUP BY (n - 1) / $batch;
CREATE FUNCTION public.checkpoint_advisory(ids uuid[], keys text[], epoch bigint) RETURNS bigint
LANGUAGE plpgsql AS \$\$
DECLARE stored bigint;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(('x' || left(replace(i::text, '-', ''), 16))::bit(64)::bigint)
       FROM unnest(ids) i ORDER BY i;
    -- A new statement: its snapshot is taken after the locks above.
    WITH ins AS (
        INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch, started_at, finished_at, attempt,
                                           position, kind)
        SELECT r.id, cp.step_key, '1'::jsonb, r.lease_epoch, now(), now(), 1, 0, 'step'
          FROM unnest(ids, keys) cp(run_id, step_key) JOIN durastep.runs r ON r.id = cp.run_id
         WHERE r.state = 'running' AND r.lease_epoch = epoch
        RETURNING 1)
    SELECT count(*) INTO stored FROM ins;
    RETURN stored;
END \$\$;
VACUUM ANALYZE;
SQL
# Every variant first reads its batch as the engine's flush receives it: the
# run ids, new step keys and the other arrays, as pgbench variables.
pick="SELECT o.ids::text AS cp_run, array_fill(1::bigint, ARRAY[$batch])::text AS cp_epoch,
       ARRAY(SELECT 's' || nextval('public.step_seq') FROM generate_series(1, $batch))::text AS cp_key,
       array_fill('1'::text, ARRAY[$batch])::text AS cp_output, '{}' AS dn_run, '{}' AS dn_epoch, '{}' AS dn_output,
       array_fill(now(), ARRAY[$batch])::text AS cp_started, array_fill(now(), ARRAY[$batch])::text AS cp_finished,
       array_fill(1, ARRAY[$batch])::text AS cp_attempt, array_fill(0, ARRAY[$batch])::text AS cp_position,
       array_fill('step'::text, ARRAY[$batch])::text AS cp_kind
  FROM public.owned o WHERE o.client = :client_id \\gset"
cat >"$tmp/raw.sql" <<SQL
$pick
INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch, started_at, finished_at, attempt, position, kind)
SELECT i, k, '1'::jsonb, 1, now(), now(), 1, 0, 'step' FROM unnest(:cp_run::uuid[], :cp_key::text[]) t(i, k);
SQL
cat >"$tmp/row_lock.sql" <<SQL
$pick
WITH cp AS (SELECT * FROM unnest(:cp_run::uuid[], :cp_key::text[]) t(run_id, step_key)),
l AS (SELECT r.id, r.lease_epoch, r.state = 'running' AS live FROM durastep.runs r
       WHERE r.id = ANY (:cp_run::uuid[]) ORDER BY r.id FOR NO KEY UPDATE),
ins AS (INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch, started_at, finished_at, attempt,
                                           position, kind)
        SELECT l.id, cp.step_key, '1'::jsonb, l.lease_epoch, now(), now(), 1, 0, 'step'
          FROM cp JOIN l ON l.id = cp.run_id WHERE l.live AND l.lease_epoch = 1 RETURNING 1)
SELECT count(*) FROM ins;
SQL
cat >"$tmp/advisory.sql" <<SQL
$pick
SELECT public.checkpoint_advisory(:cp_run::uuid[], :cp_key::text[], 1);
SQL
# The engine's own statement: the checkpoint-only flush of plain inserts
# (`flush_sql!` in crates/durastep/src/store/attempt.rs, filled as
# `flush_statement(LockWait::Skip, false, Conflicts::Fail)` fills it), its
# parameters as pgbench variables.
{
  echo "$pick"
  python3 benches/sql/checkpoint_flush.py | python3 -c '
import re, sys
names = ["cp_run", "cp_epoch", "cp_key", "cp_output", "dn_run", "dn_epoch", "dn_output", "cp_started",
         "cp_finished", "cp_attempt", "cp_position", "cp_kind"]
flush = re.sub(r"\$(\d+)", lambda m: ":" + names[int(m.group(1)) - 1], sys.stdin.read())
print(" ".join(flush.split()) + ";")'
} >"$tmp/engine.sql"
busy() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8}' /proc/stat; }
for round in $(seq 1 "$rounds"); do
  for s in raw row_lock advisory engine; do
    psql -d "$db" -qc "TRUNCATE durastep.step_results" -c "CHECKPOINT"
    start=$(psql -d "$db" -Atc "SELECT pg_current_wal_lsn()")
    cpu0=$(busy)
    out=$(pgbench -n -M prepared -c "$clients" -j "$clients" -T "$secs" -f "$tmp/$s.sql" "$db" 2>/dev/null)
    cpu1=$(busy)
    tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' <<<"$out")
    stored=$(psql -d "$db" -Atc "SELECT count(*) FROM durastep.step_results")
    psql -d "$db" -Atc "SELECT format('round %s: %-8s %s statements/s, %s ms CPU per 1,000 checkpoints, %s WAL bytes per checkpoint',
                                      $round, '$s', round($tps), round(($cpu1 - $cpu0) * 10.0 * 1000 / $stored, 1),
                                      round(pg_wal_lsn_diff(pg_current_wal_lsn(), '$start') / $stored))"
  done
done
rm -r "$tmp"
