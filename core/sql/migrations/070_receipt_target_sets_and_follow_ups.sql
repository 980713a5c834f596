-- The erasure receipt names the target set the account was cleaned with (its fingerprint) and the
-- sets that cleanup ran with before `retry-failed --with-current-targets` replaced them, and holds
-- the row counts of the declared follow-up statements of the account's batch:
-- [{"name": "recount_friend_edges", "phase": "before", "rows": 3, "batch_accounts": 2}, ...].
-- Names, fingerprints and counts only. Nullable without a default: no rewrite of the table; a
-- receipt written before says NULL (not recorded then).
ALTER TABLE erasure_receipts
    ADD COLUMN target_set text,
    ADD COLUMN replaced_target_sets text[],
    ADD COLUMN follow_ups jsonb;
