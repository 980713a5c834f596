-- The demo game's own tables, in a schema of their own: the data cleanup removes (cleanup/targets.toml
-- names them schema-qualified). A game's tables are never part of the service's migrations and
-- have no foreign key into the service's schema; `migrate --demo-game`, the demo, tests, harness and
-- benchmarks create them (cleanup.grants.create_demo_game). Idempotent.

-- name: create_game_schema
CREATE SCHEMA IF NOT EXISTS demo_game;

CREATE TABLE IF NOT EXISTS demo_game.cloud_saves (
    account_id  text NOT NULL,
    slot        smallint NOT NULL,
    saved_at    timestamptz NOT NULL DEFAULT now(),
    size_bytes  integer NOT NULL,
    checksum    text NOT NULL,
    PRIMARY KEY (account_id, slot)
);

CREATE TABLE IF NOT EXISTS demo_game.inventory_items (
    account_id  text NOT NULL,
    item_id     text NOT NULL,
    quantity    integer NOT NULL CHECK (quantity >= 0),
    acquired_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id, item_id)
);

CREATE TABLE IF NOT EXISTS demo_game.match_history (
    match_id    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account_id  text NOT NULL,
    played_at   timestamptz NOT NULL,
    mode        text NOT NULL,
    result      text NOT NULL CHECK (result IN ('win', 'loss', 'draw')),
    score       integer NOT NULL
);
CREATE INDEX IF NOT EXISTS match_history_account_idx ON demo_game.match_history (account_id);

-- Match history is kept for anti-cheat audits, so cleanup moves it here instead of deleting it.
CREATE TABLE IF NOT EXISTS demo_game.match_history_archive (
    match_id    bigint PRIMARY KEY,
    account_id  text NOT NULL,
    played_at   timestamptz NOT NULL,
    mode        text NOT NULL,
    result      text NOT NULL,
    score       integer NOT NULL,
    archived_at timestamptz NOT NULL DEFAULT now()
);

-- The worker role reaches these tables one by one (never a whole schema), as a game's
-- administrator grants what its declared targets need (`starter.py migrate` does the same).
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'cleanup_worker') THEN
        GRANT USAGE ON SCHEMA demo_game TO cleanup_worker;
        GRANT SELECT, INSERT, DELETE ON TABLE demo_game.cloud_saves, demo_game.inventory_items,
            demo_game.match_history, demo_game.match_history_archive TO cleanup_worker;
    END IF;
END
$$;
