-- Workers with nothing to claim ask when the next run is due (min(run_at)) so
-- that a timer fires on time rather than at the next poll. runs_due is ordered
-- by priority first and cannot answer that without scanning every waiting run.
CREATE INDEX runs_next_due ON durastep.runs (run_at) WHERE state IN ('queued', 'sleeping');
