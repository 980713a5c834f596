-- Accounts (the game's own account IDs with their renewal deadlines) and the bookkeeping that makes
-- cleanup exactly-once in effect: claims (the linearization point), the idempotency record, the
-- outbox. The game's data is not here: cleanup reaches it through the declared targets.

CREATE TABLE accounts (
    -- The game's own key, printed as text (text, UUID or bigint): any printable string of 1-200
    -- characters. No control characters, so an ID never breaks a log line or a report.
    account_id        text PRIMARY KEY
                      CHECK (length(account_id) BETWEEN 1 AND 200 AND account_id !~ '[[:cntrl:]]'),
    game              text NOT NULL DEFAULT 'arena',
    renewal_deadline  timestamptz NOT NULL,
    status            text NOT NULL DEFAULT 'active'
                      CHECK (status IN ('active', 'renewed', 'cleaning', 'cleaned', 'cleanup_failed')),
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
