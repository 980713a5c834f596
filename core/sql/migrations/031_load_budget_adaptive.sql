-- The load budget adapts in both directions (core/budget.py, docs/budget.md): while the database
-- shows no stress the work runs unthrottled (rate_limit and in_flight_limit NULL; only the
-- operator's caps, if any, apply); on stress it is throttled to half of what it was doing, and
-- grows back while healthy until the limit no longer binds, when it is lifted again.
--
-- The objective is stated in the players' terms: the commit probe's mean over an adjustment window
-- at most probe_ratio x its quiet baseline (plus probe_min_ms), and, when set, at most
-- probe_max_ms. `limited_by` says what sets the rate now (budget show, metrics).
--
-- Numbers an operator sets must be numbers: `x < 'Infinity'` excludes infinity and NaN too
-- (Postgres orders NaN above every number, so NaN > 0 would pass the older checks).
ALTER TABLE load_budget
    ADD COLUMN rate_limit           double precision CHECK (rate_limit > 0 AND rate_limit < 'Infinity'),
    ADD COLUMN in_flight_limit      integer CHECK (in_flight_limit >= 1),
    ADD COLUMN window_rows_done     bigint NOT NULL DEFAULT 0,
    ADD COLUMN window_peak_in_flight integer NOT NULL DEFAULT 0,
    ADD COLUMN observed_rows_per_second double precision,
    ADD COLUMN probe_max_ms         double precision CHECK (probe_max_ms > 0 AND probe_max_ms < 'Infinity'),
    ADD COLUMN limited_by           text,
    ADD COLUMN last_stress          text,  -- why it was last throttled (stress: the last adjustment's verdict)
    ADD CONSTRAINT load_budget_limits_are_finite CHECK (
        rows_per_second < 'Infinity' AND latency_ms < 'Infinity'
        AND max_replication_lag_seconds < 'Infinity' AND probe_ratio < 'Infinity');
