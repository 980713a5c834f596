-- Named queries of the fault harness's ordering checks. Loaded by core.queries.load(__file__).
-- Each check reads a whole lane database (a lane has a database of its own) after its scenario.
-- Stamps: recorded_at (clock_timestamp() at the write, after the row locks were granted; migration
-- 010), falling back to the transaction-start column of rows written before it. A report that is
-- replaced in place counts at the later of its two stamps (greatest() ignores a NULL).

-- name: ordering_violations
-- One count per ordering rule; every count must be 0. An account is counted once per rule.
-- `renewal` and `effect` are read per account by correlated EXISTS under OR (no semi-join): NOT
-- MATERIALIZED lets each probe use its table's account index, where a materialized CTE would be
-- scanned whole per account (quadratic: minutes at 100,000 accounts).
WITH renewal AS NOT MATERIALIZED (
    SELECT account_id, version_after, new_deadline, renewal_id,
           coalesce(recorded_at, requested_at) AS at
    FROM renewals WHERE outcome = 'in_time'
),
effect AS NOT MATERIALIZED (
    SELECT account_id, cleanup_version, coalesce(recorded_at, applied_at) AS at FROM cleanup_applied
),
latest AS (
    SELECT DISTINCT ON (account_id) account_id, version_after, new_deadline
    FROM renewal ORDER BY account_id, version_after DESC, renewal_id DESC
),
renewal_chain AS (
    SELECT account_id, version_after,
           lag(version_after, 1, 1) OVER (PARTITION BY account_id ORDER BY at, renewal_id) AS previous
    FROM renewal
),
cleanup_reports AS (
    SELECT cleanup_id, max(greatest(recorded_at, reported_at)) AS at
    FROM cleanup_partition_reports GROUP BY cleanup_id
),
shard_reports AS (
    SELECT business_date, max(greatest(recorded_at, reported_at)) AS at
    FROM ledger_shard_reports GROUP BY business_date
),
revisions AS (
    SELECT business_date, revision, coalesce(recorded_at, settled_at) AS at,
           lag(revision) OVER w AS previous_revision,
           lag(coalesce(recorded_at, settled_at)) OVER w AS previous_at,
           row_number() OVER (PARTITION BY business_date ORDER BY revision DESC) AS newest_first
    FROM ledger_settlement_revisions
    WINDOW w AS (PARTITION BY business_date ORDER BY revision)
),
-- Accounts with a reminder of another version than their own: one pass over the outbox (it has no
-- index by account, so a probe per account would read it whole each time).
stale_reminder AS (
    SELECT o.account_id FROM outbox o JOIN accounts a USING (account_id)
    WHERE o.kind = 'renewal_reminder' AND (o.payload ->> 'cleanup_version')::int <> a.cleanup_version
),
corrections AS (
    SELECT game, payment_id, version_before, version_after,
           lag(version_after, 1, 1) OVER w AS previous_after,
           row_number() OVER (PARTITION BY game, payment_id ORDER BY correction_id DESC) AS newest_first
    FROM ledger_corrections
    WINDOW w AS (PARTITION BY game, payment_id ORDER BY correction_id)
)
SELECT
  -- a cleanup effect of version v committed after a renewal to a later version, or after the
  -- effect of a later version
  (SELECT count(DISTINCT e.account_id) FROM effect e
     WHERE EXISTS (SELECT 1 FROM renewal r WHERE r.account_id = e.account_id
                     AND r.version_after > e.cleanup_version AND r.at < e.at)
        OR EXISTS (SELECT 1 FROM effect n WHERE n.account_id = e.account_id
                     AND n.cleanup_version > e.cleanup_version AND n.at < e.at))::int
      AS ord_effect_after_newer_version,
  -- in-time renewals committed out of version order, or a version skipped or taken twice
  (SELECT count(DISTINCT account_id) FROM renewal_chain WHERE version_after <> previous + 1)::int
      AS ord_renewal_chain,
  -- the account's state is not the one its latest version implies: its version is not the latest
  -- renewal's; cleaned by another version's cleanup, or at another deadline than the latest one;
  -- 'renewed' although the latest renewal moved the deadline (or there was none); a reminder of an
  -- older version
  (SELECT count(*) FROM accounts a LEFT JOIN latest l USING (account_id)
     WHERE (l.account_id IS NOT NULL AND a.cleanup_version <> l.version_after)
        OR (a.status = 'cleaned' AND (
              NOT EXISTS (SELECT 1 FROM effect e WHERE e.account_id = a.account_id
                            AND e.cleanup_version = a.cleanup_version)
              OR EXISTS (SELECT 1 FROM effect e WHERE e.account_id = a.account_id
                           AND e.cleanup_version <> a.cleanup_version)
              OR (l.account_id IS NOT NULL AND l.new_deadline IS NULL)
              OR (l.new_deadline IS NOT NULL AND a.renewal_deadline <> l.new_deadline)
              OR a.account_id IN (SELECT account_id FROM stale_reminder)))
        OR (a.status = 'renewed' AND (l.account_id IS NULL OR l.new_deadline IS NOT NULL)))::int
      AS ord_terminal_state,
  -- a cleanup settled before one of its partitions reported (or reported again)
  (SELECT count(*) FROM cleanup_settlements s JOIN cleanup_reports p USING (cleanup_id)
     WHERE p.at > coalesce(s.recorded_at, s.settled_at))::int AS ord_cleanup_settled_before_report,
  -- a ledger date whose latest settlement revision precedes one of its shard reports
  (SELECT count(*) FROM revisions v JOIN shard_reports r USING (business_date)
     WHERE v.newest_first = 1 AND r.at > v.at)::int AS ord_ledger_settled_before_report,
  -- a settlement revision not after the one before it, a revision number skipped, or the date's
  -- settlement row not showing the latest revision
  ((SELECT count(*) FROM revisions
      WHERE coalesce(previous_revision, 0) <> revision - 1 OR at <= previous_at)
   + (SELECT count(*) FROM ledger_settlements s JOIN revisions v
        ON v.business_date = s.business_date AND v.newest_first = 1
      WHERE s.revision <> v.revision))::int AS ord_settlement_revisions,
  -- a correction whose version_before is not the version the previous correction of the payment
  -- left (a gap or a fork), or a chain that does not end at the payment's current version
  ((SELECT count(*) FROM corrections WHERE version_before <> previous_after)
   + (SELECT count(*) FROM corrections c JOIN ledger_payments p USING (game, payment_id)
      WHERE c.newest_first = 1 AND c.version_after <> p.version))::int AS ord_correction_chain;

