#!/usr/bin/env bash
# What the hot path's statements cost the server, in instructions: counted,
# not timed, so the figure is the same on a busy machine as on a quiet one
# and a change of a few percent is resolved (docs/performance.md "Counted
# instructions"). A private server runs under `valgrind --tool=callgrind`
# (its own data directory in a temporary folder, its own socket, no TCP
# port, autovacuum off), with Durastep's migrations in a database of its
# own, one function `f` triggered by the event `go` and HISTORY (default
# 20,000) completed runs of it. Each statement is
# sent by pgbench (`-M prepared`, one client, one statement per transaction
# as the engine sends it, so each count includes its commit) WARM times in
# one connection and WARM + CALLS times in another; the difference of the
# two backends' totals, divided by CALLS, is one call's instructions, and
# the same difference per function of the server (callgrind_annotate,
# inclusive) says where they go. The statements:
#
#   send          `send_events` with one event: the send of a run queued
#                 for any worker;
#   send_handing  `send_event_to_worker` with one slot: the send that hands
#                 its run to a worker of its process (the wake-up in the
#                 same process), the run inserted claimed;
#   claim_32      the fast claim of 32 runs from a backlog (store/sql/
#                 claim_fast.sql as a worker sends it after a full claim);
#   claim_full_32 the full claim of 32 runs from a backlog (store/sql/
#                 claim.sql, which a worker sends for functions with flow
#                 rules or timeouts, as it sends it after a full claim; here
#                 for a function with neither, so its flow steps find no key);
#   complete_32   the completion of 32 running runs (each carrying its
#                 completion, no history row, its count added to the
#                 minute's: migration 0045), by id, as the checkpoint flush's `fin` does (a copy of
#                 `completions!(writes)` in
#                 store/attempt.rs, without the step rows and the fence's
#                 lock), then the deletion of their claim record;
#   checkpoint_32 one step row for each of 32 running runs behind their fence
#                 (the runs' rows locked, their epochs and state compared), as
#                 the checkpoint flush writes them (a copy of `flush_sql!` in
#                 store/attempt.rs without completions and without its
#                 answer's columns); the claim record whose runs it writes
#                 for is read first, in one more statement;
#   flush_32      the checkpoint flush itself, whole, as the worker sends it
#                 (`flush_sql`, below: the text of `flush_sql!` for 32
#                 checkpoints, its answer included): a new step for each of
#                 the 32 runs of a claim;
#   flush_mixed_32 the same flush with 16 checkpoints and 16 completions,
#                 for the 32 runs of one claim, then the deletion of its
#                 claim record;
#   flush_mixed_4 the same with 2 checkpoints and 2 completions: a flush as
#                 small as those of a worker with few runs in flight, where
#                 what each statement pays once dominates (not a default).
#   flush_4       4 checkpoints alone: the text without the completions' parts
#                 (`no_completions!`), as small a flush (not a default);
#   flush_done_4  4 completions alone: the text without the checkpoints'
#                 parts (`no_checkpoints!`), the flush a worker with one run
#                 in flight sends when the run ends (not a default);
#   flush_done_32 32 completions alone, the same text (not a default).
#   flush_done_1  1 completion alone, the same text: a worker with one run
#                 in flight (not a default).
#
# VARIANT names a SQL file applied to the template after the history (a
# probe of a schema change: its figures beside the shipped schema's, from
# two runs of the script); CLAIM_SQL another text of the fast claim for it
# (default store/sql/claim_fast.sql); FLUSH_ARRAYS=from the flush as it
# was before 2026-12-07 (see `flush_sql`). Plain psql, pgbench and valgrind
# (Debian's package `valgrind`); no Rust build. From the repository root:
#
#   bash benches/sql/instructions.sh
#
# WARM (default 20) and CALLS (default 100) set the calls; STATEMENTS (default
# send, send_handing, claim_32, flush_32 and flush_mixed_32: the statements
# as the engine sends them; the others are parts or other ways, for
# comparing with the figures of earlier sections) which statements, in order; TOP (default 10) how many of the
# server's functions to list by their own instructions (0: none); KEEP a
# folder to keep the callgrind files in (`<statement>.warm` and
# `<statement>.calls`, for callgrind_annotate). Needs the server's
# binaries (pg_config --bindir, else /usr/lib/postgresql/*/bin) and runs the
# private server as the user `postgres` when started by root. Takes about
# five minutes on two cores.
set -euo pipefail
warm="${WARM:-20}"
calls="${CALLS:-100}"
statements="${STATEMENTS:-send send_handing claim_32 flush_32 flush_mixed_32}"
top="${TOP:-10}"
bindir=$(pg_config --bindir 2>/dev/null || true)
[ -x "$bindir/postgres" ] || bindir=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
. benches/sql/lib.sh
root=$(mktemp -d)
as_owner() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
[ "$(id -u)" = 0 ] && chown postgres "$root"
export PGHOST="$root" PGPORT=5499 PGUSER=postgres PGOPTIONS="-c client_min_messages=warning"
stop() {
  as_owner "$bindir/pg_ctl" -D "$root/data" -m immediate stop >/dev/null 2>&1 || true
  # Backends under valgrind may still be writing their callgrind files.
  for _ in 1 2 3 4 5; do rm -rf "$root" 2>/dev/null && break; sleep 1; done
}
trap stop EXIT
as_owner "$bindir/initdb" -D "$root/data" -A trust -U postgres >/dev/null
as_owner valgrind --tool=callgrind --callgrind-out-file="$root/cg.%p" "$bindir/postgres" -D "$root/data" \
  -p "$PGPORT" -k "$root" -c listen_addresses= -c autovacuum=off \
  -c log_connections=on -c log_line_prefix='%p ' >"$root/server.log" 2>&1 &
