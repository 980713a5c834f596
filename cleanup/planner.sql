-- Named queries of the deadline planner (cleanup/planner.py). Every one is bounded: skip scans
-- over indexes, LIMITs, or chunks; none reads a whole cohort.

-- name: clock
SELECT cleanup_clock();

-- name: upcoming_buckets
-- Deadline buckets of width :width holding active accounts with a deadline in [:since, :until), at
-- most :buckets: a skip scan (one index probe per bucket, accounts_active_due_idx), however many
-- accounts each holds. `accounts` counts each bucket's active accounts up to :count_up_to only (an
-- index-only scan of at most that many entries per bucket), enough to tell a bucket that fits in one batch from a bigger one. `first` and
-- `last`: its earliest and latest deadline (two index probes), equal when it holds one instant.
WITH RECURSIVE buckets(start, n) AS (
    SELECT date_bin(:width::interval, f.d, 'epoch'::timestamptz), 1
    FROM (SELECT min(renewal_deadline) AS d FROM accounts
          WHERE status = 'active' AND renewal_deadline >= :since AND renewal_deadline < :until) f
    WHERE f.d IS NOT NULL
  UNION ALL
    SELECT date_bin(:width::interval, f.d, 'epoch'::timestamptz), b.n + 1
    FROM buckets b
    CROSS JOIN LATERAL (SELECT min(renewal_deadline) AS d FROM accounts
                        WHERE status = 'active' AND renewal_deadline >= b.start + :width::interval
                          AND renewal_deadline < :until) f
    WHERE f.d IS NOT NULL AND b.n < :buckets
)
SELECT b.start, d.first, d.last,
       (SELECT count(*) FROM (SELECT 1 FROM accounts a
                              WHERE a.status = 'active' AND a.renewal_deadline >= b.start
                                AND a.renewal_deadline < b.start + :width::interval
                              LIMIT :count_up_to) c)::int AS accounts
FROM buckets b
CROSS JOIN LATERAL (SELECT min(a.renewal_deadline) AS first, max(a.renewal_deadline) AS last FROM accounts a
                    WHERE a.status = 'active' AND a.renewal_deadline >= b.start
                      AND a.renewal_deadline < b.start + :width::interval) d
ORDER BY b.start;

-- name: active_accounts_in_range
-- Active accounts with a deadline in [:since, :until): what a planner's cohort of that range would
-- claim now.
SELECT count(*)::int FROM accounts
WHERE status = 'active' AND renewal_deadline >= :since AND renewal_deadline < :until;

-- name: next_deadline
-- The earliest deadline of an active account at or after an instant (one probe of accounts_active_due_idx):
-- the first one a plan did not cover, which the planner must wake for before it enters the horizon.
SELECT min(renewal_deadline) FROM accounts WHERE status = 'active' AND renewal_deadline >= $1;

-- name: claiming_workflows
-- The distinct workflows of a namespace holding accounts in 'cleaning' (a skip scan over
-- accounts_cleaning_namespace_idx), at most :most.
WITH RECURSIVE w(claimed_by) AS (
    (SELECT claimed_by FROM accounts
     WHERE status = 'cleaning' AND claimed_namespace = :namespace AND claimed_by IS NOT NULL
     ORDER BY claimed_by LIMIT 1)
  UNION ALL
    SELECT (SELECT a.claimed_by FROM accounts a
            WHERE a.status = 'cleaning' AND a.claimed_namespace = :namespace AND a.claimed_by > w.claimed_by
            ORDER BY a.claimed_by LIMIT 1)
    FROM w WHERE w.claimed_by IS NOT NULL
)
SELECT claimed_by FROM w WHERE claimed_by IS NOT NULL LIMIT :most;

-- name: release_stranded_chunk
-- Claims of a closed workflow go back to 'active' (same version), :chunk_size at a time, for the
-- sweep to re-claim. Safe under the renewal rule: their deadline has passed, so a renewal now is too late either way, and
-- the idempotency key (account_id, cleanup_version) still allows one effect only.
WITH chunk AS (
    SELECT account_id FROM accounts
    WHERE status = 'cleaning' AND claimed_namespace = :namespace AND claimed_by = :workflow_id
    LIMIT :chunk_size
    FOR UPDATE SKIP LOCKED
)
UPDATE accounts a
SET status = 'active', claimed_by = NULL, claimed_at = NULL, claimed_namespace = ''
FROM chunk c
WHERE a.account_id = c.account_id AND a.status = 'cleaning' AND a.claimed_by = :workflow_id
  AND a.claimed_namespace = :namespace;

