-- durastep.now() as a SQL function that Postgres inlines: transaction time
-- plus the test clock's offset, written into the function as a constant and
-- written again by a trigger whenever the offset changes (issue 12;
-- docs/architecture.md "durastep.clock").
--
-- Since 0019 it was PL/pgSQL reading durastep.clock: every call ran a query
-- of its own (its executor started and ended, its snapshot taken), and
-- statements call it per row (the full claim four to six times for each run
-- it takes). Counted with benches/sql/instructions.sh, its six calls in a
-- one-event send were about 130,000 of the send's 1.15 million instructions.
-- A SQL function whose body is one expression without a table is inlined
-- into the plan of each statement that calls it: no call is left, only
-- `now() + constant`. Postgres records each plan's dependency on the inlined
-- function, so replacing the function re-plans every kept plan that used
-- it (prepared statements and PL/pgSQL's alike) before its next execution.
--
-- durastep.clock stays the record of the offset (and of `offset_max`, which
-- `run_id_floor` reads); it is zero in production, where the function is
-- never replaced. Whoever moves the clock (the test kit, or plain SQL) must
-- own durastep.now(): the runtime role can do neither (docs/security.md).
-- The body names pg_catalog.now() because an inlined body is parsed with the
-- caller's search_path, and it carries no SET clause because a function
-- with one is not inlined.
CREATE OR REPLACE FUNCTION durastep.now() RETURNS timestamptz
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT pg_catalog.now() + 'PT0S'::interval $$;

-- After each update of the clock's row: durastep.now() again, with the new
-- offset as an ISO 8601 interval (which every IntervalStyle reads alike).
-- The statement's function name is built from its parts so that it does
-- not read as a definition of this migration's own (tests/schema.rs).
CREATE FUNCTION durastep.clock_now_defined() RETURNS trigger
    LANGUAGE plpgsql
    SET IntervalStyle = 'iso_8601'
    AS $fn$
BEGIN
    EXECUTE format('CREATE OR REPLACE FUNCTION %I.%I() RETURNS timestamptz LANGUAGE sql STABLE PARALLEL SAFE AS %L',
                   'durastep', 'now', format(' SELECT pg_catalog.now() + %L::interval ', NEW.offset_by));
    RETURN NULL;
END $fn$;

CREATE TRIGGER clock_now_defined AFTER UPDATE ON durastep.clock
    FOR EACH ROW EXECUTE FUNCTION durastep.clock_now_defined();

-- A clock already moved (a test database migrated after it moved its clock).
UPDATE durastep.clock SET offset_by = offset_by WHERE offset_by <> '0';
