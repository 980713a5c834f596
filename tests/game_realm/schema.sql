-- The game realm: a game server's own schema (the game's migrations, never the service's), shaped
-- like a live multiplayer backend. Players are UUID-keyed; the users row is kept when a player is
-- cleaned (leaderboard history and other players' rows point at it) but nothing personal may stay
-- in it. Friendships are stored once per direction; each player counts its friends and each group
-- its members. A notification names its recipient and, when another player sent it, its sender:
-- the sender column deliberately has no index (the start-up check reports it, with the fix).
CREATE SCHEMA realm;

CREATE TABLE realm.users (
    id            uuid PRIMARY KEY,
    handle        text NOT NULL UNIQUE,          -- shown to other players
    login         text NOT NULL UNIQUE,          -- what the player signs in with
    email         text UNIQUE,
    profile       jsonb NOT NULL,                -- real name, birthday, locale
    friend_count  integer NOT NULL DEFAULT 0 CONSTRAINT users_friend_count_not_negative CHECK (friend_count >= 0),
    created_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE realm.devices (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id     uuid NOT NULL REFERENCES realm.users ON DELETE CASCADE,
    platform    text NOT NULL,
    push_token  text NOT NULL
);
CREATE INDEX devices_user_idx ON realm.devices (user_id);

CREATE TABLE realm.storage_objects (        -- saves and settings: (collection, key) per player
    user_id     uuid NOT NULL REFERENCES realm.users ON DELETE CASCADE,
    collection  text NOT NULL,
    key         text NOT NULL,
    value       jsonb NOT NULL,
    PRIMARY KEY (user_id, collection, key)
);

CREATE TABLE realm.friendships (             -- one row per direction
    owner_id  uuid NOT NULL REFERENCES realm.users ON DELETE CASCADE,
    peer_id   uuid NOT NULL REFERENCES realm.users ON DELETE CASCADE,
    state     smallint NOT NULL DEFAULT 0,
    PRIMARY KEY (owner_id, peer_id)
);
CREATE INDEX friendships_peer_idx ON realm.friendships (peer_id);

CREATE TABLE realm.channels (                 -- no personal data: never a target
    id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    label  text NOT NULL
);

CREATE TABLE realm.messages (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    channel_id bigint NOT NULL REFERENCES realm.channels,
    sender_id  uuid NOT NULL,
    body       text NOT NULL,
    sent_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX messages_sender_idx ON realm.messages (sender_id);

CREATE TABLE realm.notifications (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    recipient_id  uuid NOT NULL,
    sender_id     uuid,                          -- another player, or NULL for the game; no index
    content       jsonb NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX notifications_recipient_idx ON realm.notifications (recipient_id);

CREATE TABLE realm.wallet_ledger (
    id          uuid PRIMARY KEY,
    user_id     uuid NOT NULL,
    changeset   jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX wallet_ledger_user_idx ON realm.wallet_ledger (user_id);
CREATE TABLE realm.wallet_ledger_archive (LIKE realm.wallet_ledger INCLUDING ALL);

CREATE TABLE realm.leaderboards (
    id          text PRIMARY KEY,
    sort_order  smallint NOT NULL DEFAULT 1
);

CREATE TABLE realm.leaderboard_records (
    leaderboard_id  text NOT NULL REFERENCES realm.leaderboards,
    owner_id        uuid NOT NULL,
    handle          text NOT NULL,               -- the player's handle when the score was set
    score           bigint NOT NULL,
    PRIMARY KEY (leaderboard_id, owner_id)
);
CREATE INDEX leaderboard_records_owner_idx ON realm.leaderboard_records (owner_id);

CREATE TABLE realm.groups (
    id            uuid PRIMARY KEY,
    name          text NOT NULL,
    member_count  integer NOT NULL DEFAULT 0 CONSTRAINT groups_member_count_not_negative CHECK (member_count >= 0)
);

CREATE TABLE realm.group_members (
    group_id  uuid NOT NULL REFERENCES realm.groups ON DELETE CASCADE,
    user_id   uuid NOT NULL REFERENCES realm.users ON DELETE CASCADE,
    role      smallint NOT NULL DEFAULT 2,
    PRIMARY KEY (group_id, user_id)
);
CREATE INDEX group_members_user_idx ON realm.group_members (user_id);

CREATE TABLE realm.purchases (                 -- store receipts: kept, the buyer pseudonymized
    id             uuid PRIMARY KEY,
    user_id        uuid NOT NULL,
    buyer_ref      text NOT NULL,              -- the store's customer reference
    product        text NOT NULL,
    price_cents    integer NOT NULL
);
CREATE INDEX purchases_user_idx ON realm.purchases (user_id);