-- name: reminder_versions
-- Every reminder of the lane with the version it was written for, and the account's own version
-- and state (NULL for events the harness seeded for accounts that do not exist).
SELECT o.event_key, o.account_id, (o.payload ->> 'cleanup_version')::int AS version,
       a.cleanup_version AS account_version, a.status AS account_status
FROM outbox o LEFT JOIN accounts a USING (account_id)
WHERE o.kind = 'renewal_reminder';

-- name: inject_revision_out_of_order
-- The deliberately broken ordering (`--inject-ordering-violation`): a settlement revision of the
-- date stamped before the revision it follows, as a settlement that raced an older one would be.
INSERT INTO ledger_settlement_revisions
    (business_date, revision, shards, keys_examined, discrepancies_found, corrected, sent_to_review,
     duplicate_report_rows, new_discrepancies, new_corrections, new_review_rows, changed_shards, reason,
     workflow_id, settled_at, recorded_at)
SELECT business_date, revision + 1, shards, keys_examined, discrepancies_found, corrected, sent_to_review,
       duplicate_report_rows, 0, 0, 0, '{}', 'injected ordering violation', workflow_id,
       settled_at - interval '1 second', coalesce(recorded_at, settled_at) - interval '1 second'
FROM ledger_settlement_revisions
WHERE business_date = $1
ORDER BY revision DESC
LIMIT 1
RETURNING revision;

