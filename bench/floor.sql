-- The Postgres floor of each job: the least work that has the same effects with the same
-- guarantees (the idempotency record commits in the same transaction as the effect, under its
-- UNIQUE constraint), as one set-based statement, on one backend, with no Temporal, no claim, no
-- partitions, no batches and no counts read back. The benchmarks divide the direct path's and the
-- pipeline's throughput by this one, measured in the same script run.

-- name: cleanup_floor
-- A whole cohort ($2 = its deadline) cleaned by one statement under cleanup ID $1: every active
-- account past its deadline marked cleaned, its idempotency record, the shipped game data
-- deleted (saves, items) or archived (matches), its renewal reminder in the outbox.
WITH cleaned AS (
    UPDATE accounts
    SET status = 'cleaned', claimed_by = $1, claimed_at = now(), cleaned_at = now()
    WHERE renewal_deadline = $2 AND status = 'active' AND renewal_deadline <= cleanup_clock()
    RETURNING account_id, cleanup_version
),
applied AS (
    INSERT INTO cleanup_applied (account_id, cleanup_version, cleanup_id, partition_no)
    SELECT account_id, cleanup_version, $1, 0 FROM cleaned
    ON CONFLICT ON CONSTRAINT cleanup_applied_once DO NOTHING
    RETURNING account_id, cleanup_version
),
saves AS (
    DELETE FROM cloud_saves t USING applied p WHERE t.account_id = p.account_id RETURNING 1
),
items AS (
    DELETE FROM inventory_items t USING applied p WHERE t.account_id = p.account_id RETURNING 1
),
moved AS (
    DELETE FROM match_history t USING applied p WHERE t.account_id = p.account_id RETURNING t.*
),
archived AS (
    INSERT INTO match_history_archive (match_id, account_id, played_at, mode, result, score)
    SELECT match_id, account_id, played_at, mode, result, score FROM moved
    RETURNING 1
),
reminders AS (
    INSERT INTO outbox (event_key, kind, account_id, source_id, payload)
    SELECT 'renewal-reminder:' || account_id || ':v' || cleanup_version, 'renewal_reminder',
           account_id, $1,
           jsonb_build_object('account_id', account_id, 'cleanup_version', cleanup_version,
                              'cleanup_id', $1::text)
    FROM applied
    ON CONFLICT (event_key) DO NOTHING
    RETURNING 1
)
SELECT (SELECT count(*) FROM applied)::int AS cleaned,
       (SELECT count(*) FROM saves)::int AS cloud_saves,
       (SELECT count(*) FROM items)::int AS inventory_items,
       (SELECT count(*) FROM archived)::int AS match_history,
       (SELECT count(*) FROM reminders)::int AS reminders;
