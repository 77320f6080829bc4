#!/usr/bin/env bash
# What sleeping runs cost a claim: the fast claim of 128 runs (its statement
# as the worker sends it: store/sql/claim_fast.sql with run_records.sql,
# prepared, so under the generic plan a worker keeps) in a database holding
# SLEEPING runs asleep until random times in the next month (default
# 400,000). First "idle": nothing due, the claim an idle worker makes, and
# most claims under a trickle of sends (fewer runs due than they ask for).
# Then "busy": 200,000 of them made due, each round claiming for a second
# from that backlog (the rest still asleep), once as after a claim that came
# back short (the due runs read first, then the walk) and once as after a
# full one (the walk alone: the worker sends that statement, `store::Queue`).
# pgbench, 1 client, the latency per claim. Plain psql and pgbench;
# no Rust build. From the repository root:
#
#   bash benches/sql/sleeping_claims.sh
#
# CLAIM_SQL names another version of the claim to measure instead (the one
# before 2026-12-04, which walked every sleeping run's entry of `runs_due`
# whenever fewer runs were due than it asked for):
#
#   git show 42cd94b:crates/durastep/src/store/sql/claim_fast.sql > /tmp/old_claim.sql
#   CLAIM_SQL=/tmp/old_claim.sql bash benches/sql/sleeping_claims.sh
#
# (A claim older than migration 0035 reads the due queue through `runs_due`
# and `runs_next_due`, which 0035 dropped: measure it on a checkout of its
# own time, whose migrations this script applies.)
#
# Needs a local Postgres (PGHOST/PGUSER as for psql; default 127.0.0.1 and
# postgres). Creates and drops the database durastep_sleeping_claims. SECS
# (default 3) sets each idle run's length (a busy one lasts a second, so that
# the backlog lasts), ROUNDS (default 2) the rounds of each, SLEEPING the
# runs asleep.
set -euo pipefail
. benches/sql/lib.sh
db=durastep_sleeping_claims
secs="${SECS:-3}"
rounds="${ROUNDS:-2}"
sleeping="${SLEEPING:-400000}"
claim_sql="${CLAIM_SQL:-crates/durastep/src/store/sql/claim_fast.sql}"
tmp=$(mktemp -d)
trap 'psql -qc "DROP DATABASE IF EXISTS $db"; rm -rf "$tmp"' EXIT
migrated_db "$db"

# The claim with its parameters filled in (the runs it takes as a pgbench
# variable), as sent after a short claim and after a full one.
fast_claim_sql "$claim_sql" :n few >"$tmp/few.sql"
fast_claim_sql "$claim_sql" :n backlog >"$tmp/backlog.sql"

psql -d "$db" -q -v ON_ERROR_STOP=1 <<SQL
INSERT INTO durastep.functions (id, triggers, max_attempts) VALUES ('f', ARRAY['go'], 3);
CREATE TEMP TABLE ids AS SELECT durastep.uuid7() AS ev FROM generate_series(1, $sleeping);
INSERT INTO durastep.events (id, name, payload) SELECT ev, 'go', '{}' FROM ids;
INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts)
    SELECT durastep.uuid7(), 'f', ev, 'sleeping', now() + interval '1 hour' + random() * interval '30 days', 3 FROM ids;
VACUUM ANALYZE durastep.runs;
SQL

# Claims for $1 seconds, as after a short claim ($2 = few) or a full one ($2 = backlog).
claims() {
  pgbench -d "$db" -n -M prepared -D n=128 -f "$tmp/$2.sql" -T "$1" -c 1 2>&1 \
    | sed -n 's/^latency average = \(.*\)$/\1 per claim/p'
}
for round in $(seq "$rounds"); do
  echo "idle, $sleeping runs asleep, round $round: $(claims "$secs" few)"
done
psql -d "$db" -q -c "UPDATE durastep.runs SET state = 'queued', run_at = now() - random() * interval '1 hour'
                      WHERE id IN (SELECT id FROM durastep.runs ORDER BY id LIMIT 200000)" -c "VACUUM ANALYZE durastep.runs"
for round in $(seq "$rounds"); do
  for claim in few backlog; do
    echo "busy, claims of 128 from a backlog of 200,000 due beside the sleeping runs, sent as after a $([ $claim = few ] && echo short || echo full) claim, round $round: $(claims 1 "$claim")"
  done
done