-- The "late data" scenario (harness/scenarios/late_data.py). The business's ledger as it wrote it:
-- the seeded rows of a date and every late edit the scenario makes, never the reconciliation's
-- corrections (the scenario writes each edit to ledger_payments and here in one transaction).
-- With the provider's report rows, which the reconciliation never changes, these are the raw
-- inputs the oracle below reads.

-- name: late_data_truth_table
CREATE TABLE IF NOT EXISTS harness_ledger_truth (
    game           text NOT NULL,
    payment_id     text NOT NULL,
    business_date  date NOT NULL,
    shard          integer NOT NULL,
    amount_cents   bigint NOT NULL,
    currency       text NOT NULL,
    status         text NOT NULL,
    PRIMARY KEY (game, payment_id)
);

-- name: late_data_truth_copy
-- The date's ledger as seeded, before any run. $1 business date
INSERT INTO harness_ledger_truth (game, payment_id, business_date, shard, amount_cents, currency, status)
SELECT game, payment_id, business_date, shard, amount_cents, currency, status
FROM ledger_payments WHERE business_date = $1;

-- name: late_data_oracle
-- What reconciling a date must leave, computed from the raw inputs alone (harness_ledger_truth and
-- ledger_report_rows): one row per payment key of the date with the effect the rules of
-- docs/ledger.md demand (a correction, a review row or nothing), its kind, and the ledger values
-- the payment must end with. Written from the rules table, not from the product's batch statement:
-- it shares no SQL with reconcile_batch and never reads what a run wrote (corrections, review
-- rows, reports, the corrected ledger). Since every late edit touches a key that had no
-- discrepancy, or a new key, at most once, the result does not depend on when a run judged a key.
-- $1 business date, $2 tolerance in cents
WITH provider AS (
    SELECT game, payment_id,
           count(*) AS copies,
           count(DISTINCT (amount_cents, currency, status)) AS variants,
           min(amount_cents) AS amount_cents, min(currency) AS currency, min(status) AS status
    FROM ledger_report_rows
    WHERE business_date = $1
    GROUP BY game, payment_id
),
ours AS (
    SELECT game, payment_id, amount_cents, currency, status
    FROM harness_ledger_truth
    WHERE business_date = $1
),
side_by_side AS (
    SELECT game, payment_id,
           o.game IS NOT NULL AS in_ledger, p.game IS NOT NULL AS in_report,
           o.amount_cents AS ledger_amount, o.currency AS ledger_currency, o.status AS ledger_status,
           p.amount_cents AS provider_amount, p.currency AS provider_currency, p.status AS provider_status,
           coalesce(p.copies, 0) AS copies, coalesce(p.variants, 0) AS variants
    FROM ours o FULL JOIN provider p USING (game, payment_id)
),
rule AS (
    SELECT s.*,
        CASE
            WHEN NOT in_ledger THEN 'unknown_payment'
            WHEN NOT in_report AND ledger_status = 'unsettled' THEN NULL
            WHEN NOT in_report THEN 'not_settled'
            WHEN variants > 1 THEN 'conflicting_report_rows'
            WHEN ledger_currency <> provider_currency THEN 'currency_mismatch'
            WHEN abs(ledger_amount - provider_amount) > $2 THEN 'amount_beyond_tolerance'
            WHEN provider_status = 'refunded' AND ledger_status = 'captured' THEN 'refund_not_recorded'
            WHEN (provider_status, ledger_status) NOT IN (('settled', 'captured'), ('refunded', 'refunded'))
                THEN 'status_mismatch'
            WHEN ledger_amount <> provider_amount THEN 'amount_mismatch'
        END AS kind
    FROM side_by_side s
)
SELECT game, payment_id, kind,
       CASE WHEN kind IN ('not_settled', 'refund_not_recorded', 'amount_mismatch') THEN 'correction'
            WHEN kind IS NOT NULL THEN 'review'
       END AS effect,
       in_ledger,
       -- the payment's ledger values once reconciled (a review row changes nothing)
       CASE kind WHEN 'not_settled' THEN 'unsettled' WHEN 'refund_not_recorded' THEN 'refunded'
                 ELSE ledger_status END AS final_status,
       CASE WHEN kind IN ('refund_not_recorded', 'amount_mismatch') THEN provider_amount
            ELSE ledger_amount END AS final_amount,
       CASE WHEN variants = 1 THEN copies - 1 ELSE 0 END AS duplicate_report_rows
