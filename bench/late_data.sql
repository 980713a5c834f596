-- Late data for the ledger rerun benchmark (bench/ledger_rerun.py): a reconciled date changes a
-- little, and a re-check has to find and judge the change.

-- name: change_payments
-- Every payment of the date whose ID hashes into the first :per_10000 of each 10,000 changes (spread
-- over all shards alike): half of them (by a second hash) get a hand edit of their ledger amount by
-- 1..:tolerance_cents cents, within tolerance (a new amount mismatch: one correction); the other half get a
-- late provider row that conflicts with the one reported (one review row). A payment judged
-- before (it has a correction or a review row for the date) stays judged: nothing new. Returns
-- what changed and what a re-check must therefore add.
WITH chosen AS (
    SELECT l.game, l.payment_id, l.shard,
           abs(hashtextextended(l.payment_id, 12)) % 2 = 0 AS ledger_edit,
           EXISTS (SELECT 1 FROM ledger_corrections c
                   WHERE c.business_date = :business_date AND c.game = l.game AND c.payment_id = l.payment_id)
           OR EXISTS (SELECT 1 FROM ledger_review v
                      WHERE v.business_date = :business_date AND v.game = l.game AND v.payment_id = l.payment_id)
               AS judged_before,
           EXISTS (SELECT 1 FROM ledger_report_rows r
                   WHERE r.business_date = :business_date AND r.shard = l.shard AND r.game = l.game
                     AND r.payment_id = l.payment_id) AS reported
    FROM ledger_payments l
    WHERE l.business_date = :business_date AND abs(hashtextextended(l.payment_id, 11)) % 10000 < :per_10000
),
edited AS (
    UPDATE ledger_payments p
    SET amount_cents = p.amount_cents + 1 + abs(hashtextextended(p.payment_id, 13)) % :tolerance_cents, updated_at = now()
    FROM chosen c
    WHERE c.ledger_edit AND p.game = c.game AND p.payment_id = c.payment_id
    RETURNING 1
),
late_rows AS (
    INSERT INTO ledger_report_rows (business_date, shard, game, payment_id, amount_cents, currency, status)
    SELECT DISTINCT ON (r.game, r.payment_id) r.business_date, r.shard, r.game, r.payment_id,
           r.amount_cents + 1, r.currency, r.status
    FROM chosen c
    JOIN ledger_report_rows r
      ON r.business_date = :business_date AND r.shard = c.shard AND r.game = c.game AND r.payment_id = c.payment_id
    WHERE NOT c.ledger_edit
    ORDER BY r.game, r.payment_id, r.report_row_id
    RETURNING 1
)
SELECT
    (SELECT count(*) FROM chosen)::int AS payments_changed,
    (SELECT count(*) FROM edited)::int AS ledger_edits,
    (SELECT count(*) FROM late_rows)::int AS late_provider_rows,
    (SELECT count(DISTINCT shard) FROM chosen)::int AS shards_changed,
    (SELECT count(*) FROM chosen WHERE judged_before)::int AS changed_but_judged_before,
    (SELECT count(*) FROM chosen WHERE ledger_edit AND NOT judged_before)::int AS expect_new_corrections,
    (SELECT count(*) FROM chosen WHERE NOT ledger_edit AND reported AND NOT judged_before)::int
        AS expect_new_review_rows;

-- name: latest_revision
-- The date's latest settlement revision: what the re-check recorded, and why. $1 business date
SELECT revision, keys_examined, discrepancies_found, corrected, sent_to_review, new_discrepancies,
       new_corrections, new_review_rows, changed_shards, reason, workflow_id
FROM ledger_settlement_revisions
WHERE business_date = $1
ORDER BY revision DESC
LIMIT 1;