for _ in $(seq 120); do psql -d postgres -Atc "SELECT 1" >/dev/null 2>&1 && break; sleep 1; done
db=instructions_template
migrated_db "$db"
psql -d "$db" -q -v ON_ERROR_STOP=1 -c "INSERT INTO durastep.functions (id, triggers, max_attempts) VALUES ('f', ARRAY['go'], 3)"
# A history of finished runs, so that the statistics the plans are made from
# are those of tables in use, not of empty ones (which would plan sequential
# scans). Runs of one attempt carry their completion and have no history
# row (migration 0045); their counts are the minutes'.
psql -d "$db" -q -v ON_ERROR_STOP=1 <<SQL
INSERT INTO durastep.topics (name) VALUES ('go');
CREATE TEMP TABLE ids AS SELECT durastep.uuid7() AS ev FROM generate_series(1, ${HISTORY:-20000});
INSERT INTO durastep.events (id, name, payload) SELECT ev, 'go', '{}' FROM ids;
INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, started_at, finished_at, output)
    SELECT durastep.uuid7(), 'f', ev, 'completed', now(), 3, now(), now(), 'null' FROM ids;
INSERT INTO durastep.completions_per_minute (minute, backend, completed)
    SELECT date_trunc('minute', now()) - make_interval(mins => m), 1, 1000 FROM generate_series(1, 20) AS m;
SQL
if [ -n "${VARIANT:-}" ]; then psql -d "$db" -q -v ON_ERROR_STOP=1 -f "$VARIANT"; fi

