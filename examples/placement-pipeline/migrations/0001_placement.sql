-- The example's own state, in its own schema (never inside `durastep`).
-- Everything here can be changed with a plain UPDATE, without a deploy.

-- Cutover switches. One row; `dry_run` on means runs are created and record
-- what they would send, but no side effect is fired.
CREATE TABLE placement.settings (
    id         boolean PRIMARY KEY DEFAULT true CHECK (id),
    dry_run    boolean NOT NULL DEFAULT false,
    updated_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO placement.settings DEFAULT VALUES;

-- One on/off switch per side effect. A side effect without a row is on.
CREATE TABLE placement.switches (
    side_effect text PRIMARY KEY,
    enabled     boolean NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- Which chat channel each client account posts to (the story's incident was a
-- typo in one of these).
CREATE TABLE placement.channels (
    client_account text PRIMARY KEY,
    channel        text NOT NULL,
    updated_at     timestamptz NOT NULL DEFAULT now()
);
