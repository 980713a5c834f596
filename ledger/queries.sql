-- Named queries of the nightly ledger reconciliation. Loaded by core.queries.load(__file__).

-- name: ledger_day
SELECT business_date, shards, payments FROM ledger_days WHERE business_date = $1;

-- name: lock_shard
-- Taken first in every transaction that judges or reports a (date, shard): attempts of the same
-- shard (a zombie and its retry, the night run and a re-check) take turns batch by batch, and the
-- batch statement that follows takes its snapshot only after the lock is granted, so it sees every
-- correction the other attempt committed. Released at COMMIT/ROLLBACK (transaction-scoped).
SELECT pg_advisory_xact_lock(hashtext('ledger-shard:' || :business_date::date::text), :shard::int);

-- name: lock_settlement
-- Serialises the settlements (revisions) of one date.
SELECT pg_advisory_xact_lock(hashtext('ledger-settle:' || :business_date::date::text), -1);

-- name: reconcile_batch
-- One statement per batch, one transaction (after lock_shard): take the next keys of the shard after the cursor
-- (ledger keys and provider-report keys alike, so unknown payments are seen too), judge each key,
-- record corrections under their idempotency key and apply them to the ledger, and send what no
-- rule reconciles to review. A key judged before (by this run, a crashed attempt or another run)
-- is found by the batch's join with the effect rows of its range and counted again as a
-- discrepancy, but never reaches an INSERT: nothing is inserted twice, no dead tuple is left.
-- The cursor is (:after_game, :after_payment_id); :workflow_id is for the audit only.
--
-- The batch is the key range (cursor, last key] of (date, shard), and everything is read by that
-- range from the range indexes (migration 014) and nothing else: the batch costs what its keys
-- cost, never what the shard, the date or the effect tables' history hold. The last key is the
-- :batch_size-th key after the cursor of whichever table reaches it first (two index-only walks that
-- stop there), so a batch holds at least :batch_size keys unless it runs to the shard's end, and at
-- most 2 x :batch_size (at most :batch_size of each table's). A batch with fewer than :batch_size
-- keys is therefore the shard's last.
-- Each side is then read once by range: the ledger rows locked in key order, the report rows
-- aggregated from the index that carries their columns; one hash join each for the two sides and
-- for the effect rows of the range.
WITH bound AS (
    SELECT b.game, b.payment_id
    FROM (
        (SELECT l.game, l.payment_id FROM ledger_payments l
         WHERE l.business_date = :business_date AND l.shard = :shard AND (l.game, l.payment_id) > (:after_game::text, :after_payment_id::text)
         ORDER BY l.game, l.payment_id OFFSET :batch_size::int - 1 LIMIT 1)
        UNION ALL
        (SELECT r.game, r.payment_id FROM ledger_report_rows r
         WHERE r.business_date = :business_date AND r.shard = :shard AND (r.game, r.payment_id) > (:after_game::text, :after_payment_id::text)
         GROUP BY r.game, r.payment_id
         ORDER BY r.game, r.payment_id OFFSET :batch_size::int - 1 LIMIT 1)
    ) b
    ORDER BY b.game, b.payment_id
    LIMIT 1
),
-- Neither table has :batch_size keys after the cursor: the batch runs to the shard's last key.
shard_end AS (
    SELECT e.game, e.payment_id
    FROM (
        (SELECT l.game, l.payment_id FROM ledger_payments l
         WHERE l.business_date = :business_date AND l.shard = :shard
         ORDER BY l.game DESC, l.payment_id DESC LIMIT 1)
        UNION ALL
        (SELECT r.game, r.payment_id FROM ledger_report_rows r
         WHERE r.business_date = :business_date AND r.shard = :shard
         ORDER BY r.game DESC, r.payment_id DESC LIMIT 1)
    ) e
    WHERE NOT EXISTS (SELECT 1 FROM bound)
    ORDER BY e.game DESC, e.payment_id DESC
    LIMIT 1
),
last_key AS (
    SELECT game, payment_id FROM bound UNION ALL SELECT game, payment_id FROM shard_end
),
-- Every key of (cursor, last key] is a key of the batch, so the two sides are read by range and
-- joined to each other, and to the effect rows of the same range (a first run finds none, a rerun
-- its own; a key's corrections and review rows carry its date and shard, and the effect tables are
-- unique on (date, game, payment_id), the tuple joined on).
facts AS (
    SELECT coalesce(l.game, r.game) AS game, coalesce(l.payment_id, r.payment_id) AS payment_id,
           coalesce(l.game, r.game) || ':' || coalesce(l.payment_id, r.payment_id) || ':'
               || to_char(:business_date::date, 'YYYY-MM-DD') AS key,
           l.payment_id IS NOT NULL AS in_ledger, l.amount_cents AS l_amount, l.currency AS l_currency,
           l.status AS l_status, l.version AS l_version,
           r.payment_id IS NOT NULL AS in_report, r.amount_cents AS r_amount, r.currency AS r_currency,
           r.status AS r_status, coalesce(r.report_rows, 0) AS report_rows, coalesce(r.variants, 0) AS variants,
           r.max_row_id, r.fp_sum AS fp_report
    FROM (
        SELECT l.game, l.payment_id, l.amount_cents, l.currency, l.status, l.version
        FROM ledger_payments l
        WHERE l.business_date = :business_date AND l.shard = :shard
          AND (l.game, l.payment_id) > (:after_game::text, :after_payment_id::text)
          AND (l.game, l.payment_id) <= (SELECT game, payment_id FROM last_key)
        ORDER BY l.game, l.payment_id  -- the range index's order: never a scan of the table, however small
        FOR UPDATE OF l
    ) l
    FULL JOIN (
        SELECT r.game, r.payment_id,
               count(*)::int AS report_rows,
               count(DISTINCT (r.amount_cents, r.currency, r.status))::int AS variants,
               min(r.amount_cents) AS amount_cents, min(r.currency) AS currency, min(r.status) AS status,
               max(r.report_row_id) AS max_row_id,
               sum(hashtextextended(
                   r.game || '|' || r.payment_id || '|' || r.amount_cents || '|' || r.currency || '|' || r.status, 0))
                   AS fp_sum
        FROM ledger_report_rows r
        WHERE r.business_date = :business_date AND r.shard = :shard
          AND (r.game, r.payment_id) > (:after_game::text, :after_payment_id::text)
          AND (r.game, r.payment_id) <= (SELECT game, payment_id FROM last_key)
        GROUP BY r.game, r.payment_id
    ) r ON r.game = l.game AND r.payment_id = l.payment_id
),
judged AS (
    SELECT f.*,
        CASE
            WHEN c.payment_id IS NOT NULL THEN 'already_corrected'
            WHEN v.payment_id IS NOT NULL THEN 'already_in_review'
            WHEN NOT f.in_ledger THEN 'unknown_payment'
            WHEN NOT f.in_report THEN CASE WHEN f.l_status = 'unsettled' THEN 'match' ELSE 'not_settled' END
            WHEN f.variants > 1 THEN 'conflicting_report_rows'
            WHEN f.l_currency <> f.r_currency THEN 'currency_mismatch'
            WHEN abs(f.l_amount - f.r_amount) > :tolerance_cents THEN 'amount_beyond_tolerance'
            WHEN f.r_status = 'refunded' AND f.l_status = 'captured' THEN 'refund_not_recorded'
            WHEN f.l_status <> CASE f.r_status WHEN 'refunded' THEN 'refunded' ELSE 'captured' END
                THEN 'status_mismatch'
            WHEN f.l_amount <> f.r_amount THEN 'amount_mismatch'
            ELSE 'match'
        END AS verdict
    FROM facts f
    LEFT JOIN (
        SELECT c.game, c.payment_id FROM ledger_corrections c
        WHERE c.business_date = :business_date AND c.shard = :shard
          AND (c.game, c.payment_id) > (:after_game::text, :after_payment_id::text)
          AND (c.game, c.payment_id) <= (SELECT game, payment_id FROM last_key)
    ) c ON c.game = f.game AND c.payment_id = f.payment_id
    LEFT JOIN (
        SELECT v.game, v.payment_id FROM ledger_review v
        WHERE v.business_date = :business_date AND v.shard = :shard
          AND (v.game, v.payment_id) > (:after_game::text, :after_payment_id::text)
          AND (v.game, v.payment_id) <= (SELECT game, payment_id FROM last_key)
    ) v ON v.game = f.game AND v.payment_id = f.payment_id
),
corrected AS (
    INSERT INTO ledger_corrections
        (idempotency_key, business_date, shard, game, payment_id, kind, old_status, new_status,
         old_amount_cents, new_amount_cents, version_before, version_after, workflow_id)
    SELECT j.key, :business_date, :shard, j.game, j.payment_id, j.verdict, j.l_status,
           CASE j.verdict WHEN 'refund_not_recorded' THEN 'refunded'
                          WHEN 'not_settled' THEN 'unsettled'
                          ELSE j.l_status END,
           j.l_amount, coalesce(j.r_amount, j.l_amount), j.l_version, j.l_version + 1, :workflow_id
    FROM judged j
    -- (a key already corrected is judged 'already_corrected' in this same snapshot: never sent here)
    WHERE j.verdict IN ('refund_not_recorded', 'amount_mismatch', 'not_settled')
    ON CONFLICT (business_date, game, payment_id) DO NOTHING
    RETURNING game, payment_id, new_status, new_amount_cents, version_before
),
updated AS (
    UPDATE ledger_payments p
    SET status = c.new_status, amount_cents = c.new_amount_cents, version = p.version + 1,
        updated_at = now()
    FROM corrected c
    WHERE p.game = c.game AND p.payment_id = c.payment_id AND p.version = c.version_before
    RETURNING 1
),
reviewed AS (
    INSERT INTO ledger_review
        (review_key, business_date, shard, game, payment_id, kind, reason,
         ledger_amount_cents, provider_amount_cents, ledger_currency, provider_currency,
         ledger_status, provider_status, report_rows, workflow_id)
    SELECT j.key, :business_date, :shard, j.game, j.payment_id, j.verdict,
        CASE j.verdict
            WHEN 'unknown_payment' THEN format(
                'unknown payment: the provider settled %s %s (%s) for %s:%s on %s, '
                'but the ledger has no such payment for that date',
                ledger_money(j.r_amount), j.r_currency, j.r_status, j.game, j.payment_id,
                to_char(:business_date::date, 'YYYY-MM-DD'))
            WHEN 'amount_beyond_tolerance' THEN format(
                'amount mismatch beyond tolerance: the ledger has %s %s, the provider settled %s %s '
                '(difference %s, tolerance %s); check the capture before correcting by hand',
                ledger_money(j.l_amount), j.l_currency, ledger_money(j.r_amount), j.r_currency,
                ledger_money(j.r_amount - j.l_amount), ledger_money(:tolerance_cents::bigint))
            WHEN 'currency_mismatch' THEN format(
                'currency mismatch: the ledger has %s %s, the provider settled %s %s',
                ledger_money(j.l_amount), j.l_currency, ledger_money(j.r_amount), j.r_currency)
            WHEN 'status_mismatch' THEN format(
                'status mismatch: the ledger says %s, the provider reported %s; no rule reconciles this',
                j.l_status, j.r_status)
            ELSE format(
                'conflicting report rows: the provider reported this payment %s times with different '
                'amounts, currencies or statuses', j.report_rows)
        END,
        j.l_amount, j.r_amount, j.l_currency, j.r_currency, j.l_status, j.r_status, j.report_rows, :workflow_id
    FROM judged j
    WHERE j.verdict IN ('unknown_payment', 'amount_beyond_tolerance', 'currency_mismatch',
                        'status_mismatch', 'conflicting_report_rows')
    ON CONFLICT (business_date, game, payment_id) DO NOTHING
    RETURNING 1
),
-- Every output in one pass over the judged keys. The fingerprint terms of the judged ledger rows
-- are those rows as this batch leaves them (a corrected row with its new values and version), in
-- the terms of shard_fingerprint: the sum over the batches is the fingerprint of exactly what the
-- shard's run judged, whatever changed elsewhere in the shard meanwhile.
totals AS (
    SELECT
        count(*)::int AS batch_rows,
        count(*) FILTER (WHERE j.verdict <> 'match')::int AS discrepancies,
        count(*) FILTER (WHERE j.verdict IN ('already_corrected', 'already_in_review'))::int AS already_applied,
        coalesce(sum(j.report_rows - 1) FILTER (WHERE j.variants = 1), 0)::int AS duplicate_report_rows,
        -- What the judged keys count as: a correction (now or before) or a review row (now or before).
        count(*) FILTER (
            WHERE j.verdict IN ('refund_not_recorded', 'amount_mismatch', 'not_settled', 'already_corrected'))::int
            AS corrections_judged,
        count(*) FILTER (
            WHERE j.verdict NOT IN ('match', 'refund_not_recorded', 'amount_mismatch', 'not_settled',
                                    'already_corrected'))::int AS reviews_judged,
        count(*) FILTER (WHERE j.in_ledger)::int AS fp_ledger_rows,
        coalesce(sum(hashtextextended(
            j.game || '|' || j.payment_id || '|' || coalesce(c.new_amount_cents, j.l_amount) || '|'
            || j.l_currency || '|' || coalesce(c.new_status, j.l_status) || '|'
            || CASE WHEN c.game IS NULL THEN j.l_version ELSE c.version_before + 1 END, 0))
            FILTER (WHERE j.in_ledger), 0)::text AS fp_ledger_sum,
        coalesce(sum(j.report_rows), 0)::int AS fp_report_rows,
        coalesce(max(j.max_row_id), 0)::bigint AS fp_report_max,
        coalesce(sum(j.fp_report), 0)::text AS fp_report_sum
    FROM judged j LEFT JOIN corrected c ON c.game = j.game AND c.payment_id = j.payment_id
)
SELECT
    (SELECT game FROM last_key) AS last_game,
    (SELECT payment_id FROM last_key) AS last_payment_id,
    t.batch_rows, t.discrepancies, t.already_applied,
    (SELECT count(*) FROM corrected)::int AS corrected,
    (SELECT count(*) FROM updated)::int AS updated,
    (SELECT count(*) FROM reviewed)::int AS reviewed,
    t.duplicate_report_rows, t.corrections_judged, t.reviews_judged,
    t.fp_ledger_rows, t.fp_ledger_sum, t.fp_report_rows, t.fp_report_max, t.fp_report_sum
FROM totals t;

-- name: record_shard_report
-- The shard's report: the counts of one full judgement of the shard and the fingerprint of exactly
-- the inputs it judged. Runs under lock_shard. The first report is inserted; a later one replaces
-- it only if the recorded report no longer describes the shard's current inputs
-- (:current_fingerprint): a report that still does is exact and a late or zombie attempt, which
-- judged an older view, leaves it alone. Same counts: only the fingerprint is refreshed
-- (reported_at, workflow_id and batches stay those of the report that first found them). Nothing
-- differs: nothing is written. :current_fingerprint is NULL when the shard has no report yet (the
-- caller, under the lock, skips reading it; only the replacement of a recorded report needs it).
WITH inserted AS (
    INSERT INTO ledger_shard_reports
        (business_date, shard, workflow_id, keys_examined, discrepancies_found, corrected, sent_to_review,
         duplicate_report_rows, batches, input_fingerprint)
    SELECT :business_date, :shard, :workflow_id, :keys_examined, :discrepancies, :corrected, :sent_to_review, :duplicate_report_rows, :batches, :judged_fingerprint
    WHERE NOT EXISTS (SELECT 1 FROM ledger_shard_reports WHERE business_date = :business_date AND shard = :shard)
    ON CONFLICT (business_date, shard) DO NOTHING
    RETURNING 1
)
UPDATE ledger_shard_reports r
SET input_fingerprint = :judged_fingerprint,
    workflow_id = CASE WHEN same.counts THEN r.workflow_id ELSE :workflow_id END,
    keys_examined = :keys_examined, discrepancies_found = :discrepancies, corrected = :corrected, sent_to_review = :sent_to_review,
    duplicate_report_rows = :duplicate_report_rows,
    batches = CASE WHEN same.counts THEN r.batches ELSE :batches END,
    reported_at = CASE WHEN same.counts THEN r.reported_at ELSE now() END,
    recorded_at = CASE WHEN same.counts THEN r.recorded_at ELSE clock_timestamp() END
FROM (SELECT (keys_examined, discrepancies_found, corrected, sent_to_review, duplicate_report_rows)
             = (:keys_examined::bigint, :discrepancies::bigint, :corrected::bigint, :sent_to_review::bigint, :duplicate_report_rows::bigint) AS counts
      FROM ledger_shard_reports WHERE business_date = :business_date AND shard = :shard) same
WHERE r.business_date = :business_date AND r.shard = :shard AND NOT EXISTS (SELECT 1 FROM inserted)
  AND r.input_fingerprint IS DISTINCT FROM :current_fingerprint
  AND (r.input_fingerprint IS DISTINCT FROM :judged_fingerprint OR NOT same.counts);

-- name: shard_fingerprint
-- Order-independent digest of a shard's inputs: every ledger row with its version (corrections bump
-- it) and every provider report row. Read-only, one pass over the shard's rows of each table.
SELECT
    (SELECT count(*) || ':' || coalesce(sum(hashtextextended(
                game || '|' || payment_id || '|' || amount_cents || '|' || currency || '|' || status || '|' || version,
                0)), 0)
     FROM ledger_payments WHERE business_date = $1 AND shard = $2)
    || '/' ||
    (SELECT count(*) || ':' || coalesce(max(report_row_id), 0) || ':' || coalesce(sum(hashtextextended(
                game || '|' || payment_id || '|' || amount_cents || '|' || currency || '|' || status, 0)), 0)
     FROM ledger_report_rows WHERE business_date = $1 AND shard = $2) AS fingerprint;

