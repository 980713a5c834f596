-- Outbox delivery: only real failures count toward dead-lettering. Additive only.
--
-- `attempts` keeps counting claims (every send that was started or planned, including 429 answers
-- and rows released unsent because the lease ran short). `failures` counts only the answers that
-- say the provider or the path to it is broken (5xx, 408, 401/403, timeouts, broken connections);
-- it is what `max_attempts` is compared with. `failure_counts` keeps them by kind, e.g.
-- {"503": 20, "timeout": 5}, so a dead letter says which failures it counted.
--
-- `recorded_by` is the lease owner whose outcome was recorded last. A relay that lost its database
-- connection right after COMMIT runs record_outcomes again; rows it finds recorded by its
-- own owner are counted as its outcomes again instead of as "fenced", so the totals stay exact.
ALTER TABLE outbox
    ADD COLUMN failures       integer NOT NULL DEFAULT 0,
    ADD COLUMN failure_counts jsonb   NOT NULL DEFAULT '{}'::jsonb,
    ADD COLUMN recorded_by    text;