# The checkpoint flush as the worker sends it (`flush_sql!` in
# crates/durastep/src/store/attempt.rs, `FOR NO KEY UPDATE SKIP LOCKED` and
# `plain_inserts!`), as a pgbench script: checkpoints for the first $1 runs
# of the first claim record and completions for its next $2 (each kind's
# parts only when it has writes, as `Halves` picks them: `checkpoints!` or
# `no_checkpoints!`, `completions!` or `no_completions!`), its parameters as
# pgbench variables (sent as text where the worker binds binary arrays, so `array_in` and `uuid_in` are
# counted here and not in the engine); after completions, the claim record is
# deleted, so that each call takes the next claim. FLUSH_ARRAYS=from gives the
# text before 2026-12-07 (the arrays unnested in a FROM with ordinality, read
# by two parts of the statement from a CTE): docs/performance.md "The flush's
# arrays streamed". FLUSH_HALVES=both gives a flush of one kind of write the
# text it had before 2026-12-07, late morning (the other kind's CTEs and half
# of the answer, empty; implied by FLUSH_ARRAYS=from): docs/performance.md
# "Flushes without an empty half".
flush_sql() {
  local cp=$1 dn=$2 fin="" cp_src dn_src lo=1 hi=0 both=0 cps=0 dns=0
  if [ "${FLUSH_HALVES:-}" = both ] || [ "${FLUSH_ARRAYS:-}" = from ]; then both=1; fi
  if [ "$cp" -gt 0 ] || [ "$both" = 1 ]; then cps=1; fi
  if [ "$dn" -gt 0 ] || [ "$both" = 1 ]; then dns=1; fi
  if [ "$dns" = 1 ]; then
    fin=",
 fin AS (SELECT NULL::uuid AS id WHERE false),
 fin_counted AS (SELECT NULL::uuid AS id WHERE false)"
  fi
  if [ "$dn" -gt 0 ]; then
    lo=$((cp + 1)) hi=$((cp + dn))
    fin=",
 fin AS (
     UPDATE durastep.runs r
        SET state = 'completed', output = dn.output::jsonb, finished_at = (SELECT durastep.now()),
            lease_expires_at = NULL, history_noted = NOT r.history_noted
       FROM dn JOIN l ON l.id = dn.run_id AND l.lease_epoch = dn.epoch AND l.live
      WHERE r.id = dn.run_id
     RETURNING r.id, r.finished_at),
 fin_counted AS (
     INSERT INTO durastep.completions_per_minute AS c (minute, backend, completed)
     SELECT date_trunc('minute', min(fin.finished_at)), pg_backend_pid(), count(*) FROM fin
     HAVING count(*) > 0
     ON CONFLICT (minute, backend) DO UPDATE SET completed = c.completed + excluded.completed)"
  fi
  cat <<SQL
SELECT id AS claim, run_ids::text AS ids, epochs::text AS epochs FROM durastep.run_claims ORDER BY id LIMIT 1 \gset
\set key random(1, 1000000000000)
WITH p AS MATERIALIZED (
     SELECT (:ids::uuid[])[1 : $cp] AS cp_run, (:epochs::bigint[])[1 : $cp] AS cp_epoch,
            array_fill('step-' || :key, ARRAY[$cp]) AS cp_key, array_fill('{"ok": true}'::text, ARRAY[$cp]) AS cp_output,
            (:ids::uuid[])[$lo : $hi] AS dn_run, (:epochs::bigint[])[$lo : $hi] AS dn_epoch,
            array_fill('null'::text, ARRAY[$dn]) AS dn_output,
            array_fill(now(), ARRAY[$cp]) AS cp_started, array_fill(now(), ARRAY[$cp]) AS cp_finished,
            array_fill(1, ARRAY[$cp]) AS cp_attempt, array_fill(1, ARRAY[$cp]) AS cp_position,
            array_fill('step'::text, ARRAY[$cp]) AS cp_kind),
SQL
  if [ "${FLUSH_ARRAYS:-}" = from ]; then
    cp_src="(SELECT * FROM cp)" dn_src="(SELECT * FROM dn)"
    cat <<'SQL'
 cp AS (
     SELECT t.* FROM p, unnest(p.cp_run, p.cp_epoch, p.cp_key, p.cp_output, p.cp_started, p.cp_finished,
                               p.cp_attempt, p.cp_position, p.cp_kind)
         WITH ORDINALITY AS t(run_id, epoch, step_key, output, started_at, finished_at, attempt,
                              position, kind, ord)),
 dn AS (
     SELECT t.* FROM p, unnest(p.dn_run, p.dn_epoch, p.dn_output)
         WITH ORDINALITY AS t(run_id, epoch, output, ord)),
SQL
  else
    cp_src="(SELECT unnest(p.cp_run) AS run_id, unnest(p.cp_epoch) AS epoch, unnest(p.cp_key) AS step_key,
               generate_series(1::bigint, cardinality(p.cp_run)) AS ord FROM p)"
    dn_src="(SELECT unnest(p.dn_run) AS run_id, unnest(p.dn_epoch) AS epoch,
               generate_series(1::bigint, cardinality(p.dn_run)) AS ord FROM p)"
    if [ "$cps" = 1 ]; then cat <<'SQL'
 cp AS (
     SELECT unnest(p.cp_run) AS run_id, unnest(p.cp_epoch) AS epoch, unnest(p.cp_key) AS step_key,
            unnest(p.cp_output) AS output, unnest(p.cp_started) AS started_at,
            unnest(p.cp_finished) AS finished_at, unnest(p.cp_attempt) AS attempt,
            unnest(p.cp_position) AS position, unnest(p.cp_kind) AS kind
       FROM p),