-- name: shard_report_exists
SELECT EXISTS (SELECT 1 FROM ledger_shard_reports WHERE business_date = $1 AND shard = $2);

-- name: get_shard_report
SELECT business_date, shard, workflow_id, keys_examined, discrepancies_found, corrected, sent_to_review,
       duplicate_report_rows, batches, reported_at, input_fingerprint
FROM ledger_shard_reports WHERE business_date = $1 AND shard = $2;

-- name: unreported_shards
SELECT s AS shard
FROM generate_series(0, $2::int - 1) s
WHERE NOT EXISTS (SELECT 1 FROM ledger_shard_reports r WHERE r.business_date = $1 AND r.shard = s)
ORDER BY s;

-- name: date_totals
-- The settlement's totals: the sum of the shard reports (the join), each a balanced full judgement
-- of its shard. Effects written by an attempt that has not reported yet are not counted until it
-- (or a re-check) reports them; the live effect counts are shown next to them by `ledger status`.
SELECT
    (SELECT count(*) FROM ledger_shard_reports WHERE business_date = $1)::int AS shards_reported,
    (SELECT coalesce(sum(keys_examined), 0) FROM ledger_shard_reports WHERE business_date = $1)::bigint
        AS keys_examined,
    (SELECT coalesce(sum(discrepancies_found), 0) FROM ledger_shard_reports WHERE business_date = $1)::bigint
        AS discrepancies_found,
    (SELECT coalesce(sum(duplicate_report_rows), 0) FROM ledger_shard_reports WHERE business_date = $1)::bigint
        AS duplicate_report_rows,
    (SELECT coalesce(sum(corrected), 0) FROM ledger_shard_reports WHERE business_date = $1)::bigint AS corrected,
    (SELECT coalesce(sum(sent_to_review), 0) FROM ledger_shard_reports WHERE business_date = $1)::bigint
        AS sent_to_review,
    (SELECT count(*) FROM ledger_corrections WHERE business_date = $1) AS corrections_recorded,
    (SELECT count(*) FROM ledger_review WHERE business_date = $1) AS review_rows_recorded;

