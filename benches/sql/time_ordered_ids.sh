#!/usr/bin/env bash
# What time-ordered ids (UUID version 7, migration 0021) save the claim against
# random ones (version 4): two databases with the same migrations and the same
# queued runs, one minting ids with gen_random_uuid() and one with
# durastep.uuid7(), both claimed 32 at a time by the engine's fast claim
# (crates/durastep/src/store/sql/claim_fast.sql, prepared) under pgbench,
# alternating, three rounds. Plain psql and pgbench; no Rust build. From the
# repository root:
#
#   bash benches/sql/time_ordered_ids.sh            # RUNS=300000 CLAIMS=2000
#
# Needs a local Postgres (PGHOST/PGUSER as for psql; default 127.0.0.1 and
# postgres). Creates and drops the databases durastep_ids_v4 and durastep_ids_v7.
set -euo pipefail
. benches/sql/lib.sh
runs="${RUNS:-300000}"
claims="${CLAIMS:-2000}"
if ((claims * 3 * 32 > runs)); then
    echo "time_ordered_ids.sh: RUNS must be at least CLAIMS x 96" >&2
    exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"; for v in v4 v7; do psql -qc "DROP DATABASE IF EXISTS durastep_ids_$v"; done' EXIT
for v in v4 v7; do
    db=durastep_ids_$v
    mint="gen_random_uuid()"
    [[ $v == v7 ]] && mint="durastep.uuid7()"
    migrated_db "$db"
    psql -d "$db" -v ON_ERROR_STOP=1 -q <<SQL
INSERT INTO durastep.functions (id, triggers, max_attempts) VALUES ('f', ARRAY['go'], 3);
CREATE TEMP TABLE ids AS SELECT $mint AS event_id, $mint AS run_id, g FROM generate_series(1, $runs) g;
INSERT INTO durastep.events (id, name, payload) SELECT event_id, 'go', to_jsonb(g) FROM ids ORDER BY g;
INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts)
SELECT run_id, 'f', event_id, 'queued', now() - interval '1 hour' + g * interval '1 ms', 3 FROM ids ORDER BY g;
SQL
    psql -d "$db" -qc "VACUUM ANALYZE" -c "CHECKPOINT"
done
fast_claim_sql crates/durastep/src/store/sql/claim_fast.sql 32 backlog >"$tmp/claim.sql"
echo "| round | ids | claim of 32, mean latency |"
echo "|---|---|---|"
for round in 1 2 3; do
    for v in v4 v7; do
        lat=$(pgbench -n -M prepared -t "$claims" -f "$tmp/claim.sql" "durastep_ids_$v" 2>/dev/null |
            sed -n 's/^latency average = //p')
        echo "| $round | $v | $lat |"
    done
done
for v in v4 v7; do
    n=$(psql -d "durastep_ids_$v" -Atc "SELECT count(*) FROM durastep.runs WHERE state = 'running'")
    if ((n != claims * 3 * 32)); then
        echo "time_ordered_ids.sh: $v claimed $n runs, expected $((claims * 3 * 32))" >&2
        exit 1
    fi
done
echo
echo "Each database: $runs queued runs; every claim took 32 (checked)."
