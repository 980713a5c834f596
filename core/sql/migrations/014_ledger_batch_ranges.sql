-- The ledger batch reads everything it needs by the batch's key range (cursor, last key] of its
-- (date, shard), so each batch costs what its own keys cost, whatever else the tables hold:
--
-- - the effect tables: a batch looks up the corrections and review rows already written for its
--   range (one short index range scan per table) instead of hashing the whole table once per
--   batch, which grew with every correction of the run and with every date kept. The
--   (business_date, shard) indexes are prefixes of the new ones and go.
-- - the provider's report rows: the shard index also carries the judged columns, so a batch (and
--   the shard fingerprint) reads them from the index in key order (an index-only scan once the
--   table is vacuumed) instead of one random heap page per key.
--
-- Building the report index reads ledger_report_rows once and blocks writes to it meanwhile.
CREATE INDEX ledger_corrections_range_idx ON ledger_corrections (business_date, shard, game, payment_id);
DROP INDEX ledger_corrections_shard_idx;

CREATE INDEX ledger_review_range_idx ON ledger_review (business_date, shard, game, payment_id);
DROP INDEX ledger_review_shard_idx;

CREATE INDEX ledger_report_rows_judged_idx ON ledger_report_rows (business_date, shard, game, payment_id)
    INCLUDE (amount_cents, currency, status, report_row_id);
DROP INDEX ledger_report_rows_shard_idx;
