-- Retention of the service's bookkeeping (docs/deployment.md "Retention"). A cleanup's records of
-- an account it cleaned are pruned once the cleanup settled, and the account was cleaned, before a
-- cutoff at least 7 days ago (the worker prunes after CLEANUP_RETENTION_DAYS, at least 7). The
-- worker may DELETE its own bookkeeping (claims, idempotency records, delivered reminders); the
-- audit tables are append-only for it (core/roles.py), so their rows go only through this
-- function, which runs with the owner's rights and judges every row itself: whatever the worker
-- passes, nothing of an account not cleaned, of a cleanup not settled, or younger than 7 days goes.
DO $migration$
DECLARE
    ddl text := $ddl$
-- The receipts, registration events, renewal attempts and resolved failures of the accounts that
-- cleanup `cleanup_ids[i]` cleaned (`account_ids[i]`), when that cleanup settled and the account was
-- cleaned before `cutoff`. `dry_run`: counted, not deleted. The caller holds the batch bounded.
CREATE FUNCTION {schema}.prune_account_records(cleanup_ids text[], account_ids text[], cutoff timestamptz,
                                               dry_run boolean)
RETURNS TABLE (receipts bigint, events bigint, renewals bigint, failures bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $fn$
#variable_conflict use_column
BEGIN
    IF prune_account_records.cutoff IS NULL
       OR prune_account_records.cutoff > {schema}.cleanup_clock() - interval '7 days' THEN
        RAISE EXCEPTION 'a retention cutoff is at least 7 days ago, got %', prune_account_records.cutoff
            USING ERRCODE = '22023';
    END IF;
    -- Only accounts this cleanup claimed last and cleaned (claimed_by), both before the cutoff.
    RETURN QUERY
    WITH p AS MATERIALIZED (
        SELECT k.cleanup_id, k.account_id
        FROM unnest(prune_account_records.cleanup_ids, prune_account_records.account_ids) AS k (cleanup_id, account_id)
        JOIN {schema}.accounts a ON a.account_id = k.account_id
        JOIN {schema}.cleanup_settlements s ON s.cleanup_id = k.cleanup_id
        WHERE a.status = 'cleaned' AND a.claimed_by = k.cleanup_id AND a.cleaned_at < prune_account_records.cutoff
          AND s.settled_at < prune_account_records.cutoff
    ), r AS (
        DELETE FROM {schema}.erasure_receipts r USING p
        WHERE NOT prune_account_records.dry_run AND r.account_id = p.account_id AND r.cleanup_id = p.cleanup_id
        RETURNING 1
    ), e AS (
        DELETE FROM {schema}.account_events e USING p
        WHERE NOT prune_account_records.dry_run AND e.account_id = p.account_id RETURNING 1
    ), n AS (
        DELETE FROM {schema}.renewals n USING p
        WHERE NOT prune_account_records.dry_run AND n.account_id = p.account_id RETURNING 1
    ), f AS (
        -- A failure resolved before the cutoff (the account was cleaned: every failure of it is resolved).
        DELETE FROM {schema}.cleanup_failed f USING p
        WHERE NOT prune_account_records.dry_run AND f.account_id = p.account_id
          AND f.resolved_at < prune_account_records.cutoff
        RETURNING 1
    )
    SELECT
        CASE WHEN prune_account_records.dry_run
             THEN (SELECT count(*) FROM {schema}.erasure_receipts r JOIN p
                   ON r.account_id = p.account_id AND r.cleanup_id = p.cleanup_id)
             ELSE (SELECT count(*) FROM r) END,
        CASE WHEN prune_account_records.dry_run
             THEN (SELECT count(*) FROM {schema}.account_events e JOIN p ON e.account_id = p.account_id)
             ELSE (SELECT count(*) FROM e) END,
        CASE WHEN prune_account_records.dry_run
             THEN (SELECT count(*) FROM {schema}.renewals n JOIN p ON n.account_id = p.account_id)
             ELSE (SELECT count(*) FROM n) END,
        CASE WHEN prune_account_records.dry_run
             THEN (SELECT count(*) FROM {schema}.cleanup_failed f JOIN p ON f.account_id = p.account_id
                   WHERE f.resolved_at < prune_account_records.cutoff)
             ELSE (SELECT count(*) FROM f) END;
END
$fn$;
$ddl$;
BEGIN
    EXECUTE replace(ddl, '{schema}', quote_ident(current_schema()));
END
$migration$;
