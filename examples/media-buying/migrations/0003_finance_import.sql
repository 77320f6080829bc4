-- The one-off import of the finance sheet (a CSV export), row by row, against
-- budget_writes. Rows that do not match go to a review queue where an
-- accountant approves or corrects each one.

-- One imported file. The same content imported twice is one import (sha256).
CREATE TABLE media.finance_imports (
    id          bigserial PRIMARY KEY,
    file_name   text NOT NULL,
    sha256      text NOT NULL UNIQUE,
    csv         text NOT NULL,
    row_count   integer NOT NULL CHECK (row_count >= 0),
    imported_at timestamptz NOT NULL DEFAULT durastep.now(),
    -- The Durastep run that imports it.
    run_id      uuid
);

-- One row of a sheet, as imported (once: UNIQUE (import_id, row_no)).
--   matched    it is the budget write `budget_write_id`;
--   duplicate  an earlier import already holds the same row (`row_key`);
--   flagged    it does not match (`reason`); waiting for an accountant;
--   approved   an accountant accepted it as it is;
--   corrected  an accountant corrected its amount (`corrected_cents`);
--   expired    nobody decided within the review period.
CREATE TABLE media.finance_rows (
    id              bigserial PRIMARY KEY,
    import_id       bigint NOT NULL REFERENCES media.finance_imports (id),
    row_no          integer NOT NULL CHECK (row_no > 0),
    -- platform:reference, or the row's normalized text when it has no reference.
    row_key         text NOT NULL,
    sheet           jsonb NOT NULL,
    sheet_cents     bigint,
    budget_write_id bigint REFERENCES media.budget_writes (id),
    store_cents     bigint,
    status          text NOT NULL CHECK (status IN ('matched', 'duplicate', 'flagged', 'approved', 'corrected', 'expired')),
    reason          text,
    review_run_id   uuid,
    corrected_cents bigint CHECK (corrected_cents > 0),
    decided_by      text,
    decided_at      timestamptz,
    note            text,
    imported_at     timestamptz NOT NULL DEFAULT durastep.now(),
    UNIQUE (import_id, row_no),
    CHECK ((status = 'corrected') = (corrected_cents IS NOT NULL)),
    CHECK ((status IN ('approved', 'corrected')) = (decided_by IS NOT NULL))
);
CREATE INDEX finance_rows_key ON media.finance_rows (row_key);
-- Never two rows for one write, never the same row twice (besides `duplicate`
-- rows pointing at it), whatever runs at once.
CREATE UNIQUE INDEX finance_rows_one_per_write ON media.finance_rows (budget_write_id) WHERE status = 'matched';
CREATE UNIQUE INDEX finance_rows_one_per_key ON media.finance_rows (row_key) WHERE status <> 'duplicate';
-- The review queue: few rows, found by this index.
CREATE INDEX finance_rows_review ON media.finance_rows (imported_at) WHERE status = 'flagged';
