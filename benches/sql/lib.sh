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
