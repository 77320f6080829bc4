#!/usr/bin/env bash
# What the HOT redesign gives a claim and a completion on the server
# (docs/performance.md "What the HOT redesign would give", "Running runs
# found by their claims", "The due queue in a narrow table"). Copies of
# `durastep.runs` with 300,000 queued runs each. The variants, as of
# migration 0035 (2026-12-06; before it, `today` was 0034's schema, `narrow`
# 0034's with the due queue in its own table, `hot` that at fillfactor 50):
#   today:  0035: every index of `runs` as migrated (none of them changes on
#           a plain run's claim or completion), fillfactor 50, the due queue
#           in its own table (`run_queue`, its indexes as migrated): the claim
#           walks the queue, locks the runs, deletes their queue rows and
#           writes its claim record (`run_claims`, 0034), as the engine's;
#   ff80:   today at fillfactor 80, the table's setting before 0035;
#   before: 0034: today's indexes and the due queue's two on `runs`
#           (`runs_due`, `runs_next_due`), which 0035 dropped, no queue
#           table, fillfactor 80, the claim record;
#   older:  0033: `before` with `runs_running`, which 0034 dropped, and no
#           claim record;
#   leases: `today` with a lease row per running run instead of a claim
#           record (inserted by the claim, deleted by the completion), the
#           design 0034 measured and did not take.
# Each round claims 32 runs (SKIP LOCKED, in queue order) and completes them by
# id, two statements in two transactions as the engine does, from CLIENTS
# pgbench clients. Prints runs/s, the machine's busy CPU per 1,000 runs (all
# processes, pgbench included), WAL bytes per run, and the share of the
# table's updates that were HOT. Plain psql and pgbench; no Rust build. From
# the repository root:
#
#   bash benches/sql/hot_ceiling.sh
#
# Needs a local Postgres (PGHOST/PGUSER as for psql; default 127.0.0.1 and
# postgres). Creates and drops the database durastep_hot_ceiling. SECS
# (default 5), ROUNDS (default 2) and CLIENTS (default 2) set each run's
# length, the alternated rounds and the concurrency; VARIANTS (default all
# five) which variants each round measures, in order.
set -euo pipefail
. benches/sql/lib.sh
export PGOPTIONS="-c client_min_messages=warning"
db=durastep_hot_ceiling
secs="${SECS:-5}"
rounds="${ROUNDS:-2}"
clients="${CLIENTS:-2}"
variants="${VARIANTS:-today ff80 before older leases}"
trap 'psql -qc "DROP DATABASE IF EXISTS $db"' EXIT
migrated_db "$db"
tmp=$(mktemp -d)
cat >"$tmp/setup.sql" <<'SQL'
DROP TABLE IF EXISTS public.runs_today, public.due_today, public.runs_ff80, public.due_ff80, public.runs_before,
    public.runs_older, public.claims, public.leases;
CREATE TABLE public.runs_today (LIKE durastep.runs INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)
    WITH (fillfactor = 50);
CREATE TABLE public.due_today (LIKE durastep.run_queue INCLUDING ALL);
CREATE TABLE public.runs_ff80 (LIKE durastep.runs INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)
    WITH (fillfactor = 80);
CREATE TABLE public.due_ff80 (LIKE durastep.run_queue INCLUDING ALL);
CREATE TABLE public.runs_before (LIKE durastep.runs INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)
    WITH (fillfactor = 80);
CREATE INDEX ON public.runs_before (priority DESC, run_at) WHERE state IN ('queued', 'sleeping', 'waiting');
CREATE INDEX ON public.runs_before (run_at) WHERE state IN ('queued', 'sleeping', 'waiting');
CREATE TABLE public.runs_older (LIKE public.runs_before INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)
    WITH (fillfactor = 80);
CREATE INDEX ON public.runs_older (function_id) WHERE state = 'running';
CREATE TABLE public.claims (LIKE durastep.run_claims INCLUDING ALL);
CREATE TABLE public.leases (run_id uuid PRIMARY KEY, lease_expires_at timestamptz NOT NULL);
CREATE INDEX ON public.leases (lease_expires_at);
INSERT INTO public.runs_today (id, function_id, event_id, state, run_at, max_attempts, created_at)
    SELECT gen_random_uuid(), 'f', gen_random_uuid(), 'queued', now(), 3, now() FROM generate_series(1, 300000);
