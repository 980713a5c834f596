-- Named queries of retention (cleanup/retention.py): the service's bookkeeping pruned after
-- CLEANUP_RETENTION_DAYS. Each is one bounded batch of at most :rows rows older than :cutoff (a
-- :dry_run, with :rows NULL, counts every row and deletes none). Nothing of an account not
-- cleaned before the cutoff, nor of a cleanup not settled before it, is ever selected.

-- name: prune_lock
-- One pruner at a time across the workers (the batch's transaction holds it): false, another prunes.
SELECT pg_try_advisory_xact_lock(hashtext('deadline_cleanup.retention'));

-- name: prune_claims_batch
-- The claims of cleanups settled before the cutoff whose account was cleaned before it, with
-- everything of those accounts: the idempotency record, and through prune_account_records (the
-- audit tables: owner's rights) the receipt, registration events, renewals and resolved failures.
-- Walked from the oldest settlement (cleanup_settlements_settled_idx), each cleanup's claims by its
-- primary key; a claim goes in the statement that prunes its account's records, so no batch walks
-- what an earlier one pruned. The records of an account a cleanup claimed but did not clean (a
-- renewal after a failure, a stranded claim cleaned by another cleanup) are judged by the
-- cleanup that cleaned it (claimed_by).
WITH doomed AS (
    SELECT c.ctid AS claim, c.cleanup_id, c.account_id, c.claimed_version
    FROM (SELECT s.cleanup_id FROM cleanup_settlements s WHERE s.settled_at < :cutoff ORDER BY s.settled_at) s
    CROSS JOIN LATERAL (
        SELECT c.ctid, c.cleanup_id, c.account_id, c.claimed_version
        FROM cleanup_claims c
        -- A probe of the account by its key per claim (LATERAL ... LIMIT 1 is never turned into a
        -- hash join that would read every account for each batch).
        CROSS JOIN LATERAL (
            SELECT 1 FROM accounts a
            WHERE a.account_id = c.account_id AND a.status = 'cleaned' AND a.cleaned_at < :cutoff
            LIMIT 1
        ) cleaned
        WHERE c.cleanup_id = s.cleanup_id
        LIMIT :rows
    ) c
    LIMIT :rows
),
audit AS (
    SELECT * FROM prune_account_records(ARRAY(SELECT cleanup_id FROM doomed),
                                        ARRAY(SELECT account_id FROM doomed), :cutoff, :dry_run)
),
applied AS (
    DELETE FROM cleanup_applied d
    WHERE NOT :dry_run AND d.account_id = ANY (ARRAY(SELECT account_id FROM doomed))
      AND EXISTS (SELECT 1 FROM doomed k WHERE k.account_id = d.account_id AND k.cleanup_id = d.cleanup_id)
    RETURNING 1
),
claims AS (
    DELETE FROM cleanup_claims c WHERE NOT :dry_run AND c.ctid = ANY (ARRAY(SELECT claim FROM doomed))
    RETURNING 1
)
SELECT (SELECT count(*) FROM doomed)::bigint AS claims,
       CASE WHEN :dry_run THEN (SELECT count(*) FROM cleanup_applied d JOIN doomed k
                          ON d.account_id = k.account_id AND d.cleanup_id = k.cleanup_id)
            ELSE (SELECT count(*) FROM applied) END::bigint AS applied,
       (SELECT receipts FROM audit) AS receipts, (SELECT events FROM audit) AS events,
       (SELECT renewals FROM audit) AS renewals, (SELECT failures FROM audit) AS failures,
       (SELECT count(*) FROM claims)::bigint AS deleted_claims;

-- name: prune_outbox_batch
-- Reminders delivered, or dead, before the cutoff, of cleanups settled before it (the settlement
-- counted them) and of accounts cleaned before it. Pending ones are the relay's work: never.
WITH candidates AS (
    (SELECT o.ctid, o.source_id, o.account_id FROM outbox o
     WHERE o.status = 'delivered' AND o.delivered_at < :cutoff ORDER BY o.delivered_at LIMIT :rows)
    UNION ALL
    (SELECT o.ctid, o.source_id, o.account_id FROM outbox o
     WHERE o.status = 'dead' AND o.dead_at < :cutoff ORDER BY o.dead_at LIMIT :rows)
),
doomed AS (
    SELECT k.ctid FROM candidates k
    -- Probes by key, as in prune_claims_batch.
    CROSS JOIN LATERAL (
        SELECT 1 FROM cleanup_settlements s WHERE s.cleanup_id = k.source_id AND s.settled_at < :cutoff LIMIT 1
    ) settled
    CROSS JOIN LATERAL (
        SELECT 1 FROM accounts a WHERE a.account_id = k.account_id AND a.status = 'cleaned' AND a.cleaned_at < :cutoff
        LIMIT 1
    ) cleaned
),
gone AS (
    DELETE FROM outbox o WHERE NOT :dry_run AND o.ctid = ANY (ARRAY(SELECT ctid FROM doomed)) RETURNING 1
)
SELECT (SELECT count(*) FROM candidates)::bigint AS walked, (SELECT count(*) FROM doomed)::bigint AS outbox,
       (SELECT count(*) FROM gone)::bigint AS deleted;

-- name: prune_cleanups_batch
-- What is left of a cleanup settled before the cutoff once none of its claims, idempotency
-- records, unresolved failures or reminders remain: its settlement, partition reports, claim
-- progress and target set run. A cleanup that keeps a claim (an account it did not clean) keeps these.
WITH doomed AS (
    SELECT s.cleanup_id FROM cleanup_settlements s
    WHERE s.settled_at < :cutoff
      AND NOT EXISTS (SELECT 1 FROM cleanup_claims c WHERE c.cleanup_id = s.cleanup_id)
      AND NOT EXISTS (SELECT 1 FROM cleanup_applied d WHERE d.cleanup_id = s.cleanup_id)
      AND NOT EXISTS (SELECT 1 FROM cleanup_failed f WHERE f.cleanup_id = s.cleanup_id AND f.resolved_at IS NULL)
      AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.source_id = s.cleanup_id)
    ORDER BY s.settled_at
    LIMIT :rows
),
reports AS (
    DELETE FROM cleanup_partition_reports r WHERE NOT :dry_run AND r.cleanup_id = ANY (ARRAY(SELECT cleanup_id FROM doomed)) RETURNING 1
),
progress AS (
    DELETE FROM cleanup_claim_progress p WHERE NOT :dry_run AND p.cleanup_id = ANY (ARRAY(SELECT cleanup_id FROM doomed)) RETURNING 1
),
target_runs AS (
    DELETE FROM cleanup_target_runs t WHERE NOT :dry_run AND t.cleanup_id = ANY (ARRAY(SELECT cleanup_id FROM doomed)) RETURNING 1
),
settlements AS (
    DELETE FROM cleanup_settlements s WHERE NOT :dry_run AND s.cleanup_id = ANY (ARRAY(SELECT cleanup_id FROM doomed)) RETURNING 1
)
SELECT (SELECT count(*) FROM doomed)::bigint AS cleanups,
       (SELECT count(*) FROM reports) + (SELECT count(*) FROM progress) + (SELECT count(*) FROM target_runs)
       + (SELECT count(*) FROM settlements) AS deleted;

-- name: prune_planner_sweeps_batch
-- The planner's record of its sweeps before the cutoff, but the newest of each kind (a retried
-- sweep step reads the last one).
WITH doomed AS (
    SELECT p.ctid FROM planner_sweeps p
    WHERE p.swept_at < :cutoff
      AND p.sweep_id < (SELECT max(l.sweep_id) FROM planner_sweeps l WHERE l.kind = p.kind)
    ORDER BY p.swept_at
    LIMIT :rows
),
gone AS (DELETE FROM planner_sweeps p WHERE NOT :dry_run AND p.ctid = ANY (ARRAY(SELECT ctid FROM doomed)) RETURNING 1)
SELECT (SELECT count(*) FROM doomed)::bigint AS sweeps, (SELECT count(*) FROM gone)::bigint AS deleted;

-- name: retention_cutoff
-- The database's clock less the retention.
SELECT cleanup_clock() - make_interval(days => $1::int);
