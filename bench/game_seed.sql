-- Seeding of the game-server benchmark (bench/game_schema.py): its cohorts written into the game's
-- own schema (tests/game_server/schema.sql) by one INSERT ... SELECT generate_series per table, the
-- same data per user as the tests' seed (tests/game_server/seed.sql): 2 characters with 2 items
-- each, 3 matches, a friendship with the next user of its cohort (the last with the first). User k
-- of cohort c (1-based, c of $1 the cohorts' deadlines, k up to $2 users per cohort) has the UUID
-- md5('user:c:k'), a character's UUID md5('user:c:k:ch'): each table computes the keys it refers
-- to instead of reading them back, and the keys come in random order, as UUIDs do.

-- name: seed_users
INSERT INTO game_server.users (id, username, email, profile)
SELECT u.id, 'player_' || u.id, 'p_' || u.id || '@example.com', jsonb_build_object('bio', 'plays since ' || k)
FROM generate_series(1, cardinality($1::timestamptz[])) c, generate_series(1, $2::int) k,
     LATERAL (SELECT md5('user:' || c || ':' || k)::uuid AS id) u;

-- name: seed_accounts
-- Each user registered as an account of its cohort's deadline (a benchmark's seeding, not the
-- game's contract), in account order: the primary key and the deadline indexes fill page by page.
INSERT INTO accounts (account_id, renewal_deadline)
SELECT id, deadline
FROM (
    SELECT md5('user:' || c || ':' || k)::uuid::text AS id, ($1::timestamptz[])[c] AS deadline
    FROM generate_series(1, cardinality($1::timestamptz[])) c, generate_series(1, $2::int) k
) u
ORDER BY id;

-- name: seed_characters
INSERT INTO game_server.characters (id, user_id, name, level)
SELECT md5('user:' || c || ':' || k || ':' || ch)::uuid, md5('user:' || c || ':' || k)::uuid, 'hero ' || ch, ch
FROM generate_series(1, cardinality($1::timestamptz[])) c, generate_series(1, $2::int) k,
     generate_series(1, 2) ch;

-- name: seed_inventory
INSERT INTO game_server.inventory (character_id, user_id, item, quantity)
SELECT md5('user:' || c || ':' || k || ':' || ch)::uuid, md5('user:' || c || ':' || k)::uuid, 'item ' || i, i
FROM generate_series(1, cardinality($1::timestamptz[])) c, generate_series(1, $2::int) k,
     generate_series(1, 2) ch, generate_series(1, 2) i;

-- name: seed_friends
-- User k's friendship with user k % n + 1 of its cohort (none in a cohort of one user).
INSERT INTO game_server.friends (user_a, user_b)
SELECT md5('user:' || c || ':' || k)::uuid, md5('user:' || c || ':' || (k % $2::int + 1))::uuid
FROM generate_series(1, cardinality($1::timestamptz[])) c, generate_series(1, $2::int) k
WHERE $2::int > 1;

-- name: seed_matches
INSERT INTO game_server.matches (user_id, played_at, kills, deaths)
SELECT md5('user:' || c || ':' || k)::uuid, now() - make_interval(days => m), m * 3, m
FROM generate_series(1, cardinality($1::timestamptz[])) c, generate_series(1, $2::int) k,
     generate_series(1, 3) m;

-- name: game_keys
-- The game schema's primary keys, unique constraints and foreign keys ($1 its name), with their
-- definitions: dropped before the load and added back after it (an index built once over the
-- loaded rows; a foreign key checked by one query, not by a trigger per row). Foreign keys first
-- (they depend on the keys they reference); add them back in the reverse order.
SELECT c.conrelid::regclass::text AS table_name, c.conname::text AS name, pg_get_constraintdef(c.oid) AS definition
FROM pg_constraint c
WHERE c.connamespace = $1::regnamespace AND c.contype IN ('f', 'p', 'u')
ORDER BY c.contype = 'f' DESC, c.conrelid::regclass::text, c.conname;

-- name: game_indexes
-- The game schema's other indexes ($1 its name): dropped before the load, built after it.
SELECT i.indexrelid::regclass::text AS name, pg_get_indexdef(i.indexrelid) AS definition
FROM pg_index i JOIN pg_class t ON t.oid = i.indrelid
WHERE t.relnamespace = $1::regnamespace
  AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid AND c.contype IN ('p', 'u', 'x'))
ORDER BY 1;

-- name: game_autovacuum_off
-- No autovacuum on the game schema's tables either, as on the service's (`AUTOVACUUM_OFF`; the
-- benchmark vacuums before each run): an autovacuum never lands in the middle of a timed run.
DO $$
DECLARE t regclass;
BEGIN
    FOR t IN SELECT c.oid::regclass FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = 'game_server' AND c.relkind = 'r'
    LOOP
        EXECUTE format('ALTER TABLE %s SET (autovacuum_enabled = false)', t);
    END LOOP;
END $$;
