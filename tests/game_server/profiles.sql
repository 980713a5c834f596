-- The game server as a real one grows: the users row holds the player's profile in a JSON document
-- (a real name, a birthday) that may not be NULL, and notifications are kept by recipient and by
-- sender, the sender's column without an index on a table far from tiny. $1: notification rows.
ALTER TABLE game_server.users ADD COLUMN metadata jsonb NOT NULL DEFAULT '{}';
ALTER TABLE game_server.users ALTER COLUMN metadata DROP DEFAULT;
UPDATE game_server.users
SET metadata = jsonb_build_object('name', 'Real Name ' || left(id::text, 8), 'birthday', '1990-04-0' || (1 + abs(hashtext(id::text)) % 9));

CREATE TABLE game_server.notifications (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    recipient_id  uuid NOT NULL,
    sender_id     uuid,
    body          text NOT NULL
);
CREATE INDEX notifications_recipient_idx ON game_server.notifications (recipient_id);
