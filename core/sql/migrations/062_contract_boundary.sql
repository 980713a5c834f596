-- The game's contract as a security boundary (docs/security.md).
--
-- The contract functions run with their owner's rights (SECURITY DEFINER): the game's role holds no
-- privilege on any table and may only call set_deadline and renew; hold and release are the
-- compliance role's. Who may EXECUTE what is granted per role by `migrate` (core/roles.py: the role
-- names are a setting), after PUBLIC's default EXECUTE is revoked. Each function pins its search
-- path to the service schema with pg_temp last (nothing a caller creates can shadow a name) and
-- names every object schema-qualified: the bodies below are written with `{schema}` and created
-- for the schema this migration runs in.

-- The anonymize key's HMAC pads, where only the service's roles can read them: a batch statement
-- reads them in a subquery, so the key is never a statement parameter or literal the server could
-- log. Written by the worker over COPY (whose rows are never logged), replaced only by the
-- documented rotation (docs/targets.md). `fingerprint` tells keys apart without revealing them.
CREATE TABLE anonymize_key (
    id           smallint PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    inner_pad    bytea NOT NULL CHECK (length(inner_pad) = 64),
    outer_pad    bytea NOT NULL CHECK (length(outer_pad) = 64),
    fingerprint  text NOT NULL,
    stored_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The renewal rule's clock is the database's clock, nothing else: no session setting moves it.
-- (Tests that skip Temporal's time replace this function in their own database: tests/helpers.py.)
CREATE OR REPLACE FUNCTION cleanup_clock() RETURNS timestamptz LANGUAGE sql VOLATILE AS $$
    SELECT clock_timestamp()
$$;

-- A failure record keeps codes and names only: a message could quote what a game's trigger raised.
UPDATE cleanup_failed SET message = 'error ' || sqlstate WHERE message IS DISTINCT FROM 'error ' || sqlstate;

DROP FUNCTION set_deadline(text, timestamptz);
DROP FUNCTION renew(text, timestamptz, boolean);
DROP FUNCTION renew_account(text, timestamptz, boolean);
DROP FUNCTION hold(text, text);
DROP FUNCTION release(text);

DO $migration$
DECLARE
    ddl text := $ddl$
-- Registers an account at `deadline`, or moves the deadline of one not yet claimed: 'registered',
-- 'moved', or 'too_late' (claimed, failed in a cleanup, or cleaned: nothing changes; recorded).
-- A move follows the renewal's rules, each refusal an error of its own SQLSTATE:
--   DC001 the new deadline is not after the database's now;
--   DC002 it is earlier than the current one and `allow_earlier` was not said;
--   DC003 the account is renewed for good and `rearm` was not said.
-- A registration may name a past deadline (an account imported already due is swept at once).
-- A moved deadline bumps the account's version: a cleanup planned for the old one finds it stale.
CREATE FUNCTION {schema}.set_deadline(account_id text, deadline timestamptz,
                                      allow_earlier boolean DEFAULT false, rearm boolean DEFAULT false)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $fn$
#variable_conflict use_column
DECLARE
    c record;
    judged timestamptz;
BEGIN
    PERFORM {schema}.check_account_key(set_deadline.account_id);
    IF set_deadline.deadline IS NULL OR NOT isfinite(set_deadline.deadline) THEN
        RAISE EXCEPTION 'a deadline is a finite timestamptz, got %', set_deadline.deadline USING ERRCODE = '22023';
    END IF;
    INSERT INTO {schema}.accounts AS a (account_id, renewal_deadline)
    VALUES (set_deadline.account_id, set_deadline.deadline)
    ON CONFLICT (account_id) DO NOTHING;
    IF FOUND THEN
        INSERT INTO {schema}.account_events (account_id, kind, deadline)
        VALUES (set_deadline.account_id, 'registered', set_deadline.deadline);
        RETURN 'registered';
    END IF;
    SELECT a.status, a.renewal_deadline INTO c
    FROM {schema}.accounts a WHERE a.account_id = set_deadline.account_id FOR UPDATE;
    IF c.status NOT IN ('active', 'renewed') THEN
        INSERT INTO {schema}.account_events (account_id, kind, deadline)
        VALUES (set_deadline.account_id, 'refused', set_deadline.deadline);
        RETURN 'too_late';
    END IF;
    IF c.status = 'renewed' AND NOT coalesce(set_deadline.rearm, false) THEN
        RAISE EXCEPTION 'account % is renewed for good: a plain set_deadline does not give it a deadline again',
            quote_literal(set_deadline.account_id)
            USING ERRCODE = 'DC003', HINT = 'say so explicitly to re-arm its cleanup (rearm => true)';
    END IF;
    judged := {schema}.cleanup_clock();  -- read once the row lock is held
    IF set_deadline.deadline <= judged THEN
        RAISE EXCEPTION 'the new deadline % is not after the database''s now (%)', set_deadline.deadline, judged
            USING ERRCODE = 'DC001', HINT = 'a moved deadline lies in the future; a wrong unit (seconds as milliseconds) deletes data';
    END IF;
    IF c.status = 'active' AND set_deadline.deadline < c.renewal_deadline
       AND NOT coalesce(set_deadline.allow_earlier, false) THEN
        RAISE EXCEPTION 'the new deadline % is earlier than the current one %', set_deadline.deadline, c.renewal_deadline
            USING ERRCODE = 'DC002', HINT = 'say so explicitly to move a deadline earlier (allow_earlier => true)';
    END IF;
    UPDATE {schema}.accounts a
    SET renewal_deadline = set_deadline.deadline, status = 'active', cleanup_version = a.cleanup_version + 1
    WHERE a.account_id = set_deadline.account_id;
    INSERT INTO {schema}.account_events (account_id, kind, deadline)
    VALUES (set_deadline.account_id, 'moved', set_deadline.deadline);
    RETURN 'moved';
END
$fn$;

-- The renewal rule, judged by the database clock once the account's row is locked: in time iff the
-- account is renewed for good, or active (or failed in a cleanup) and judged before its deadline; a
-- claimed or cleaned account is always too late. `until` NULL renews for good; a new deadline must
-- be after the database's now, and not before the current deadline unless `allow_earlier`. Every
-- attempt is recorded in `renewals`, too late ones included. No row: no such account.
CREATE FUNCTION {schema}.renew_account(account_id text, until timestamptz DEFAULT NULL, allow_earlier boolean DEFAULT false)
RETURNS TABLE (status_seen text, old_deadline timestamptz, old_version integer, claimed_by text,
               outcome text, version_after integer, judged_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $fn$
#variable_conflict use_column
DECLARE
    c record;
    judged timestamptz;
    in_time boolean;
    after integer;
BEGIN
    SELECT a.status, a.cleanup_version, a.renewal_deadline, a.claimed_by INTO c
    FROM {schema}.accounts a WHERE a.account_id = renew_account.account_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    judged := {schema}.cleanup_clock();  -- read once the row lock is held
    IF renew_account.until IS NOT NULL AND renew_account.until <= judged THEN
        RAISE EXCEPTION 'the new deadline % is in the past by the database clock (%); a renewal extends the deadline',
            renew_account.until, judged USING ERRCODE = '22023';
    END IF;
    in_time := c.status = 'renewed' OR (c.status IN ('active', 'cleanup_failed') AND judged < c.renewal_deadline);
    IF in_time AND c.status <> 'renewed' AND renew_account.until < c.renewal_deadline
       AND NOT coalesce(renew_account.allow_earlier, false) THEN
        RAISE EXCEPTION 'the new deadline % is earlier than the current one %', renew_account.until, c.renewal_deadline
            USING ERRCODE = '22023', HINT = 'say so explicitly to move a deadline earlier (allow_earlier)';
    END IF;
    after := c.cleanup_version;
    IF in_time THEN
        UPDATE {schema}.accounts a
        SET status = CASE WHEN renew_account.until IS NULL THEN 'renewed' ELSE 'active' END,
            renewal_deadline = coalesce(renew_account.until, a.renewal_deadline),
            cleanup_version = a.cleanup_version + 1,
            renewed_at = now()
        WHERE a.account_id = renew_account.account_id
        RETURNING a.cleanup_version INTO after;
        -- A renewal makes a pending failure stale: nothing of it is kept but its code.
        UPDATE {schema}.cleanup_failed f SET detail = NULL
        WHERE f.account_id = renew_account.account_id AND f.resolved_at IS NULL AND f.detail IS NOT NULL;
    END IF;
    INSERT INTO {schema}.renewals (account_id, outcome, new_deadline, version_after, status_seen, judged_at, deadline_seen)
    VALUES (renew_account.account_id, CASE WHEN in_time THEN 'in_time' ELSE 'too_late' END, renew_account.until,
            after, c.status, judged, c.renewal_deadline);
    RETURN QUERY SELECT c.status, c.renewal_deadline, c.cleanup_version, c.claimed_by,
                        CASE WHEN in_time THEN 'in_time' ELSE 'too_late' END, after, judged;
END
$fn$;

-- The game's renewal: 'in_time' or 'too_late' (renew_account's rule). An unknown account raises.
CREATE FUNCTION {schema}.renew(account_id text, until timestamptz DEFAULT NULL, allow_earlier boolean DEFAULT false)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $fn$
DECLARE
    result text;
BEGIN
    SELECT r.outcome INTO result FROM {schema}.renew_account(renew.account_id, renew.until, renew.allow_earlier) r;
    IF result IS NULL THEN
        RAISE EXCEPTION 'unknown account %', quote_literal(renew.account_id) USING ERRCODE = 'P0002';
    END IF;
    RETURN result;
END
$fn$;

-- A legal hold: 'held', 'already_held', or 'too_late' (claimed by a cleanup in progress, or
-- cleaned). An account whose cleanup failed may be held: retry-failed skips it while it is held.
-- A claim that committed first wins; one that comes after skips the held row.
CREATE FUNCTION {schema}.hold(account_id text, reason text) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $fn$
#variable_conflict use_column
DECLARE
    c record;
BEGIN
    IF hold.reason IS NULL OR btrim(hold.reason) = '' THEN
        RAISE EXCEPTION 'a hold needs a reason' USING ERRCODE = '22023';
    END IF;
    SELECT a.status, a.held_since, a.renewal_deadline INTO c
    FROM {schema}.accounts a WHERE a.account_id = hold.account_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown account %', quote_literal(hold.account_id) USING ERRCODE = 'P0002';
    END IF;
    IF c.status NOT IN ('active', 'renewed', 'cleanup_failed') THEN
        RETURN 'too_late';
    END IF;
    IF c.held_since IS NOT NULL THEN
        RETURN 'already_held';
    END IF;
    UPDATE {schema}.accounts a SET held_since = clock_timestamp(), hold_reason = hold.reason
    WHERE a.account_id = hold.account_id;
    INSERT INTO {schema}.account_events (account_id, kind, deadline, reason)
    VALUES (hold.account_id, 'held', c.renewal_deadline, hold.reason);
    RETURN 'held';
END
$fn$;

-- Ends a hold: 'released' or 'not_held'. The account is then claimed like any other: at its
-- deadline, or by the overdue sweep if the deadline has passed (a failed one by retry-failed).
CREATE FUNCTION {schema}.release(account_id text) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $fn$
#variable_conflict use_column
DECLARE
    c record;
BEGIN
    SELECT a.held_since, a.renewal_deadline INTO c
    FROM {schema}.accounts a WHERE a.account_id = release.account_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown account %', quote_literal(release.account_id) USING ERRCODE = 'P0002';
    END IF;
    IF c.held_since IS NULL THEN
        RETURN 'not_held';
    END IF;
    UPDATE {schema}.accounts a SET held_since = NULL, hold_reason = NULL WHERE a.account_id = release.account_id;
    INSERT INTO {schema}.account_events (account_id, kind, deadline)
    VALUES (release.account_id, 'released', c.renewal_deadline);
    RETURN 'released';
END
$fn$;
$ddl$;
BEGIN
    EXECUTE replace(ddl, '{schema}', quote_ident(current_schema()));
END
$migration$;
