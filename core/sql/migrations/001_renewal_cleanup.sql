-- Accounts, the game data that cleanup targets, and the bookkeeping that makes cleanup
-- exactly-once in effect: claims (the linearization point), the idempotency record, the outbox.

CREATE TABLE accounts (
    account_id        text PRIMARY KEY CHECK (account_id ~ '^acct_[A-Za-z0-9_-]{1,60}$'),
    game              text NOT NULL DEFAULT 'arena',
    renewal_deadline  timestamptz NOT NULL,
    status            text NOT NULL DEFAULT 'active'
                      CHECK (status IN ('active', 'renewed', 'cleaning', 'cleaned')),
    cleanup_version   integer NOT NULL DEFAULT 1,
    renewed_at        timestamptz,
    claimed_by        text,
    claimed_at        timestamptz,
    cleaned_at        timestamptz
);
CREATE INDEX accounts_cohort_idx ON accounts (renewal_deadline) WHERE status IN ('active', 'renewed');

-- Every renewal attempt, including the ones that came too late: late renewals are reported, not lost.
CREATE TABLE renewals (
    renewal_id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account_id        text NOT NULL REFERENCES accounts,
    requested_at      timestamptz NOT NULL DEFAULT now(),
    outcome           text NOT NULL CHECK (outcome IN ('in_time', 'too_late')),
    new_deadline      timestamptz,
    version_after     integer NOT NULL,
    status_seen       text NOT NULL
);
CREATE INDEX renewals_account_idx ON renewals (account_id);

-- Game data owned by an account: what cleanup removes (see core/cleanup_targets.toml).
CREATE TABLE cloud_saves (
    account_id  text NOT NULL REFERENCES accounts,
    slot        smallint NOT NULL,
    saved_at    timestamptz NOT NULL DEFAULT now(),
    size_bytes  integer NOT NULL,
    checksum    text NOT NULL,
    PRIMARY KEY (account_id, slot)
);

CREATE TABLE inventory_items (
    account_id  text NOT NULL REFERENCES accounts,
    item_id     text NOT NULL,
    quantity    integer NOT NULL CHECK (quantity >= 0),
    acquired_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id, item_id)
);

CREATE TABLE match_history (
    match_id    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account_id  text NOT NULL REFERENCES accounts,
    played_at   timestamptz NOT NULL,
    mode        text NOT NULL,
    result      text NOT NULL CHECK (result IN ('win', 'loss', 'draw')),
    score       integer NOT NULL
);
CREATE INDEX match_history_account_idx ON match_history (account_id);

-- Match history is kept for anti-cheat audits, so cleanup moves it here instead of deleting it.
CREATE TABLE match_history_archive (
    match_id    bigint PRIMARY KEY,
    account_id  text NOT NULL,
    played_at   timestamptz NOT NULL,
    mode        text NOT NULL,
    result      text NOT NULL,
    score       integer NOT NULL,
    archived_at timestamptz NOT NULL DEFAULT now()
);

-- The claim: which cleanup took responsibility for which account, at which version, in which partition.
CREATE TABLE cleanup_claims (
    cleanup_id       text NOT NULL,
    account_id       text NOT NULL REFERENCES accounts,
    claimed_version  integer NOT NULL,
    partition_no     integer NOT NULL,
    PRIMARY KEY (cleanup_id, partition_no, account_id)
);

-- The idempotency record: one cleanup effect per (account, version), whoever runs it and how often.
CREATE TABLE cleanup_applied (
    account_id       text NOT NULL,
    cleanup_version  integer NOT NULL,
    cleanup_id       text NOT NULL,
    partition_no     integer NOT NULL,
    applied_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT cleanup_applied_once UNIQUE (account_id, cleanup_version)
);
CREATE INDEX cleanup_applied_cleanup_idx ON cleanup_applied (cleanup_id);

-- Per-partition report, written when a partition finishes: the join is visible in the database too.
CREATE TABLE cleanup_partition_reports (
    cleanup_id       text NOT NULL,
    partition_no     integer NOT NULL,
    reported_at      timestamptz NOT NULL DEFAULT now(),
    cleaned          integer NOT NULL,
    skipped_renewed  integer NOT NULL,
    skipped_stale    integer NOT NULL,
    already_applied  integer NOT NULL,
    PRIMARY KEY (cleanup_id, partition_no)
);

-- One row per cleanup, written exactly once by the settlement step.
CREATE TABLE cleanup_settlements (
    cleanup_id        text PRIMARY KEY,
    deadline          timestamptz NOT NULL,
    account_id        text,
    partitions        integer NOT NULL,
    claimed           integer NOT NULL,
    cleaned           integer NOT NULL,
    reminders         integer NOT NULL,
    skipped_renewed   integer NOT NULL,
    skipped_stale     integer NOT NULL,
    already_applied   integer NOT NULL,
    settled_at        timestamptz NOT NULL DEFAULT now()
);

-- Transactional outbox: written in the cleanup's own transaction, delivered by a relay later.
CREATE TABLE outbox (
    event_id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_key     text NOT NULL UNIQUE,
    kind          text NOT NULL,
    account_id    text NOT NULL,
    source_id     text NOT NULL,
    payload       jsonb NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    status        text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'delivered', 'dead')),
    attempts      integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    delivered_at  timestamptz,
    last_error    text
);
CREATE INDEX outbox_source_idx ON outbox (source_id);
CREATE INDEX outbox_pending_idx ON outbox (next_attempt_at) WHERE status = 'pending';
