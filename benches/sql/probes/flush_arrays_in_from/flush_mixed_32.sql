-- Before 2026-12-07: the arrays unnested in a FROM with ordinality.
-- The flush of 16 checkpoints and 16 completions, as the worker sends it.
-- A pgbench script for instructions.sh (flush_mixed_32): 16 checkpoints for half of a claim's runs and 16 completions for the
-- other half; each call takes the next claim
-- The statement is the text of `flush_sql!` in crates/durastep/src/store/attempt.rs
-- (`FOR NO KEY UPDATE SKIP LOCKED`, `fin_complete!`, `plain_inserts!`), its parameters given as pgbench variables; pgbench sends
-- them as text where the worker binds binary arrays, so the arrays' parsing
-- (`array_in`, `uuid_in`) is counted here and not in the engine.
SELECT id AS claim, run_ids::text AS ids, epochs::text AS epochs FROM durastep.run_claims ORDER BY id LIMIT 1 \gset
\set key random(1, 1000000000000)
WITH p AS MATERIALIZED (
     SELECT (:ids::uuid[])[1 : 16] AS cp_run, (:epochs::bigint[])[1 : 16] AS cp_epoch,
            array_fill('step-' || :key, ARRAY[16]) AS cp_key, array_fill('{"ok": true}'::text, ARRAY[16]) AS cp_output,
            (:ids::uuid[])[17 : 32] AS dn_run, (:epochs::bigint[])[17 : 32] AS dn_epoch,
            array_fill('null'::text, ARRAY[16]) AS dn_output,
            array_fill(now(), ARRAY[16]) AS cp_started, array_fill(now(), ARRAY[16]) AS cp_finished,
            array_fill(1, ARRAY[16]) AS cp_attempt, array_fill(1, ARRAY[16]) AS cp_position,
            array_fill('step'::text, ARRAY[16]) AS cp_kind),
 cp AS (
     SELECT t.* FROM p, unnest(p.cp_run, p.cp_epoch, p.cp_key, p.cp_output, p.cp_started, p.cp_finished,
                               p.cp_attempt, p.cp_position, p.cp_kind)
         WITH ORDINALITY AS t(run_id, epoch, step_key, output, started_at, finished_at, attempt,
                              position, kind, ord)),
 dn AS (
     SELECT t.* FROM p, unnest(p.dn_run, p.dn_epoch, p.dn_output)
         WITH ORDINALITY AS t(run_id, epoch, output, ord)),
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
 fin AS (UPDATE durastep.runs r
        SET state = 'completed', output = dn.output::jsonb, finished_at = (SELECT durastep.now()),
            lease_expires_at = NULL, worker_id = NULL, history_noted = NOT r.history_noted
       FROM dn JOIN l ON l.id = dn.run_id AND l.lease_epoch = dn.epoch AND l.live
      WHERE r.id = dn.run_id
     RETURNING r.id, r.attempt, r.lease_epoch, r.finished_at),
 fin_history AS (INSERT INTO durastep.run_history (run_id, at, state, attempt, lease_epoch)
     SELECT fin.id, fin.finished_at, 'completed', fin.attempt, fin.lease_epoch FROM fin)
SELECT 0, cp.ord, (l.id IS NOT NULL), (l.id IS NOT NULL),
       (l.id IS NULL AND coalesce((SELECT b.lease_epoch = cp.epoch AND b.state = 'running'
                                     FROM durastep.runs b WHERE b.id = cp.run_id), false))
  FROM (SELECT * FROM cp) cp
  LEFT JOIN l ON l.id = cp.run_id AND l.lease_epoch = cp.epoch AND l.live
UNION ALL
SELECT 1, dn.ord, (fin.id IS NOT NULL), (fin.id IS NOT NULL),
       (fin.id IS NULL AND coalesce((SELECT b.lease_epoch = dn.epoch AND b.state = 'running'
                                       FROM durastep.runs b WHERE b.id = dn.run_id), false))
  FROM (SELECT * FROM dn) dn
  LEFT JOIN fin ON fin.id = dn.run_id;
DELETE FROM durastep.run_claims WHERE id = :claim;
