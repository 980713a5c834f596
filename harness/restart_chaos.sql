-- Named queries of harness/restart_chaos.py: what is left of a night, and its reminders.

-- name: night_pending
-- The cohort due at $1 not yet cleaned (not claimed, or being cleaned: only this cohort's cleanup
-- runs) and the reminders not yet delivered (only this night's are pending).
SELECT (SELECT count(*) FROM accounts WHERE renewal_deadline = $1 AND status = 'active')
     + (SELECT count(*) FROM accounts WHERE status = 'cleaning') AS accounts,
       (SELECT count(*) FROM outbox WHERE status = 'pending') AS reminders;

-- name: cohort_reminders
-- The reminders of the cohort due at $1: how many, how many still pending, and the last one
-- delivered, in seconds after the deadline (the database's clock).
SELECT count(*)::int AS reminders,
       count(*) FILTER (WHERE o.status = 'pending')::int AS pending,
       extract(epoch FROM max(o.delivered_at) - $1)::float8 AS last_delivered
FROM outbox o JOIN accounts a USING (account_id)
WHERE a.renewal_deadline = $1;
