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
-- Untimed, before the floor: the account_ids that cut the cohort of a deadline into :slices slices
-- of equal size, ascending (slice k is [bound k-1, bound k), the first and the last
-- open-ended). NULL for an empty cohort; a bound repeats (an empty slice) when the cohort has
-- fewer accounts than slices.
SELECT percentile_disc(ARRAY(SELECT k::float8 / :slices FROM generate_series(1, :slices - 1) AS k))
           WITHIN GROUP (ORDER BY account_id) AS bounds
FROM accounts
WHERE renewal_deadline = :deadline AND status = 'active';

-- name: cleanup_floor
-- One slice of a cohort (account_id >= :from_account and < :until_account, NULL = unbounded)
-- cleaned by one statement: every active account of the slice past its deadline
-- marked cleaned, its idempotency record, the shipped game data deleted (saves, items) or
-- archived (matches), its erasure receipt (rows per target, as the batches write it), its
-- renewal reminder in the outbox. The slices are disjoint, so they touch
-- disjoint rows; a range fits the index accounts_active_due_idx (deadline, account_id).
WITH cleaned AS (
    UPDATE accounts
    SET status = 'cleaned', claimed_by = :cleanup_id, claimed_at = now(), cleaned_at = now()
    WHERE renewal_deadline = :deadline AND status = 'active' AND renewal_deadline <= cleanup_clock()
      AND (:from_account::text IS NULL OR account_id >= :from_account::text)
      AND (:until_account::text IS NULL OR account_id < :until_account::text)
    RETURNING account_id, cleanup_version
),
applied AS (
    INSERT INTO cleanup_applied (account_id, cleanup_version, cleanup_id, partition_no)
    SELECT account_id, cleanup_version, :cleanup_id, 0 FROM cleaned
    ON CONFLICT ON CONSTRAINT cleanup_applied_once DO NOTHING
    RETURNING account_id, cleanup_version
),
saves AS (
    DELETE FROM demo_game.cloud_saves t USING applied p WHERE t.account_id = p.account_id
    RETURNING t.account_id AS key
),
items AS (
    DELETE FROM demo_game.inventory_items t USING applied p WHERE t.account_id = p.account_id
    RETURNING t.account_id AS key
),
moved AS (
    DELETE FROM demo_game.match_history t USING applied p WHERE t.account_id = p.account_id RETURNING t.*
),
archived AS (
    INSERT INTO demo_game.match_history_archive (match_id, account_id, played_at, mode, result, score)
    SELECT match_id, account_id, played_at, mode, result, score FROM moved
    RETURNING account_id AS key
),
receipts AS (
    INSERT INTO erasure_receipts (account_id, cleanup_version, cleanup_id, targets)
    SELECT a.account_id, a.cleanup_version, :cleanup_id, jsonb_build_array(
        jsonb_build_object('target', 'demo_game.cloud_saves', 'action', 'delete', 'rows', coalesce(s.n, 0)),
        jsonb_build_object('target', 'demo_game.inventory_items', 'action', 'delete', 'rows', coalesce(i.n, 0)),
        jsonb_build_object('target', 'demo_game.match_history', 'action', 'archive', 'rows', coalesce(m.n, 0)))
    FROM applied a
    LEFT JOIN (SELECT key, count(*) AS n FROM saves GROUP BY key) s ON s.key = a.account_id
    LEFT JOIN (SELECT key, count(*) AS n FROM items GROUP BY key) i ON i.key = a.account_id
    LEFT JOIN (SELECT key, count(*) AS n FROM archived GROUP BY key) m ON m.key = a.account_id
    RETURNING 1
),
reminders AS (
    INSERT INTO outbox (event_key, kind, account_id, source_id, payload)
    SELECT 'renewal-reminder:' || account_id || ':v' || cleanup_version, 'renewal_reminder',
           account_id, :cleanup_id,
           jsonb_build_object('account_id', account_id, 'cleanup_version', cleanup_version,
                              'cleanup_id', :cleanup_id::text)
    FROM applied
    ON CONFLICT (event_key) DO NOTHING
    RETURNING 1
)
SELECT (SELECT count(*) FROM applied)::int AS cleaned,
       (SELECT count(*) FROM saves)::int AS cloud_saves,
       (SELECT count(*) FROM items)::int AS inventory_items,
       (SELECT count(*) FROM archived)::int AS match_history,
       (SELECT count(*) FROM reminders)::int AS reminders,
       (SELECT count(*) FROM receipts)::int AS receipts;

-- name: ledger_floor_slices
-- Untimed, before the floor: the shards of the date dealt to :slices slices, slice k taking every
-- shard s with s % :slices = k (a slice with no shard, when the date has fewer shards than slices, is
-- not listed). A payment's ledger row and its report rows carry the same shard (what the batches
-- rely on too), so every key is judged in exactly one slice.
SELECT s % :slices AS slice, array_agg(s ORDER BY s) AS shards
FROM ledger_days d, generate_series(0, d.shards - 1) AS s
WHERE d.business_date = :business_date
GROUP BY s % :slices
ORDER BY slice;