FROM rule
ORDER BY game, payment_id;

-- name: late_data_new_payment
-- A payment the business records late. $1 date, $2 shards, $3 game, $4 payment ID, $5 amount,
-- $6 currency, $7 status
WITH live AS (
    INSERT INTO ledger_payments (game, payment_id, business_date, shard, amount_cents, currency, status)
    VALUES ($3, $4, $1, ledger_shard_of($3, $4, $2), $5, $6, $7)
    RETURNING game, payment_id, business_date, shard, amount_cents, currency, status
)
INSERT INTO harness_ledger_truth (game, payment_id, business_date, shard, amount_cents, currency, status)
SELECT game, payment_id, business_date, shard, amount_cents, currency, status FROM live
RETURNING shard;

-- name: late_data_new_report_row
-- A provider report row arriving late. $1 date, $2 shards, $3 game, $4 payment ID, $5 amount,
-- $6 currency, $7 status
INSERT INTO ledger_report_rows (business_date, shard, game, payment_id, amount_cents, currency, status)
VALUES ($1, ledger_shard_of($3, $4, $2), $3, $4, $5, $6, $7)
RETURNING shard;

-- name: late_data_copy_report_row
-- The provider reports a payment again: an exact copy ($4 = 0) or a conflicting one (amount + $4).
-- $1 date, $2 game, $3 payment ID, $4 amount delta
INSERT INTO ledger_report_rows (business_date, shard, game, payment_id, amount_cents, currency, status)
SELECT business_date, shard, game, payment_id, amount_cents + $4, currency, status
FROM ledger_report_rows
WHERE business_date = $1 AND game = $2 AND payment_id = $3
ORDER BY report_row_id
LIMIT 1
RETURNING shard;

-- name: late_data_edit_payment
-- The business edits a payment by hand: amount + $3, the currency swapped ($4), captured <->
-- refunded ($5); in the ledger and in harness_ledger_truth alike, and only while the ledger row is
-- still as the business wrote it (a correction since would make the edit's outcome depend on
-- timing). $1 game, $2 payment ID
WITH live AS (
    UPDATE ledger_payments l
    SET amount_cents = t.amount_cents + $3,
        currency = CASE WHEN $4 THEN (CASE t.currency WHEN 'EUR' THEN 'USD' ELSE 'EUR' END) ELSE t.currency END,
        status = CASE WHEN $5 THEN (CASE t.status WHEN 'captured' THEN 'refunded' ELSE 'captured' END)
                      ELSE t.status END,
        updated_at = now()
    FROM harness_ledger_truth t
    WHERE l.game = $1 AND l.payment_id = $2 AND t.game = l.game AND t.payment_id = l.payment_id
      AND (l.amount_cents, l.currency, l.status) = (t.amount_cents, t.currency, t.status)
    RETURNING l.game, l.payment_id, l.shard, l.amount_cents, l.currency, l.status
)
UPDATE harness_ledger_truth t
SET amount_cents = live.amount_cents, currency = live.currency, status = live.status
FROM live
WHERE t.game = live.game AND t.payment_id = live.payment_id
RETURNING live.shard;

-- name: late_data_effects
-- What the runs wrote for a date: every correction and review row. $1 business date
SELECT game, payment_id, 'correction' AS effect, kind, new_status, new_amount_cents
FROM ledger_corrections WHERE business_date = $1
UNION ALL
SELECT game, payment_id, 'review', kind, NULL, NULL
FROM ledger_review WHERE business_date = $1;

