-- A payment's readable key '{game}:{payment_id}:{YYYY-MM-DD}' and the string the shard function
-- hashes ('{game}:{payment_id}') are only one-to-one when an ID cannot contain the separator:
-- without that, the payments (a:b, c) and (a, b:c) share a key and a shard, and the second one's
-- correction is dropped as "already corrected". IDs are therefore restricted (no ':' nor '|', the
-- separators of the keys and of the shard fingerprint; no blanks or control characters; 1-128
-- characters), and the effect tables are unique on the tuple itself, which is what a batch judges by.
-- NOT VALID: rows loaded before stay as they are; every row written from now on is checked.
ALTER TABLE ledger_payments
    ADD CONSTRAINT ledger_payments_game_id_check
        CHECK (game ~ '^[^:|[:space:][:cntrl:]]{1,128}$') NOT VALID,
    ADD CONSTRAINT ledger_payments_payment_id_check
        CHECK (payment_id ~ '^[^:|[:space:][:cntrl:]]{1,128}$') NOT VALID;
ALTER TABLE ledger_report_rows
    ADD CONSTRAINT ledger_report_rows_game_id_check
        CHECK (game ~ '^[^:|[:space:][:cntrl:]]{1,128}$') NOT VALID,
    ADD CONSTRAINT ledger_report_rows_payment_id_check
        CHECK (payment_id ~ '^[^:|[:space:][:cntrl:]]{1,128}$') NOT VALID;

-- The idempotency record is the tuple; the readable key stays for display and look-ups.
ALTER TABLE ledger_corrections
    ADD CONSTRAINT ledger_corrections_payment_date_key UNIQUE (business_date, game, payment_id);
ALTER TABLE ledger_review
    ADD CONSTRAINT ledger_review_payment_date_key UNIQUE (business_date, game, payment_id);

-- The readable key is no longer what is unique: two payments loaded before the checks may share it.
-- It keeps an index for the operators' look-ups.
ALTER TABLE ledger_corrections DROP CONSTRAINT IF EXISTS ledger_corrections_idempotency_key_key;
CREATE INDEX ledger_corrections_key_idx ON ledger_corrections (idempotency_key);
ALTER TABLE ledger_review DROP CONSTRAINT IF EXISTS ledger_review_review_key_key;
CREATE INDEX ledger_review_key_idx ON ledger_review (review_key);
