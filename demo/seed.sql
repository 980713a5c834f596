-- Realistic game data for demos, tests and benchmarks, generated server-side in one statement:
-- the demo game's rows (demo_game) and their accounts' deadlines (the service's accounts).

-- name: seed_accounts
-- $1 id prefix, $2 game, $3 renewal deadline, $4 number of accounts, $5 saves, $6 items, $7 matches
WITH acc AS (
    INSERT INTO accounts (account_id, game, renewal_deadline)
    SELECT 'acct_' || $1 || '_' || lpad(g::text, 7, '0'), $2, $3
    FROM generate_series(1, $4::int) g
    ON CONFLICT (account_id) DO NOTHING
    RETURNING account_id
),
saves AS (
    INSERT INTO demo_game.cloud_saves (account_id, slot, size_bytes, checksum)
    SELECT account_id, s, 4096 + (abs(hashtext(account_id || s)) % 60000), md5(account_id || s)
    FROM acc CROSS JOIN generate_series(1, $5::int) s
    RETURNING 1
),
items AS (
    INSERT INTO demo_game.inventory_items (account_id, item_id, quantity)
    SELECT account_id, 'item_' || i, 1 + abs(hashtext(account_id || i)) % 99
    FROM acc CROSS JOIN generate_series(1, $6::int) i
    RETURNING 1
),
matches AS (
    INSERT INTO demo_game.match_history (account_id, played_at, mode, result, score)
    SELECT account_id, $3 - make_interval(hours => m * 7),
           (ARRAY['ranked', 'casual', 'arena'])[1 + m % 3],
           (ARRAY['win', 'loss', 'draw'])[1 + abs(hashtext(account_id || m)) % 3],
           abs(hashtext(account_id || m)) % 5000
    FROM acc CROSS JOIN generate_series(1, $7::int) m
    RETURNING 1
)
SELECT (SELECT count(*) FROM acc)::int AS accounts,
       (SELECT count(*) FROM saves)::int AS cloud_saves,
       (SELECT count(*) FROM items)::int AS inventory_items,
       (SELECT count(*) FROM matches)::int AS match_history;
