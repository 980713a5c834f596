-- One bad account never blocks a cohort (issue 14).
--
-- An account whose cleanup fails deterministically (a constraint, a trigger that raises, a value
-- the archive table refuses) is isolated from its batch and recorded here, with no partial effect
-- on it; every other account of the batch is cleaned normally. The row is keyed like the
-- idempotency record, (account_id, cleanup_version): a retry after a fix cleans it at most once.
CREATE TABLE cleanup_failed (
    account_id       text NOT NULL REFERENCES accounts,
    cleanup_version  integer NOT NULL,
    cleanup_id       text NOT NULL,
    partition_no     integer NOT NULL,
    target           text,                 -- the declared target table, when it can be told
    sqlstate         text NOT NULL,
    message          text NOT NULL,        -- the database's own message
    detail           text,                 -- its DETAIL, when it has one
    failed_at        timestamptz NOT NULL DEFAULT now(),
    attempts         integer NOT NULL DEFAULT 1,
    resolved_at      timestamptz,
    resolution       text CHECK (resolution IN ('cleaned', 'renewed', 'stale')),
    PRIMARY KEY (account_id, cleanup_version)
);
CREATE INDEX cleanup_failed_cleanup_idx ON cleanup_failed (cleanup_id) WHERE resolved_at IS NULL;

-- A failed account is 'cleanup_failed' (a status of accounts since 001): still claimed by its
-- cleanup (retry-failed may clean it), and renewable like an active account (a renewal bumps its
-- version, so the failure goes stale).
ALTER TABLE cleanup_partition_reports ADD COLUMN failed integer NOT NULL DEFAULT 0;
ALTER TABLE cleanup_settlements ADD COLUMN failed integer NOT NULL DEFAULT 0;
