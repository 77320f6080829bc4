-- durastep.now() in PL/pgSQL instead of SQL. A SQL function that reads a table
-- cannot be inlined, so Postgres parsed and planned its body again in every
-- statement that called it (about 40 µs per calling statement here, measured
-- with pgbench: docs/performance.md); PL/pgSQL keeps the plan of its body for
-- the session. Same result: transaction time plus the test clock's offset.
CREATE OR REPLACE FUNCTION durastep.now() RETURNS timestamptz
    LANGUAGE plpgsql STABLE PARALLEL SAFE
    AS $$
BEGIN
    RETURN now() + (SELECT offset_by FROM durastep.clock);
END $$;
