-- The CHECK constraints that hold a list of names (a run's state, a journal
-- entry's kind) as casts to enum types that hold the lists (issue 12;
-- docs/architecture.md "Names checked by enum types").
--
-- Postgres 15 reads each CHECK constraint's stored expression again in every
-- statement that writes its table, before the first row, and stores a list
-- of names as one text array constant, which it reads token by token. Counted
-- with benches/sql/instructions.sh (docs/performance.md), the constraints'
-- work in a one-event send fell from 87,705 to 28,339 instructions with the
-- casts (5% of the send), in a completion of 32 runs by 1.4%, in a checkpoint
-- of 32 steps by 2%: a cast's stored form is short, and an enum type's
-- labels are read from the catalog's cache.
--
-- The columns stay text: a change of their type would rewrite the tables and
-- every statement and binding that reads them. A name outside the list is
-- still refused, with the cast's error ("invalid input value for enum",
-- SQLSTATE 22P02) instead of a check violation (23514). A state or kind added
-- later is an `ALTER TYPE ... ADD VALUE` in its own migration.
--
-- Each constraint keeps its name, and allows exactly what it allowed before,
-- so it is added NOT VALID: every stored row passed the old one, and no row
-- is read again (each table is locked only while the constraint is swapped).
-- `VALIDATE CONSTRAINT` would read them all and find nothing.
CREATE TYPE durastep.run_state AS ENUM
    ('queued', 'running', 'sleeping', 'waiting', 'completed', 'failed', 'cancelled', 'skipped', 'diverged');
CREATE TYPE durastep.entry_kind AS ENUM
    ('step', 'step_tx', 'sleep', 'wait', 'send_event', 'invoke', 'changed');

ALTER TABLE durastep.runs
    DROP CONSTRAINT runs_state_check,
    ADD CONSTRAINT runs_state_check CHECK (state::durastep.run_state IS NOT NULL) NOT VALID;

-- A row with a position and no kind passed the old constraint (its list
-- compared with NULL is NULL, which a CHECK lets through), so it passes
-- this one too, by name. The engine writes a kind with every position
-- (migration 0029).
ALTER TABLE durastep.step_results
    DROP CONSTRAINT step_results_entry,
    ADD CONSTRAINT step_results_entry CHECK (
        (position IS NULL AND kind IS NULL)
        OR (position >= 0 AND (kind IS NULL OR kind::durastep.entry_kind IS NOT NULL))) NOT VALID;

ALTER TABLE durastep.step_journal
    DROP CONSTRAINT step_journal_kind_check,
    ADD CONSTRAINT step_journal_kind_check CHECK (kind::durastep.entry_kind IS NOT NULL) NOT VALID;
