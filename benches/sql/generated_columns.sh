#!/usr/bin/env bash
# What the stored generated columns of migration 0032 cost a claim and a
# completion before any of them is HOT (docs/performance.md "Indexes a
# claim leaves alone"). Three copies of `durastep.runs` with 300,000 queued
# runs each, every one with the due queue's two indexes and `runs_running`
# (migration 0033's, which 0034 and 0035 dropped; they are made again here
# so that the three differ only in the generated columns):
#   before:    the columns and indexes of migration 0031 (eight indexes
#              that name `state` in their predicate, and `runs_finished`);
#   generated: today's table, with its six generated columns and the
#              indexes on them (migrations 0032 and 0033: no `runs_finished`);
#   plain:     today's indexes on the same six columns as plain ones that
#              stay NULL: `generated` without computing them.
# Each round claims 32 runs (SKIP LOCKED, in queue order) and completes them
# by id, two statements in two transactions as the engine does, from
# CLIENTS pgbench clients. Prints runs/s, the machine's busy CPU per 1,000
# runs (all processes, pgbench included) and WAL bytes per run. Plain psql
# and pgbench; no Rust build. From the repository root:
#
#   bash benches/sql/generated_columns.sh
#
# Needs a local Postgres (PGHOST/PGUSER as for psql; default 127.0.0.1 and
# postgres). Creates and drops the database durastep_generated_columns.
# SECS (default 5), ROUNDS (default 3) and CLIENTS (default 2) set each
# run's length, the alternated rounds and the concurrency.
set -euo pipefail
. benches/sql/lib.sh
export PGOPTIONS="-c client_min_messages=warning"
db=durastep_generated_columns
secs="${SECS:-5}"
rounds="${ROUNDS:-3}"
clients="${CLIENTS:-2}"
trap 'psql -qc "DROP DATABASE IF EXISTS $db"' EXIT
migrated_db "$db"
tmp=$(mktemp -d)
cat >"$tmp/setup.sql" <<'SQL'
DROP TABLE IF EXISTS public.runs_before, public.runs_generated, public.runs_plain;
CREATE TABLE public.runs_generated (LIKE durastep.runs INCLUDING ALL) WITH (fillfactor = 80);
CREATE TABLE public.runs_plain (LIKE durastep.runs INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)
    WITH (fillfactor = 80);
CREATE INDEX ON public.runs_generated (function_id) WHERE state = 'running';
CREATE INDEX ON public.runs_plain (function_id) WHERE state = 'running';
CREATE INDEX ON public.runs_generated (priority DESC, run_at) WHERE state IN ('queued', 'sleeping', 'waiting');
CREATE INDEX ON public.runs_plain (priority DESC, run_at) WHERE state IN ('queued', 'sleeping', 'waiting');
CREATE INDEX ON public.runs_generated (run_at) WHERE state IN ('queued', 'sleeping', 'waiting');
CREATE INDEX ON public.runs_plain (run_at) WHERE state IN ('queued', 'sleeping', 'waiting');
CREATE TABLE public.runs_before (LIKE durastep.runs INCLUDING DEFAULTS INCLUDING CONSTRAINTS) WITH (fillfactor = 80);
ALTER TABLE public.runs_before ADD PRIMARY KEY (id);
CREATE UNIQUE INDEX ON public.runs_before (event_id, function_id);
CREATE INDEX ON public.runs_before (function_id) WHERE state = 'running';
CREATE INDEX ON public.runs_before (finished_at) WHERE finished_at IS NOT NULL;
CREATE INDEX ON public.runs_before (priority DESC, run_at) WHERE state IN ('queued', 'sleeping', 'waiting');
CREATE INDEX ON public.runs_before (run_at) WHERE state IN ('queued', 'sleeping', 'waiting');
CREATE UNIQUE INDEX ON public.runs_before (parent_run_id, parent_step_key) WHERE parent_run_id IS NOT NULL;
CREATE INDEX ON public.runs_before (deadline_at)
    WHERE deadline_at IS NOT NULL AND state IN ('queued', 'running', 'sleeping', 'waiting');