SQL
    fi
    if [ "$dns" = 1 ]; then cat <<'SQL'
 dn AS (
     SELECT unnest(p.dn_run) AS run_id, unnest(p.dn_epoch) AS epoch, unnest(p.dn_output) AS output FROM p),
SQL
    fi
  fi
  cat <<SQL
 l AS (
     SELECT r.id, r.lease_epoch, r.state = 'running' AS live, r.worker_id FROM durastep.runs r
      WHERE r.id = ANY ((SELECT p.cp_run || p.dn_run FROM p)::uuid[])
      ORDER BY r.id FOR NO KEY UPDATE SKIP LOCKED)
SQL
  if [ "$cps" = 1 ]; then cat <<SQL
, ins AS (
     INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch, started_at, finished_at, attempt,
                                        position, kind)
     SELECT cp.run_id, cp.step_key, cp.output::jsonb, cp.epoch, cp.started_at, cp.finished_at, cp.attempt,
            cp.position, cp.kind
       FROM cp JOIN l ON l.id = cp.run_id AND l.lease_epoch = cp.epoch AND l.live)
SQL
  fi
  echo "$fin"
  if [ "$cps" = 1 ]; then cat <<SQL
SELECT 0, cp.ord, (l.id IS NOT NULL), (l.id IS NOT NULL),
       (l.id IS NULL AND coalesce((SELECT b.lease_epoch = cp.epoch AND b.state = 'running'
                                     FROM durastep.runs b WHERE b.id = cp.run_id), false))
  FROM $cp_src cp
  LEFT JOIN l ON l.id = cp.run_id AND l.lease_epoch = cp.epoch AND l.live
SQL
  fi
  if [ "$cps" = 1 ] && [ "$dns" = 1 ]; then echo "UNION ALL"; fi
  if [ "$dns" = 1 ]; then cat <<SQL
SELECT 1, dn.ord, (fin.id IS NOT NULL), (fin.id IS NOT NULL),
       (fin.id IS NULL AND coalesce((SELECT b.lease_epoch = dn.epoch AND b.state = 'running'
                                       FROM durastep.runs b WHERE b.id = dn.run_id), false))
  FROM $dn_src dn
  LEFT JOIN fin ON fin.id = dn.run_id
SQL
  fi
  echo ";"
  if [ "$dn" -gt 0 ]; then echo "DELETE FROM durastep.run_claims WHERE id = :claim;"; fi
}

worker="'00000000-0000-0000-0000-000000000001'::uuid"
cat >"$root/send.sql" <<SQL
SELECT count(*) FROM durastep.send_events(ARRAY[gen_random_uuid()], ARRAY['go'], ARRAY['{}'], ARRAY[NULL::text],
                                          ARRAY[NULL::timestamptz], ARRAY[0]);
SQL
cat >"$root/send_handing.sql" <<SQL
SELECT count(*) FROM durastep.send_event_to_worker(gen_random_uuid(), 'go', '{}', NULL, 0, $worker, 30,
                                                   ARRAY['f'], ARRAY[0], 1);
