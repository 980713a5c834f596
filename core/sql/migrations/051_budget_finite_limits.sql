-- The operator's budget limits are finite numbers. In Postgres NaN sorts above every number, so
-- `rows_per_second > 0` let NaN through (and 'Infinity' too), and a NaN rate removed the limit.
-- `< 'Infinity'` is false for both NaN and infinity; NULL still means "the workers' setting".
-- A non-finite value already stored goes back to that setting first, so the constraints apply.
UPDATE load_budget SET rows_per_second = NULL WHERE NOT rows_per_second < 'Infinity'::float8;
UPDATE load_budget SET latency_ms = NULL WHERE NOT latency_ms < 'Infinity'::float8;
UPDATE load_budget SET max_replication_lag_seconds = NULL
    WHERE NOT max_replication_lag_seconds < 'Infinity'::float8;
UPDATE load_budget SET probe_ratio = NULL WHERE NOT probe_ratio < 'Infinity'::float8;

ALTER TABLE load_budget
    ADD CONSTRAINT load_budget_rows_per_second_finite CHECK (rows_per_second < 'Infinity'::float8),
    ADD CONSTRAINT load_budget_latency_ms_finite CHECK (latency_ms < 'Infinity'::float8),
    ADD CONSTRAINT load_budget_max_replication_lag_finite
        CHECK (max_replication_lag_seconds < 'Infinity'::float8),
    ADD CONSTRAINT load_budget_probe_ratio_finite CHECK (probe_ratio < 'Infinity'::float8);
