-- Flow control: concurrency limits, throttles, rate limits and back-pressure per
-- key, enforced in the claim statement; debounce, singleton and priority from the
-- event, applied at send. See docs/architecture.md ("Flow control").
--
-- Locking protocol (why no limit can be exceeded by concurrent claimers):
-- every (rule, key) has ONE row in durastep.flow_keys holding its whole state
-- (slots in use, GCRA theoretical arrival time, pause). A claim locks the rows
-- of its candidates' keys FOR UPDATE SKIP LOCKED: a row it could not lock is
-- "in flux" and its runs are neither started nor parked in that claim. Decisions
-- are made on the locked (latest) row version and written back in the same
-- statement, so two claimers can never both take the last slot. Slots are given
-- back by a statement trigger on durastep.runs, in the same statement (and so
-- behind the same fencing) as whatever takes a run out of 'running'.

-- The run states of 0001 plus 'skipped' (a rate-limited or singleton-refused run)
-- and 'waiting' (wait_for_event, added by another migration of the same release;
-- listed here so that the order the two migrations land in does not matter).
ALTER TABLE durastep.runs DROP CONSTRAINT IF EXISTS runs_state_check;
ALTER TABLE durastep.runs ADD CONSTRAINT runs_state_check CHECK (state IN
    ('queued', 'running', 'sleeping', 'waiting', 'completed', 'failed', 'cancelled', 'skipped'));

ALTER TABLE durastep.runs
    -- The concurrency keys this attempt holds a slot of, as [[rule, key], ...]: set
    -- by the claim, read (from the old row) when the run leaves 'running'.
    ADD COLUMN flow_held jsonb,
    -- What a parked run waits for (visibility, and the index that wakes it);
    -- run_at is then its next possible start.
    ADD COLUMN park_rule text,
    ADD COLUMN park_key text,
    -- Back-pressure retries that did not count as attempts (bounded).
    ADD COLUMN pauses integer NOT NULL DEFAULT 0,
    -- Debounce: the key, and the latest time the run may start (first event + max_wait).
    ADD COLUMN debounce_key text,
    ADD COLUMN debounce_deadline timestamptz,
    -- Singleton: the key of which at most one run is active.
    ADD COLUMN singleton_key text;

-- Runs parked on a concurrency key, in the order they are woken.
CREATE INDEX runs_parked ON durastep.runs (park_rule, park_key, priority DESC, created_at)
    WHERE state = 'queued' AND park_rule IS NOT NULL;
-- One debounced run per (function, key) that has not started yet.
CREATE UNIQUE INDEX runs_debounce ON durastep.runs (function_id, debounce_key)
    WHERE state = 'queued' AND debounce_key IS NOT NULL;
-- At most one active run per (function, singleton key).
CREATE UNIQUE INDEX runs_singleton ON durastep.runs (function_id, singleton_key)
    WHERE state IN ('queued', 'running', 'sleeping', 'waiting') AND singleton_key IS NOT NULL;