-- name: overdue_accounts
-- Active accounts whose deadline is before :cutoff (the database clock minus the grace), outside
-- the ranges of claims in progress; counted up to :count_up_to.
WITH busy AS MATERIALIZED (
    SELECT deadline_from, deadline_until FROM cleanup_claim_progress
    WHERE NOT done AND updated_at > clock_timestamp() - interval '60 seconds'
),
overdue AS (
    SELECT a.renewal_deadline FROM accounts a
    WHERE a.status = 'active' AND a.renewal_deadline < :cutoff AND a.held_since IS NULL
      AND NOT EXISTS (SELECT 1 FROM busy b
                      WHERE a.renewal_deadline >= b.deadline_from AND a.renewal_deadline < b.deadline_until)
    ORDER BY a.renewal_deadline, a.account_id
    LIMIT :count_up_to
)
SELECT count(*)::int AS overdue, min(renewal_deadline) AS oldest FROM overdue;

-- name: record_sweep
INSERT INTO planner_sweeps (kind, cleanup_id, accounts, oldest_deadline)
VALUES (:kind, :cleanup_id, :accounts, :oldest_deadline);

-- name: latest_overdue_sweep
-- The sweep cleanup recorded last (planner_sweeps_kind_idx): a retried sweep step whose first
-- attempt started and recorded it, then died before replying, finds it here.
SELECT cleanup_id FROM planner_sweeps WHERE kind = 'overdue' ORDER BY swept_at DESC, sweep_id DESC LIMIT 1;

-- name: cleaned_since
-- Lateness (cleaned_at - renewal_deadline) of cleanups committed after :since, oldest first.
SELECT cleaned_at, extract(epoch FROM cleaned_at - renewal_deadline)::float8 AS lateness
FROM accounts
WHERE status = 'cleaned' AND cleaned_at > :since
ORDER BY cleaned_at
LIMIT :most;

-- name: lateness_stats
-- Lateness of the most recent cleanups, in seconds.
SELECT count(*)::int AS cleanups,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY lateness) AS p50,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY lateness) AS p99,
       max(lateness) AS max
FROM (
    SELECT extract(epoch FROM cleaned_at - renewal_deadline)::float8 AS lateness
    FROM accounts
    WHERE status = 'cleaned' AND cleaned_at > clock_timestamp() - make_interval(secs => :within_seconds)
    ORDER BY cleaned_at DESC
    LIMIT :most
) recent;

-- name: next_deadlines
SELECT renewal_deadline AS deadline, count(*)::int AS accounts
FROM accounts
WHERE status = 'active' AND renewal_deadline >= cleanup_clock()
GROUP BY renewal_deadline
ORDER BY renewal_deadline
LIMIT $1;

-- name: due_within
SELECT count(*)::int FROM accounts
WHERE status = 'active' AND renewal_deadline >= cleanup_clock()
  AND renewal_deadline < cleanup_clock() + make_interval(secs => $1);

-- name: sweep_totals
-- Each cleanup counted once: two attempts of one sweep step running at once (a zombie and its
-- retry) start the same sweep cleanup and may both record it.
SELECT kind, coalesce(sum(accounts), 0)::bigint AS accounts, count(*)::int AS sweeps, max(swept_at) AS last_at
FROM (SELECT DISTINCT ON (kind, cleanup_id) kind, accounts, swept_at
      FROM planner_sweeps ORDER BY kind, cleanup_id, sweep_id) once
GROUP BY kind;

-- name: planner_pause_set
-- A second pause updates the first.
INSERT INTO planner_pauses (task_queue, reason, hold_scheduled) VALUES (:task_queue, :reason, :hold_scheduled)
ON CONFLICT (task_queue) DO UPDATE
SET reason = EXCLUDED.reason, hold_scheduled = EXCLUDED.hold_scheduled, paused_at = now();

-- name: planner_pause_clear
DELETE FROM planner_pauses WHERE task_queue = $1;

-- name: planner_pause_get
SELECT reason, hold_scheduled, paused_at FROM planner_pauses WHERE task_queue = $1;

-- name: held_overdue
-- Accounts under a legal hold whose deadline has passed: cleaned once released.
SELECT count(*)::int AS held_overdue, min(renewal_deadline) AS oldest_held
FROM accounts WHERE held_since IS NOT NULL AND status = 'active' AND renewal_deadline < cleanup_clock();

-- name: failed_accounts
-- Accounts whose cleanup failed and wait for review (`failed`, `retry-failed`), and of those the
-- ones a schema or privilege error (SQLSTATE class 42) failed: every account of a cleanup alike.
SELECT count(*)::int AS pending, count(*) FILTER (WHERE sqlstate LIKE '42%')::int AS schema_errors
FROM cleanup_failed WHERE resolved_at IS NULL;

-- name: database_clock_behind
-- The last claim that found the database clock far behind its timer, if recent.
SELECT behind_seconds, instant, cleanup_id, observed_at FROM database_clock_behind
WHERE task_queue = :task_queue AND observed_at > now() - make_interval(secs => :within_seconds);

-- name: latest_worker_targets
-- The targets (JSON) the workers last started with: what `planner status` checks for missing indexes.
SELECT targets::text FROM cleanup_target_sets ORDER BY last_started_at DESC LIMIT 1;
