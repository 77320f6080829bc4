# Sourced by the scripts of benches/sql (run from the repository root): the
# local server as psql finds it (PGHOST and PGUSER, default 127.0.0.1 and
# postgres), and a database of their own with Durastep's migrations.
export PGHOST="${PGHOST:-127.0.0.1}" PGUSER="${PGUSER:-postgres}"

# Creates the database $1 afresh (dropping one left by an earlier run) and
# applies every migration to it; the caller drops it when it exits.
migrated_db() {
  PGOPTIONS="-c client_min_messages=warning" psql -qc "DROP DATABASE IF EXISTS $1" -c "CREATE DATABASE $1"
  for f in migrations/*.sql; do psql -d "$1" -v ON_ERROR_STOP=1 -q -f "$f" >/dev/null; done
}

# Prints the fast claim for pgbench on one line: the statement in the SQL file
# $1 (store/sql/claim_fast.sql, or an older version of it) with run_records.sql,
# comments dropped, for function `f` at version 0, a 30 s lease and a fixed
# worker; $2 is the runs it takes (a value, or a pgbench variable such as :n)
# and $3 which claim the worker sends: `few` (after a short claim: the whole
# text, the due runs read first) or `backlog` (after a full one: the text
# without its lines that end with `-- few`). A claim older than 2026-12-04
# has no such lines: both are the same.
fast_claim_sql() {
  local few='s/ *-- few$//'
  if [ "$3" = backlog ]; then few='/-- few$/d'; fi
  sed -e "$few" -e 's/\$1/ARRAY['"'"'f'"'"']/g; s/\$2/'"$2"'/g; s/\$3/30/g' \
      -e 's/\$4/'"'"'00000000-0000-0000-0000-000000000001'"'"'::uuid/g' \
      -e 's/\$5/ARRAY['"'"'f'"'"']/g; s/\$6/ARRAY[0]/g' \
      "$1" crates/durastep/src/store/sql/run_records.sql | grep -v '^ *--' | tr '\n' ' '
  echo ";"
}
