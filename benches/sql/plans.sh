#!/usr/bin/env bash
# Do the hot statements keep a generic plan? Prepares three of them with psql,
# in a database with the migrations and 4,000 queued runs of another function: the group-commit flush (its
# `flush_sql!` text with checkpoints only and FOR NO KEY UPDATE SKIP LOCKED, as
# the store builds it from crates/durastep/src/store/attempt.rs, one
# checkpoint of a run that is not running, so it stores nothing), the fast
# claim (store/sql/claim_fast.sql), `next_due_in` (an idle worker's "when is
# the next run due", in store/claim.rs) and the full claim
# (store/sql/claim.sql), all for a function with no runs, and a one-event
# send (`durastep.send_events`, whose statements run inside PL/pgSQL under
# the same plan cache rules). Each is executed 12 times under
# the server's plan_cache_mode (auto), then 12 times with force_generic_plan,
# printing each execution's time. Postgres plans the first five executions
# for their values (custom plans); if the later ones under auto are not as
# fast as under force_generic_plan, it kept planning every execution (as the
# flush did before 2026-12-02, when it read its arrays directly: a custom plan
# saw one row where the generic plan assumed ten, so it always looked
# cheaper; the send's statement did until migration 0022 gave the function
# its own force_generic_plan, so that the send shows no difference between the
# two modes now). Each series runs in one transaction that is rolled back, so
# that no commit is timed. From the repository root:
#
#   bash benches/sql/plans.sh
#
# Needs a local Postgres (PGHOST/PGUSER as for psql; default 127.0.0.1 and
# postgres), python3 (to cut the flush out of the Rust source). Creates and
# drops the database durastep_plans.
set -euo pipefail
. benches/sql/lib.sh
db=durastep_plans
trap 'psql -qc "DROP DATABASE IF EXISTS $db"' EXIT
migrated_db "$db"
# A function for the sends to fan out to (its runs are never claimed).
psql -d "$db" -qc "INSERT INTO durastep.functions (id, triggers, max_attempts) VALUES ('f', ARRAY['go'], 3)"
# Runs of another function, as any live database has (in empty tables the
# send's custom and generic plans cost alike, which hid its planning on every
# call); the claims below claim none of them.
psql -d "$db" -qc "INSERT INTO durastep.functions (id, triggers, max_attempts) VALUES ('g', ARRAY['seed'], 3)"
n=4000
psql -d "$db" -qc "SELECT count(*) FROM durastep.send_events(
    ARRAY(SELECT gen_random_uuid() FROM generate_series(1, $n)), array_fill('seed'::text, ARRAY[$n]),
    array_fill('{}'::text, ARRAY[$n]), array_fill(NULL::text, ARRAY[$n]),
    array_fill(NULL::timestamptz, ARRAY[$n]), array_fill(0, ARRAY[$n]))" -c "ANALYZE" >/dev/null
script=$(mktemp)
FLUSH_SQL=$(python3 benches/sql/checkpoint_flush.py) python3 - "$script" <<'PY'
import os, re, sys
flush = os.environ["FLUSH_SQL"]
statements = [
    ("flush", flush,
     "uuid[], bigint[], text[], text[], uuid[], bigint[], text[], timestamptz[], timestamptz[], int[], int[], text[]",
     "ARRAY[gen_random_uuid()], ARRAY[1::bigint], ARRAY['k'], ARRAY['1'], '{}', '{}', '{}', "
     "ARRAY[now()], ARRAY[now()], ARRAY[1], ARRAY[0], ARRAY['step']"),
    ("claim_fast", open("crates/durastep/src/store/sql/claim_fast.sql").read() + open("crates/durastep/src/store/sql/run_records.sql").read(),
     "text[], int8, float8, uuid, text[], int[]",
     "ARRAY['f'], 32, 30, gen_random_uuid(), ARRAY['f'], ARRAY[0]"),
    ("next_due_in", re.search(r'fn next_due_in.*?query_scalar\(\s*"(.*?)",', open("crates/durastep/src/store/claim.rs").read(), re.S).group(1),
     "text[], text[], int[]", "ARRAY['f'], ARRAY['f'], ARRAY[0]"),
    ("send_events", "SELECT count(*) FROM durastep.send_events($1, $2, $3, $4, $5, $6)",
     "uuid[], text[], text[], text[], timestamptz[], int[]",
     "ARRAY[gen_random_uuid()], ARRAY['go'], ARRAY['{}'], ARRAY[NULL::text], ARRAY[NULL::timestamptz], ARRAY[0]"),
    ("claim", open("crates/durastep/src/store/sql/claim.sql").read() + open("crates/durastep/src/store/sql/run_records.sql").read(),
     "text[], int8, float8, uuid, float8, text[], int[]",
     "ARRAY['f'], 32, 30, gen_random_uuid(), 1.0, ARRAY['f'], ARRAY[0]"),
]
# Each claim also as the worker sends it after a full one: without its lines
# that end with `-- few` (store/claim.rs).
statements += [(name + "_walk", "\n".join(l for l in sql.splitlines() if not l.rstrip().endswith("-- few")), types, args)
               for name, sql, types, args in statements if name.startswith("claim")]
out = []
for name, sql, types, args in statements:
    out += ["\\timing off", f"PREPARE {name}({types}) AS {sql};"]
    for mode in ["auto", "force_generic_plan"]:
        out += ["\\timing off", f"SET plan_cache_mode = {mode};", f"\\echo {name} plan_cache_mode {mode}", "\\timing on"]
        # In one transaction, rolled back: the times are planning and
        # execution, without a commit's flush (which on a busy machine hid
        # the send's planning under its commit).
        out += ["BEGIN;"] + [f"EXECUTE {name}({args});"] * 12 + ["\\timing off", "ROLLBACK;"]
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PY
psql -d "$db" -v ON_ERROR_STOP=1 -q -f "$script" | grep -E 'plan_cache_mode|^Time' | sed 's/^Time: //' | paste -sd ' ' | sed 's/ \([a-z_]* plan_cache_mode\)/\n\1/g'
rm "$script"
