#!/usr/bin/env bash
# Does the group-commit flush statement get a generic plan? Prepares the
# `flush_sql!` text (checkpoints only, FOR NO KEY UPDATE SKIP LOCKED, as the
# store builds it from crates/durastep/src/store/attempt.rs) with psql and
# executes it 12 times with one checkpoint under the server's plan_cache_mode
# (auto), then 12 times with force_generic_plan, printing each execution's
# time. Postgres plans the first five executions for their values (custom
# plans); if the later ones under auto are not as fast as under
# force_generic_plan, it kept planning every execution (as it did before
# 2026-12-02, when the statement read its arrays directly: a custom plan saw
# one row where the generic plan assumed ten, so it always looked cheaper).
# The run it writes for is not running, so every execution plans and runs the
# statement but stores nothing. From the repository root:
#
#   bash benches/sql/flush_plan.sh
#
# Needs a local Postgres (PGHOST/PGUSER as for psql; default 127.0.0.1 and
# postgres), python3 (to cut the statement out of the Rust source). Creates
# and drops the database durastep_flush_plan.
set -euo pipefail
export PGHOST="${PGHOST:-127.0.0.1}" PGUSER="${PGUSER:-postgres}"
db=durastep_flush_plan
psql -qc "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db" 2>/dev/null
trap 'psql -qc "DROP DATABASE IF EXISTS $db"' EXIT
for f in migrations/*.sql; do psql -d "$db" -v ON_ERROR_STOP=1 -q -f "$f" >/dev/null; done
script=$(mktemp)
python3 - "$script" <<'PY'
import re, sys
src = open("crates/durastep/src/store/attempt.rs").read()
body = re.search(r"macro_rules! flush_sql \{.*?concat!\(\s*(.*?)\n\s*\)\n\s*\};", src, re.S).group(1)
lit = re.findall(r'"((?:[^"\\]|\\.)*)"', body)
fin = re.search(r'macro_rules! fin_none \{.*?"(.*?)"', src, re.S).group(1)
sql = lit[0] + "FOR NO KEY UPDATE SKIP LOCKED" + lit[1] + fin + lit[2]
types = "uuid[], bigint[], text[], text[], uuid[], bigint[], text[], timestamptz[], timestamptz[], int[], int[], text[]"
ex = ("EXECUTE flush(ARRAY[gen_random_uuid()], ARRAY[1::bigint], ARRAY['k'], ARRAY['1'], '{}', '{}', '{}', "
      "ARRAY[now()], ARRAY[now()], ARRAY[1], ARRAY[0], ARRAY['step'])")
out = ["\\timing on", f"PREPARE flush({types}) AS {sql};"]
for mode in ["auto", "force_generic_plan"]:
    out.append(f"SET plan_cache_mode = {mode};")
    out.append(f"\\echo plan_cache_mode {mode}")
    out += [ex + ";"] * 12
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PY
psql -d "$db" -q -f "$script" | grep -E '^plan_cache_mode|^Time'
rm "$script"
