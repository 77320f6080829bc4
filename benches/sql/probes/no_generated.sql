-- Probe for benches/sql/instructions.sh (VARIANT): the six stored generated
-- columns of migration 0032 dropped, and with them their indexes. An upper
-- bound of what undoing 0032 saves a writer of `runs`: a schema without
-- them needs other indexes for what they serve (predicates.sql).
ALTER TABLE durastep.runs DROP COLUMN singleton_active_key, DROP COLUMN debounce_open_key, DROP COLUMN deadline_open_at,
    DROP COLUMN start_by_open_at, DROP COLUMN listed_state, DROP COLUMN attempt_stopping;
