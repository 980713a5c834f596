-- Game data for the users $1 (uuid[]), set-based: 2 characters with 2 items each, 3 matches, and a
-- friendship with the next user of the list (the last with the first: each user is on both sides).
WITH u AS (
    SELECT id, n FROM unnest($1::uuid[]) WITH ORDINALITY AS u (id, n)
),
users AS (
    INSERT INTO game_server.users (id, username, email, profile)
    SELECT id, 'player_' || id, 'p_' || id || '@example.com', jsonb_build_object('bio', 'plays since ' || n)
    FROM u
    RETURNING id
),
chars AS (
    INSERT INTO game_server.characters (id, user_id, name, level)
    SELECT gen_random_uuid(), u.id, 'hero ' || c, c FROM u, generate_series(1, 2) c
    RETURNING id, user_id
),
items AS (
    INSERT INTO game_server.inventory (character_id, user_id, item, quantity)
    SELECT chars.id, chars.user_id, 'item ' || i, i FROM chars, generate_series(1, 2) i
    RETURNING 1
),
friends AS (
    INSERT INTO game_server.friends (user_a, user_b)
    SELECT a.id, b.id FROM u a JOIN u b ON b.n = a.n % (SELECT count(*) FROM u) + 1
    WHERE a.id <> b.id
    RETURNING 1
),
matches AS (
    INSERT INTO game_server.matches (user_id, played_at, kills, deaths)
    SELECT u.id, now() - make_interval(days => m), m * 3, m FROM u, generate_series(1, 3) m
    RETURNING 1
)
SELECT (SELECT count(*) FROM users) AS users, (SELECT count(*) FROM items) AS items,
       (SELECT count(*) FROM friends) AS friends, (SELECT count(*) FROM matches) AS matches