INSERT INTO public.due_today (run_id, function_id, version, state, priority, run_at)
    SELECT id, function_id, version, state, priority, run_at FROM public.runs_today;
INSERT INTO public.runs_ff80 SELECT * FROM public.runs_today;
INSERT INTO public.due_ff80 SELECT * FROM public.due_today;
INSERT INTO public.runs_before SELECT * FROM public.runs_today;
INSERT INTO public.runs_older SELECT * FROM public.runs_today;
VACUUM ANALYZE public.runs_today;
VACUUM ANALYZE public.due_today;
VACUUM ANALYZE public.runs_ff80;
VACUUM ANALYZE public.due_ff80;
VACUUM ANALYZE public.runs_before;
VACUUM ANALYZE public.runs_older;
SQL
# One round: `c` (the claim's candidates, from the variant's queue), then the
# claim and the completion, the same for every variant but for their table and
# what the claim records of its runs ($3: `claim` a claim record, `lease` a
# lease row per run, deleted by the completion, `none` nothing) and, with a
# queue table ($4), the claimed runs' queue rows deleted.
round_script() { # table, candidates CTE, record, queue table
  cat <<SQL
WITH c AS ($2),
u AS (UPDATE public.$1 r
         SET state = 'running', lease_epoch = r.lease_epoch + 1, worker_id = '00000000-0000-0000-0000-000000000001',
             lease_expires_at = now() + interval '30 s', started_at = coalesce(r.started_at, now())
        FROM c WHERE r.id = c.id RETURNING r.id, r.lease_epoch, r.lease_expires_at)
SQL
  case $3 in
    claim) echo ", k AS (INSERT INTO public.claims (recheck_at, run_ids, epochs)
        SELECT min(lease_expires_at), array_agg(id), array_agg(lease_epoch) FROM u HAVING count(*) > 0)" ;;
    lease) echo ", k AS (INSERT INTO public.leases SELECT id, lease_expires_at FROM u)" ;;
  esac
  if [ -n "${4:-}" ]; then
    echo ", dq AS (DELETE FROM public.$4 q WHERE q.run_id IN (SELECT id FROM u))"
  fi
  cat <<SQL
SELECT array_agg(id)::text AS ids FROM u \gset
UPDATE public.$1 r SET state = 'completed', finished_at = now(), output = 'null', lease_expires_at = NULL,
       worker_id = NULL
 WHERE r.id = ANY (:ids::uuid[]);
SQL
  if [ "$3" = lease ]; then
    echo "DELETE FROM public.leases WHERE run_id = ANY (:ids::uuid[]);"
  fi
}
walk() { # table
  echo "SELECT id FROM public.$1
     WHERE state IN ('queued', 'sleeping', 'waiting') AND run_at <= now()
     ORDER BY priority DESC, run_at LIMIT 32 FOR UPDATE SKIP LOCKED"
}
queue_walk() { # runs table, queue table: as the engine's claims walk `run_queue`
  echo "SELECT r.id FROM public.$2 q JOIN public.$1 r ON r.id = q.run_id
     WHERE q.run_at <= now() AND r.state IN ('queued', 'sleeping', 'waiting') AND r.run_at <= now()
     ORDER BY q.priority DESC, q.run_at LIMIT 32 FOR UPDATE OF r SKIP LOCKED"
}
round_script runs_today "$(queue_walk runs_today due_today)" claim due_today >"$tmp/today.sql"
round_script runs_ff80 "$(queue_walk runs_ff80 due_ff80)" claim due_ff80 >"$tmp/ff80.sql"
round_script runs_before "$(walk runs_before)" claim >"$tmp/before.sql"
round_script runs_older "$(walk runs_older)" none >"$tmp/older.sql"
round_script runs_today "$(queue_walk runs_today due_today)" lease due_today >"$tmp/leases.sql"
for round in $(seq 1 "$rounds"); do
  for s in $variants; do
    psql -d "$db" -q -f "$tmp/setup.sql"
    sleep 1
    table=runs_$s
    if [ "$s" = leases ]; then table=runs_today; fi
    claim_rounds "$db" "round $round: $s" "$tmp/$s.sql" "$secs" "$clients" "$table"
  done
done
rm -r "$tmp"
