-- The reaper's search for lapsed leases, through the claim records
-- (migration 0034): up to $1 (run, epoch) pairs still running whose lease
-- has passed, from the records whose `recheck_at` has passed (at most $2 of
-- them, oldest first, skipping those another reaper holds). Each record it
-- reads is tidied in the same statement: deleted when none of its runs is
-- still running under its epoch, else cut down to those that are, with
-- `recheck_at` moved to the earliest of their leases (the heartbeat extends
-- a lease on `runs` alone, so a record is looked at about once per lease
-- while its runs run).
--
-- The records due now, locked.
WITH due AS MATERIALIZED (
    SELECT c.id, c.run_ids, c.epochs FROM durastep.run_claims c
     WHERE c.recheck_at < durastep.now()
     ORDER BY c.recheck_at LIMIT $2
     FOR UPDATE SKIP LOCKED),
-- Their pairs whose run is still running under that epoch.
live AS MATERIALIZED (
    SELECT d.id AS claim, r.id, r.lease_epoch, r.lease_expires_at
      FROM due d CROSS JOIN LATERAL unnest(d.run_ids, d.epochs) AS u(run_id, epoch)
      JOIN durastep.runs r ON r.id = u.run_id AND r.lease_epoch = u.epoch
     WHERE r.state = 'running'),
-- Records with no live pair: garbage.
gone AS (
    DELETE FROM durastep.run_claims c
     WHERE c.id IN (SELECT d.id FROM due d) AND c.id NOT IN (SELECT l.claim FROM live l)),
-- The others: their live pairs, looked at again when the first lease can
-- lapse (a lapsed one keeps its record due until the reaper has taken it
-- back under a new epoch; a running run without a lease, in a minute).
kept AS (
    UPDATE durastep.run_claims c
       SET run_ids = k.run_ids, epochs = k.epochs, recheck_at = k.recheck_at
      FROM (SELECT l.claim, array_agg(l.id) AS run_ids, array_agg(l.lease_epoch) AS epochs,
                   coalesce(min(l.lease_expires_at), durastep.now() + interval '1 minute') AS recheck_at
              FROM live l GROUP BY l.claim) k
     WHERE c.id = k.claim)
SELECT l.id, l.lease_epoch FROM live l
 WHERE l.lease_expires_at < durastep.now()
 ORDER BY l.lease_expires_at LIMIT $1
