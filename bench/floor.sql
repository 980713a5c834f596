-- The Postgres floor of each job: the least work that has the same effects with the same
-- guarantees (the idempotency record commits in the same transaction as the effect, under its
-- UNIQUE constraint), as set-based statements on as many backends as there are cores, with no
-- Temporal, no claim, no partitions, no batches and no counts read back. The work is cut into
-- FLOOR_BACKENDS (bench/floor.py: os.cpu_count()) disjoint slices, decided by one untimed query
-- before the run; each slice runs on its own connection, all slices at once, timed together (start
-- of the first to end of the last), their counts summed. A cleanup slice is ONE statement in its own
-- transaction; a ledger slice is one statement per shard of the slice, in turn, each in its own
-- transaction (over 8 shards at once the statement read both tables whole and sorted on disk: 1.6x
-- the CPU of the same shards one by one).
-- The benchmarks divide the direct path's and the pipeline's throughput by this one, measured in
-- the same script run. (Figures measured before the floor was sliced used one statement on one
-- backend.)

-- name: cleanup_floor_bounds
-- Untimed, before the floor: the $2 - 1 account_ids that cut the cohort ($1 = its deadline) into
-- $2 slices of equal size, ascending (slice k is [bound k-1, bound k), the first and the last
-- open-ended). NULL for an empty cohort; a bound repeats (an empty slice) when the cohort has
-- fewer accounts than slices.
SELECT percentile_disc(ARRAY(SELECT k::float8 / $2 FROM generate_series(1, $2 - 1) AS k))
           WITHIN GROUP (ORDER BY account_id) AS bounds
FROM accounts
WHERE renewal_deadline = $1 AND status = 'active';

-- name: cleanup_floor
-- One slice of a cohort ($2 = its deadline; account_id >= $3 and < $4, NULL = unbounded) cleaned
-- by one statement under cleanup ID $1: every active account of the slice past its deadline
-- marked cleaned, its idempotency record, the shipped game data deleted (saves, items) or
-- archived (matches), its renewal reminder in the outbox. The slices are disjoint, so they touch
-- disjoint rows; a range fits the index accounts_active_due_idx (deadline, account_id).
WITH cleaned AS (
    UPDATE accounts
    SET status = 'cleaned', claimed_by = $1, claimed_at = now(), cleaned_at = now()
    WHERE renewal_deadline = $2 AND status = 'active' AND renewal_deadline <= cleanup_clock()
      AND ($3::text IS NULL OR account_id >= $3::text)
      AND ($4::text IS NULL OR account_id < $4::text)
    RETURNING account_id, cleanup_version
),
applied AS (
    INSERT INTO cleanup_applied (account_id, cleanup_version, cleanup_id, partition_no)
    SELECT account_id, cleanup_version, $1, 0 FROM cleaned
    ON CONFLICT ON CONSTRAINT cleanup_applied_once DO NOTHING
    RETURNING account_id, cleanup_version
),
saves AS (
    DELETE FROM cloud_saves t USING applied p WHERE t.account_id = p.account_id RETURNING 1
),
items AS (
    DELETE FROM inventory_items t USING applied p WHERE t.account_id = p.account_id RETURNING 1
),
moved AS (
    DELETE FROM match_history t USING applied p WHERE t.account_id = p.account_id RETURNING t.*
),
archived AS (
    INSERT INTO match_history_archive (match_id, account_id, played_at, mode, result, score)
    SELECT match_id, account_id, played_at, mode, result, score FROM moved
    RETURNING 1
),
reminders AS (
    INSERT INTO outbox (event_key, kind, account_id, source_id, payload)
    SELECT 'renewal-reminder:' || account_id || ':v' || cleanup_version, 'renewal_reminder',
           account_id, $1,
           jsonb_build_object('account_id', account_id, 'cleanup_version', cleanup_version,
                              'cleanup_id', $1::text)
    FROM applied
    ON CONFLICT (event_key) DO NOTHING
    RETURNING 1
)
SELECT (SELECT count(*) FROM applied)::int AS cleaned,
       (SELECT count(*) FROM saves)::int AS cloud_saves,
       (SELECT count(*) FROM items)::int AS inventory_items,
       (SELECT count(*) FROM archived)::int AS match_history,
       (SELECT count(*) FROM reminders)::int AS reminders;

-- name: ledger_floor_slices
-- Untimed, before the floor: the shards of the date ($1) dealt to $2 slices, slice k taking every
-- shard s with s % $2 = k (a slice with no shard, when the date has fewer shards than slices, is
-- not listed). A payment's ledger row and its report rows carry the same shard (what the batches
-- rely on too), so every key is judged in exactly one slice.
SELECT s % $2 AS slice, array_agg(s ORDER BY s) AS shards
FROM ledger_days d, generate_series(0, d.shards - 1) AS s
WHERE d.business_date = $1
GROUP BY s % $2
ORDER BY slice;