-- name: ledger_floor
-- One shard of a business date reconciled by one statement (a slice runs its shards in
-- turn): every ledger row of the shard locked (as the batches lock theirs) and judged against the
-- provider's report rows by the same rules, corrections recorded under their idempotency key and
-- applied to the ledger, the rest sent to review (the idempotency record: (date, game, payment_id)). No keyset, no fingerprint, no reports, no shard
-- lock: the slices are disjoint sets of whole shards. `shard = :shard`, not `= ANY(...)`: with one
-- value the report rows come in the order of their (date, shard, game, payment_id) index, where a
-- ScalarArrayOp made the planner sort them first (EXPLAIN, 400,000 payments: a quicksort of each
-- shard's 25,000 report rows, 28 ms of ~350).
WITH ledger AS (
    SELECT l.game, l.payment_id, l.shard, l.amount_cents, l.currency, l.status, l.version
    FROM ledger_payments l
    WHERE l.business_date = :business_date AND l.shard = :shard::int
    FOR UPDATE OF l
),
report AS (
    SELECT r.game, r.payment_id, min(r.shard) AS shard,
           count(*)::int AS report_rows,
           count(DISTINCT (r.amount_cents, r.currency, r.status))::int AS variants,
           min(r.amount_cents) AS amount_cents, min(r.currency) AS currency, min(r.status) AS status
    FROM ledger_report_rows r
    WHERE r.business_date = :business_date AND r.shard = :shard::int
    GROUP BY r.game, r.payment_id
),
facts AS (
    SELECT coalesce(l.game, r.game) AS game, coalesce(l.payment_id, r.payment_id) AS payment_id,
           coalesce(l.shard, r.shard) AS shard,
           coalesce(l.game, r.game) || ':' || coalesce(l.payment_id, r.payment_id) || ':'
               || to_char(:business_date::date, 'YYYY-MM-DD') AS key,
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
            WHEN abs(f.l_amount - f.r_amount) > :tolerance_cents THEN 'amount_beyond_tolerance'
            WHEN f.r_status = 'refunded' AND f.l_status = 'captured' THEN 'refund_not_recorded'
            WHEN f.l_status <> CASE f.r_status WHEN 'refunded' THEN 'refunded' ELSE 'captured' END
                THEN 'status_mismatch'
            WHEN f.l_amount <> f.r_amount THEN 'amount_mismatch'
            ELSE 'match'
        END AS verdict
    FROM facts f
    LEFT JOIN ledger_corrections c ON c.business_date = :business_date AND c.game = f.game AND c.payment_id = f.payment_id
    LEFT JOIN ledger_review v ON v.business_date = :business_date AND v.game = f.game AND v.payment_id = f.payment_id
),
corrected AS (
    INSERT INTO ledger_corrections
        (idempotency_key, business_date, shard, game, payment_id, kind, old_status, new_status,
         old_amount_cents, new_amount_cents, version_before, version_after, workflow_id)
    SELECT j.key, :business_date, j.shard, j.game, j.payment_id, j.verdict, j.l_status,
           CASE j.verdict WHEN 'refund_not_recorded' THEN 'refunded'
                          WHEN 'not_settled' THEN 'unsettled'
                          ELSE j.l_status END,
           j.l_amount, coalesce(j.r_amount, j.l_amount), j.l_version, j.l_version + 1, :workflow_id
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
    SELECT j.key, :business_date, j.shard, j.game, j.payment_id, j.verdict,
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
)
SELECT (SELECT count(*) FROM judged)::int AS keys_examined,
       (SELECT count(*) FROM judged WHERE verdict <> 'match')::int AS discrepancies_found,
       (SELECT count(*) FROM corrected)::int AS corrected,
       (SELECT count(*) FROM updated)::int AS updated,
       (SELECT count(*) FROM reviewed)::int AS sent_to_review;

-- name: game_cleanup_floor
-- The floor on the game server's own schema (tests/game_server): one slice of a cohort
-- (account_id >= :from_account and < :until_account, NULL = unbounded) cleaned by one statement,
-- with the effects of its declared targets (tests/game_server/targets.toml): the items and
-- characters deleted, every friendship of the user (either side) deleted, the matches archived
-- (the archive's identity copied as is), the users row kept with its username replaced by its
-- HMAC-SHA256 (of the key's inner and outer pads) and its email and profile nulled; plus the
-- account marked cleaned, its idempotency record, its erasure receipt (rows per target, as the
-- batch statement writes it) and its reminder in the outbox.
WITH cleaned AS (
    UPDATE accounts
    SET status = 'cleaned', claimed_by = :cleanup_id, claimed_at = now(), cleaned_at = now()
    WHERE renewal_deadline = :deadline AND status = 'active' AND renewal_deadline <= cleanup_clock()
      AND (:from_account::text IS NULL OR account_id >= :from_account::text)
      AND (:until_account::text IS NULL OR account_id < :until_account::text)
    RETURNING account_id, cleanup_version
),
applied AS (
    INSERT INTO cleanup_applied (account_id, cleanup_version, cleanup_id, partition_no)
    SELECT account_id, cleanup_version, :cleanup_id, 0 FROM cleaned
    ON CONFLICT ON CONSTRAINT cleanup_applied_once DO NOTHING
    RETURNING account_id, cleanup_version
),
keys AS (
    SELECT account_id::uuid AS id FROM applied
),
items AS (
    DELETE FROM game_server.inventory t USING keys k WHERE t.user_id = k.id RETURNING t.user_id AS key
),
characters AS (
    DELETE FROM game_server.characters t USING keys k WHERE t.user_id = k.id RETURNING t.user_id AS key
),
friends AS (
    DELETE FROM game_server.friends t
    WHERE t.user_a IN (SELECT id FROM keys) OR t.user_b IN (SELECT id FROM keys)
    RETURNING t.user_a, t.user_b
),
moved AS (
    DELETE FROM game_server.matches t USING keys k WHERE t.user_id = k.id RETURNING t.*
),
archived AS (
    INSERT INTO game_server.matches_archive (id, user_id, played_at, kills, deaths) OVERRIDING SYSTEM VALUE
    SELECT id, user_id, played_at, kills, deaths FROM moved
    RETURNING user_id AS key
),
users AS (
    UPDATE game_server.users t
    SET username = encode(sha256(:outer_pad::bytea || sha256(:inner_pad::bytea || convert_to(t.username, 'UTF8'))), 'hex'),
        email = NULL, profile = NULL
    FROM keys k WHERE t.id = k.id
    RETURNING t.id AS key
),
-- a friendship counts for user_a's target when user_a is cleaned, else for user_b's (as the batch)
friends_keyed AS (
    SELECT CASE WHEN f.user_a IN (SELECT id FROM keys) THEN 'a' ELSE 'b' END AS side,
           CASE WHEN f.user_a IN (SELECT id FROM keys) THEN f.user_a ELSE f.user_b END AS key
    FROM friends f
),
receipts AS (
    INSERT INTO erasure_receipts (account_id, cleanup_version, cleanup_id, targets)
    SELECT a.account_id, a.cleanup_version, :cleanup_id, jsonb_build_array(
        jsonb_build_object('target', 'game_server.inventory', 'action', 'delete', 'rows', coalesce(i.n, 0)),
        jsonb_build_object('target', 'game_server.characters', 'action', 'delete', 'rows', coalesce(c.n, 0)),
        jsonb_build_object('target', 'game_server.friends', 'action', 'delete', 'rows', coalesce(fa.n, 0)),
        jsonb_build_object('target', 'game_server.friends', 'action', 'delete', 'rows', coalesce(fb.n, 0)),
        jsonb_build_object('target', 'game_server.matches', 'action', 'archive', 'rows', coalesce(m.n, 0)),
        jsonb_build_object('target', 'game_server.users', 'action', 'anonymize', 'rows', coalesce(u.n, 0)))
    FROM applied a
    LEFT JOIN (SELECT key, count(*) AS n FROM items GROUP BY key) i ON i.key = a.account_id::uuid
    LEFT JOIN (SELECT key, count(*) AS n FROM characters GROUP BY key) c ON c.key = a.account_id::uuid
    LEFT JOIN (SELECT key, count(*) AS n FROM friends_keyed WHERE side = 'a' GROUP BY key) fa
        ON fa.key = a.account_id::uuid
    LEFT JOIN (SELECT key, count(*) AS n FROM friends_keyed WHERE side = 'b' GROUP BY key) fb
        ON fb.key = a.account_id::uuid
    LEFT JOIN (SELECT key, count(*) AS n FROM archived GROUP BY key) m ON m.key = a.account_id::uuid
    LEFT JOIN (SELECT key, count(*) AS n FROM users GROUP BY key) u ON u.key = a.account_id::uuid
    ON CONFLICT DO NOTHING
    RETURNING 1
),
reminders AS (
    INSERT INTO outbox (event_key, kind, account_id, source_id, payload)
    SELECT 'renewal-reminder:' || account_id || ':v' || cleanup_version, 'renewal_reminder',
           account_id, :cleanup_id,
           jsonb_build_object('account_id', account_id, 'cleanup_version', cleanup_version,
                              'cleanup_id', :cleanup_id::text)
    FROM applied
    ON CONFLICT (event_key) DO NOTHING
    RETURNING 1
)
SELECT (SELECT count(*) FROM applied)::int AS cleaned,
       (SELECT count(*) FROM items)::int AS inventory,
       (SELECT count(*) FROM characters)::int AS characters,
       (SELECT count(*) FROM friends)::int AS friends,
       (SELECT count(*) FROM archived)::int AS matches,
       (SELECT count(*) FROM users)::int AS users,
       (SELECT count(*) FROM receipts)::int AS receipts,
       (SELECT count(*) FROM reminders)::int AS reminders;
