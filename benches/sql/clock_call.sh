#!/usr/bin/env bash
# What a call of durastep.now() costs a statement: the PL/pgSQL function of
# migration 0019 against the SQL function it replaced (a copy made here), and
# a statement with no call, each as its own prepared statement under pgbench.
# Plain psql and pgbench; no Rust build. From the repository root:
#
#   bash benches/sql/clock_call.sh
#
# Needs a local Postgres (PGHOST/PGUSER as for psql; default 127.0.0.1 and
# postgres). Creates and drops the database durastep_clock_call.
set -euo pipefail
. benches/sql/lib.sh
db=durastep_clock_call
secs="${SECS:-8}"
trap 'psql -qc "DROP DATABASE IF EXISTS $db"' EXIT
migrated_db "$db"
psql -d "$db" -qc "CREATE FUNCTION durastep.now_as_sql() RETURNS timestamptz LANGUAGE sql STABLE PARALLEL SAFE
                   AS \$\$ SELECT now() + (SELECT offset_by FROM durastep.clock) \$\$"
tmp=$(mktemp -d)
echo "SELECT durastep.now();" >"$tmp/plpgsql.sql"
echo "SELECT durastep.now_as_sql();" >"$tmp/sql.sql"
echo "SELECT now();" >"$tmp/none.sql"
for round in 1 2; do
  for s in none plpgsql sql; do
    lat=$(pgbench -n -M prepared -T "$secs" -f "$tmp/$s.sql" "$db" 2>/dev/null | sed -n 's/^latency average = //p')
    echo "round $round: $s: $lat"
  done
done
rm -r "$tmp"