-- Claim-time rules, by name. A rule may be shared by several functions (the name
-- is then chosen by the user, e.g. 'exact-online'); otherwise it is named after
-- its function ('<function>#concurrency1', ...). Upserted at build: last writer wins.
CREATE TABLE durastep.flow_rules (
    name       text PRIMARY KEY,
    kind       text NOT NULL CHECK (kind IN ('concurrency', 'throttle', 'rate_limit', 'backpressure')),
    -- concurrency: slots per key; throttle and rate_limit: starts per period.
    capacity   integer NOT NULL DEFAULT 0 CHECK (capacity >= 0),
    period_s   float8 NOT NULL DEFAULT 0 CHECK (period_s >= 0),
    burst      integer NOT NULL DEFAULT 0 CHECK (burst >= 0),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Which functions use which rule, and where in the event data the key is.
CREATE TABLE durastep.function_flow (
    function_id text NOT NULL,
    rule        text NOT NULL,
    -- The JSON pointer as written (for error messages) and as a jsonb path; NULL:
    -- one key ('') for every run of the function.
    key_pointer text,
    key_path    text[],
    PRIMARY KEY (function_id, rule)
);

-- Send-time options of a function.
CREATE TABLE durastep.function_options (
    function_id       text PRIMARY KEY,
    debounce_s        float8,
    debounce_max_s    float8,
    debounce_pointer  text,
    debounce_path     text[],
    singleton_mode    text CHECK (singleton_mode IN ('skip_new', 'cancel_old')),
    singleton_pointer text,
    singleton_path    text[],
    priority_pointer  text,
    priority_path     text[]
);

-- The state of one key of one rule. Rows are created by the claim for the keys
-- of its candidates. `horizon` orders throttled runs: the latest start time
-- handed out to a parked run of this key.
CREATE TABLE durastep.flow_keys (
    rule         text NOT NULL,
    key          text NOT NULL,
    in_use       integer NOT NULL DEFAULT 0,
    tat          timestamptz,
    horizon      timestamptz,
    paused_until timestamptz,
    PRIMARY KEY (rule, key)
) WITH (fillfactor = 70);

-- The key of a run for one rule: the value at `path` in the event data (a string
-- as is, anything else as its JSON text; over 200 bytes: its SHA-256). With
-- `strict`, a missing or null value raises SQLSTATE DSK01 (the send fails with
-- durastep::Error::MissingKey); otherwise it is the default key ''.
CREATE FUNCTION durastep.flow_key(payload jsonb, path text[], strict boolean, function_id text, pointer text)
    RETURNS text LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v jsonb;
    k text;
BEGIN
    IF path IS NULL THEN
        RETURN '';
    END IF;
    v := payload #> path;
    IF v IS NULL OR jsonb_typeof(v) = 'null' THEN
        IF strict THEN
            RAISE EXCEPTION 'function % needs the key % in the event data; it is missing or null', function_id, pointer
                USING ERRCODE = 'DSK01',
                      DETAIL = jsonb_build_object('function', function_id, 'key', pointer)::text;
        END IF;
        RETURN '';
    END IF;
    k := CASE WHEN jsonb_typeof(v) = 'string' THEN v #>> '{}' ELSE v::text END;
    IF octet_length(k) > 200 THEN
        k := 'sha256:' || encode(sha256(convert_to(k, 'UTF8')), 'hex');
    END IF;
    RETURN k;
END $$;

-- A priority taken from the event data: an integer-valued number at `path`, clamped
-- to the int range; anything else keeps the event's priority.
CREATE FUNCTION durastep.flow_priority(payload jsonb, path text[], fallback integer)
    RETURNS integer LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v jsonb;
BEGIN
    IF path IS NULL THEN
        RETURN fallback;
    END IF;
    v := payload #> path;
    IF v IS NULL OR jsonb_typeof(v) <> 'number' THEN
        RETURN fallback;
    END IF;
    RETURN greatest(least(round((v #>> '{}')::numeric), 2147483647), -2147483648)::integer;
END $$;

-- Gives back the concurrency slots of every run that left 'running' in this
-- statement (completed, failed, retried, suspended, released, reaped, cancelled):
-- so it happens in the same transaction as, and only if, the fenced write that
-- ended the attempt. Keys are locked in (rule, key) order, so releases cannot
-- deadlock one another; claims never wait on these rows (SKIP LOCKED). After the
-- decrement, in a new statement (a new snapshot: it sees every park committed by a
-- claim that held a row), the first parked runs of each key are woken, one per
-- freed slot. Statements that free no slot return after one query over the
-- transition tables.
CREATE FUNCTION durastep.release_flow() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    rules text[];
    keys text[];
    ns integer[];
BEGIN
    SELECT array_agg(x.rule ORDER BY x.rule, x.key), array_agg(x.key ORDER BY x.rule, x.key),
           array_agg(x.n ORDER BY x.rule, x.key)
      INTO rules, keys, ns
      FROM (SELECT h->>0 AS rule, h->>1 AS key, count(*)::integer AS n
              FROM old_runs o
              LEFT JOIN new_runs n ON n.id = o.id
              CROSS JOIN LATERAL jsonb_array_elements(o.flow_held) AS h
             WHERE o.state = 'running' AND o.flow_held IS NOT NULL
               AND (n.id IS NULL OR n.state <> 'running' OR n.lease_epoch <> o.lease_epoch)
             GROUP BY 1, 2) x;
    IF rules IS NULL THEN
        RETURN NULL;
    END IF;
    -- Lock in (rule, key) order, waiting for a claim that holds a row.
    PERFORM 1 FROM durastep.flow_keys f JOIN unnest(rules, keys) AS u(rule, key) ON f.rule = u.rule AND f.key = u.key
      ORDER BY f.rule, f.key FOR UPDATE OF f;
    UPDATE durastep.flow_keys f SET in_use = greatest(f.in_use - u.n, 0)
      FROM unnest(rules, keys, ns) AS u(rule, key, n)
     WHERE f.rule = u.rule AND f.key = u.key;
    -- A new statement, so a new snapshot: it sees every park committed by a claim that held a row.
    UPDATE durastep.runs r SET run_at = durastep.now(), park_rule = NULL, park_key = NULL
     WHERE r.id IN (SELECT w.id FROM unnest(rules, keys, ns) AS u(rule, key, n)
                    CROSS JOIN LATERAL (
                        SELECT w.id FROM durastep.runs w
                         WHERE w.park_rule = u.rule AND w.park_key = u.key AND w.state = 'queued'
                         ORDER BY w.priority DESC, w.created_at
                         LIMIT u.n
                         FOR UPDATE SKIP LOCKED) w);
    IF FOUND THEN
        PERFORM pg_notify('durastep_wakeup', '');
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER runs_release_flow AFTER UPDATE ON durastep.runs
    REFERENCING OLD TABLE AS old_runs NEW TABLE AS new_runs
    FOR EACH STATEMENT EXECUTE FUNCTION durastep.release_flow();

-- A running run deleted (its event pruned) gives its slots back too.
CREATE FUNCTION durastep.release_flow_deleted() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    k record;
BEGIN
    FOR k IN
        SELECT h->>0 AS rule, h->>1 AS key, count(*)::integer AS n
          FROM old_runs o CROSS JOIN LATERAL jsonb_array_elements(o.flow_held) AS h
         WHERE o.state = 'running' AND o.flow_held IS NOT NULL
         GROUP BY 1, 2
         ORDER BY 1, 2
    LOOP
        UPDATE durastep.flow_keys SET in_use = greatest(in_use - k.n, 0)
         WHERE rule = k.rule AND key = k.key;
    END LOOP;
    RETURN NULL;
END $$;

CREATE TRIGGER runs_release_flow_deleted AFTER DELETE ON durastep.runs
    REFERENCING OLD TABLE AS old_runs
    FOR EACH STATEMENT EXECUTE FUNCTION durastep.release_flow_deleted();

-- Why is this run not running? One row per parked run, computed on read.
CREATE VIEW durastep.run_flow_waits AS
SELECT r.id AS run_id, r.function_id, r.park_rule AS rule, fr.kind, r.park_key AS key,
       fr.capacity AS "limit", fr.period_s, fk.in_use, fk.paused_until,
       CASE WHEN fr.kind = 'concurrency' THEN NULL ELSE r.run_at END AS next_possible_start,
       r.run_at AS next_check
  FROM durastep.runs r
  JOIN durastep.flow_rules fr ON fr.name = r.park_rule
  LEFT JOIN durastep.flow_keys fk ON fk.rule = r.park_rule AND fk.key = r.park_key
 WHERE r.state = 'queued' AND r.park_rule IS NOT NULL;
