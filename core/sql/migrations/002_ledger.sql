-- Nightly payment-ledger reconciliation: the ledger, the provider's settlement report for
-- a business date, and the bookkeeping that makes reconciliation exactly once in effect:
-- corrections under an idempotency key, a dead-letter review table for operators, the per-shard
-- reports (the join, visible in the database) and one settlement row per business date.

-- Which shard a payment belongs to. The ledger and the provider report use the same function, so
-- a report row for a payment we do not know still lands in a definite shard.
CREATE FUNCTION ledger_shard_of(game text, payment_id text, shards integer) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT (((hashtextextended(game || ':' || payment_id, 0) % shards) + shards) % shards)::integer
$$;

-- Cents as an operator reads them: 1234 -> '12.34', -5 -> '-0.05'.
CREATE FUNCTION ledger_money(cents bigint) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT to_char(cents / 100.0, 'FM999999999999990.00')
$$;

-- One row per business date whose ledger and provider report are loaded, with its shard count:
-- reconciling a date that is not here, or a shard outside [0, shards), is malformed input.
CREATE TABLE ledger_days (
    business_date  date PRIMARY KEY,
    shards         integer NOT NULL CHECK (shards BETWEEN 1 AND 256),
    payments       bigint NOT NULL CHECK (payments >= 0),
    loaded_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE ledger_payments (
    game           text NOT NULL,
    payment_id     text NOT NULL,
    business_date  date NOT NULL REFERENCES ledger_days,
    shard          integer NOT NULL CHECK (shard >= 0),
    amount_cents   bigint NOT NULL,
    currency       text NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    status         text NOT NULL CHECK (status IN ('captured', 'refunded', 'unsettled')),
    version        integer NOT NULL DEFAULT 1 CHECK (version >= 1),
    updated_at     timestamptz,
    PRIMARY KEY (game, payment_id)
);
-- The keyset cursor of a shard: (game, payment_id) within (date, shard).
CREATE INDEX ledger_payments_shard_idx ON ledger_payments (business_date, shard, game, payment_id);

-- The provider's settlement report, as received: duplicates and unknown payments included.
CREATE TABLE ledger_report_rows (
    report_row_id  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    business_date  date NOT NULL,
    shard          integer NOT NULL CHECK (shard >= 0),
    game           text NOT NULL,
    payment_id     text NOT NULL,
    amount_cents   bigint NOT NULL,
    currency       text NOT NULL,
    status         text NOT NULL CHECK (status IN ('settled', 'refunded'))
);
CREATE INDEX ledger_report_rows_shard_idx ON ledger_report_rows (business_date, shard, game, payment_id);

-- The idempotency record and the audit trail of every correction: one per payment per date,
-- whoever runs the reconciliation and however often.
CREATE TABLE ledger_corrections (
    correction_id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    idempotency_key   text NOT NULL UNIQUE,  -- '{game}:{payment_id}:{YYYY-MM-DD}'
    business_date     date NOT NULL,
    shard             integer NOT NULL,
    game              text NOT NULL,
    payment_id        text NOT NULL,
    kind              text NOT NULL CHECK (kind IN ('refund_not_recorded', 'amount_mismatch', 'not_settled')),
    old_status        text NOT NULL,
    new_status        text NOT NULL,
    old_amount_cents  bigint NOT NULL,
    new_amount_cents  bigint NOT NULL,
    version_before    integer NOT NULL,
    version_after     integer NOT NULL,
    workflow_id       text NOT NULL,
    corrected_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ledger_corrections_shard_idx ON ledger_corrections (business_date, shard);

-- Dead letters: what no rule can reconcile, with a reason an operator can act on.
CREATE TABLE ledger_review (
    review_id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    review_key             text NOT NULL UNIQUE,  -- '{game}:{payment_id}:{YYYY-MM-DD}'
    business_date          date NOT NULL,
    shard                  integer NOT NULL,
    game                   text NOT NULL,
    payment_id             text NOT NULL,
    kind                   text NOT NULL CHECK (kind IN ('unknown_payment', 'amount_beyond_tolerance',
                               'currency_mismatch', 'status_mismatch', 'conflicting_report_rows')),
    reason                 text NOT NULL,
    ledger_amount_cents    bigint,
    provider_amount_cents  bigint,
    ledger_currency        text,
    provider_currency      text,
    ledger_status          text,
    provider_status        text,
    report_rows            integer NOT NULL,
    workflow_id            text NOT NULL,
    created_at             timestamptz NOT NULL DEFAULT now(),
    resolved_at            timestamptz,
    resolution             text
);
CREATE INDEX ledger_review_shard_idx ON ledger_review (business_date, shard);
CREATE INDEX ledger_review_open_idx ON ledger_review (business_date) WHERE resolved_at IS NULL;

-- The join: one row per (date, shard) once the shard has reported; written once.
CREATE TABLE ledger_shard_reports (
    business_date          date NOT NULL,
    shard                  integer NOT NULL,
    workflow_id            text NOT NULL,
    keys_examined          bigint NOT NULL,
    discrepancies_found    bigint NOT NULL,
    corrected              bigint NOT NULL,
    sent_to_review         bigint NOT NULL,
    duplicate_report_rows  bigint NOT NULL,
    batches                integer NOT NULL,
    reported_at            timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (business_date, shard),
    CHECK (corrected + sent_to_review = discrepancies_found)
);

-- One row per business date, written exactly once by the settlement step, and only balanced.
CREATE TABLE ledger_settlements (
    business_date          date PRIMARY KEY,
    shards                 integer NOT NULL,
    keys_examined          bigint NOT NULL,
    discrepancies_found    bigint NOT NULL,
    corrected              bigint NOT NULL,
    sent_to_review         bigint NOT NULL,
    duplicate_report_rows  bigint NOT NULL,
    workflow_id            text NOT NULL,
    settled_at             timestamptz NOT NULL DEFAULT now(),
    CHECK (corrected + sent_to_review = discrepancies_found)
);
