-- Lost leases have their own budget (G8). A lease that expires (the worker
-- was killed, crashed, was redeployed or stalled, or a claim's answer was
-- lost) is not a failure of the user's code, so it no longer spends the
-- function's retries: the reaper counts it in runs.lease_losses, and fails
-- the run only when it has lost more leases than its function's
-- max_lease_losses (FunctionBuilder::lease_losses, default 10). A failed
-- attempt spends a retry when attempt - lease_losses reaches max_attempts.
-- Redefines nothing; adds two columns.
ALTER TABLE durastep.functions
    ADD COLUMN max_lease_losses integer NOT NULL DEFAULT 10 CHECK (max_lease_losses >= 0);
ALTER TABLE durastep.runs
    ADD COLUMN lease_losses integer NOT NULL DEFAULT 0;
