-- Runs listed by their id instead of an index on `created_at` (issue 12).
-- `runs_created (created_at DESC, id DESC)` (0005) was a full index of the
-- table, so every claim and every completion, neither of which is a HOT
-- update, wrote an entry into it, for the listings only: a one-process drain
-- of single-step runs paid about 6% of its CPU per run for it
-- (docs/performance.md "Runs listed by id"). Since 0021 every run id is
-- minted by `durastep.uuid7()`: its first 48 bits are the wall-clock
-- millisecond of the insert, so the primary key already orders runs by
-- creation. The listings now walk it (`store::inspect`), and the index goes.
--
-- Left for it: runs whose id is not time-ordered (created before 0021, or
-- inserted by hand with another kind of UUID). They keep a partial index by
-- creation time of their own, which no run created since 0021 enters (its
-- predicate is false for them, so their inserts and updates write nothing
-- into it); a listing reads them after every time-ordered run, in creation
-- order, as the older runs they are.

-- `(get_byte(uuid_send(id), 6) >> 4)` is the version of a UUID (RFC 9562):
-- 7 for the time-ordered ids runs get, 4 for the random ones of
-- gen_random_uuid(). `03bb2cc3-d800-0000-0000-000000000000` is the smallest
-- time-ordered id of 2100-01-01: the listings walk the primary key below it
-- only, because most random ids lie above every time-ordered one (about 1% of
-- them between today's ids and it are passed over by that walk), and a
-- version-7 id above it (minted by a clock set decades ahead, or not time at
-- all) is left to this index with the random ones rather than lost. Both
-- conditions are written out rather than as functions of the schema: the
-- listings repeat them word for word, so that the planner matches the
-- predicate, and built-in functions need no grant to the runtime and reader
-- roles (docs/security.md), who insert runs and list them.
CREATE INDEX runs_created_legacy ON durastep.runs (created_at DESC, id DESC)
    WHERE (get_byte(uuid_send(id), 6) >> 4) <> 7 OR id >= '03bb2cc3-d800-0000-0000-000000000000';

DROP INDEX durastep.runs_created;

-- Listings by state (0018) in the same order as the others: newest id first.
DROP INDEX durastep.runs_listed_by_state;
CREATE INDEX runs_listed_by_state ON durastep.runs (state, id DESC)
    WHERE state IN ('sleeping', 'waiting', 'failed', 'cancelled', 'skipped', 'diverged');

-- The largest offset the test clock has had (`durastep.now()` is transaction
-- time plus `offset_by`). A run's `created_at` is at most its id's wall-clock
-- time plus the offset of its insert, so a run created (by the database
-- clock) at or after t has an id of at least the wall-clock time
-- t - offset_max: `durastep.run_id_floor`. Kept by the trigger below,
-- whatever moves the clock (the test kit, or plain SQL); it stays 0 in
-- production. Its first value covers the runs already stored, whatever
-- offsets they were created under.
ALTER TABLE durastep.clock ADD COLUMN offset_max interval NOT NULL DEFAULT '0';

CREATE FUNCTION durastep.clock_offset_max() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    NEW.offset_max := greatest(OLD.offset_max, NEW.offset_max, NEW.offset_by);
    RETURN NEW;
END $$;

CREATE TRIGGER clock_offset_max BEFORE UPDATE ON durastep.clock
    FOR EACH ROW EXECUTE FUNCTION durastep.clock_offset_max();

UPDATE durastep.clock c
   SET offset_max = greatest(c.offset_by, '0',
       (SELECT max(r.created_at - to_timestamp(
                   ('x' || substr(replace(r.id::text, '-', ''), 1, 12))::bit(48)::bigint / 1000.0))
          FROM durastep.runs r WHERE (get_byte(uuid_send(r.id), 6) >> 4) = 7));

-- The smallest UUID whose first 48 bits are the Unix millisecond of `t`
-- (clamped to what 48 bits hold): every time-ordered id minted at or after
-- `t` is at least this one, and every one minted before it is smaller
-- (`uuid7_floor('2100-01-01 00:00:00+00')` is the constant above).
CREATE FUNCTION durastep.uuid7_floor(t timestamptz) RETURNS uuid
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT encode(
        substring(int8send(floor(extract(epoch FROM
            least(greatest(t, 'epoch'::timestamptz), '9999-12-31 00:00:00+00'::timestamptz)) * 1000)::bigint) FROM 3)
        || '\x00000000000000000000'::bytea,
        'hex')::uuid
$$;

-- The smallest id a time-ordered run created at or after `t` (by the
-- database clock) can have: that of the wall-clock time t - offset_max, a
-- minute earlier still for ids minted by an application whose clock runs
-- behind the database's (the test kit mints the ids of the runs it starts).
-- For a listing's `created_after` and the per-minute counts: a lower bound on
-- the primary key, so that they read the recent runs only; `created_at` is
-- still checked on every row.
CREATE FUNCTION durastep.run_id_floor(t timestamptz) RETURNS uuid
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT durastep.uuid7_floor(t - c.offset_max - interval '1 minute') FROM durastep.clock c $$;