-- name: late_data_ledger
-- The date's ledger as the runs left it. $1 business date
SELECT game, payment_id, status, amount_cents FROM ledger_payments WHERE business_date = $1;

-- name: late_data_hold_payment
-- The middle ledger row of a shard, locked by the caller's open transaction so the shard's batch
-- that reaches it waits. $1 business date, $2 shard
SELECT game, payment_id
FROM ledger_payments
WHERE business_date = $1 AND shard = $2
ORDER BY game, payment_id
OFFSET (SELECT count(*) / 2 FROM ledger_payments WHERE business_date = $1 AND shard = $2)
LIMIT 1
FOR UPDATE;

-- name: late_data_lock_waiters
-- Backends of this database waiting for a row lock (a batch held on the locked row; not the
-- advisory locks of the load budget or of a shard).
SELECT count(*)::int FROM pg_stat_activity
WHERE datname = current_database() AND wait_event_type = 'Lock' AND wait_event IN ('transactionid', 'tuple');

-- name: planner_not_terminal
-- Scenario 13: accounts of the given ID patterns not yet in a terminal state (cleaned or renewed).
SELECT count(*)::int FROM accounts
WHERE account_id LIKE ANY($1::text[]) AND status NOT IN ('cleaned', 'renewed');

-- name: planner_account_states
-- Scenario 13: each account's state and version, to compare with what its renewals imply.
SELECT account_id, status, cleanup_version FROM accounts WHERE account_id LIKE ANY($1::text[]);

-- name: planner_cleanups
-- Scenario 13: every cleanup that claimed or applied one of these accounts; `by_planner` is false
-- for a cleanup the planner did not start (its IDs are cleanup-bucket-* and cleanup-sweep-*).
SELECT cleanup_id, (cleanup_id LIKE 'cleanup-bucket-%' OR cleanup_id LIKE 'cleanup-sweep-%') AS by_planner
FROM (SELECT cleanup_id FROM cleanup_claims WHERE account_id LIKE ANY($1::text[])
      UNION SELECT cleanup_id FROM cleanup_applied WHERE account_id LIKE ANY($1::text[])) c
ORDER BY cleanup_id;

-- name: planner_due_done_at
-- Scenario 13: when the last account whose deadline had passed at $2 reached its terminal state
-- (cleaned_at; NULL if none of them was cleaned after $2), for the recovery after a kill at $2.
SELECT max(cleaned_at) FROM accounts
WHERE account_id LIKE ANY($1::text[]) AND renewal_deadline <= $2 AND cleaned_at > $2;

-- name: planner_lateness
-- Scenario 13: lateness (cleaned_at - renewal_deadline, seconds) of these accounts' cleanups.
SELECT count(*)::int AS cleaned,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY lateness) AS p50,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY lateness) AS p99,
       max(lateness) AS max
FROM (SELECT extract(epoch FROM cleaned_at - renewal_deadline)::float8 AS lateness
      FROM accounts WHERE account_id LIKE ANY($1::text[]) AND status = 'cleaned') l;

-- name: planner_late_renewals
-- Scenario 13: the renewals recorded for these accounts, by outcome.
SELECT outcome, count(*)::int AS n FROM renewals WHERE account_id = ANY($1::text[]) GROUP BY outcome;

-- name: planner_swept_since
-- Scenario 13: accounts the planner recorded as swept since $1, each sweep cleanup once (what
-- `planner status` adds up), and how many sweeps.
SELECT coalesce(sum(accounts), 0)::int AS accounts, count(*)::int AS sweeps
FROM (SELECT DISTINCT ON (cleanup_id) accounts FROM planner_sweeps
      WHERE kind = 'overdue' AND swept_at >= $1 ORDER BY cleanup_id, sweep_id) once;

-- name: planner_clock
-- Scenario 13: the database's clock (the planner's and the sweeps' time).
SELECT clock_timestamp();