SQL
fast_claim_sql "${CLAIM_SQL:-crates/durastep/src/store/sql/claim_fast.sql}" 32 backlog >"$root/claim_32.sql"
claim_sql crates/durastep/src/store/sql/claim.sql 32 backlog full >"$root/claim_full_32.sql"
flush_sql 32 0 >"$root/flush_32.sql"
flush_sql 16 16 >"$root/flush_mixed_32.sql"
flush_sql 2 2 >"$root/flush_mixed_4.sql"
flush_sql 4 0 >"$root/flush_4.sql"
flush_sql 0 4 >"$root/flush_done_4.sql"
flush_sql 0 32 >"$root/flush_done_32.sql"
flush_sql 0 1 >"$root/flush_done_1.sql"
cat >"$root/complete_32.sql" <<SQL
SELECT id AS claim, run_ids::text AS ids, epochs::text AS epochs FROM durastep.run_claims ORDER BY id LIMIT 1 \gset
WITH dn AS (SELECT * FROM unnest(:ids::uuid[], :epochs::bigint[]) AS t(run_id, epoch)),
fin AS (
    UPDATE durastep.runs r
       SET state = 'completed', output = 'null'::jsonb, finished_at = (SELECT durastep.now()),
           lease_expires_at = NULL, history_noted = NOT r.history_noted
      FROM dn WHERE r.id = dn.run_id AND r.lease_epoch = dn.epoch AND r.state = 'running'
    RETURNING r.id, r.finished_at),
fin_counted AS (
    INSERT INTO durastep.completions_per_minute AS c (minute, backend, completed)
    SELECT date_trunc('minute', min(fin.finished_at)), pg_backend_pid(), count(*) FROM fin
    HAVING count(*) > 0
    ON CONFLICT (minute, backend) DO UPDATE SET completed = c.completed + excluded.completed)
SELECT count(*) FROM fin;
DELETE FROM durastep.run_claims WHERE id = :claim;
SQL

cat >"$root/checkpoint_32.sql" <<SQL
SELECT run_ids::text AS ids, epochs::text AS epochs FROM durastep.run_claims ORDER BY id LIMIT 1 \gset
\set key random(1, 1000000000000)
WITH cp AS (SELECT * FROM unnest(:ids::uuid[], :epochs::bigint[]) WITH ORDINALITY AS t(run_id, epoch, ord)),
l AS (
    SELECT r.id, r.lease_epoch, r.state = 'running' AS live FROM durastep.runs r
     WHERE r.id = ANY (:ids::uuid[]) ORDER BY r.id FOR NO KEY UPDATE SKIP LOCKED)
INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch, started_at, finished_at, attempt,
                                   position, kind)
SELECT cp.run_id, 'step-' || :key, '{"ok": true}'::jsonb, cp.epoch, now(), now(), 1, cp.ord, 'step'
  FROM cp JOIN l ON l.id = cp.run_id AND l.lease_epoch = cp.epoch AND l.live;
SQL

