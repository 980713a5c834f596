-- A rerun of an already-reconciled night should cost little: each shard report keeps a
-- fingerprint of the shard's inputs as they stood when the report was written (ledger rows with
-- their versions, provider report rows). A later run whose fingerprint matches returns the
-- recorded report instead of re-judging every key (re-judging would write nothing anyway).
ALTER TABLE ledger_shard_reports ADD COLUMN input_fingerprint text;
