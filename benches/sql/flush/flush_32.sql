-- The checkpoint flush of 32 step rows, as the worker sends it.
-- A pgbench script for instructions.sh (flush_32): 32 checkpoints, one for each run of a claim, and no completion; each call writes
-- a new step of the same 32 runs
-- The statement is the text of `flush_sql!` in crates/durastep/src/store/attempt.rs
-- (`FOR NO KEY UPDATE SKIP LOCKED`, `fin_none!`, `plain_inserts!`), its parameters given as pgbench variables; pgbench sends
-- them as text where the worker binds binary arrays, so the arrays' parsing
-- (`array_in`, `uuid_in`) is counted here and not in the engine.
SELECT id AS claim, run_ids::text AS ids, epochs::text AS epochs FROM durastep.run_claims ORDER BY id LIMIT 1 \gset
\set key random(1, 1000000000000)
WITH p AS MATERIALIZED (
     SELECT (:ids::uuid[])[1 : 32] AS cp_run, (:epochs::bigint[])[1 : 32] AS cp_epoch,
            array_fill('step-' || :key, ARRAY[32]) AS cp_key, array_fill('{"ok": true}'::text, ARRAY[32]) AS cp_output,
            (:ids::uuid[])[1 : 0] AS dn_run, (:epochs::bigint[])[1 : 0] AS dn_epoch,
            array_fill('null'::text, ARRAY[0]) AS dn_output,
            array_fill(now(), ARRAY[32]) AS cp_started, array_fill(now(), ARRAY[32]) AS cp_finished,
            array_fill(1, ARRAY[32]) AS cp_attempt, array_fill(1, ARRAY[32]) AS cp_position,
            array_fill('step'::text, ARRAY[32]) AS cp_kind),
 cp AS (
     SELECT unnest(p.cp_run) AS run_id, unnest(p.cp_epoch) AS epoch, unnest(p.cp_key) AS step_key,
            unnest(p.cp_output) AS output, unnest(p.cp_started) AS started_at,
            unnest(p.cp_finished) AS finished_at, unnest(p.cp_attempt) AS attempt,
            unnest(p.cp_position) AS position, unnest(p.cp_kind) AS kind
       FROM p),
 dn AS (
     SELECT unnest(p.dn_run) AS run_id, unnest(p.dn_epoch) AS epoch, unnest(p.dn_output) AS output FROM p),
 l AS (
     SELECT r.id, r.lease_epoch, r.state = 'running' AS live FROM durastep.runs r
      WHERE r.id = ANY ((SELECT p.cp_run || p.dn_run FROM p)::uuid[])
      ORDER BY r.id FOR NO KEY UPDATE SKIP LOCKED),
 ins AS (
     INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch, started_at, finished_at, attempt,
                                        position, kind)
     SELECT cp.run_id, cp.step_key, cp.output::jsonb, cp.epoch, cp.started_at, cp.finished_at, cp.attempt,
            cp.position, cp.kind
       FROM cp JOIN l ON l.id = cp.run_id AND l.lease_epoch = cp.epoch AND l.live),
 fin AS (SELECT NULL::uuid AS id WHERE false),
 fin_history AS (SELECT NULL::uuid AS id WHERE false)
SELECT 0, cp.ord, (l.id IS NOT NULL), (l.id IS NOT NULL),
       (l.id IS NULL AND coalesce((SELECT b.lease_epoch = cp.epoch AND b.state = 'running'
                                     FROM durastep.runs b WHERE b.id = cp.run_id), false))
  FROM (SELECT unnest(p.cp_run) AS run_id, unnest(p.cp_epoch) AS epoch, unnest(p.cp_key) AS step_key,
               generate_series(1::bigint, cardinality(p.cp_run)) AS ord FROM p) cp
  LEFT JOIN l ON l.id = cp.run_id AND l.lease_epoch = cp.epoch AND l.live
UNION ALL
SELECT 1, dn.ord, (fin.id IS NOT NULL), (fin.id IS NOT NULL),
       (fin.id IS NULL AND coalesce((SELECT b.lease_epoch = dn.epoch AND b.state = 'running'
                                       FROM durastep.runs b WHERE b.id = dn.run_id), false))
  FROM (SELECT unnest(p.dn_run) AS run_id, unnest(p.dn_epoch) AS epoch,
               generate_series(1::bigint, cardinality(p.dn_run)) AS ord FROM p) dn
  LEFT JOIN fin ON fin.id = dn.run_id;