-- name: ledger_floor
-- One shard ($4) of a business date ($1) reconciled by one statement (a slice runs its shards in
-- turn): every ledger row of the shard locked (as the batches lock theirs) and judged against the
-- provider's report rows by the same rules, corrections recorded under their idempotency key and
-- applied to the ledger, the rest sent to review (the idempotency record: (date, game, payment_id)). No keyset, no fingerprint, no reports, no shard
-- lock: the slices are disjoint sets of whole shards. `shard = $4`, not `= ANY(...)`: with one
-- value the report rows come in the order of their (date, shard, game, payment_id) index, where a
-- ScalarArrayOp made the planner sort them first (EXPLAIN, 400,000 payments: a quicksort of each
-- shard's 25,000 report rows, 28 ms of ~350). $2 tolerance in cents, $3 workflow ID.
WITH ledger AS (
    SELECT l.game, l.payment_id, l.shard, l.amount_cents, l.currency, l.status, l.version
    FROM ledger_payments l
    WHERE l.business_date = $1 AND l.shard = $4::int
    FOR UPDATE OF l
),
report AS (
    SELECT r.game, r.payment_id, min(r.shard) AS shard,
           count(*)::int AS report_rows,
           count(DISTINCT (r.amount_cents, r.currency, r.status))::int AS variants,
           min(r.amount_cents) AS amount_cents, min(r.currency) AS currency, min(r.status) AS status
    FROM ledger_report_rows r
    WHERE r.business_date = $1 AND r.shard = $4::int
    GROUP BY r.game, r.payment_id
),
facts AS (
    SELECT coalesce(l.game, r.game) AS game, coalesce(l.payment_id, r.payment_id) AS payment_id,
           coalesce(l.shard, r.shard) AS shard,
           coalesce(l.game, r.game) || ':' || coalesce(l.payment_id, r.payment_id) || ':'
               || to_char($1::date, 'YYYY-MM-DD') AS key,
           l.payment_id IS NOT NULL AS in_ledger, l.amount_cents AS l_amount, l.currency AS l_currency,
           l.status AS l_status, l.version AS l_version,
           r.payment_id IS NOT NULL AS in_report, r.amount_cents AS r_amount, r.currency AS r_currency,
           r.status AS r_status, coalesce(r.report_rows, 0) AS report_rows, coalesce(r.variants, 0) AS variants
    FROM ledger l FULL JOIN report r ON r.game = l.game AND r.payment_id = l.payment_id
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
            WHEN abs(f.l_amount - f.r_amount) > $2 THEN 'amount_beyond_tolerance'
            WHEN f.r_status = 'refunded' AND f.l_status = 'captured' THEN 'refund_not_recorded'
            WHEN f.l_status <> CASE f.r_status WHEN 'refunded' THEN 'refunded' ELSE 'captured' END
                THEN 'status_mismatch'
            WHEN f.l_amount <> f.r_amount THEN 'amount_mismatch'
            ELSE 'match'
        END AS verdict
    FROM facts f
    LEFT JOIN ledger_corrections c ON c.business_date = $1 AND c.game = f.game AND c.payment_id = f.payment_id
    LEFT JOIN ledger_review v ON v.business_date = $1 AND v.game = f.game AND v.payment_id = f.payment_id
),
corrected AS (
    INSERT INTO ledger_corrections
        (idempotency_key, business_date, shard, game, payment_id, kind, old_status, new_status,
         old_amount_cents, new_amount_cents, version_before, version_after, workflow_id)
    SELECT j.key, $1, j.shard, j.game, j.payment_id, j.verdict, j.l_status,
           CASE j.verdict WHEN 'refund_not_recorded' THEN 'refunded'
                          WHEN 'not_settled' THEN 'unsettled'
                          ELSE j.l_status END,
           j.l_amount, coalesce(j.r_amount, j.l_amount), j.l_version, j.l_version + 1, $3
    FROM judged j
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
    SELECT j.key, $1, j.shard, j.game, j.payment_id, j.verdict,
        CASE j.verdict
            WHEN 'unknown_payment' THEN format(
                'unknown payment: the provider settled %s %s (%s) for %s:%s on %s, '
                'but the ledger has no such payment for that date',
                ledger_money(j.r_amount), j.r_currency, j.r_status, j.game, j.payment_id,
                to_char($1::date, 'YYYY-MM-DD'))
            WHEN 'amount_beyond_tolerance' THEN format(
                'amount mismatch beyond tolerance: the ledger has %s %s, the provider settled %s %s '
                '(difference %s, tolerance %s); check the capture before correcting by hand',
                ledger_money(j.l_amount), j.l_currency, ledger_money(j.r_amount), j.r_currency,
                ledger_money(j.r_amount - j.l_amount), ledger_money($2::bigint))
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
        j.l_amount, j.r_amount, j.l_currency, j.r_currency, j.l_status, j.r_status, j.report_rows, $3
    FROM judged j
    WHERE j.verdict IN ('unknown_payment', 'amount_beyond_tolerance', 'currency_mismatch',
                        'status_mismatch', 'conflicting_report_rows')
    ON CONFLICT (business_date, game, payment_id) DO NOTHING
    RETURNING 1
)
SELECT (SELECT count(*) FROM judged)::int AS keys_examined,
       (SELECT count(*) FROM judged WHERE verdict <> 'match')::int AS discrepancies_found,
       (SELECT count(*) FROM corrected)::int AS corrected,
       (SELECT count(*) FROM updated)::int AS updated,
       (SELECT count(*) FROM reviewed)::int AS sent_to_review;