-- name: settle_revision
-- Runs under lock_settlement, after date_totals. Totals equal to the latest revision's: nothing is
-- written (a re-delivered settlement, a rerun or re-check that found nothing new). Otherwise the
-- next revision, with what changed since the previous one and why, and ledger_settlements (one row
-- per date) is brought to it. :reason says why (NULL: the default text).
WITH latest AS (
    SELECT * FROM ledger_settlement_revisions WHERE business_date = :business_date ORDER BY revision DESC LIMIT 1
),
changed AS (
    SELECT coalesce(array_agg(r.shard ORDER BY r.shard), '{}') AS shards
    FROM ledger_shard_reports r
    WHERE r.business_date = :business_date
      AND (NOT EXISTS (SELECT 1 FROM latest) OR r.reported_at > (SELECT settled_at FROM latest))
),
revision AS (
    INSERT INTO ledger_settlement_revisions
        (business_date, revision, shards, keys_examined, discrepancies_found, corrected, sent_to_review,
         duplicate_report_rows, new_discrepancies, new_corrections, new_review_rows, changed_shards, reason,
         workflow_id)
    SELECT :business_date, coalesce(l.revision, 0) + 1, :shards, :keys_examined, :discrepancies_found, :corrected, :sent_to_review, :duplicate_report_rows,
           :discrepancies_found - coalesce(l.discrepancies_found, 0), :corrected - coalesce(l.corrected, 0),
           :sent_to_review - coalesce(l.sent_to_review, 0), c.shards,
           CASE WHEN l.revision IS NULL THEN coalesce(:reason, 'first settlement of the date')
                ELSE format('%s: inputs of shard(s) %s changed since revision %s (late provider rows or ledger '
                            'updates); %s new correction(s), %s new review row(s)',
                            coalesce(:reason, 'rerun ' || :workflow_id), array_to_string(c.shards, ', '), l.revision,
                            :corrected - l.corrected, :sent_to_review - l.sent_to_review)
           END,
           :workflow_id
    FROM (SELECT 1) one LEFT JOIN latest l ON true CROSS JOIN changed c
    WHERE l.revision IS NULL
       OR (l.keys_examined, l.discrepancies_found, l.corrected, l.sent_to_review, l.duplicate_report_rows)
          IS DISTINCT FROM (:keys_examined::bigint, :discrepancies_found::bigint, :corrected::bigint, :sent_to_review::bigint, :duplicate_report_rows::bigint)
    ON CONFLICT (business_date, revision) DO NOTHING
    RETURNING *
)
INSERT INTO ledger_settlements
    (business_date, shards, keys_examined, discrepancies_found, corrected, sent_to_review,
     duplicate_report_rows, workflow_id, settled_at, revision)
