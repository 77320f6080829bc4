# Sourced by the scripts of benches/sql (run from the repository root): the
# local server as psql finds it (PGHOST and PGUSER, default 127.0.0.1 and
# postgres), and a database of their own with Durastep's migrations.
export PGHOST="${PGHOST:-127.0.0.1}" PGUSER="${PGUSER:-postgres}"

# Creates the database $1 afresh (dropping one left by an earlier run) and
# applies every migration to it, each in one transaction as the engine
# applies them; the caller drops it when it exits.
migrated_db() {
  PGOPTIONS="-c client_min_messages=warning" psql -qc "DROP DATABASE IF EXISTS $1" -c "CREATE DATABASE $1"
  for f in migrations/*.sql; do psql -d "$1" -1 -v ON_ERROR_STOP=1 -q -f "$f" >/dev/null; done
}

# Prints a claim for pgbench on one line: the statement in the SQL file $1
# with run_records.sql, comments dropped, for function `f` at version 0, a
# 30 s lease and a fixed worker; $2 is the runs it takes (a value, or a
# pgbench variable such as :n) and $3 which claim the worker sends: `few`
# (after a short claim: the whole text, the due runs read first) or
# `backlog` (after a full one: the text without its lines that end with
# `-- few`). A claim older than 2026-12-04 has no such lines: both are the
# same. $4 is `fast` for the fast claim's parameters (store/sql/
# claim_fast.sql: $5 and $6 the versions) or `full` for the full claim's
# (store/sql/claim.sql: $5 the recheck of parked runs, 1 s; $6 and $7 the
# versions).
claim_sql() {
  local few='s/ *-- few$//' versions='s/\$5/ARRAY['"'"'f'"'"']/g; s/\$6/ARRAY[0]/g'
  if [ "$3" = backlog ]; then few='/-- few$/d'; fi
  if [ "$4" = full ]; then versions='s/\$5/1/g; s/\$6/ARRAY['"'"'f'"'"']/g; s/\$7/ARRAY[0]/g'; fi
  sed -e "$few" -e 's/\$1/ARRAY['"'"'f'"'"']/g; s/\$2/'"$2"'/g; s/\$3/30/g' \
      -e 's/\$4/'"'"'00000000-0000-0000-0000-000000000001'"'"'::uuid/g' \
      -e "$versions" \
      "$1" crates/durastep/src/store/sql/run_records.sql | grep -v '^ *--' | tr '\n' ' '
  echo ";"
}

# The fast claim, as `claim_sql` prints it ($1 to $3 as there).
fast_claim_sql() { claim_sql "$1" "$2" "$3" fast; }

# Runs the pgbench script $3 (each transaction one claim of 32 runs and their
# completion) on the database $1 for $4 seconds from $5 clients, and prints
# one line for the variant $2: runs/s, the machine's busy CPU per 1,000 runs
# (all processes, pgbench included) and WAL bytes per run. With $6 (a table
# name), also the share of that table's updates that were HOT.
claim_rounds() {
  local db=$1 name=$2 script=$3 secs=$4 clients=$5 table=${6:-}
  local start cpu0 cpu1 out n runs wal hot=""
  busy() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8}' /proc/stat; }
  start=$(psql -d "$db" -Atc "SELECT pg_current_wal_lsn()")
  cpu0=$(busy)
  out=$(pgbench -n -M prepared -c "$clients" -j 1 -T "$secs" -f "$script" "$db" 2>/dev/null)
  cpu1=$(busy)
  n=$(sed -n 's/^number of transactions actually processed: //p' <<<"$out")
  runs=$((n * 32))
  wal=$(psql -d "$db" -Atc "SELECT round(pg_wal_lsn_diff(pg_current_wal_lsn(), '$start') / $runs)")
  if [ -n "$table" ]; then
    sleep 1.5 # the backends' table statistics reach the cumulative view
    hot=", $(psql -d "$db" -Atc "SELECT round(100.0 * n_tup_hot_upd / greatest(n_tup_upd, 1))
                                   FROM pg_stat_user_tables WHERE relname = '$table'")% of updates HOT"
  fi
  echo "$name: $((runs / secs)) runs/s, $(((cpu1 - cpu0) * 1000000 / $(getconf CLK_TCK) / runs)) ms CPU per 1,000 runs," \
       "$wal WAL bytes per run$hot"
}
