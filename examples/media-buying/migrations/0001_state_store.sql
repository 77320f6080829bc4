-- Story B's typed state store, in its own schema `media` (tracked in
-- `media._migrations`, apart from Durastep's own). Timestamps default to
-- `durastep.now()`, the database clock that decides when runs are due, so
-- that a test or the demo that moves that clock moves these too.

-- An ad account of a client on one platform.
CREATE TABLE media.accounts (
    platform   text NOT NULL CHECK (platform IN ('meta', 'tiktok', 'linkedin')),
    account_id text NOT NULL,
    client     text NOT NULL,
    PRIMARY KEY (platform, account_id)
);

-- One credential per account: no token row without an account.
CREATE TABLE media.tokens (
    platform      text NOT NULL,
    account_id    text NOT NULL,
    access_token  text NOT NULL,
    refresh_token text NOT NULL,
    expires_at    timestamptz NOT NULL,
    rotated_at    timestamptz,
    PRIMARY KEY (platform, account_id),
    FOREIGN KEY (platform, account_id) REFERENCES media.accounts (platform, account_id)
);

-- Every budget change a client asked for: no budget write without a token row.
-- Created `queued` with the request (in the transaction that sends the event),
-- `pushed` by the run's `log` step, `failed` by its failure handler.
CREATE TABLE media.budget_writes (
    id           bigserial PRIMARY KEY,
    campaign_id  text NOT NULL,
    platform     text NOT NULL,
    account_id   text NOT NULL,
    amount_cents bigint NOT NULL CHECK (amount_cents > 0),
    requested_by text NOT NULL,
    requested_at timestamptz NOT NULL DEFAULT durastep.now(),
    status       text NOT NULL DEFAULT 'queued' CHECK (status IN ('queued', 'pushed', 'failed')),
    pushed_at    timestamptz,
    external_ref text,
    -- The Durastep run that carries the write (its attempts and latest error).
    run_id       uuid,
    -- Set when the run failed for good.
    last_error   text,
    FOREIGN KEY (platform, account_id) REFERENCES media.tokens (platform, account_id),
    CHECK ((status = 'pushed') = (pushed_at IS NOT NULL AND external_ref IS NOT NULL))
);
CREATE INDEX budget_writes_platform_status ON media.budget_writes (platform, status);
-- The founder's view lists every write not pushed: few rows, found by this index.
CREATE INDEX budget_writes_open ON media.budget_writes (requested_at) WHERE status <> 'pushed';

-- Shadow mode: what the new function would have written beside what the old
-- writer did write, per request.
CREATE TABLE media.shadow_comparisons (
    id             bigserial PRIMARY KEY,
    run_id         uuid NOT NULL UNIQUE,
    platform       text NOT NULL,
    account_id     text NOT NULL,
    campaign_id    text NOT NULL,
    planned_cents  bigint NOT NULL,
    platform_cents bigint,
    agree          boolean NOT NULL,
    compared_at    timestamptz NOT NULL DEFAULT durastep.now(),
    FOREIGN KEY (platform, account_id) REFERENCES media.accounts (platform, account_id)
);
