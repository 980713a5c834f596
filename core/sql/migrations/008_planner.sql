-- The deadline planner: every account whose deadline passes is cleaned (or renewed)
-- with nobody running a command. Indexes for the planner's bounded scans, the chunked claim's
-- progress (so a retried claim resumes where its last COMMIT left it), and the planner's record
-- of what the safety net did (overdue accounts swept, stranded claims recovered).

-- The database clock of the renewal rule: clock_timestamp(). The offset exists only for tests
-- that skip Temporal's time (the time-skipping server cannot skip the database's clock); nothing
-- in production sets `cleanup.clock_offset`.
CREATE FUNCTION cleanup_clock() RETURNS timestamptz LANGUAGE sql VOLATILE AS $$
    SELECT clock_timestamp()
           + coalesce(nullif(current_setting('cleanup.clock_offset', true), '')::interval, interval '0')
$$;

-- The chunked claim's keyset (renewal_deadline, account_id) over a cohort's active and renewed
-- accounts (renewed ones are counted as skipped): each chunk walks the next rows of this index.
CREATE INDEX accounts_due_idx ON accounts (renewal_deadline, account_id) WHERE status IN ('active', 'renewed');
-- The planner's skip scan over upcoming deadlines and the overdue sweep: active accounts only, so
-- accounts renewed for good (which keep their old deadline) never slow them down.
CREATE INDEX accounts_active_due_idx ON accounts (renewal_deadline, account_id) WHERE status = 'active';
-- Superseded by the two above (same leading column): one index less to write on every claim.
DROP INDEX IF EXISTS accounts_cohort_idx;

-- Stranded-claim recovery: the distinct claiming workflows of accounts still in 'cleaning'.
CREATE INDEX accounts_cleaning_idx ON accounts (claimed_by) WHERE status = 'cleaning';

-- Lateness of recent cleanups (cleaned_at - renewal_deadline) for `planner status` and the histogram.
CREATE INDEX accounts_cleaned_at_idx ON accounts (cleaned_at) WHERE status = 'cleaned';

-- When the database judged a renewal (clock_timestamp() inside the renewal's transaction): the
-- renewal rule is "in time iff judged before the account's deadline", and this makes it checkable.
ALTER TABLE renewals ADD COLUMN judged_at timestamptz;
ALTER TABLE renewals ADD COLUMN deadline_seen timestamptz;

-- One row per chunked claim: the keyset cursor and the counts, updated in each chunk's transaction.
CREATE TABLE cleanup_claim_progress (
    cleanup_id            text PRIMARY KEY,
    deadline_from         timestamptz NOT NULL,
    deadline_until        timestamptz NOT NULL,
    cursor_deadline       timestamptz NOT NULL DEFAULT '-infinity',
    cursor_account        text NOT NULL DEFAULT '',
    claimed_per_partition integer[] NOT NULL,
    skipped_renewed       integer NOT NULL DEFAULT 0,
    chunks                integer NOT NULL DEFAULT 0,
    max_chunk_rows        integer NOT NULL DEFAULT 0,
    done                  boolean NOT NULL DEFAULT false,
    updated_at            timestamptz NOT NULL DEFAULT now()
);
-- Claims in progress: the sweep leaves their ranges to them.
CREATE INDEX cleanup_claim_progress_busy_idx ON cleanup_claim_progress (updated_at) WHERE NOT done;

-- What the planner's safety net did: 'overdue' (active accounts past their deadline handed to a
-- sweep cleanup) and 'stranded' (claims of a closed workflow released for re-claiming).
CREATE TABLE planner_sweeps (
    sweep_id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind         text NOT NULL CHECK (kind IN ('overdue', 'stranded')),
    cleanup_id   text NOT NULL,
    accounts     integer NOT NULL,
    oldest_deadline timestamptz,
    swept_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX planner_sweeps_kind_idx ON planner_sweeps (kind, swept_at);
