#!/usr/bin/env bash
# What the HOT redesign would give a claim and a completion on the server,
# before it is built (docs/performance.md "What the HOT redesign would give",
# "Running runs found by their claims"). Copies of `durastep.runs` with
# 300,000 queued runs each:
#   today:  every index of `runs` as migrated (the ones that name `state` or
#           a column a claim or completion writes keep both updates off HOT),
#           fillfactor 80; the claim writes its claim record (`run_claims`,
#           migration 0034) as the engine's claims do;
#   before: today's indexes and `runs_running`, which 0034 dropped, and no
#           claim record: the claim and completion of migration 0033;
#   narrow: today's indexes but the due queue's two (`runs_due`,
#           `runs_next_due`), with the due runs in a narrow table of their
#           own that the claim deletes from, and the claim record: the
#           narrow due queue alone, without HOT;
#   hot:    only the indexes that no claim or completion touches (primary
#           key, event and function, creation order, parent), fillfactor 50,
#           the narrow due queue and the claim record: the HOT step;
#   leases: `hot` with a lease row per running run instead of a claim record
#           (inserted by the claim, deleted by the completion), the design
#           0034 measured and did not take;
#   joined: `hot`, but its claim takes its runs as the engine's claims must
#           (2026-12-06, morning): it walks the narrow queue joined to the
#           runs by id, locks the runs (not the queue rows) `SKIP LOCKED`,
#           and deletes the claimed runs' queue rows by id;
#   due_at: today's table with the due queue's two indexes on a stored
#           generated column that holds `run_at` while the run is queued,
#           sleeping or waiting and NULL otherwise, instead of `state` in
#           their predicate: a claim still leaves the queue (not HOT), a
#           completion (running to finished, NULL to NULL) may be HOT.
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
variants="${VARIANTS:-today before narrow hot leases joined due_at}"
trap 'psql -qc "DROP DATABASE IF EXISTS $db"' EXIT
migrated_db "$db"
tmp=$(mktemp -d)
cat >"$tmp/setup.sql" <<'SQL'
DROP TABLE IF EXISTS public.runs_today, public.runs_before, public.runs_hot, public.due_hot, public.runs_narrow,
    public.due_narrow, public.leases, public.claims, public.runs_due_at;
CREATE TABLE public.runs_today (LIKE durastep.runs INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)
    WITH (fillfactor = 80);
CREATE TABLE public.runs_before (LIKE durastep.runs INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)
    WITH (fillfactor = 80);
CREATE INDEX ON public.runs_before (function_id) WHERE state = 'running';
CREATE TABLE public.runs_hot (LIKE durastep.runs INCLUDING DEFAULTS INCLUDING CONSTRAINTS) WITH (fillfactor = 50);
ALTER TABLE public.runs_hot ADD PRIMARY KEY (id);
CREATE UNIQUE INDEX ON public.runs_hot (event_id, function_id);
CREATE INDEX ON public.runs_hot (created_at DESC, id DESC);
CREATE UNIQUE INDEX ON public.runs_hot (parent_run_id, parent_step_key) WHERE parent_run_id IS NOT NULL;
CREATE TABLE public.due_hot (run_id uuid PRIMARY KEY, priority int NOT NULL, run_at timestamptz NOT NULL);
CREATE INDEX ON public.due_hot (priority DESC, run_at);
CREATE TABLE public.runs_narrow (LIKE durastep.runs INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)
    WITH (fillfactor = 80);
CREATE TABLE public.due_narrow (run_id uuid PRIMARY KEY, priority int NOT NULL, run_at timestamptz NOT NULL);
CREATE INDEX ON public.due_narrow (priority DESC, run_at);
CREATE TABLE public.runs_due_at (LIKE durastep.runs INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)
    WITH (fillfactor = 80);
-- The due queue's two indexes, off the two tables that replace them.
DO $$
DECLARE i text;
BEGIN
    FOR i IN SELECT indexname FROM pg_indexes
              WHERE schemaname = 'public' AND tablename IN ('runs_narrow', 'runs_due_at')
                AND (indexdef LIKE '%(priority DESC, run_at) WHERE%' OR indexdef LIKE '%(run_at) WHERE%') LOOP
        EXECUTE format('DROP INDEX public.%I', i);
    END LOOP;
