-- Named queries of bench/planner_cohort.py: a cohort registered through the game's contract, and
-- its times read back from the database's clock.

-- name: register_cohort
-- The game's registration: `set_deadline` (the function a game calls) for every account seeded at
-- the far-off deadline :seeded_at, moving it earlier (said explicitly) to :deadline, in one statement,
-- so the planner sees the whole cohort at once (one transaction) or not at all. Returns how many moved.
SELECT count(*) FILTER (WHERE set_deadline(account_id, :deadline, allow_earlier => true) = 'moved')::int AS moved,
       count(*)::int AS accounts
FROM accounts
WHERE renewal_deadline = :seeded_at;

-- name: cohort_pending
-- Accounts of the cohort due at $1 not yet claimed, plus accounts being cleaned by any cleanup
-- (only this cohort's run at the time): both read through partial indexes, cheap to poll.
SELECT (SELECT count(*) FROM accounts WHERE renewal_deadline = $1 AND status = 'active')
     + (SELECT count(*) FROM accounts WHERE status = 'cleaning') AS pending;

-- name: cohort_times
-- The cohort due at $1 on the database's clock, in seconds after the deadline: first and last
-- account claimed and cleaned, and how many were cleaned.
SELECT count(*)::int AS accounts,
       count(*) FILTER (WHERE status = 'cleaned')::int AS cleaned,
       extract(epoch FROM min(claimed_at) - $1)::float8 AS first_claimed,
       extract(epoch FROM max(claimed_at) - $1)::float8 AS last_claimed,
       extract(epoch FROM min(cleaned_at) - $1)::float8 AS first_cleaned,
       extract(epoch FROM max(cleaned_at) - $1)::float8 AS last_cleaned
FROM accounts
WHERE renewal_deadline = $1;

-- name: cohort_cleanups
-- Which cleanups cleaned the cohort due at $1 (a planner bucket; the overdue sweep if it was late),
-- the largest first.
SELECT c.cleanup_id, count(*)::int AS accounts
FROM cleanup_applied c JOIN accounts a USING (account_id)
WHERE a.renewal_deadline = $1
GROUP BY c.cleanup_id
ORDER BY accounts DESC, c.cleanup_id;

-- name: database_clock
SELECT cleanup_clock();

-- name: side_progress
-- An operator's progress query (bench.planner_cohort --side-load progress).
SELECT count(*) FILTER (WHERE status = 'cleaned') AS cleaned, count(*) AS accounts FROM accounts;

-- name: side_monitor_sessions
-- A monitoring agent's poll (--side-load monitor): the sessions by state ...
SELECT state, count(*) FROM pg_stat_activity GROUP BY state;

-- name: side_monitor_database
-- ... and the database's counters.
SELECT xact_commit, xact_rollback, blks_read, tup_deleted FROM pg_stat_database WHERE datname = current_database();
