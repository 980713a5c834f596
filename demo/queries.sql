-- Named queries of the demo: what it reads back to print its table.

-- name: pending_reminders
SELECT count(*) FROM outbox WHERE status = 'pending';

-- name: delivered_reminders
SELECT count(*) FROM outbox WHERE status = 'delivered';

-- name: spread_deadlines
-- Spread the demo's accounts ($1 LIKE pattern) over [$2, $2 + $3 seconds), each at its own
-- millisecond (a stable hash of its ID), as real renewal deadlines are; returns the range.
WITH spread AS (
    UPDATE accounts
    SET renewal_deadline = $2::timestamptz
        + make_interval(secs => floor((abs(hashtext(account_id)) % 1000000) / 1000000.0 * $3 * 1000) / 1000.0)
    WHERE account_id LIKE $1
    RETURNING renewal_deadline
)
SELECT min(renewal_deadline) AS first, max(renewal_deadline) AS last, count(*)::int AS accounts FROM spread;

-- name: deadlines_of
-- $1 LIKE pattern: every account with its deadline, earliest first.
SELECT account_id, renewal_deadline FROM accounts WHERE account_id LIKE $1 ORDER BY renewal_deadline, account_id;

-- name: not_yet_terminal
-- Accounts neither cleaned nor renewed for good (still active or being cleaned).
SELECT count(*)::int FROM accounts WHERE account_id LIKE $1 AND status NOT IN ('cleaned', 'renewed');

-- name: account_state
SELECT status, cleanup_version, claimed_by FROM accounts WHERE account_id = $1;

-- name: cleaned_accounts
SELECT count(*)::int FROM accounts WHERE account_id LIKE $1 AND status = 'cleaned';

-- name: duplicate_effects
-- Effects beyond one per account (0 when exactly once): idempotency records and reminders.
SELECT ((SELECT count(*) - count(DISTINCT account_id) FROM cleanup_applied)
      + (SELECT count(*) - count(DISTINCT account_id) FROM outbox WHERE kind = 'renewal_reminder'))::int;
