-- The game server's derived state: friendships stored in both directions with a per-user
-- edge_count (the user's friends), and groups with a per-group edge_count (their members). Each
-- counter may not go negative, so a follow-up that decrements one twice fails where it happens.
ALTER TABLE game_server.users ADD COLUMN edge_count integer NOT NULL DEFAULT 0
    CONSTRAINT users_edge_count_not_negative CHECK (edge_count >= 0);

CREATE TABLE game_server.groups (
    id          uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name        text NOT NULL,
    edge_count  integer NOT NULL DEFAULT 0 CONSTRAINT groups_edge_count_not_negative CHECK (edge_count >= 0)
);

CREATE TABLE game_server.group_members (
    group_id  uuid NOT NULL REFERENCES game_server.groups ON DELETE CASCADE,
    user_id   uuid NOT NULL REFERENCES game_server.users ON DELETE CASCADE,
    PRIMARY KEY (group_id, user_id)
);
CREATE INDEX group_members_user_idx ON game_server.group_members (user_id);
