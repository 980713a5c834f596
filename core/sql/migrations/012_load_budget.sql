-- The load budget: one limit for every cleanup and reconciliation batch together, across all
-- worker processes and nodes, so the work does not crowd out the players on the same database
-- (core/budget.py, docs/budget.md).
--
-- One row holds the operator's limits (NULL: the workers' LOAD_BUDGET_* settings), the adaptive
-- scale (shrinks when the database shows stress, grows back when healthy), the token bucket of rows
-- and counters. A batch holds one row of load_budget_slots while it runs: at most the effective
-- `max_in_flight` of them exist; a holder that dies stops renewing its lease and its slot expires.
CREATE TABLE load_budget (
    name                        text PRIMARY KEY CHECK (name = 'database'),
    enabled                     boolean NOT NULL DEFAULT true,
    max_in_flight               integer CHECK (max_in_flight BETWEEN 0 AND 256),
    rows_per_second             double precision CHECK (rows_per_second > 0),
    latency_ms                  double precision CHECK (latency_ms > 0),
    max_lock_waits              integer CHECK (max_lock_waits >= 0),
    max_replication_lag_seconds double precision CHECK (max_replication_lag_seconds > 0),
    changed_by                  text,
    changed_at                  timestamptz,
    -- adaptive back-off
    scale                       double precision NOT NULL DEFAULT 1 CHECK (scale > 0 AND scale <= 1),
    adjusted_at                 timestamptz,
    window_ms_sum               double precision NOT NULL DEFAULT 0,
    window_batches              integer NOT NULL DEFAULT 0,
    observed_latency_ms         double precision,
    observed_lock_waits         integer,
    observed_replication_lag    double precision,
    stress                      text,
    stressed_at                 timestamptz,
    -- token bucket of rows
    tokens                      double precision NOT NULL DEFAULT 0,
    refilled_at                 timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- counters (peak since the last `budget set`)
    peak_in_flight              integer NOT NULL DEFAULT 0,
    granted                     bigint NOT NULL DEFAULT 0,
    denied                      bigint NOT NULL DEFAULT 0,
    rows_done                   bigint NOT NULL DEFAULT 0,
    wait_seconds                double precision NOT NULL DEFAULT 0
);
INSERT INTO load_budget (name) VALUES ('database');

CREATE TABLE load_budget_slots (
    slot        integer PRIMARY KEY CHECK (slot >= 0),
    lease       text NOT NULL,
    job         text NOT NULL,
    holder      text NOT NULL,
    rows        integer NOT NULL,
    acquired_at timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL
);
