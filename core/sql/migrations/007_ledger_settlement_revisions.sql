-- Late data is a normal night. A date's settlement is revised, never overwritten in
-- place without a trace: each settlement of a date is a revision (1, 2, ...) with its totals,
-- what changed since the previous revision and why. `ledger_settlements` keeps one row per date
-- and shows the latest revision (so existing readers keep working); shard reports are replaced
-- by a newer full judgement of the shard (see docs/ledger.md, "Revisions").
ALTER TABLE ledger_settlements ADD COLUMN revision integer NOT NULL DEFAULT 1 CHECK (revision >= 1);

CREATE TABLE ledger_settlement_revisions (
    business_date          date NOT NULL,
    revision               integer NOT NULL CHECK (revision >= 1),
    shards                 integer NOT NULL,
    keys_examined          bigint NOT NULL,
    discrepancies_found    bigint NOT NULL,
    corrected              bigint NOT NULL,
    sent_to_review         bigint NOT NULL,
    duplicate_report_rows  bigint NOT NULL,
    -- What changed since the previous revision (the whole date for revision 1).
    new_discrepancies      bigint NOT NULL,
    new_corrections        bigint NOT NULL,
    new_review_rows        bigint NOT NULL,
    changed_shards         integer[] NOT NULL,
    reason                 text NOT NULL,
    workflow_id            text NOT NULL,
    settled_at             timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (business_date, revision),
    CHECK (corrected + sent_to_review = discrepancies_found)
);

-- Dates settled before this migration become revision 1 of themselves.
INSERT INTO ledger_settlement_revisions
    (business_date, revision, shards, keys_examined, discrepancies_found, corrected, sent_to_review,
     duplicate_report_rows, new_discrepancies, new_corrections, new_review_rows, changed_shards, reason,
     workflow_id, settled_at)
SELECT s.business_date, 1, s.shards, s.keys_examined, s.discrepancies_found, s.corrected, s.sent_to_review,
       s.duplicate_report_rows, s.discrepancies_found, s.corrected, s.sent_to_review,
       ARRAY(SELECT generate_series(0, s.shards - 1)), 'first settlement of the date', s.workflow_id, s.settled_at
FROM ledger_settlements s;
