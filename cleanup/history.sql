-- Named queries of an account's history (its erasure receipt): by the account's key only, each an
-- index lookup. Keys, times, versions, counts and outcomes: never the game's data nor a message
-- that may quote it (cleanup_failed.message and .detail, outbox payloads stay out).

-- name: account_now
SELECT account_id, status, renewal_deadline, cleanup_version, held_since, claimed_by, claimed_at, cleaned_at
FROM accounts WHERE account_id = $1;

-- name: account_events
SELECT kind, deadline, reason, recorded_at FROM account_events WHERE account_id = $1 ORDER BY event_id;

-- name: account_renewals
SELECT outcome, new_deadline, deadline_seen, status_seen, version_after, coalesce(judged_at, requested_at) AS judged_at
FROM renewals WHERE account_id = $1 ORDER BY renewal_id;

-- name: account_cleanups
-- Each version applied, with its receipt (rows per target) and its reminder's delivery (the
-- reminder's key is the account's key and version: a unique-index lookup).
SELECT d.cleanup_version, d.cleanup_id, d.applied_at, r.targets, r.target_set, r.replaced_target_sets, r.follow_ups,
       o.status AS reminder_status, o.created_at AS reminder_queued_at, o.delivered_at AS reminder_delivered_at,
       o.attempts AS reminder_attempts
FROM cleanup_applied d
LEFT JOIN erasure_receipts r ON r.account_id = d.account_id AND r.cleanup_version = d.cleanup_version
LEFT JOIN outbox o ON o.event_key = 'renewal-reminder:' || d.account_id || ':v' || d.cleanup_version
WHERE d.account_id = $1
ORDER BY d.cleanup_version;

-- name: account_failures
SELECT cleanup_version, cleanup_id, target, sqlstate, failed_at, attempts, resolved_at, resolution
FROM cleanup_failed WHERE account_id = $1 ORDER BY cleanup_version;
