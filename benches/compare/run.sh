#!/usr/bin/env bash
# Durastep beside graphile-worker and DBOS Transact, on the same Postgres, in one go.
#   bash benches/compare/run.sh            (DATABASE_URL defaults to the local server)
# Run it while holding the bench lock so no other benchmark runs at the same time:
#   flock /tmp/bench.lock bash benches/compare/run.sh
# Installs the pinned engines into benches/compare/.deps (git-ignored), builds
# Durastep's benches, then runs graphile-worker's, DBOS's and Durastep's own
# (throughput, latency, replay) one after the other, with a raw commit
# yardstick before and after; each creates and drops its own database. Prints
# COMPARE lines for the other engines and RESULT lines for Durastep.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
# One transport for all three engines: without an sslmode, node-postgres never
# uses TLS, while psycopg and sqlx use it whenever the server offers it (a
# Debian server does, with its snakeoil certificate). Set one to compare over TLS.
case "$DATABASE_URL" in
    *sslmode=*) ;;
    *\?*) DATABASE_URL="$DATABASE_URL&sslmode=disable" ;;
    *) DATABASE_URL="$DATABASE_URL?sslmode=disable" ;;
esac

bash "$here/install.sh"
# Built before anything is timed, so that the build does not load the machine.
(cd "$here/../.." && cargo bench -p durastep-benches --no-run --quiet)

echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores,$(uptime | sed 's/.*load average/ load average/')"
RAW_TAG=_before "$here/.deps/venv/bin/python" "$here/raw_baseline.py"
node "$here/graphile.mjs"
echo "# $(date -u '+%H:%M UTC'),$(uptime | sed 's/.*load average/ load average/')"
"$here/.deps/venv/bin/python" "$here/dbos_bench.py"
echo "# $(date -u '+%H:%M UTC'),$(uptime | sed 's/.*load average/ load average/')"
for bench in throughput latency replay; do
    (cd "$here/../.." && cargo bench -p durastep-benches --quiet --bench "$bench")
done
RAW_TAG=_after "$here/.deps/venv/bin/python" "$here/raw_baseline.py"
echo "# $(date -u '+%H:%M UTC'),$(uptime | sed 's/.*load average/ load average/')"