SELECT business_date, shards, keys_examined, discrepancies_found, corrected, sent_to_review,
       duplicate_report_rows, workflow_id, settled_at, revision
FROM revision
ON CONFLICT (business_date) DO UPDATE
SET shards = EXCLUDED.shards, keys_examined = EXCLUDED.keys_examined,
    discrepancies_found = EXCLUDED.discrepancies_found, corrected = EXCLUDED.corrected,
    sent_to_review = EXCLUDED.sent_to_review, duplicate_report_rows = EXCLUDED.duplicate_report_rows,
    workflow_id = EXCLUDED.workflow_id, settled_at = EXCLUDED.settled_at, revision = EXCLUDED.revision;

-- name: get_settlement
SELECT business_date, shards, keys_examined, discrepancies_found, corrected, sent_to_review,
       duplicate_report_rows, workflow_id, settled_at, revision
FROM ledger_settlements WHERE business_date = $1;

-- name: settlement_revisions
SELECT business_date, revision, keys_examined, discrepancies_found, corrected, sent_to_review,
       duplicate_report_rows, new_discrepancies, new_corrections, new_review_rows, changed_shards, reason,
       workflow_id, settled_at
FROM ledger_settlement_revisions WHERE business_date = $1 ORDER BY revision;

-- name: review_rows
SELECT review_key, shard, kind, reason, created_at, resolved_at
FROM ledger_review WHERE business_date = $1 ORDER BY kind, review_key LIMIT $2;

