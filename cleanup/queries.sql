-- Named queries of the renewal-deadline cleanup. Loaded by core.queries.load(__file__).

-- name: claim_cohort
-- The linearization point: an account moves to 'cleaning' only if it is still active (not renewed).
-- A renewal that commits first makes this UPDATE skip the row; one that commits later sees 'cleaning'.
WITH claimed AS (
    UPDATE accounts
    SET status = 'cleaning', claimed_by = $1, claimed_at = now()
    WHERE renewal_deadline = $2 AND status = 'active'
    RETURNING account_id, cleanup_version
)
INSERT INTO cleanup_claims (cleanup_id, account_id, claimed_version, partition_no)
SELECT $1, account_id, cleanup_version, ((row_number() OVER (ORDER BY account_id)) - 1) % $3
FROM claimed;

-- name: claim_account
WITH claimed AS (
    UPDATE accounts
    SET status = 'cleaning', claimed_by = $1, claimed_at = now()
    WHERE account_id = $2 AND renewal_deadline = $3 AND cleanup_version = $4 AND status = 'active'
    RETURNING account_id, cleanup_version
)
INSERT INTO cleanup_claims (cleanup_id, account_id, claimed_version, partition_no)
SELECT $1, account_id, cleanup_version, 0 FROM claimed;

-- name: claims_per_partition
SELECT partition_no, count(*)::int AS claimed
FROM cleanup_claims WHERE cleanup_id = $1 GROUP BY partition_no;

-- name: cohort_renewed_count
SELECT count(*)::int FROM accounts WHERE renewal_deadline = $1 AND status = 'renewed';

-- name: account_state
SELECT account_id, status, cleanup_version, renewal_deadline, claimed_by, renewed_at
FROM accounts WHERE account_id = $1;

-- name: cleanup_partition_batch
-- One statement per batch: lock the batch's accounts, judge each (apply / renewed / stale /
-- already applied), record the idempotency key, apply every declared target, write the outbox
-- reminder and mark the account cleaned. All of it commits together or not at all.
WITH batch AS (
    SELECT c.account_id, c.claimed_version
    FROM cleanup_claims c
    WHERE c.cleanup_id = $1 AND c.partition_no = $2 AND c.account_id > $3
    ORDER BY c.account_id
    LIMIT $4
),
locked AS (
    SELECT a.account_id, a.status, a.cleanup_version, a.claimed_by
    FROM accounts a JOIN batch b USING (account_id)
    ORDER BY a.account_id
    FOR UPDATE OF a
),
verdicts AS (
    SELECT b.account_id, b.claimed_version,
        CASE
            WHEN done.account_id IS NOT NULL THEN 'already_applied'
            WHEN l.status = 'cleaned' AND l.cleanup_version = b.claimed_version THEN 'already_applied'
            WHEN l.cleanup_version <> b.claimed_version THEN 'stale'
            WHEN l.status = 'renewed' THEN 'renewed'
            WHEN l.status = 'cleaning' AND l.claimed_by = $1 THEN 'apply'
            ELSE 'stale'
        END AS verdict
    FROM batch b
    JOIN locked l USING (account_id)
    LEFT JOIN cleanup_applied done
        ON done.account_id = b.account_id AND done.cleanup_version = b.claimed_version
),
applied AS (
    INSERT INTO cleanup_applied (account_id, cleanup_version, cleanup_id, partition_no)
    SELECT account_id, claimed_version, $1, $2 FROM verdicts WHERE verdict = 'apply'
    ON CONFLICT ON CONSTRAINT cleanup_applied_once DO NOTHING
    RETURNING account_id, cleanup_version
),
/*target_ctes*/
reminders AS (
    INSERT INTO outbox (event_key, kind, account_id, source_id, payload)
    SELECT 'renewal-reminder:' || account_id || ':v' || cleanup_version, 'renewal_reminder',
           account_id, $1,
           jsonb_build_object('account_id', account_id, 'cleanup_version', cleanup_version,
                              'cleanup_id', $1::text)
    FROM applied
    ON CONFLICT (event_key) DO NOTHING
    RETURNING 1
),
marked AS (
    UPDATE accounts a SET status = 'cleaned', cleaned_at = now()
    FROM applied p WHERE a.account_id = p.account_id
    RETURNING 1
)
SELECT
    (SELECT max(account_id) FROM batch) AS last_account_id,
    (SELECT count(*) FROM batch)::int AS batch_rows,
    (SELECT count(*) FROM applied)::int AS cleaned,
    (SELECT count(*) FROM verdicts WHERE verdict = 'renewed')::int AS skipped_renewed,
    (SELECT count(*) FROM verdicts WHERE verdict = 'stale')::int AS skipped_stale,
    ((SELECT count(*) FROM verdicts WHERE verdict IN ('already_applied', 'apply'))
        - (SELECT count(*) FROM applied))::int AS already_applied,
    (SELECT count(*) FROM reminders)::int AS reminders,
    (SELECT count(*) FROM marked)::int AS marked
    /*target_counts*/;

