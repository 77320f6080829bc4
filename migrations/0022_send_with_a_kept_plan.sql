-- durastep.send_events keeps one generic plan for its big statement instead of
-- planning it again on every call. Its statement reads its input from array
-- parameters (`unnest`); a custom plan knows their lengths and so always
-- looks cheaper than the generic one, and Postgres never switched to the
-- generic plan: every send planned about twenty CTEs again. Measured with
-- pgbench on this repository's development machine, one event per call,
-- rolled back (so without the commit): 0.8-1.1 ms per call with the generic
-- plan against 3.5-4.3 ms with a plan per call, under the same load
-- (docs/performance.md "Plans kept"). A batch of 500 events costs the
-- same either way. The setting is the function's own: no session setting of
-- the user's pool is needed or changed.
ALTER FUNCTION durastep.send_events(uuid[], text[], text[], text[], timestamptz[], integer[])
    SET plan_cache_mode = force_generic_plan;
