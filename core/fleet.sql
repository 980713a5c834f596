-- name: fleet_state
-- What the dashboard and the alerts read from the database rather than from events (core/fleet.py).
-- Each count is an index scan: accounts_cleaning_idx, outbox's partial status indexes, the
-- ledger settlements' primary key, accounts_cleaned_at_idx.
SELECT
  (SELECT count(*) FROM accounts WHERE status = 'cleaning')::int AS held_accounts,
  (SELECT count(DISTINCT claimed_by) FROM accounts WHERE status = 'cleaning')::int AS cleanups_in_flight,
  (SELECT count(*) FROM outbox WHERE status = 'pending')::int AS outbox_backlog,
  (SELECT count(*) FROM outbox WHERE status = 'dead')::int AS outbox_dead_letters,
  (SELECT coalesce(max(extract(epoch FROM cleaned_at - renewal_deadline)), 0) FROM accounts
     WHERE status = 'cleaned' AND cleaned_at > clock_timestamp() - interval '15 minutes')::float8
     AS lateness_max_15m,
  (SELECT extract(epoch FROM max(business_date)::timestamp AT TIME ZONE 'UTC')
     FROM ledger_settlements)::float8 AS ledger_last_settled_date;
