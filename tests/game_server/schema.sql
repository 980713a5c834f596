-- A game server's own schema, of our own making, shaped like a real one: its own schema name, UUID
-- keys, foreign keys with ON DELETE CASCADE, a friends table keyed by two user columns, a users row
-- that stays but loses its personal data, and an archive made with LIKE ... INCLUDING ALL (which
-- copies the identity and the generated column).
CREATE SCHEMA game_server;

CREATE TABLE game_server.users (
    id          uuid PRIMARY KEY,
    username    text NOT NULL UNIQUE,
    email       text UNIQUE,
    profile     jsonb,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE game_server.characters (
    id       uuid PRIMARY KEY,
    user_id  uuid NOT NULL REFERENCES game_server.users ON DELETE CASCADE,
    name     text NOT NULL,
    level    integer NOT NULL DEFAULT 1,
    UNIQUE (id, user_id)
);
CREATE INDEX characters_user_idx ON game_server.characters (user_id);

-- Items belong to a character, and through it to a user: the composite foreign key says so.
CREATE TABLE game_server.inventory (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    character_id  uuid NOT NULL,
    user_id       uuid NOT NULL,
    item          text NOT NULL,
    quantity      integer NOT NULL CHECK (quantity >= 0),
    FOREIGN KEY (character_id, user_id) REFERENCES game_server.characters (id, user_id) ON DELETE CASCADE
);
CREATE INDEX inventory_user_idx ON game_server.inventory (user_id);

CREATE TABLE game_server.friends (
    user_a  uuid NOT NULL REFERENCES game_server.users ON DELETE CASCADE,
    user_b  uuid NOT NULL REFERENCES game_server.users ON DELETE CASCADE,
    since   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (user_a, user_b),
    CHECK (user_a <> user_b)
);
CREATE INDEX friends_user_b_idx ON game_server.friends (user_b);

CREATE TABLE game_server.matches (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id    uuid NOT NULL REFERENCES game_server.users ON DELETE CASCADE,
    played_at  timestamptz NOT NULL,
    kills      integer NOT NULL,
    deaths     integer NOT NULL,
    ratio      numeric GENERATED ALWAYS AS (kills::numeric / greatest(deaths, 1)) STORED
);
CREATE INDEX matches_user_idx ON game_server.matches (user_id);

CREATE TABLE game_server.matches_archive (LIKE game_server.matches INCLUDING ALL);