END $$;
ALTER TABLE public.runs_due_at ADD COLUMN due_at timestamptz
    GENERATED ALWAYS AS (CASE WHEN state IN ('queued', 'sleeping', 'waiting') THEN run_at END) STORED;
CREATE INDEX ON public.runs_due_at (priority DESC, due_at) WHERE due_at IS NOT NULL;
CREATE INDEX ON public.runs_due_at (due_at) WHERE due_at IS NOT NULL;
CREATE TABLE public.claims (LIKE durastep.run_claims INCLUDING ALL);
CREATE TABLE public.leases (run_id uuid PRIMARY KEY, lease_expires_at timestamptz NOT NULL);
CREATE INDEX ON public.leases (lease_expires_at);
INSERT INTO public.runs_today (id, function_id, event_id, state, run_at, max_attempts, created_at)
    SELECT gen_random_uuid(), 'f', gen_random_uuid(), 'queued', now(), 3, now() FROM generate_series(1, 300000);
INSERT INTO public.runs_before SELECT * FROM public.runs_today;
INSERT INTO public.runs_hot SELECT * FROM public.runs_today;
INSERT INTO public.due_hot SELECT id, priority, run_at FROM public.runs_hot;
INSERT INTO public.runs_narrow SELECT * FROM public.runs_today;
INSERT INTO public.due_narrow SELECT id, priority, run_at FROM public.runs_narrow;
INSERT INTO public.runs_due_at SELECT * FROM public.runs_today;
VACUUM ANALYZE public.runs_today;
VACUUM ANALYZE public.runs_before;
VACUUM ANALYZE public.runs_hot;
VACUUM ANALYZE public.due_hot;
VACUUM ANALYZE public.runs_narrow;
VACUUM ANALYZE public.due_narrow;
VACUUM ANALYZE public.runs_due_at;
SQL
# One round: `c` (the claim's candidates, from the variant's queue), then the
# claim and the completion, the same for every variant but for their table and
# what the claim records of its runs ($3: `claim` a claim record, `lease` a
# lease row per run, deleted by the completion, `none` nothing) and, with a
# queue table ($4), the claimed runs' rows deleted from it by id.
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
# The engine's way with a narrow queue: the queue walked and joined to the
# runs, the runs locked (their state tested again on the locked version);
# round_script deletes the claimed runs' queue rows.
joined() { # table, due table
  echo "SELECT r.id FROM public.$2 q JOIN public.$1 r ON r.id = q.run_id
     WHERE q.run_at <= now() AND r.state IN ('queued', 'sleeping', 'waiting') AND r.run_at <= now()
     ORDER BY q.priority DESC, q.run_at LIMIT 32 FOR UPDATE OF r SKIP LOCKED"
}
narrow() { # due table
  echo "DELETE FROM public.$1 WHERE run_id IN (
         SELECT run_id FROM public.$1 WHERE run_at <= now()
          ORDER BY priority DESC, run_at LIMIT 32 FOR UPDATE SKIP LOCKED)
     RETURNING run_id AS id"
}
round_script runs_today "$(walk runs_today)" claim >"$tmp/today.sql"
round_script runs_before "$(walk runs_before)" none >"$tmp/before.sql"
round_script runs_narrow "$(narrow due_narrow)" claim >"$tmp/narrow.sql"
round_script runs_hot "$(narrow due_hot)" claim >"$tmp/hot.sql"
round_script runs_hot "$(narrow due_hot)" lease >"$tmp/leases.sql"
round_script runs_hot "$(joined runs_hot due_hot)" claim due_hot >"$tmp/joined.sql"
round_script runs_due_at "SELECT id FROM public.runs_due_at WHERE due_at <= now()
     ORDER BY priority DESC, due_at LIMIT 32 FOR UPDATE SKIP LOCKED" claim >"$tmp/due_at.sql"
for round in $(seq 1 "$rounds"); do
  for s in $variants; do
    psql -d "$db" -q -f "$tmp/setup.sql"
    sleep 1
    table=runs_$s
    if [ "$s" = leases ] || [ "$s" = joined ]; then table=runs_hot; fi
    claim_rounds "$db" "round $round: $s" "$tmp/$s.sql" "$secs" "$clients" "$table"
  done
done
rm -r "$tmp"
