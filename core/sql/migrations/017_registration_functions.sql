-- The contract with the game: SQL functions the game calls in its own transactions, from any
-- language, to register deadlines, renew, and put accounts under a legal hold. Their names and
-- results are the interface (tests outside the project call them); the CLI and the Python API call
-- the same functions. Each runs with the service schema as its search path (SET ... FROM CURRENT:
-- the schema this migration runs in), whatever the caller's.

-- A legal hold: a held account is never claimed (every claim skips it); on release it is cleaned
-- at its deadline, or by the planner's overdue sweep at once if that has passed.
ALTER TABLE accounts ADD COLUMN held_since timestamptz, ADD COLUMN hold_reason text;
CREATE INDEX accounts_held_idx ON accounts (renewal_deadline) WHERE held_since IS NOT NULL;

-- What happened to an account's registration, for its erasure receipt: registered, deadline moved,
-- held, released (renewals are in `renewals`). No personal data: the account's key, times, reasons.
CREATE TABLE account_events (
    event_id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account_id   text NOT NULL,
    kind         text NOT NULL CHECK (kind IN ('registered', 'moved', 'refused', 'held', 'released')),
    deadline     timestamptz,
    reason       text,
    recorded_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX account_events_account_idx ON account_events (account_id, event_id);

-- The game's account IDs are its own (text, UUID or bigint printed as text); the same rule as the
-- CHECK on accounts, raised with a message that says which rule.
CREATE FUNCTION check_account_key(account_id text) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF account_id IS NULL OR length(account_id) NOT BETWEEN 1 AND 200 OR account_id ~ '[[:cntrl:]]' THEN
        RAISE EXCEPTION 'not an account ID: %',
            quote_literal(regexp_replace(left(coalesce(account_id, 'NULL'), 60), '[[:cntrl:]]', '?', 'g'))
            USING ERRCODE = '22023',
                  HINT = 'an account ID is 1-200 characters without control characters';
    END IF;
END
$$;

-- Registers an account at `deadline`, or moves the deadline of one not yet claimed. 'registered',
-- 'moved', or 'too_late' (claimed by a cleanup, failed in one, or cleaned: nothing changes). A
-- moved deadline bumps the account's version, as a renewal does: a cleanup planned for the old
-- deadline finds it stale.
CREATE FUNCTION set_deadline(account_id text, deadline timestamptz) RETURNS text
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    current_status text;
BEGIN
    PERFORM check_account_key(set_deadline.account_id);
    IF set_deadline.deadline IS NULL OR NOT isfinite(set_deadline.deadline) THEN
        RAISE EXCEPTION 'a deadline is a finite timestamptz, got %', set_deadline.deadline USING ERRCODE = '22023';
    END IF;
    INSERT INTO accounts AS a (account_id, renewal_deadline) VALUES (set_deadline.account_id, set_deadline.deadline)
    ON CONFLICT (account_id) DO NOTHING;
    IF FOUND THEN
        INSERT INTO account_events (account_id, kind, deadline) VALUES (set_deadline.account_id, 'registered', set_deadline.deadline);
        RETURN 'registered';
    END IF;
    SELECT a.status INTO current_status FROM accounts a WHERE a.account_id = set_deadline.account_id FOR UPDATE;
    IF current_status NOT IN ('active', 'renewed') THEN
        INSERT INTO account_events (account_id, kind, deadline) VALUES (set_deadline.account_id, 'refused', set_deadline.deadline);
        RETURN 'too_late';
    END IF;
    UPDATE accounts a
    SET renewal_deadline = set_deadline.deadline, status = 'active', cleanup_version = a.cleanup_version + 1
    WHERE a.account_id = set_deadline.account_id;
    INSERT INTO account_events (account_id, kind, deadline) VALUES (set_deadline.account_id, 'moved', set_deadline.deadline);
    RETURN 'moved';
END
$$;

-- The renewal rule, judged by the database clock (cleanup_clock()) once the account's row is
-- locked: in time iff the account is renewed for good, or active (or failed in a cleanup) and
-- judged before its deadline; a claimed or cleaned account is always too late. `until` NULL renews
-- for good; a new deadline must be after the database's now, and not before the current deadline
-- unless `allow_earlier` (a typo must not delete an account's data weeks early). Every attempt is
-- recorded in `renewals`, too late ones included. No row: no such account.
CREATE FUNCTION renew_account(account_id text, until timestamptz DEFAULT NULL, allow_earlier boolean DEFAULT false)
RETURNS TABLE (status_seen text, old_deadline timestamptz, old_version integer, claimed_by text,
               outcome text, version_after integer, judged_at timestamptz)
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    c record;
    judged timestamptz;
    in_time boolean;
    after integer;
BEGIN
    SELECT a.status, a.cleanup_version, a.renewal_deadline, a.claimed_by INTO c
    FROM accounts a WHERE a.account_id = renew_account.account_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    judged := cleanup_clock();  -- read once the row lock is held
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
        UPDATE accounts a
        SET status = CASE WHEN renew_account.until IS NULL THEN 'renewed' ELSE 'active' END,
            renewal_deadline = coalesce(renew_account.until, a.renewal_deadline),
            cleanup_version = a.cleanup_version + 1,
            renewed_at = now()
        WHERE a.account_id = renew_account.account_id
        RETURNING a.cleanup_version INTO after;
    END IF;
    INSERT INTO renewals (account_id, outcome, new_deadline, version_after, status_seen, judged_at, deadline_seen)
    VALUES (renew_account.account_id, CASE WHEN in_time THEN 'in_time' ELSE 'too_late' END, renew_account.until,
            after, c.status, judged, c.renewal_deadline);
    RETURN QUERY SELECT c.status, c.renewal_deadline, c.cleanup_version, c.claimed_by,
                        CASE WHEN in_time THEN 'in_time' ELSE 'too_late' END, after, judged;
END
$$;

-- The game's renewal: 'in_time' or 'too_late' (renew_account's rule). An unknown account raises.
CREATE FUNCTION renew(account_id text, until timestamptz DEFAULT NULL, allow_earlier boolean DEFAULT false)
RETURNS text
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    result text;
BEGIN
    SELECT r.outcome INTO result FROM renew_account(renew.account_id, renew.until, renew.allow_earlier) r;
    IF result IS NULL THEN
        RAISE EXCEPTION 'unknown account %', quote_literal(renew.account_id) USING ERRCODE = 'P0002';
    END IF;
    RETURN result;
END
$$;

-- A legal hold: 'held', 'already_held', or 'too_late' (claimed by a cleanup, failed in one, or
-- cleaned). A claim that committed first wins (the account is then 'cleaning'); one that comes
-- after skips the held row (the claims re-check it on the row they lock).
CREATE FUNCTION hold(account_id text, reason text) RETURNS text
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    c record;
BEGIN
    IF hold.reason IS NULL OR btrim(hold.reason) = '' THEN
        RAISE EXCEPTION 'a hold needs a reason' USING ERRCODE = '22023';
    END IF;
    SELECT a.status, a.held_since, a.renewal_deadline INTO c
    FROM accounts a WHERE a.account_id = hold.account_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown account %', quote_literal(hold.account_id) USING ERRCODE = 'P0002';
    END IF;
    IF c.status NOT IN ('active', 'renewed') THEN
        RETURN 'too_late';
    END IF;
    IF c.held_since IS NOT NULL THEN
        RETURN 'already_held';
    END IF;
    UPDATE accounts a SET held_since = clock_timestamp(), hold_reason = hold.reason
    WHERE a.account_id = hold.account_id;
    INSERT INTO account_events (account_id, kind, deadline, reason)
    VALUES (hold.account_id, 'held', c.renewal_deadline, hold.reason);
    RETURN 'held';
END
$$;

-- Ends a hold: 'released' or 'not_held'. The account is then claimed like any other: at its
-- deadline, or by the overdue sweep if the deadline has passed.
CREATE FUNCTION release(account_id text) RETURNS text
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
    c record;
BEGIN
    SELECT a.held_since, a.renewal_deadline INTO c FROM accounts a WHERE a.account_id = release.account_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown account %', quote_literal(release.account_id) USING ERRCODE = 'P0002';
    END IF;
    IF c.held_since IS NULL THEN
        RETURN 'not_held';
    END IF;
    UPDATE accounts a SET held_since = NULL, hold_reason = NULL WHERE a.account_id = release.account_id;
    INSERT INTO account_events (account_id, kind, deadline) VALUES (release.account_id, 'released', c.renewal_deadline);
    RETURN 'released';
END
$$;
