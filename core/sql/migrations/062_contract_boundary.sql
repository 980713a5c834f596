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

-- One account, one key: the type of the game's account keys (text, uuid or bigint), recorded by
-- `migrate` from CLEANUP_ACCOUNT_KEY_TYPE. Every contract function canonicalizes the key it is given
-- (a UUID lower-case with hyphens, an integer without sign or leading zeros), so the spellings a
-- client sends (iOS's upper-case uuidString) are one account, and refuses a key the type cannot hold.
CREATE TABLE account_key_type (
    id           smallint PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    key_type     text NOT NULL CHECK (key_type IN ('text', 'uuid', 'bigint')),
    recorded_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
INSERT INTO account_key_type (key_type) VALUES ('text');

-- The canonical spelling of `account_id` as a key of type `kind`, or NULL when the type cannot hold
-- it. Set-based and without exception blocks (a registration of 100,000 accounts is one statement).
CREATE FUNCTION canonical_key_or_null(account_id text, kind text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE kind
        WHEN 'uuid' THEN (
            SELECT CASE WHEN h ~ '^[0-9a-f]{32}$'
                        THEN substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-' || substr(h, 13, 4) || '-'
                             || substr(h, 17, 4) || '-' || substr(h, 21, 12) END
            FROM (SELECT lower(translate(btrim(account_id, ' {}'), '-', '')) AS h) x)
        WHEN 'bigint' THEN (
            SELECT CASE WHEN d ~ '^[+-]?[0-9]{1,30}$' AND d::numeric BETWEEN -9223372036854775808 AND 9223372036854775807
                        THEN d::numeric::bigint::text END
            FROM (SELECT btrim(account_id) AS d) x)
        ELSE account_id
    END
$$;

DROP FUNCTION set_deadline(text, timestamptz);
DROP FUNCTION renew(text, timestamptz, boolean);
DROP FUNCTION renew_account(text, timestamptz, boolean);
DROP FUNCTION hold(text, text);
DROP FUNCTION release(text);

DO $migration$
DECLARE
    ddl text := $ddl$
-- The canonical key of `account_id` under the recorded key type; a key the type cannot hold raises
-- DC004 (the same rule as the accounts' CHECK first: 1-200 characters, no control characters).
CREATE FUNCTION {schema}.canonical_account_key(account_id text) RETURNS text
LANGUAGE plpgsql STABLE SET search_path = {schema}, pg_temp AS $fn$
DECLARE
    kind text := (SELECT k.key_type FROM {schema}.account_key_type k WHERE k.id = 1);
    canonical text;
BEGIN
    PERFORM {schema}.check_account_key(canonical_account_key.account_id);
    canonical := {schema}.canonical_key_or_null(canonical_account_key.account_id, coalesce(kind, 'text'));
    IF canonical IS NULL THEN
        RAISE EXCEPTION 'not an account key of type %: %', kind,
            quote_literal(left(canonical_account_key.account_id, 60))
            USING ERRCODE = 'DC004', HINT = 'the account keys are ' || kind || 's (CLEANUP_ACCOUNT_KEY_TYPE)';
    END IF;
    RETURN canonical;
END
$fn$;

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
    set_deadline.account_id := {schema}.canonical_account_key(set_deadline.account_id);
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
    renew_account.account_id := {schema}.canonical_account_key(renew_account.account_id);
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
    hold.account_id := {schema}.canonical_account_key(hold.account_id);
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
    release.account_id := {schema}.canonical_account_key(release.account_id);
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

-- Typed overloads: a game passes its own uuid or bigint column without a cast. A quoted literal or
-- an untyped parameter still resolves to the text function (Postgres prefers the string category).
CREATE FUNCTION {schema}.set_deadline(account_id uuid, deadline timestamptz,
                                      allow_earlier boolean DEFAULT false, rearm boolean DEFAULT false)
RETURNS text LANGUAGE sql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $fn$
    SELECT {schema}.set_deadline(account_id::text, deadline, allow_earlier, rearm)
$fn$;
CREATE FUNCTION {schema}.set_deadline(account_id bigint, deadline timestamptz,
                                      allow_earlier boolean DEFAULT false, rearm boolean DEFAULT false)
RETURNS text LANGUAGE sql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $fn$
    SELECT {schema}.set_deadline(account_id::text, deadline, allow_earlier, rearm)
$fn$;
CREATE FUNCTION {schema}.renew(account_id uuid, until timestamptz DEFAULT NULL, allow_earlier boolean DEFAULT false)
RETURNS text LANGUAGE sql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $fn$
    SELECT {schema}.renew(account_id::text, until, allow_earlier)
$fn$;
CREATE FUNCTION {schema}.renew(account_id bigint, until timestamptz DEFAULT NULL, allow_earlier boolean DEFAULT false)
RETURNS text LANGUAGE sql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $fn$
    SELECT {schema}.renew(account_id::text, until, allow_earlier)
$fn$;
CREATE FUNCTION {schema}.hold(account_id uuid, reason text) RETURNS text
LANGUAGE sql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $fn$
    SELECT {schema}.hold(account_id::text, reason)
$fn$;
CREATE FUNCTION {schema}.hold(account_id bigint, reason text) RETURNS text
LANGUAGE sql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $fn$
    SELECT {schema}.hold(account_id::text, reason)
$fn$;
CREATE FUNCTION {schema}.release(account_id uuid) RETURNS text
LANGUAGE sql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $fn$
    SELECT {schema}.release(account_id::text)
$fn$;
CREATE FUNCTION {schema}.release(account_id bigint) RETURNS text
LANGUAGE sql SECURITY DEFINER SET search_path = {schema}, pg_temp AS $fn$
    SELECT {schema}.release(account_id::text)
$fn$;

-- One account, one key, for registrations made before the key type was recorded (or under text):
-- a spelling that is not canonical is renamed to its canonical key while nothing claims it; one
-- whose canonical key is registered too (two accounts for one player), or that the type cannot
-- hold, is put on hold, never cleaned until an operator releases it. Nothing is erased. Returns
-- the counts; `migrate` reports them.
CREATE FUNCTION {schema}.canonicalize_registrations()
RETURNS TABLE (renamed integer, held_collisions integer, held_invalid integer)
LANGUAGE plpgsql SET search_path = {schema}, pg_temp AS $fn$
#variable_conflict use_column
DECLARE
    kind text := (SELECT k.key_type FROM {schema}.account_key_type k WHERE k.id = 1);
BEGIN
    CREATE TEMP TABLE spelling ON COMMIT DROP AS
    SELECT a.account_id, {schema}.canonical_key_or_null(a.account_id, kind) AS canonical
    FROM {schema}.accounts a
    WHERE {schema}.canonical_key_or_null(a.account_id, kind) IS DISTINCT FROM a.account_id AND a.held_since IS NULL;
    WITH held AS (
        UPDATE {schema}.accounts a
        SET held_since = clock_timestamp(),
            hold_reason = CASE WHEN s.canonical IS NULL THEN 'not a key of type ' || kind
                               ELSE 'another spelling of account ' || s.canonical END
        FROM spelling s
        WHERE a.account_id = s.account_id
          AND (s.canonical IS NULL OR EXISTS (SELECT 1 FROM {schema}.accounts c WHERE c.account_id = s.canonical)
               OR EXISTS (SELECT 1 FROM spelling o WHERE o.canonical = s.canonical AND o.account_id < s.account_id))
        RETURNING a.account_id, a.renewal_deadline, a.hold_reason, s.canonical
    ), events AS (
        INSERT INTO {schema}.account_events (account_id, kind, deadline, reason)
        SELECT account_id, 'held', renewal_deadline, hold_reason FROM held
    )
    SELECT count(*) FILTER (WHERE canonical IS NOT NULL)::int, count(*) FILTER (WHERE canonical IS NULL)::int
    INTO held_collisions, held_invalid FROM held;
    UPDATE {schema}.accounts a SET account_id = s.canonical
    FROM spelling s
    WHERE a.account_id = s.account_id AND s.canonical IS NOT NULL AND a.status IN ('active', 'renewed')
      AND a.held_since IS NULL;
    GET DIAGNOSTICS renamed = ROW_COUNT;
    RETURN NEXT;
END
$fn$;
$ddl$;
BEGIN
    EXECUTE replace(ddl, '{schema}', quote_ident(current_schema()));
END
$migration$;
