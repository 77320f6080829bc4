-- Table sizes per run, and what retention by DELETE costs against dropping a
-- time partition (docs/scaling.md). Plain psql; no Rust build.
--
-- Run it in a scratch database with the migrations applied in order, from the
-- repository root:
--
--   psql -h 127.0.0.1 -U postgres -c 'CREATE DATABASE durastep_sizes'
--   for f in migrations/*.sql; do
--     psql -h 127.0.0.1 -U postgres -d durastep_sizes -1 -v ON_ERROR_STOP=1 -q -f "$f" || break
--   done
--   psql -h 127.0.0.1 -U postgres -d durastep_sizes -v ON_ERROR_STOP=1 -f benches/sql/table_sizes.sql
--   psql -h 127.0.0.1 -U postgres -c 'DROP DATABASE durastep_sizes'
--
-- Sizes can be scaled with -v n=<runs per population> (default 100000);
--
-- What it does. Three populations of runs go through the engine's own
-- statements (the fast claim read from its file, the others copied from the
-- store; the claim writes its history rows, the triggers of the migrations
-- the others), in batches:
--   1. n single-step runs: durastep.send_events (1,000 events per call, like
--      `send_batch`), the fast claim (store/sql/claim_fast.sql, 500 per call),
--      then one group-commit flush per claimed batch holding each run's step
--      result, journal entry and completion (the `flush_sql!` text with
--      `checkpoints!` and `completions!`);
--   2. n ten-step runs: the same, with ten flushes per claimed batch (steps 1-9
--      checkpoint only, step 10 with the completion);
--   3. n sleeping runs: claimed, a `ctx.sleep` checkpoint ({"wake_at": ...}
--      with its journal entry), then the `suspend_until` UPDATE for the batch
--      (the engine runs it per run; the rows written are the same).
-- Events carry a ~90-byte JSON payload and an idempotency key; step outputs
-- are ~50-byte JSON objects. After each population the sizes of every
-- relation in schema durastep are recorded, before and after VACUUM ANALYZE;
-- the report gives each population's share scaled to a million runs.
-- Then: EXPLAIN ANALYZE of the walk of `runs_due` that every claim finding
-- fewer runs due than it asked for made before 2026-12-04 (since then such a
-- claim reads `runs_next_due` up to the first run not yet due instead, and
-- walks `runs_due` only when more runs are due than it takes), with the
-- sleeping runs in the table, and the retention comparison (the engine's own `durastep.prune_batch` in
-- batches of 500 until nothing is left, against DETACH + DROP of the month
-- partitions of a partitioned copy holding the same rows).

\set ON_ERROR_STOP 1
\if :{?n}
\else
  \set n 100000
\endif
\timing on


DROP SCHEMA IF EXISTS sizes CASCADE;
CREATE SCHEMA sizes;
CREATE TABLE sizes.snap (
    phase text NOT NULL,
    vacuumed boolean NOT NULL,
    tbl text NOT NULL,
    rel text NOT NULL,          -- the table itself, or one of its indexes
    kind text NOT NULL,         -- 'heap' (table + TOAST + maps) or 'index'
    bytes bigint NOT NULL,
    live_rows bigint
);

-- Records every relation of schema durastep: heap (pg_table_size: heap, TOAST,
-- free space and visibility maps) and each index (pg_relation_size).
CREATE FUNCTION sizes.record(p_phase text, p_vacuumed boolean) RETURNS void LANGUAGE sql AS $$
    INSERT INTO sizes.snap
    SELECT p_phase, p_vacuumed, c.relname, c.relname, 'heap', pg_table_size(c.oid),
           (SELECT n_live_tup FROM pg_stat_user_tables s WHERE s.relid = c.oid)
      FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace
     WHERE ns.nspname = 'durastep' AND c.relkind = 'r'
    UNION ALL
    SELECT p_phase, p_vacuumed, t.relname, i.relname, 'index', pg_relation_size(i.oid), NULL
      FROM pg_index x
      JOIN pg_class i ON i.oid = x.indexrelid
      JOIN pg_class t ON t.oid = x.indrelid
      JOIN pg_namespace ns ON ns.oid = t.relnamespace
     WHERE ns.nspname = 'durastep' AND t.relkind = 'r'
$$;

-- The engine's statements, verbatim from the store.
CREATE TABLE sizes.stmt (name text PRIMARY KEY, sql text NOT NULL);
-- crates/durastep/src/store/sql/claim_fast.sql with run_records.sql appended, as the
-- store sends it, read from the files (run from the repository root).
\set claim_fast_sql `cat crates/durastep/src/store/sql/claim_fast.sql crates/durastep/src/store/sql/run_records.sql`
INSERT INTO sizes.stmt VALUES ('claim_fast', :'claim_fast_sql');
-- crates/durastep/src/store/attempt.rs: flush_sql!("FOR NO KEY UPDATE", ..., checkpoints, completions, ...), in its text
-- before 2026-12-02 (it read its arrays directly; the rows it writes are the same)
INSERT INTO sizes.stmt VALUES ('flush', $q$
WITH cp AS (
     SELECT * FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::text[],
                          $8::timestamptz[], $9::timestamptz[], $10::int[], $11::int[], $12::text[])
         WITH ORDINALITY AS t(run_id, epoch, step_key, output, started_at, finished_at, attempt,
                              position, kind, ord)),
 dn AS (
     SELECT * FROM unnest($5::uuid[], $6::bigint[], $7::text[])
         WITH ORDINALITY AS t(run_id, epoch, output, ord)),
 l AS (
     SELECT r.id, r.lease_epoch FROM durastep.runs r
      WHERE r.id = ANY ($1::uuid[] || $5::uuid[]) AND r.state = 'running'
      ORDER BY r.id FOR NO KEY UPDATE),
 ins AS (
     -- The journal entry on the step row (migration 0029).
     INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch, started_at, finished_at, attempt,
                                        position, kind)
     SELECT cp.run_id, cp.step_key, cp.output::jsonb, cp.epoch, cp.started_at, cp.finished_at, cp.attempt,
            cp.position, cp.kind
       FROM cp JOIN l ON l.id = cp.run_id AND l.lease_epoch = cp.epoch
     ON CONFLICT (run_id, step_key) DO NOTHING
     RETURNING run_id, step_key),
 fin AS (
     UPDATE durastep.runs r
        SET state = 'completed', output = dn.output::jsonb, finished_at = durastep.now(),
            lease_expires_at = NULL, worker_id = NULL
       FROM dn JOIN l ON l.id = dn.run_id AND l.lease_epoch = dn.epoch
      WHERE r.id = dn.run_id
     RETURNING r.id)
 SELECT 0, cp.ord, (l.id IS NOT NULL), (ins.run_id IS NOT NULL),
        (l.id IS NULL AND EXISTS (SELECT 1 FROM durastep.runs b
                                   WHERE b.id = cp.run_id AND b.lease_epoch = cp.epoch
                                     AND b.state = 'running'))
   FROM cp LEFT JOIN l ON l.id = cp.run_id AND l.lease_epoch = cp.epoch
   LEFT JOIN ins ON ins.run_id = cp.run_id AND ins.step_key = cp.step_key
 UNION ALL
 SELECT 1, dn.ord, (fin.id IS NOT NULL), (fin.id IS NOT NULL),
        (fin.id IS NULL AND EXISTS (SELECT 1 FROM durastep.runs b
                                     WHERE b.id = dn.run_id AND b.lease_epoch = dn.epoch
                                       AND b.state = 'running'))
   FROM dn LEFT JOIN fin ON fin.id = dn.run_id
$q$);
-- crates/durastep/src/store.rs: suspend_until, for a batch of runs.
INSERT INTO sizes.stmt VALUES ('suspend', $q$
UPDATE durastep.runs
   SET state = CASE WHEN $3 > durastep.now() THEN 'sleeping' ELSE 'running' END,
       run_at = CASE WHEN $3 > durastep.now() THEN $3 ELSE run_at END,
       lease_expires_at = CASE WHEN $3 > durastep.now() THEN NULL ELSE lease_expires_at END,
       worker_id = CASE WHEN $3 > durastep.now() THEN NULL ELSE worker_id END
 WHERE id = ANY ($1) AND lease_epoch = ANY ($2) AND state = 'running'
$q$);

-- Functions, as register_functions upserts them (store.rs).
INSERT INTO durastep.functions (id, triggers, max_attempts, has_on_failure, cancel_on,
                                start_timeout_secs, finish_timeout_secs, max_lease_losses, version, updated_at)
VALUES ('bench-one-step', ARRAY['bench/one'], 3, false, '[]', NULL, NULL, 10, 0, now()),
       ('bench-ten-steps', ARRAY['bench/ten'], 3, false, '[]', NULL, NULL, 10, 0, now()),
       ('bench-sleeper', ARRAY['bench/sleep'], 3, false, '[]', NULL, NULL, 10, 0, now());

-- Sends p_n events named p_name, 1,000 per durastep.send_events call, one
-- commit per call.
CREATE PROCEDURE sizes.send(p_name text, p_n integer) LANGUAGE plpgsql AS $$
DECLARE
    i integer := 0;
    k integer;
BEGIN
    WHILE i < p_n LOOP
        k := least(1000, p_n - i);
        PERFORM count(*) FROM durastep.send_events(
            ARRAY(SELECT gen_random_uuid() FROM generate_series(1, k)),
            array_fill(p_name, ARRAY[k]),
            ARRAY(SELECT format('{"order_id": "ord_%s", "customer_id": "cus_%s", "amount_cents": %s, "currency": "EUR"}',
                                lpad((i + g)::text, 9, '0'), lpad(((i + g) % 50000)::text, 6, '0'), 100 + (i + g) % 90000)
                    FROM generate_series(1, k) g),
            ARRAY(SELECT p_name || ':ord_' || lpad((i + g)::text, 9, '0') FROM generate_series(1, k) g),
            array_fill(NULL::timestamptz, ARRAY[k]),
            array_fill(0, ARRAY[k]));
        COMMIT;
        i := i + k;
    END LOOP;
END $$;

-- Drains the runs of p_function: claims 500 at a time with the fast claim,
-- then per claimed batch p_steps flushes (the last one with the completions),
-- or, with p_sleep, one checkpoint of a sleep record and the suspension.
CREATE PROCEDURE sizes.drain(p_function text, p_steps integer, p_sleep boolean) LANGUAGE plpgsql AS $$
DECLARE
    claim_sql text := (SELECT sql FROM sizes.stmt WHERE name = 'claim_fast');
    flush_sql text := (SELECT sql FROM sizes.stmt WHERE name = 'flush');
    suspend_sql text := (SELECT sql FROM sizes.stmt WHERE name = 'suspend');
    worker uuid := gen_random_uuid();
    rec record;
    ids uuid[];
    epochs bigint[];
    n integer;
    s integer;
    wake timestamptz;
    none_uuid uuid[] := '{}';
    none_big bigint[] := '{}';
    none_text text[] := '{}';
BEGIN
    LOOP
        ids := '{}';
        epochs := '{}';
        FOR rec IN EXECUTE claim_sql
                USING ARRAY[p_function], 500::bigint, 300.0::float8, worker, ARRAY[p_function], ARRAY[0] LOOP
            ids := ids || rec.id;
            epochs := epochs || rec.lease_epoch;
        END LOOP;
        EXIT WHEN cardinality(ids) = 0;
        COMMIT;
        n := cardinality(ids);
        IF p_sleep THEN
            wake := durastep.now() + interval '1 hour';
            EXECUTE flush_sql USING ids, epochs, array_fill('nap'::text, ARRAY[n]),
                array_fill(format('{"wake_at": "%s"}', to_char(wake AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')),
                           ARRAY[n]),
                none_uuid, none_big, none_text,
                array_fill(clock_timestamp(), ARRAY[n]), array_fill(clock_timestamp(), ARRAY[n]),
                array_fill(1, ARRAY[n]), array_fill(0, ARRAY[n]), array_fill('sleep'::text, ARRAY[n]);
            COMMIT;
            EXECUTE suspend_sql USING ids, epochs, wake;
            COMMIT;
            CONTINUE;
        END IF;
        FOR s IN 1..p_steps LOOP
            EXECUTE flush_sql USING ids, epochs, array_fill('step-' || s, ARRAY[n]),
                ARRAY(SELECT format('{"charge_id": "ch_%s", "status": "succeeded"}',
                                    substr(md5(i::text || s), 1, 14)) FROM unnest(ids) AS i),
                CASE WHEN s = p_steps THEN ids ELSE none_uuid END,
                CASE WHEN s = p_steps THEN epochs ELSE none_big END,
                CASE WHEN s = p_steps THEN array_fill(format('{"ok": true, "steps": %s}', p_steps), ARRAY[n])
                     ELSE none_text END,
                array_fill(clock_timestamp(), ARRAY[n]), array_fill(clock_timestamp(), ARRAY[n]),
                array_fill(1, ARRAY[n]), array_fill(s - 1, ARRAY[n]), array_fill('step'::text, ARRAY[n]);
            COMMIT;
        END LOOP;
    END LOOP;
END $$;

SELECT sizes.record('0 empty', false);
SELECT sizes.record('0 empty', true);

-- 1. Single-step runs.
CALL sizes.send('bench/one', :n);
CALL sizes.drain('bench-one-step', 1, false);
SELECT sizes.record('1 single-step', false);
VACUUM ANALYZE;
SELECT sizes.record('1 single-step', true);

-- 2. Ten-step runs.
CALL sizes.send('bench/ten', :n);
CALL sizes.drain('bench-ten-steps', 10, false);
SELECT sizes.record('2 ten-step', false);
VACUUM ANALYZE;
SELECT sizes.record('2 ten-step', true);

-- 3. Sleeping runs (one checkpointed sleep of an hour each).
CALL sizes.send('bench/sleep', :n);
CALL sizes.drain('bench-sleeper', 0, true);
SELECT sizes.record('3 sleeping', false);
VACUUM ANALYZE;
SELECT sizes.record('3 sleeping', true);

\timing off
\echo
\echo == Rows per table after the three populations
SELECT 'runs' AS tbl, state AS detail, count(*) FROM durastep.runs GROUP BY state
UNION ALL SELECT 'step_results', NULL, count(*) FROM durastep.step_results
UNION ALL SELECT 'step_journal', NULL, count(*) FROM durastep.step_journal
UNION ALL SELECT 'run_history', NULL, count(*) FROM durastep.run_history
UNION ALL SELECT 'events', NULL, count(*) FROM durastep.events
ORDER BY 1, 2;

-- Each population's share: the growth of every relation over its phase,
-- scaled to a million runs.
CREATE VIEW sizes.growth AS
SELECT s.phase, s.vacuumed, s.tbl, s.rel, s.kind,
       s.bytes - coalesce((SELECT p.bytes FROM sizes.snap p
                            WHERE p.rel = s.rel AND p.vacuumed = s.vacuumed
                              AND p.phase = (SELECT max(q.phase) FROM sizes.snap q WHERE q.phase < s.phase)), 0)
         AS grown
  FROM sizes.snap s;

\echo
\echo == MB per million runs, per table (heap + TOAST + indexes), after VACUUM ANALYZE
SELECT tbl,
       round(sum(grown) FILTER (WHERE phase = '1 single-step') * (1000000.0 / :n) / 1048576) AS single_step_mb,
       round(sum(grown) FILTER (WHERE phase = '2 ten-step') * (1000000.0 / :n) / 1048576) AS ten_step_mb,
       round(sum(grown) FILTER (WHERE phase = '3 sleeping') * (1000000.0 / :n) / 1048576) AS sleeping_mb
  FROM sizes.growth WHERE vacuumed
 GROUP BY tbl HAVING sum(abs(grown)) > 0
 ORDER BY 2 DESC NULLS LAST, 1;
SELECT 'total' AS tbl,
       round(sum(grown) FILTER (WHERE phase = '1 single-step') * (1000000.0 / :n) / 1048576) AS single_step_mb,
       round(sum(grown) FILTER (WHERE phase = '2 ten-step') * (1000000.0 / :n) / 1048576) AS ten_step_mb,
       round(sum(grown) FILTER (WHERE phase = '3 sleeping') * (1000000.0 / :n) / 1048576) AS sleeping_mb
  FROM sizes.growth WHERE vacuumed AND phase > '0';

\echo
\echo == The same before VACUUM (as the statements left them)
SELECT tbl,
       round(sum(grown) FILTER (WHERE phase = '1 single-step') * (1000000.0 / :n) / 1048576) AS single_step_mb,
       round(sum(grown) FILTER (WHERE phase = '2 ten-step') * (1000000.0 / :n) / 1048576) AS ten_step_mb,
       round(sum(grown) FILTER (WHERE phase = '3 sleeping') * (1000000.0 / :n) / 1048576) AS sleeping_mb
  FROM sizes.growth WHERE NOT vacuumed
 GROUP BY tbl HAVING sum(abs(grown)) > 0
 ORDER BY 2 DESC NULLS LAST, 1;

\echo
\echo == MB per million runs, per relation (heap or index), after VACUUM ANALYZE
SELECT tbl, rel, kind,
       round(sum(grown) FILTER (WHERE phase = '1 single-step') * (1000000.0 / :n) / 1048576, 1) AS single_step_mb,
       round(sum(grown) FILTER (WHERE phase = '2 ten-step') * (1000000.0 / :n) / 1048576, 1) AS ten_step_mb,
       round(sum(grown) FILTER (WHERE phase = '3 sleeping') * (1000000.0 / :n) / 1048576, 1) AS sleeping_mb
  FROM sizes.growth WHERE vacuumed
 GROUP BY tbl, rel, kind HAVING sum(abs(grown)) > 0
 ORDER BY tbl, kind DESC, rel;

\echo
\echo == Absolute sizes at the end (pg_total_relation_size), MB
SELECT c.relname, round(pg_total_relation_size(c.oid) / 1048576.0, 1) AS total_mb,
       round(pg_table_size(c.oid) / 1048576.0, 1) AS table_mb,
       round(pg_indexes_size(c.oid) / 1048576.0, 1) AS indexes_mb
  FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace
 WHERE ns.nspname = 'durastep' AND c.relkind = 'r' AND pg_total_relation_size(c.oid) > 16384
 ORDER BY 2 DESC;

\echo
\echo == The walk of runs_due with only sleeping runs unfinished (what an empty claim walked before 2026-12-04)
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF)
SELECT c.id FROM durastep.runs c
 WHERE c.state IN ('queued', 'sleeping', 'waiting') AND c.run_at <= durastep.now()
   AND c.function_id = ANY (ARRAY['bench-sleeper'])
   AND (c.function_id, c.version) IN (SELECT * FROM unnest(ARRAY['bench-sleeper'], ARRAY[0]))
   AND NOT EXISTS (SELECT 1 FROM durastep.function_flow ff WHERE ff.function_id = c.function_id)
   AND (c.deadline_at IS NULL OR c.deadline_at >= durastep.now())
   AND (c.start_by IS NULL OR c.started_at IS NOT NULL OR c.start_by >= durastep.now())
 ORDER BY c.priority DESC, c.run_at
 LIMIT 32
 FOR UPDATE OF c SKIP LOCKED;

-- Retention. A copy of the six run-owned tables (`run_keys` since migration
-- 0042), partitioned by month of the run's creation (the finished runs of populations 1 and 2 moved into last
-- month, the sleeping ones in this month), with the same indexes as the
-- originals (unique ones as plain indexes: a unique index on a partitioned
-- table must contain the partition key), and the primary keys extended by it.
\echo
\echo == Building the partitioned copy
DROP SCHEMA IF EXISTS part CASCADE;
CREATE SCHEMA part;
SELECT date_trunc('month', now()) AS this_month \gset
CREATE TABLE part.events (LIKE durastep.events INCLUDING DEFAULTS, PRIMARY KEY (id, created_at))
    PARTITION BY RANGE (created_at);
CREATE TABLE part.runs (LIKE durastep.runs INCLUDING DEFAULTS, PRIMARY KEY (id, created_at))
    PARTITION BY RANGE (created_at);
CREATE TABLE part.step_results (LIKE durastep.step_results INCLUDING DEFAULTS, run_created_at timestamptz NOT NULL,
    PRIMARY KEY (run_id, step_key, run_created_at)) PARTITION BY RANGE (run_created_at);
CREATE TABLE part.step_journal (LIKE durastep.step_journal INCLUDING DEFAULTS, run_created_at timestamptz NOT NULL,
    PRIMARY KEY (run_id, position, run_created_at)) PARTITION BY RANGE (run_created_at);
CREATE TABLE part.run_history (LIKE durastep.run_history INCLUDING DEFAULTS, run_created_at timestamptz NOT NULL,
    PRIMARY KEY (run_id, seq, run_created_at)) PARTITION BY RANGE (run_created_at);
CREATE TABLE part.run_keys (LIKE durastep.run_keys INCLUDING DEFAULTS, run_created_at timestamptz NOT NULL,
    PRIMARY KEY (event_id, function_id, run_created_at)) PARTITION BY RANGE (run_created_at);
DO $$
DECLARE
    t text;
    m timestamptz := date_trunc('month', now());
    d text;
BEGIN
    FOREACH t IN ARRAY ARRAY['events', 'runs', 'step_results', 'step_journal', 'run_history', 'run_keys'] LOOP
        EXECUTE format('CREATE TABLE part.%I PARTITION OF part.%I FOR VALUES FROM (%L) TO (%L)',
                       t || '_last_month', t, m - interval '1 month', m);
        EXECUTE format('CREATE TABLE part.%I PARTITION OF part.%I FOR VALUES FROM (%L) TO (%L)',
                       t || '_this_month', t, m, m + interval '1 month');
    END LOOP;
    -- The secondary indexes of the originals, as partitioned indexes.
    FOR d IN
        SELECT regexp_replace(replace(i.indexdef, 'CREATE UNIQUE INDEX', 'CREATE INDEX'),
                              'INDEX (\w+) ON durastep\.', 'INDEX p_\1 ON part.')
          FROM pg_indexes i
         WHERE i.schemaname = 'durastep'
           AND i.tablename IN ('events', 'runs', 'step_results', 'step_journal', 'run_history')
           AND i.indexname NOT LIKE '%pkey'
    LOOP
        EXECUTE d;
    END LOOP;
END $$;
-- Finished runs (and everything they own) go to last month.
CREATE TEMP TABLE moved AS
SELECT r.id, r.event_id,
       CASE WHEN r.finished_at IS NOT NULL THEN :'this_month'::timestamptz - interval '1 day' - (now() - r.created_at)
            ELSE r.created_at END AS created_at
  FROM durastep.runs r;
INSERT INTO part.events SELECT e.id, e.name, e.payload, e.idempotency_key, m.created_at
  FROM durastep.events e JOIN moved m ON m.event_id = e.id;
INSERT INTO part.runs SELECT (jsonb_populate_record(r, jsonb_build_object('created_at', m.created_at))).*
  FROM durastep.runs r JOIN moved m ON m.id = r.id;
INSERT INTO part.step_results SELECT s.*, m.created_at FROM durastep.step_results s JOIN moved m ON m.id = s.run_id;
INSERT INTO part.step_journal SELECT j.*, m.created_at FROM durastep.step_journal j JOIN moved m ON m.id = j.run_id;
INSERT INTO part.run_history
SELECT h.*, m.created_at FROM durastep.run_history h JOIN moved m ON m.id = h.run_id;
INSERT INTO part.run_keys SELECT k.*, m.created_at FROM durastep.run_keys k JOIN moved m ON m.id = k.run_id;
VACUUM ANALYZE part.events, part.runs, part.step_results, part.step_journal, part.run_history, part.run_keys;
SELECT 'last month' AS partition,
       (SELECT count(*) FROM part.runs_last_month) AS runs,
       (SELECT count(*) FROM part.step_results_last_month) AS step_results,
       (SELECT count(*) FROM part.step_journal_last_month) AS step_journal,
       (SELECT count(*) FROM part.run_history_last_month) AS run_history,
       (SELECT count(*) FROM part.run_keys_last_month) AS run_keys,
       (SELECT count(*) FROM part.events_last_month) AS events;

\echo
\echo == Retention by DELETE: durastep.prune_batch (500 runs per batch, one commit each) until nothing is left
CREATE PROCEDURE sizes.prune_all() LANGUAGE plpgsql AS $$
DECLARE
    runs bigint;
    events bigint;
    fks bigint;
    batches integer := 0;
    total_runs bigint := 0;
    total_events bigint := 0;
BEGIN
    LOOP
        SELECT * INTO runs, events, fks FROM durastep.prune_batch(0, 500);
        COMMIT;
        batches := batches + 1;
        total_runs := total_runs + runs;
        total_events := total_events + events;
        EXIT WHEN runs = 0 AND events = 0;
    END LOOP;
    RAISE NOTICE 'prune: % batches, % runs, % events deleted', batches, total_runs, total_events;
END $$;
CHECKPOINT;
SELECT pg_current_wal_lsn() AS wal_before_delete \gset
\timing on
CALL sizes.prune_all();
\timing off
SELECT pg_size_pretty(pg_wal_lsn_diff(pg_current_wal_lsn(), :'wal_before_delete')) AS wal_written_by_delete;
SELECT c.relname, round(pg_total_relation_size(c.oid) / 1048576.0, 1) AS total_mb_after_delete,
       (SELECT n_dead_tup FROM pg_stat_user_tables s WHERE s.relid = c.oid) AS dead_rows
  FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace
 WHERE ns.nspname = 'durastep' AND c.relname IN ('runs', 'step_results', 'step_journal', 'run_history', 'run_keys', 'events')
 ORDER BY 2 DESC;
\timing on
VACUUM durastep.runs, durastep.step_results, durastep.step_journal, durastep.run_history, durastep.run_keys, durastep.events;
\timing off

\echo
\echo == Retention by dropping the last-month partitions (the same rows)
CHECKPOINT;
SELECT pg_current_wal_lsn() AS wal_before_drop \gset
\timing on
BEGIN;
ALTER TABLE part.runs DETACH PARTITION part.runs_last_month;
ALTER TABLE part.step_results DETACH PARTITION part.step_results_last_month;
ALTER TABLE part.step_journal DETACH PARTITION part.step_journal_last_month;
ALTER TABLE part.run_history DETACH PARTITION part.run_history_last_month;
ALTER TABLE part.run_keys DETACH PARTITION part.run_keys_last_month;
ALTER TABLE part.events DETACH PARTITION part.events_last_month;
DROP TABLE part.runs_last_month, part.step_results_last_month, part.step_journal_last_month,
           part.run_history_last_month, part.run_keys_last_month, part.events_last_month;
COMMIT;
\timing off
SELECT pg_size_pretty(pg_wal_lsn_diff(pg_current_wal_lsn(), :'wal_before_drop')) AS wal_written_by_drop;

DROP SCHEMA part CASCADE;
