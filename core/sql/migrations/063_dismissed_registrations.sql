-- A registration that can never be cleaned (a key the game's tables cannot hold, an account whose
-- data is gone another way) is dismissed by an operator: its status says so, its pending failure is
-- resolved as dismissed, the event is recorded, and nothing claims it again. The CHECKs grow by
-- one value each: added NOT VALID (a brief lock, no scan), validated by the next file.
ALTER TABLE accounts DROP CONSTRAINT accounts_status_check;
ALTER TABLE accounts ADD CONSTRAINT accounts_status_check
    CHECK (status IN ('active', 'renewed', 'cleaning', 'cleaned', 'cleanup_failed', 'dismissed')) NOT VALID;
ALTER TABLE cleanup_failed DROP CONSTRAINT cleanup_failed_resolution_check;
ALTER TABLE cleanup_failed ADD CONSTRAINT cleanup_failed_resolution_check
    CHECK (resolution IN ('cleaned', 'renewed', 'stale', 'dismissed')) NOT VALID;
ALTER TABLE account_events DROP CONSTRAINT account_events_kind_check;
ALTER TABLE account_events ADD CONSTRAINT account_events_kind_check
    CHECK (kind IN ('registered', 'moved', 'refused', 'held', 'released', 'dismissed')) NOT VALID;

-- A cleanup retried with other targets than it ran with (said explicitly: `retry-failed
-- --with-current-targets`) keeps the sets it ran with before, beside the one it runs with now.
ALTER TABLE cleanup_target_runs ADD COLUMN replaced_fingerprints text[] NOT NULL DEFAULT '{}';

DO $migration$
BEGIN
    EXECUTE replace($ddl$
-- 'dismissed', 'not_dismissable' (claimed by a cleanup in progress, cleaned, or already dismissed).
-- An active, renewed or failed account is dismissed: never claimed again, its failure resolved.
CREATE FUNCTION {schema}.dismiss(account_id text, reason text) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $fn$
#variable_conflict use_column
DECLARE
    c record;
BEGIN
    IF dismiss.reason IS NULL OR btrim(dismiss.reason) = '' THEN
        RAISE EXCEPTION 'a dismissal needs a reason' USING ERRCODE = '22023';
    END IF;
    SELECT a.status, a.renewal_deadline INTO c
    FROM {schema}.accounts a WHERE a.account_id = dismiss.account_id FOR UPDATE;
    IF NOT FOUND THEN  -- a key the key type cannot hold was never canonicalized: look it up as given
        RAISE EXCEPTION 'unknown account %', quote_literal(dismiss.account_id) USING ERRCODE = 'P0002';
    END IF;
    IF c.status NOT IN ('active', 'renewed', 'cleanup_failed') THEN
        RETURN 'not_dismissable';
    END IF;
    UPDATE {schema}.accounts a SET status = 'dismissed', held_since = NULL, hold_reason = NULL
    WHERE a.account_id = dismiss.account_id;
    UPDATE {schema}.cleanup_failed f
    SET resolved_at = now(), resolution = 'dismissed', detail = NULL
    WHERE f.account_id = dismiss.account_id AND f.resolved_at IS NULL;
    INSERT INTO {schema}.account_events (account_id, kind, deadline, reason)
    VALUES (dismiss.account_id, 'dismissed', c.renewal_deadline, dismiss.reason);
    RETURN 'dismissed';
END
$fn$;
$ddl$, '{schema}', quote_ident(current_schema()));
END
$migration$;