-- name: record_partition_report
INSERT INTO cleanup_partition_reports
    (cleanup_id, partition_no, cleaned, skipped_renewed, skipped_stale, already_applied)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (cleanup_id, partition_no) DO UPDATE
SET reported_at = now(), cleaned = EXCLUDED.cleaned, skipped_renewed = EXCLUDED.skipped_renewed,
    skipped_stale = EXCLUDED.skipped_stale, already_applied = EXCLUDED.already_applied;

-- name: unreported_partitions
SELECT DISTINCT c.partition_no
FROM cleanup_claims c
WHERE c.cleanup_id = $1
  AND NOT EXISTS (SELECT 1 FROM cleanup_partition_reports r
                  WHERE r.cleanup_id = c.cleanup_id AND r.partition_no = c.partition_no)
ORDER BY 1;

-- name: settle_cleanup
-- Written once: a re-delivered settlement finds the row and changes nothing.
INSERT INTO cleanup_settlements
    (cleanup_id, deadline, account_id, partitions, claimed, cleaned, reminders,
     skipped_renewed, skipped_stale, already_applied)
SELECT $1, $2, $3, $4,
       (SELECT count(*) FROM cleanup_claims WHERE cleanup_id = $1),
       (SELECT count(*) FROM cleanup_applied WHERE cleanup_id = $1),
       (SELECT count(*) FROM outbox WHERE source_id = $1 AND kind = 'renewal_reminder'),
       $5, $6, $7
ON CONFLICT (cleanup_id) DO NOTHING;

-- name: get_settlement
SELECT cleanup_id, claimed, cleaned, reminders, skipped_renewed, skipped_stale, already_applied,
       settled_at
FROM cleanup_settlements WHERE cleanup_id = $1;

-- name: renew_account
-- The database is the source of truth for a renewal: mark it and bump the version in one
-- transaction, unless a cleanup already claimed the account (then the renewal is too late).
WITH current AS (
    SELECT account_id, status, cleanup_version, renewal_deadline, claimed_by
    FROM accounts WHERE account_id = $1
    FOR UPDATE
),
updated AS (
    UPDATE accounts a
    SET status = CASE WHEN $2::timestamptz IS NULL THEN 'renewed' ELSE 'active' END,
        renewal_deadline = coalesce($2::timestamptz, a.renewal_deadline),
        cleanup_version = a.cleanup_version + 1,
        renewed_at = now()
    FROM current c
    WHERE a.account_id = c.account_id AND c.status IN ('active', 'renewed')
    RETURNING a.account_id, a.cleanup_version
),
logged AS (
    INSERT INTO renewals (account_id, outcome, new_deadline, version_after, status_seen)
    SELECT c.account_id,
           CASE WHEN u.account_id IS NULL THEN 'too_late' ELSE 'in_time' END,
           $2::timestamptz, coalesce(u.cleanup_version, c.cleanup_version), c.status
    FROM current c LEFT JOIN updated u USING (account_id)
    RETURNING outcome, version_after
)
SELECT c.status AS status_seen, c.renewal_deadline AS old_deadline, c.cleanup_version AS old_version,
       c.claimed_by, l.outcome, l.version_after
FROM current c CROSS JOIN logged l;

-- name: partition_reports_of_cleanup
-- What `status` shows per partition. $1 cleanup ID.
SELECT partition_no, cleaned, skipped_renewed, skipped_stale, already_applied
FROM cleanup_partition_reports WHERE cleanup_id = $1 ORDER BY partition_no;

-- name: partitions_with_work
-- Partitions that claimed at least one account. $1 cleanup ID.
SELECT count(DISTINCT partition_no) FROM cleanup_claims WHERE cleanup_id = $1;

-- name: active_accounts_at_deadline
-- Accounts a cohort cleanup of this deadline would claim now. $1 deadline.
SELECT count(*) FROM accounts WHERE renewal_deadline = $1 AND status = 'active';
