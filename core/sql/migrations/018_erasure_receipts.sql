-- The erasure receipt of an account: what its cleanup removed, per declared target, written by the
-- cleanup batch in the transaction that applies it (with the idempotency record, so once per
-- account and version). Names and counts only, no personal data; no foreign key, so it outlives
-- the account's data and the game's rows. `targets` is an array in declared order:
-- [{"target": "game.saves", "action": "delete", "rows": 2}, ...].
CREATE TABLE erasure_receipts (
    account_id       text NOT NULL,
    cleanup_version  integer NOT NULL,
    cleanup_id       text NOT NULL,
    targets          jsonb NOT NULL,
    recorded_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (account_id, cleanup_version)
);
