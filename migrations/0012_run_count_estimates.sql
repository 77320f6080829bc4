-- Cheap run counts for the dashboard's overview (which reloads every 10 s in
-- every open tab): instead of counting every row of durastep.runs, finished
-- states are estimated from a multivariate MCV statistic on (function_id,
-- state) that ANALYZE (and autovacuum's analyze) keeps, scaled by the table's
-- row estimate. Unfinished states are still counted exactly (few rows, found
-- through runs_state_created).
CREATE STATISTICS durastep.runs_function_state (mcv) ON function_id, state FROM durastep.runs;
-- Up to 1,000 (function, state) pairs are tracked.
ALTER STATISTICS durastep.runs_function_state SET STATISTICS 1000;

-- pg_stats_ext shows rows to the table's owner only; this function, owned by
-- the schema owner, hands out the frequencies (nothing but counts) to roles
-- granted EXECUTE on it, such as the reader role.
CREATE FUNCTION durastep.run_count_estimates()
RETURNS TABLE (function_id text, state text, estimate bigint)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT m.values[1], m.values[2], round(m.frequency * greatest(c.reltuples, 0))::bigint
      FROM pg_catalog.pg_class c,
           pg_catalog.pg_statistic_ext s
      JOIN pg_catalog.pg_statistic_ext_data d ON d.stxoid = s.oid AND NOT d.stxdinherit,
           LATERAL pg_catalog.pg_mcv_list_items(d.stxdmcv) m
     WHERE c.oid = 'durastep.runs'::regclass
       AND s.stxrelid = c.oid
       AND s.stxname = 'runs_function_state'
$$;
