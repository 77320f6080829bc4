-- Appended to the claims and the dry replay's page (`concat!`): a run's
-- stored steps as four arrays from one scan (key i holds output i, and the
-- journal entry at position i, NULL for a step row written before migration
-- 0029 or without an entry of its own; kind i is NULL for a plain step, the
-- most common kind, so that a replay of 1,000 steps carries no 1,000 copies
-- of 'step' to build, send and decode), and the rest of its
-- journal (`step_journal`: waits, invokes, markers, and every entry written
-- before 0029) as three, for the run `c` of the statement it ends. A jsonb
-- object of 1,000 steps and one scan of the journal per array cost about
-- twice as much to build and decode (docs/performance.md "Replay's load in
-- two arrays"). The journal's order does not matter: the worker keys it by
-- position.
  CROSS JOIN LATERAL (
       SELECT coalesce(array_agg(s.step_key), '{}') AS step_keys, coalesce(array_agg(s.output), '{}') AS step_outputs,
              coalesce(array_agg(s.position), '{}') AS step_positions, coalesce(array_agg(NULLIF(s.kind, 'step')), '{}') AS step_kinds
         FROM durastep.step_results s WHERE s.run_id = c.id) st
  CROSS JOIN LATERAL (
       SELECT coalesce(array_agg(j.position), '{}') AS journal_positions, coalesce(array_agg(j.kind), '{}') AS journal_kinds,
              coalesce(array_agg(j.step_key), '{}') AS journal_keys
         FROM durastep.step_journal j WHERE j.run_id = c.id) jr
