#!/usr/bin/env bash
# What the HOT redesign would give a claim and a completion on the server,
# before it is built (docs/performance.md "What the HOT redesign would give").
# Two copies of `durastep.runs` with 300,000 queued runs each:
#   today: every index of `runs` (twelve of them name `state` or a column a
#          claim or completion writes, so neither update can be HOT);
#   hot:   only the indexes that no claim or completion touches (primary key,
#          event and function, creation order, parent), fillfactor 50, and
#          the due runs in a narrow table of their own that a claim deletes from;
#   narrow: every index of today but the due queue's two (`runs_due`,
#          `runs_next_due`), fillfactor 80, and the due runs in a narrow
#          table as in `hot`: the narrow due queue alone, without HOT.
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
# length, the alternated rounds and the concurrency.
set -euo pipefail
. benches/sql/lib.sh
export PGOPTIONS="-c client_min_messages=warning"
db=durastep_hot_ceiling
secs="${SECS:-5}"
rounds="${ROUNDS:-2}"
clients="${CLIENTS:-2}"
trap 'psql -qc "DROP DATABASE IF EXISTS $db"' EXIT
migrated_db "$db"
tmp=$(mktemp -d)
cat >"$tmp/setup.sql" <<'SQL'
DROP TABLE IF EXISTS public.runs_today, public.runs_hot, public.due_hot, public.runs_narrow, public.due_narrow;
CREATE TABLE public.runs_today (LIKE durastep.runs INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)
    WITH (fillfactor = 80);
CREATE TABLE public.runs_hot (LIKE durastep.runs INCLUDING DEFAULTS INCLUDING CONSTRAINTS) WITH (fillfactor = 50);
ALTER TABLE public.runs_hot ADD PRIMARY KEY (id);
CREATE UNIQUE INDEX ON public.runs_hot (event_id, function_id);
CREATE INDEX ON public.runs_hot (created_at DESC, id DESC);
CREATE UNIQUE INDEX ON public.runs_hot (parent_run_id, parent_step_key) WHERE parent_run_id IS NOT NULL;
CREATE TABLE public.due_hot (run_id uuid PRIMARY KEY, priority int NOT NULL, run_at timestamptz NOT NULL);
CREATE INDEX ON public.due_hot (priority DESC, run_at);
CREATE TABLE public.runs_narrow (LIKE durastep.runs INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)
    WITH (fillfactor = 80);
DO $$
DECLARE i text;
BEGIN
    FOR i IN SELECT indexname FROM pg_indexes WHERE schemaname = 'public' AND tablename = 'runs_narrow'
                AND (indexdef LIKE '%(priority DESC, run_at) WHERE%' OR indexdef LIKE '%(run_at) WHERE%') LOOP
        EXECUTE format('DROP INDEX public.%I', i);
    END LOOP;
END $$;
CREATE TABLE public.due_narrow (run_id uuid PRIMARY KEY, priority int NOT NULL, run_at timestamptz NOT NULL);
CREATE INDEX ON public.due_narrow (priority DESC, run_at);
INSERT INTO public.runs_today (id, function_id, event_id, state, run_at, max_attempts, created_at)
    SELECT gen_random_uuid(), 'f', gen_random_uuid(), 'queued', now(), 3, now() FROM generate_series(1, 300000);
INSERT INTO public.runs_hot SELECT * FROM public.runs_today;
INSERT INTO public.due_hot SELECT id, priority, run_at FROM public.runs_hot;
INSERT INTO public.runs_narrow SELECT * FROM public.runs_today;
INSERT INTO public.due_narrow SELECT id, priority, run_at FROM public.runs_narrow;
VACUUM ANALYZE public.runs_today;
VACUUM ANALYZE public.runs_hot;
VACUUM ANALYZE public.due_hot;
VACUUM ANALYZE public.runs_narrow;
VACUUM ANALYZE public.due_narrow;
SQL
# One round: `c` (the claim's candidates, from the variant's queue), then the
# claim and the completion, the same for both variants but for their table.
round_script() { # table, candidates CTE
  cat <<SQL
WITH c AS ($2),
u AS (UPDATE public.$1 r
         SET state = 'running', lease_epoch = r.lease_epoch + 1, worker_id = '00000000-0000-0000-0000-000000000001',
             lease_expires_at = now() + interval '30 s', started_at = coalesce(r.started_at, now())
        FROM c WHERE r.id = c.id RETURNING r.id)
SELECT array_agg(id)::text AS ids FROM u \gset
UPDATE public.$1 r SET state = 'completed', finished_at = now(), output = 'null', lease_expires_at = NULL,
       worker_id = NULL
 WHERE r.id = ANY (:ids::uuid[]);
SQL
}
round_script runs_today "SELECT id FROM public.runs_today
     WHERE state IN ('queued', 'sleeping', 'waiting') AND run_at <= now()
     ORDER BY priority DESC, run_at LIMIT 32 FOR UPDATE SKIP LOCKED" >"$tmp/today.sql"
round_script runs_hot "DELETE FROM public.due_hot WHERE run_id IN (
         SELECT run_id FROM public.due_hot WHERE run_at <= now()
          ORDER BY priority DESC, run_at LIMIT 32 FOR UPDATE SKIP LOCKED)
     RETURNING run_id AS id" >"$tmp/hot.sql"
round_script runs_narrow "DELETE FROM public.due_narrow WHERE run_id IN (
         SELECT run_id FROM public.due_narrow WHERE run_at <= now()
          ORDER BY priority DESC, run_at LIMIT 32 FOR UPDATE SKIP LOCKED)
     RETURNING run_id AS id" >"$tmp/narrow.sql"
for round in $(seq 1 "$rounds"); do
  for s in today narrow hot; do
    psql -d "$db" -q -f "$tmp/setup.sql"
    sleep 1
    claim_rounds "$db" "round $round: $s" "$tmp/$s.sql" "$secs" "$clients" "runs_$s"
  done
done
rm -r "$tmp"
