-- name: seed_others
-- The realm's other players ($1 of them, named by the population $2): never cleaned, each the
-- friend of some cleaned players; $3 groups they lead; $4 notifications the game broadcast to them
-- (the notifications table is not tiny, so the sender's missing index is reported).
WITH others AS (
    INSERT INTO realm.users (id, handle, login, email, profile)
    SELECT md5($2 || ':' || n)::uuid, $2 || '_' || n, 'login_' || $2 || '_' || n, $2 || n || '@mail.example',
           jsonb_build_object('name', 'Other Player ' || n, 'birthday', '1985-02-0' || (n % 9 + 1))
    FROM generate_series(1, $1::int) n
    RETURNING id
),
channel AS (
    INSERT INTO realm.channels (label) VALUES ('global') RETURNING id
),
boards AS (
    INSERT INTO realm.leaderboards (id) VALUES ('weekly'), ('all_time') RETURNING id
),
groups AS (
    INSERT INTO realm.groups (id, name)
    SELECT md5($2 || ':group:' || g)::uuid, 'guild ' || g FROM generate_series(1, $3::int) g
    RETURNING id
),
broadcast AS (
    INSERT INTO realm.notifications (recipient_id, content)
    SELECT md5($2 || ':' || (b % $1::int + 1))::uuid, '{"text": "season starts"}'::jsonb
    FROM generate_series(1, $4::int) b
    RETURNING 1
)
SELECT (SELECT count(*) FROM others)::int AS users, (SELECT count(*) FROM groups)::int AS groups,
       (SELECT count(*) FROM channel)::int + (SELECT count(*) FROM boards)::int AS fixed,
       (SELECT count(*) FROM broadcast)::int AS broadcast;

-- name: seed_players
-- $2 players of the cohort named $1 (ids md5($1 || ':' || n)), each with a profile holding a real
-- name and birthday, a device, two storage objects, a message, two ledger entries, a leaderboard
-- record, a purchase, a membership of one of the $5 groups of population $3 ($4 players); a
-- friendship (both directions) with the next player of the cohort and one with a player of $3; a
-- notification from the next player, one from the game, and one sent to that other player.
WITH p AS (
    SELECT n, md5($1 || ':' || n)::uuid AS id, md5($1 || ':' || (n % $2::int + 1))::uuid AS next_id,
           md5($3 || ':' || (n % $4::int + 1))::uuid AS other_id,
           md5($3 || ':group:' || (n % $5::int + 1))::uuid AS group_id
    FROM generate_series(1, $2::int) n
),
users AS (
    INSERT INTO realm.users (id, handle, login, email, profile)
    SELECT id, $1 || '_' || n, 'login_' || $1 || '_' || n, $1 || n || '@mail.example',
           jsonb_build_object('name', 'Real Name ' || n, 'birthday', '1990-04-0' || (n % 9 + 1), 'locale', 'de')
    FROM p RETURNING 1
),
devices AS (
    INSERT INTO realm.devices (user_id, platform, push_token) SELECT id, 'ios', 'apns-' || md5(id::text) FROM p
    RETURNING 1
),
storage AS (
    INSERT INTO realm.storage_objects (user_id, collection, key, value)
    SELECT id, 'saves', 'slot' || s, jsonb_build_object('level', s) FROM p, generate_series(1, 2) s
    RETURNING 1
),
friends AS (
    INSERT INTO realm.friendships (owner_id, peer_id)
    SELECT a, b FROM p, LATERAL (VALUES (id, next_id), (next_id, id), (id, other_id), (other_id, id)) e (a, b)
    WHERE next_id <> id
    ON CONFLICT DO NOTHING
    RETURNING 1
),
messages AS (
    INSERT INTO realm.messages (channel_id, sender_id, body)
    SELECT (SELECT min(id) FROM realm.channels), id, 'gg from ' || n FROM p RETURNING 1
),
notes AS (
    INSERT INTO realm.notifications (recipient_id, sender_id, content)
    SELECT r, s, c FROM p, LATERAL (VALUES (id, next_id, '{"text": "gift"}'::jsonb),
                                           (id, NULL::uuid, '{"text": "welcome"}'::jsonb),
                                           (other_id, id, '{"text": "invite"}'::jsonb)) x (r, s, c)
    RETURNING 1
),
ledger AS (
    INSERT INTO realm.wallet_ledger (id, user_id, changeset)
    SELECT md5($1 || ':ledger:' || n || ':' || k)::uuid, id, jsonb_build_object('coins', k * 10)
    FROM p, generate_series(1, 2) k
    RETURNING 1
),
records AS (
    INSERT INTO realm.leaderboard_records (leaderboard_id, owner_id, handle, score)
    SELECT 'weekly', id, $1 || '_' || n, n FROM p RETURNING 1
),
purchases AS (
    INSERT INTO realm.purchases (id, user_id, buyer_ref, product, price_cents)
    SELECT md5($1 || ':buy:' || n)::uuid, id, 'cus_' || md5(id::text), 'gem pack', 499 FROM p RETURNING 1
),
members AS (
    INSERT INTO realm.group_members (group_id, user_id) SELECT group_id, id FROM p RETURNING 1
)
SELECT (SELECT count(*) FROM users)::int AS users, (SELECT count(*) FROM friends)::int AS friendships,
       (SELECT count(*) FROM notes)::int AS notifications, (SELECT count(*) FROM members)::int AS memberships,
       (SELECT count(*) FROM devices)::int + (SELECT count(*) FROM storage)::int + (SELECT count(*) FROM messages)::int
       + (SELECT count(*) FROM ledger)::int + (SELECT count(*) FROM records)::int
       + (SELECT count(*) FROM purchases)::int AS other_rows;

-- name: recount
-- Every counter as the game keeps it: friends per player, members per group.
UPDATE realm.users u SET friend_count = f.n
FROM (SELECT owner_id, count(*)::int AS n FROM realm.friendships GROUP BY owner_id) f
WHERE u.id = f.owner_id AND u.friend_count <> f.n;
UPDATE realm.groups g SET member_count = m.n
FROM (SELECT group_id, count(*)::int AS n FROM realm.group_members GROUP BY group_id) m
WHERE g.id = m.group_id AND g.member_count <> m.n;

-- name: wrong_counters
-- Players and groups whose counter is not what their rows say.
SELECT (SELECT count(*) FROM realm.users u
        WHERE friend_count <> (SELECT count(*) FROM realm.friendships f WHERE f.owner_id = u.id))::int AS players,
       (SELECT count(*) FROM realm.groups g
        WHERE member_count <> (SELECT count(*) FROM realm.group_members m WHERE m.group_id = g.id))::int AS groups;

-- name: personal_left
-- What of the players $1 (text[]) is left: rows in the live tables, and kept rows whose personal
-- columns still hold a value the player gave (a random replacement reads anon-<uuid>; the store's
-- reference cus_<md5>, its keyed hash 64 hex characters).
SELECT (SELECT count(*) FROM realm.users u WHERE u.id = ANY($1::uuid[])
          AND (u.email IS NOT NULL OR u.profile <> '{}' OR u.handle NOT LIKE 'anon-%' OR u.login NOT LIKE 'anon-%'))::int
         AS users_personal,
       (SELECT count(*) FROM realm.purchases WHERE user_id = ANY($1::uuid[]) AND buyer_ref LIKE 'cus_%')::int
         AS purchases_personal,
       (SELECT count(*) FROM realm.notifications
        WHERE recipient_id = ANY($1::uuid[]) OR sender_id = ANY($1::uuid[]))::int AS notifications,
       (SELECT count(*) FROM realm.friendships
        WHERE owner_id = ANY($1::uuid[]) OR peer_id = ANY($1::uuid[]))::int AS friendships,
       (SELECT count(*) FROM realm.messages WHERE sender_id = ANY($1::uuid[]))::int AS messages,
       (SELECT count(*) FROM realm.devices WHERE user_id = ANY($1::uuid[]))::int AS devices,
       (SELECT count(*) FROM realm.storage_objects WHERE user_id = ANY($1::uuid[]))::int AS storage_objects,
       (SELECT count(*) FROM realm.leaderboard_records WHERE owner_id = ANY($1::uuid[]))::int AS leaderboard_records,
       (SELECT count(*) FROM realm.group_members WHERE user_id = ANY($1::uuid[]))::int AS memberships,
       (SELECT count(*) FROM realm.wallet_ledger WHERE user_id = ANY($1::uuid[]))::int AS ledger,
       (SELECT count(*) FROM realm.wallet_ledger_archive WHERE user_id = ANY($1::uuid[]))::int AS archived;