CREATE INDEX ON public.runs_before (start_by) WHERE start_by IS NOT NULL AND started_at IS NULL AND state = 'queued';
CREATE INDEX ON public.runs_before (park_rule, park_key, priority DESC, created_at)
    WHERE state = 'queued' AND park_rule IS NOT NULL;
CREATE UNIQUE INDEX ON public.runs_before (function_id, singleton_key)
    WHERE state IN ('queued', 'running', 'sleeping', 'waiting') AND singleton_key IS NOT NULL;
CREATE UNIQUE INDEX ON public.runs_before (function_id, debounce_key)
    WHERE state = 'queued' AND started_at IS NULL AND debounce_key IS NOT NULL;
CREATE INDEX ON public.runs_before (function_id) WHERE state = 'diverged';
CREATE INDEX ON public.runs_before (id) WHERE state IN ('cancelled', 'queued') AND worker_id IS NOT NULL;
CREATE INDEX ON public.runs_before (created_at DESC, id DESC)
    WHERE (get_byte(uuid_send(id), 6) >> 4) <> 7 OR id >= '03bb2cc3-d800-0000-0000-000000000000';
CREATE INDEX ON public.runs_before (state, id DESC)
    WHERE state IN ('sleeping', 'waiting', 'failed', 'cancelled', 'skipped', 'diverged');
INSERT INTO public.runs_generated (id, function_id, event_id, state, run_at, max_attempts, created_at)
    SELECT durastep.uuid7(), 'f', gen_random_uuid(), 'queued', now(), 3, now() FROM generate_series(1, 300000);
INSERT INTO public.runs_plain (id, function_id, event_id, state, run_at, max_attempts, created_at)
    SELECT id, function_id, event_id, state, run_at, max_attempts, created_at FROM public.runs_generated;
INSERT INTO public.runs_before (id, function_id, event_id, state, run_at, max_attempts, created_at)
    SELECT id, function_id, event_id, state, run_at, max_attempts, created_at FROM public.runs_generated;
VACUUM ANALYZE public.runs_generated;
VACUUM ANALYZE public.runs_plain;
VACUUM ANALYZE public.runs_before;
SQL
# One round on table $1: the claim of 32 due runs, then their completion.
round_script() {
  cat <<SQL
WITH c AS (SELECT id FROM public.$1
     WHERE state IN ('queued', 'sleeping', 'waiting') AND run_at <= now()
     ORDER BY priority DESC, run_at LIMIT 32 FOR UPDATE SKIP LOCKED),
u AS (UPDATE public.$1 r
         SET state = 'running', lease_epoch = r.lease_epoch + 1, worker_id = '00000000-0000-0000-0000-000000000001',
             lease_expires_at = now() + interval '30 s', started_at = coalesce(r.started_at, now()),
             park_rule = NULL, park_key = NULL, flow_held = NULL, history_noted = NOT r.history_noted
        FROM c WHERE r.id = c.id RETURNING r.id)
SELECT array_agg(id)::text AS ids FROM u \gset
UPDATE public.$1 r SET state = 'completed', finished_at = now(), output = 'null', lease_expires_at = NULL,
       worker_id = NULL, history_noted = NOT r.history_noted
 WHERE r.id = ANY (:ids::uuid[]);
SQL
}
for s in before generated plain; do round_script "runs_$s" >"$tmp/$s.sql"; done
for round in $(seq 1 "$rounds"); do
  for s in before generated plain; do
    psql -d "$db" -q -f "$tmp/setup.sql"
    sleep 1
    claim_rounds "$db" "round $round: $s" "$tmp/$s.sql" "$secs" "$clients"
  done
done
rm -r "$tmp"
