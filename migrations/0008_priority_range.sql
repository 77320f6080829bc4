-- A priority taken from event data (FunctionBuilder::priority_from) is clamped
-- to a range per function (FunctionBuilder::priority_range, default -100..=100),
-- so a sender cannot put its runs ahead of every other run by writing a huge
-- number into its event. Rows written before this migration get the default.
ALTER TABLE durastep.function_options
    ADD COLUMN priority_min integer NOT NULL DEFAULT -100,
    ADD COLUMN priority_max integer NOT NULL DEFAULT 100,
    ADD CONSTRAINT function_options_priority_range CHECK (priority_min <= priority_max);

-- The priority at `path` in the event data, clamped to [lo, hi]; an event
-- without an integer-valued number there keeps `fallback` (the priority it was
-- sent with), unclamped. New function: durastep.flow_priority is unchanged.
CREATE FUNCTION durastep.flow_priority_clamped(payload jsonb, path text[], fallback integer, lo integer, hi integer)
    RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN s.p IS NULL THEN fallback ELSE greatest(least(s.p, hi), lo) END
      FROM (SELECT durastep.flow_priority(payload, path, NULL) AS p) s
$$;
