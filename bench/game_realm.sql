-- Named queries of bench/game_realm.py: the floor of a cohort cleanup on the game realm
-- (tests/game_realm), and the realm's state read back after the runs.

-- name: realm_floor
-- One slice of a cohort ($2 = its deadline; account_id >= $3 and < $4, NULL = unbounded) cleaned by
-- one statement under cleanup ID $1, with the effects of the realm's targets and follow-ups
-- (tests/game_realm/targets.toml) and the pipeline's guarantees: each account marked cleaned, its
-- idempotency record, its erasure receipt (rows per target, the follow-ups' rows) and its reminder,
-- in the slice's one transaction. $5, $6: the anonymize key's inner and outer pads.
-- The slices run at once and never lock one row in different orders: a row two slices would both
-- delete (a friendship or a notification between players of two slices) is the slice's of its
-- first side only, and the counters several slices decrement (the friends outside the cohort, the
-- groups) are locked first, in key order, before any other row of the game.
WITH cleaned AS (
    UPDATE accounts
    SET status = 'cleaned', claimed_by = $1, claimed_at = now(), cleaned_at = now()
    WHERE renewal_deadline = $2 AND status = 'active' AND renewal_deadline <= cleanup_clock()
      AND ($3::text IS NULL OR account_id >= $3::text)
      AND ($4::text IS NULL OR account_id < $4::text)
    RETURNING account_id, cleanup_version
),
applied AS (
    INSERT INTO cleanup_applied (account_id, cleanup_version, cleanup_id, partition_no)
    SELECT account_id, cleanup_version, $1, 0 FROM cleaned
    ON CONFLICT ON CONSTRAINT cleanup_applied_once DO NOTHING
    RETURNING account_id, cleanup_version
),
ids AS (
    SELECT account_id::uuid AS id FROM applied
),
-- follow-up friends_lose_an_edge: friends outside the cohort lose their edges with the slice
friend_edges AS (
    SELECT f.peer_id AS id, count(*)::int AS n FROM realm.friendships f JOIN ids k ON f.owner_id = k.id
    WHERE NOT EXISTS (SELECT 1 FROM accounts c WHERE c.account_id = f.peer_id::text AND c.renewal_deadline = $2)
    GROUP BY f.peer_id
),
friends_locked AS (
    SELECT u.id FROM realm.users u WHERE u.id IN (SELECT id FROM friend_edges) ORDER BY u.id FOR UPDATE
),
-- follow-up groups_lose_a_member
group_edges AS (
    SELECT m.group_id AS id, count(*)::int AS n FROM realm.group_members m JOIN ids k ON m.user_id = k.id
    GROUP BY m.group_id
),
groups_locked AS (
    SELECT g.id FROM realm.groups g
    WHERE g.id IN (SELECT id FROM group_edges) AND (SELECT count(*) FROM friends_locked) >= 0
    ORDER BY g.id FOR UPDATE
),
friends_counted AS (
    UPDATE realm.users u SET friend_count = u.friend_count - e.n FROM friend_edges e
    WHERE u.id = e.id AND (SELECT count(*) FROM groups_locked) >= 0
    RETURNING 1
),
groups_counted AS (
    UPDATE realm.groups g SET member_count = g.member_count - e.n FROM group_edges e
    WHERE g.id = e.id AND (SELECT count(*) FROM groups_locked) >= 0
    RETURNING 1
),
notes_received AS (
    DELETE FROM realm.notifications t USING ids k
    WHERE t.recipient_id = k.id AND (SELECT count(*) FROM groups_locked) >= 0
    RETURNING t.recipient_id AS key
),
notes_sent AS (
    DELETE FROM realm.notifications t USING ids k
    WHERE t.sender_id = k.id AND (SELECT count(*) FROM groups_locked) >= 0
      AND NOT EXISTS (SELECT 1 FROM accounts c WHERE c.account_id = t.recipient_id::text AND c.renewal_deadline = $2)
    RETURNING t.sender_id AS key
),
messages AS (
    DELETE FROM realm.messages t USING ids k WHERE t.sender_id = k.id RETURNING t.sender_id AS key
),
devices AS (
    DELETE FROM realm.devices t USING ids k WHERE t.user_id = k.id RETURNING t.user_id AS key
),
storage AS (
    DELETE FROM realm.storage_objects t USING ids k WHERE t.user_id = k.id RETURNING t.user_id AS key
),
records AS (
    DELETE FROM realm.leaderboard_records t USING ids k WHERE t.owner_id = k.id RETURNING t.owner_id AS key
),
members AS (
    DELETE FROM realm.group_members t USING ids k WHERE t.user_id = k.id RETURNING t.user_id AS key
),
friends_own AS (
    DELETE FROM realm.friendships t USING ids k
    WHERE t.owner_id = k.id AND (SELECT count(*) FROM groups_locked) >= 0
    RETURNING t.owner_id AS key
),
friends_peer AS (
    DELETE FROM realm.friendships t USING ids k
    WHERE t.peer_id = k.id AND (SELECT count(*) FROM groups_locked) >= 0
      AND NOT EXISTS (SELECT 1 FROM accounts c WHERE c.account_id = t.owner_id::text AND c.renewal_deadline = $2)
    RETURNING t.peer_id AS key
),
ledger_moved AS (
    DELETE FROM realm.wallet_ledger t USING ids k WHERE t.user_id = k.id RETURNING t.*
),
ledger AS (
    INSERT INTO realm.wallet_ledger_archive (id, user_id, changeset, created_at)
    SELECT id, user_id, changeset, created_at FROM ledger_moved
    RETURNING user_id AS key
),
purchases AS (
    UPDATE realm.purchases t
    SET buyer_ref = encode(sha256($6::bytea || sha256($5::bytea || convert_to(t.buyer_ref, 'UTF8'))), 'hex')
    FROM ids k WHERE t.user_id = k.id
    RETURNING t.user_id AS key
),
-- the users row anonymized; follow-up players_have_no_friends_left: none of their edges is left
users AS (
    UPDATE realm.users t
    SET email = NULL, profile = '{}', handle = 'anon-' || gen_random_uuid()::text,
        login = 'anon-' || gen_random_uuid()::text, friend_count = 0
    FROM ids k WHERE t.id = k.id
    RETURNING t.id AS key
),
-- rows per target and account, in the order of the targets file
per_target AS (
    SELECT key, count(*) FILTER (WHERE t = 0) AS n0, count(*) FILTER (WHERE t = 1) AS n1,
           count(*) FILTER (WHERE t = 2) AS n2, count(*) FILTER (WHERE t = 3) AS n3,
           count(*) FILTER (WHERE t = 4) AS n4, count(*) FILTER (WHERE t = 5) AS n5,
           count(*) FILTER (WHERE t = 6) AS n6, count(*) FILTER (WHERE t = 7) AS n7,
           count(*) FILTER (WHERE t = 8) AS n8, count(*) FILTER (WHERE t = 9) AS n9,
           count(*) FILTER (WHERE t = 10) AS n10, count(*) FILTER (WHERE t = 11) AS n11
    FROM (SELECT 0 AS t, key FROM notes_received UNION ALL SELECT 1, key FROM notes_sent
          UNION ALL SELECT 2, key FROM messages UNION ALL SELECT 3, key FROM devices
          UNION ALL SELECT 4, key FROM storage UNION ALL SELECT 5, key FROM records
          UNION ALL SELECT 6, key FROM members UNION ALL SELECT 7, key FROM friends_own
          UNION ALL SELECT 8, key FROM friends_peer UNION ALL SELECT 9, key FROM ledger
          UNION ALL SELECT 10, key FROM purchases UNION ALL SELECT 11, key FROM users) r
    GROUP BY key
),
receipts AS (
    INSERT INTO erasure_receipts (account_id, cleanup_version, cleanup_id, targets, follow_ups)
    SELECT a.account_id, a.cleanup_version, $1, jsonb_build_array(
        jsonb_build_object('target', 'realm.notifications', 'match_column', 'recipient_id', 'rows', coalesce(n0, 0)),
        jsonb_build_object('target', 'realm.notifications', 'match_column', 'sender_id', 'rows', coalesce(n1, 0)),
        jsonb_build_object('target', 'realm.messages', 'match_column', 'sender_id', 'rows', coalesce(n2, 0)),
        jsonb_build_object('target', 'realm.devices', 'match_column', 'user_id', 'rows', coalesce(n3, 0)),
        jsonb_build_object('target', 'realm.storage_objects', 'match_column', 'user_id', 'rows', coalesce(n4, 0)),
        jsonb_build_object('target', 'realm.leaderboard_records', 'match_column', 'owner_id', 'rows', coalesce(n5, 0)),
        jsonb_build_object('target', 'realm.group_members', 'match_column', 'user_id', 'rows', coalesce(n6, 0)),
        jsonb_build_object('target', 'realm.friendships', 'match_column', 'owner_id', 'rows', coalesce(n7, 0)),
        jsonb_build_object('target', 'realm.friendships', 'match_column', 'peer_id', 'rows', coalesce(n8, 0)),
        jsonb_build_object('target', 'realm.wallet_ledger', 'match_column', 'user_id', 'rows', coalesce(n9, 0)),
        jsonb_build_object('target', 'realm.purchases', 'match_column', 'user_id', 'rows', coalesce(n10, 0)),
        jsonb_build_object('target', 'realm.users', 'match_column', 'id', 'rows', coalesce(n11, 0))),
        jsonb_build_array(
            jsonb_build_object('name', 'friends_lose_an_edge', 'rows', (SELECT count(*) FROM friends_counted)),
            jsonb_build_object('name', 'groups_lose_a_member', 'rows', (SELECT count(*) FROM groups_counted)),
            jsonb_build_object('name', 'players_have_no_friends_left', 'rows', (SELECT count(*) FROM users)))
    FROM applied a LEFT JOIN per_target p ON p.key = a.account_id::uuid
    ON CONFLICT DO NOTHING
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
       (SELECT count(*) FROM notes_received)::int + (SELECT count(*) FROM notes_sent)::int AS notifications,
       (SELECT count(*) FROM friends_own)::int + (SELECT count(*) FROM friends_peer)::int AS friendships,
       (SELECT count(*) FROM ledger)::int AS archived,
       (SELECT count(*) FROM users)::int AS users,
       (SELECT count(*) FROM friends_counted)::int AS friends_counted,
       (SELECT count(*) FROM groups_counted)::int AS groups_counted,
       (SELECT count(*) FROM receipts)::int AS receipts,
       (SELECT count(*) FROM reminders)::int AS reminders;

-- name: seed_accounts
-- The registrations of the cohort named $1 ($2 players, seed.sql's ids, canonical), waiting at the
-- far-off deadline $3 until the benchmark registers them at their instant.
INSERT INTO accounts (account_id, renewal_deadline)
SELECT md5($1 || ':' || n)::uuid::text, $3 FROM generate_series(1, $2::int) n;

-- name: realm_autovacuum_off
-- As the service's tables (bench.cohort_cleanup.AUTOVACUUM_OFF): no vacuum of one run's dead
-- tuples in the middle of another; the benchmark vacuums between runs.
DO $$
DECLARE t regclass;
BEGIN
    FOR t IN SELECT c.oid::regclass FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = 'realm' AND c.relkind = 'r'
    LOOP
        EXECUTE format('ALTER TABLE %s SET (autovacuum_enabled = false)', t);
    END LOOP;
END $$;

-- name: spread_cohort
-- The game's registrations of the cohort waiting at $1: `set_deadline` (the contract function)
-- for each, its deadline spread uniformly over [$2, $2 + $3 seconds) in an order unrelated to the
-- IDs, in one statement (one transaction). Returns how many moved.
WITH ranked AS (
    SELECT account_id, row_number() OVER (ORDER BY md5(account_id)) - 1 AS k, count(*) OVER () AS n
    FROM accounts WHERE renewal_deadline = $1
)
SELECT count(*) FILTER (
           WHERE set_deadline(account_id, $2::timestamptz + make_interval(secs => k * $3::float8 / n),
                              allow_earlier => true) = 'moved')::int AS moved
FROM ranked;

-- name: window_pending
-- Accounts due in [$1, $2) not cleaned yet.
SELECT count(*)::int FROM accounts
WHERE renewal_deadline >= $1 AND renewal_deadline < $2 AND status <> 'cleaned';

-- name: window_lateness
-- cleaned_at - renewal_deadline of every account due in [$1, $2), in seconds.
SELECT count(*) FILTER (WHERE status = 'cleaned')::int AS cleaned,
       count(*) FILTER (WHERE status <> 'cleaned')::int AS not_cleaned,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY lateness) AS p50,
       percentile_cont(0.9) WITHIN GROUP (ORDER BY lateness) AS p90,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY lateness) AS p99,
       max(lateness) AS max
FROM (SELECT status, extract(epoch FROM cleaned_at - renewal_deadline)::float8 AS lateness
      FROM accounts WHERE renewal_deadline >= $1 AND renewal_deadline < $2) l;

-- name: cohort_ids
-- The canonical IDs of the cohort named $1 of $2 players.
SELECT array_agg(md5($1 || ':' || n)::uuid::text) FROM generate_series(1, $2::int) n;

-- name: lock_waits
-- This database's backends now: running a statement, and waiting for the follow-ups' advisory lock.
SELECT count(*) FILTER (WHERE state = 'active')::int AS active,
       count(*) FILTER (WHERE wait_event_type = 'Lock' AND wait_event = 'advisory')::int AS advisory
FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid();

-- name: database_clock
SELECT cleanup_clock();