# The callgrind file of the backend that ran the script $1 $2 times: found by
# its application name in the server's log of connections (pgbench also
# opens a connection of its own before its clients': the larger one).
backend_file() {
  local name="instructions_$1_$2" pid f
  PGAPPNAME=$name pgbench -n -M prepared -c 1 -t "$2" -f "$root/$1.sql" "$db" >"$root/pgbench.log" 2>&1 \
    || { cat "$root/pgbench.log" >&2; return 1; }
  for pid in $(sed -n "s/^\([0-9]*\) .*connection authorized: .*application_name=$name\$/\1/p" "$root/server.log"); do
    f="$root/cg.$pid"
    for _ in $(seq 60); do grep -q '^totals:' "$f" 2>/dev/null && break; sleep 0.5; done
    echo "$(total "$f") $f"
  done | sort -n | tail -1 | cut -d' ' -f2
}
total() { sed -n 's/^totals: //p' "$1"; }
# Instructions per function of the server in the callgrind file $2, one
# "count name" line each: inclusive (each function with what it calls) for
# $1 = inclusive, its own alone for $1 = self.
by_function() {
  callgrind_annotate --inclusive="$([ "$1" = inclusive ] && echo yes || echo no)" --threshold=100 "$2" 2>/dev/null \
    | sed -n 's/^ *\([0-9,]*\) ([ 0-9.]*%)  ???:\([A-Za-z_][A-Za-z0-9_]*\) \[.*$/\1 \2/p' | tr -d ','
}
# Per call, what grew between the files $2 and $3 over $4 calls, of the
# total $5 per call: the functions of the list $6 (inclusive; $1 =
# inclusive), or the $6 functions whose own instructions grew most ($1 = self).
grown() {
  join -1 2 -2 2 -a 1 -e 0 -o 0,1.1,2.1 <(by_function "$1" "$3" | sort -k2,2 -u) <(by_function "$1" "$2" | sort -k2,2 -u) \
    | awk -v n="$4" -v all="$5" '{ d = ($2 - $3) / n; if (d > 0) printf "%d %.1f %s\n", d, 100 * d / all, $1 }' \
    | if [ "$1" = inclusive ]; then grep -Ew "$(echo "$6" | tr -s ' \n' '|')\$" || true; else sort -rn | awk -v n="$6" 'NR <= n'; fi \
    | sort -rn | awk '{ printf "    %10d  %5.1f%%  %s\n", $1, $2, $3 }'
}
# Where a statement's instructions go, inclusive: executor start-up and end,
# the generated columns and CHECK constraints each writing statement
# prepares again, index entries written (and the B-tree's bottom-up deletion
# of old versions), heap writes, triggers (row and statement), PL/pgSQL,
# planning (a cached plan checked or made), the commit.
CENTRES="ExecutorStart ExecutorEnd ExecInitStoredGenerated ExecConstraints ExecInsertIndexTuples _bt_bottomupdel_pass
  heap_insert heap_update heap_lock_tuple AfterTriggerEndQuery AfterTriggerSaveEvent plpgsql_call_handler GetCachedPlan
  pg_plan_query CommitTransactionCommand XLogInsert"

queue() { # runs queued for the claims to come
  psql -d "$db" -q -v ON_ERROR_STOP=1 <<SQL
CREATE TEMP TABLE ids AS SELECT durastep.uuid7() AS ev FROM generate_series(1, $1);
INSERT INTO durastep.events (id, name, payload) SELECT ev, 'go', '{}' FROM ids;
INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts)
    SELECT durastep.uuid7(), 'f', ev, 'queued', now() - interval '1 s', 3 FROM ids;
SQL
}

echo "Server instructions per call (${VARIANT:-the shipped schema}; $calls calls after $warm):"
for s in $statements; do
  # Each statement in a copy of the same database: what one statement leaves
  # changes the statistics, so the plans, of the next (a run left queued would
  # also keep the handing send from handing: it hands only when nothing else
  # is due).
  db=instructions
  psql -d postgres -q -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db TEMPLATE instructions_template"
  case $s in
    claim_32 | claim_full_32) queue $(((2 * warm + calls) * 32)) ;;
    complete_32 | checkpoint_32 | flush_32 | flush_mixed_32 | flush_mixed_4 | flush_4 | flush_done_4 | flush_done_32 | flush_done_1)
      # Claims of 32 runs each, for the completions or checkpoints to come.
      queue $(((2 * warm + calls) * 32))
      pgbench -n -M prepared -c 1 -t $((2 * warm + calls)) -f "$root/claim_32.sql" "$db" >/dev/null ;;
  esac
  psql -d "$db" -q -c "VACUUM ANALYZE"
  a=$(backend_file "$s" "$warm")
  b=$(backend_file "$s" $((warm + calls)))
  per=$((($(total "$b") - $(total "$a")) / calls))
  printf '%-13s %10s instructions\n' "$s" "$per"
  if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP" && cp "$a" "$KEEP/$s.warm" && cp "$b" "$KEEP/$s.calls"; fi
  grown inclusive "$a" "$b" "$calls" "$per" "$CENTRES"
  if [ "$top" -gt 0 ]; then
    echo "  the $top functions whose own instructions grew most:"
    grown self "$a" "$b" "$calls" "$per" "$top"
  fi
done
