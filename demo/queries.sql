-- Named queries of the demo: what it reads back to print its table.

-- name: accounts_with_prefix
-- $1 LIKE pattern of the demo's account IDs.
SELECT account_id FROM accounts WHERE account_id LIKE $1 ORDER BY account_id;

-- name: pending_reminders
SELECT count(*) FROM outbox WHERE status = 'pending';

-- name: duplicate_reminders
-- Reminders of one cleanup beyond one per account (0 when exactly once). $1 cleanup ID.
SELECT (SELECT count(*) FROM outbox WHERE source_id = $1)
     - (SELECT count(DISTINCT account_id) FROM outbox WHERE source_id = $1);

-- name: delivered_reminders
SELECT count(*) FROM outbox WHERE status = 'delivered';