-- name: seed_ledger_day
-- A realistic business day, generated server-side in one statement (no per-row round trips).
-- Each payment falls into one bucket by a deterministic hash of its ID:
--   refund       the provider settled a refund, the ledger still says captured   -> corrected
--   small        amount differs by 1..tolerance cents                              -> corrected
--   large        amount differs by more than the tolerance                         -> review
--   unsettled    the provider never settled the payment                            -> corrected
--   refunded_ok  refunded on both sides (2%, no discrepancy)
--   ok           matches
-- plus report rows for payments the ledger does not know (-> review) and exact duplicate report
-- rows (collapsed, counted, no discrepancy). Seeding a date that is already loaded does nothing.
-- Payment numbers are zero-padded to the width of the largest (at least 7 digits), so IDs stay
-- distinct past 9,999,999 payments and a day of fewer keeps the IDs it always had.
WITH day AS (
    INSERT INTO ledger_days (business_date, shards, payments) VALUES (:business_date, :shards, :payments)
    ON CONFLICT (business_date) DO NOTHING
    RETURNING business_date
),
base AS (
    SELECT g, 'game-' || (1 + g % :games::int) AS game,
           'pay-' || to_char(:business_date::date, 'YYYYMMDD') || '-' || lpad(g::text, greatest(7, length(:payments::int::text)), '0') AS payment_id
    FROM generate_series(1, :payments::int) g
    WHERE EXISTS (SELECT 1 FROM day)
),
gen AS (
    SELECT b.game, b.payment_id, ledger_shard_of(b.game, b.payment_id, :shards::int) AS shard,
           99 + (abs(hashtextextended(b.payment_id, 1)) % 19900) AS amount,
           (ARRAY['EUR', 'USD', 'GBP'])[1 + b.g % 3] AS currency,
           CASE
               WHEN u < :refund_rate::float8 THEN 'refund'
               WHEN u < :refund_rate::float8 + :small_mismatch_rate::float8 THEN 'small'
               WHEN u < :refund_rate::float8 + :small_mismatch_rate::float8 + :large_mismatch_rate::float8 THEN 'large'
               WHEN u < :refund_rate::float8 + :small_mismatch_rate::float8 + :large_mismatch_rate::float8 + :unsettled_rate::float8 THEN 'unsettled'
               WHEN u < :refund_rate::float8 + :small_mismatch_rate::float8 + :large_mismatch_rate::float8 + :unsettled_rate::float8 + 0.02 THEN 'refunded_ok'
               ELSE 'ok'
           END AS kind,
           (abs(hashtextextended(b.payment_id, 3)) % 1000000) / 1000000.0::float8 < :duplicate_rate::float8 AS duplicated,
           abs(hashtextextended(b.payment_id, 4)) AS h
    FROM base b
    CROSS JOIN LATERAL (SELECT (abs(hashtextextended(b.payment_id, 2)) % 1000000) / 1000000.0::float8 AS u) r
),
ledger AS (
    INSERT INTO ledger_payments (game, payment_id, business_date, shard, amount_cents, currency, status)
    SELECT game, payment_id, :business_date, shard, amount, currency,
           CASE WHEN kind = 'refunded_ok' THEN 'refunded' ELSE 'captured' END
    FROM gen
    RETURNING 1
),
report AS (
    INSERT INTO ledger_report_rows (business_date, shard, game, payment_id, amount_cents, currency, status)
    SELECT :business_date, shard, game, payment_id,
           CASE kind
               WHEN 'small' THEN amount + (CASE WHEN h % 2 = 0 THEN 1 ELSE -1 END) * (1 + h % :tolerance_cents::bigint)
               WHEN 'large' THEN amount + :tolerance_cents::bigint + 1 + h % 10000
               ELSE amount
           END,
           currency,
           CASE WHEN kind IN ('refund', 'refunded_ok') THEN 'refunded' ELSE 'settled' END
    FROM gen CROSS JOIN LATERAL generate_series(1, CASE WHEN duplicated THEN 2 ELSE 1 END) copy
    WHERE kind <> 'unsettled'
    UNION ALL
    SELECT :business_date, ledger_shard_of(x.game, x.payment_id, :shards::int), x.game, x.payment_id,
           99 + (abs(hashtextextended(x.payment_id, 1)) % 19900), 'EUR', 'settled'
    FROM (
        SELECT 'game-' || (1 + u % :games::int) AS game,
               'pay-' || to_char(:business_date::date, 'YYYYMMDD') || '-x' || lpad(u::text, greatest(7, length(:payments::int::text)), '0') AS payment_id
        FROM generate_series(1, round(:payments::int * :unknown_rate::float8)::int) u
        WHERE EXISTS (SELECT 1 FROM day)
    ) x
    RETURNING 1
)
SELECT
    (SELECT count(*) FROM day)::int AS days_created,
    (SELECT count(*) FROM ledger)::int AS payments,
    (SELECT count(*) FROM report)::int AS report_rows,
    (SELECT count(*) FROM gen WHERE kind = 'refund')::int AS refunds_not_recorded,
    (SELECT count(*) FROM gen WHERE kind = 'small')::int AS small_mismatches,
    (SELECT count(*) FROM gen WHERE kind = 'large')::int AS large_mismatches,
    (SELECT count(*) FROM gen WHERE kind = 'unsettled')::int AS never_settled,
    (SELECT count(*) FROM gen WHERE kind = 'refunded_ok')::int AS refunds_ok,
    (CASE WHEN EXISTS (SELECT 1 FROM day) THEN round(:payments::int * :unknown_rate::float8) ELSE 0 END)::int
        AS unknown_payments,
    (SELECT count(*) FROM gen WHERE duplicated AND kind <> 'unsettled')::int AS duplicate_report_rows;

-- name: open_reviews
-- Review rows of a date nobody has resolved yet.
SELECT count(*) FROM ledger_review WHERE business_date = :business_date AND resolved_at IS NULL;

-- name: analyze_ledger
-- Fresh statistics after a bulk load.
ANALYZE ledger_payments, ledger_report_rows;
