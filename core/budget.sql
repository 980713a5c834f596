-- The load budget's statements (core/budget.py). Acquires are serialised by a transaction-scoped
-- advisory lock taken in a statement of its own, so each acquire's snapshot already sees every
-- slot taken before it (advisory waits are not counted as lock stress).

-- name: lock_budget
SELECT pg_advisory_xact_lock(7261012);

-- name: acquire
-- $1 lease, $2 job, $3 holder, $4 rows, $5 lease seconds, $6 default max_in_flight,
-- $7 default rows/s, $8 seconds this caller waited, $9 burst seconds
WITH b AS (
    SELECT clock_timestamp() AS now_, enabled, scale, tokens, refilled_at,
           coalesce(max_in_flight, $6::int) AS max_n,
           coalesce(rows_per_second, $7::float8) AS max_r
    FROM load_budget WHERE name = 'database'
),
lim AS (
    SELECT b.*,
           CASE WHEN b.max_n = 0 THEN 0 ELSE greatest(1, floor(b.max_n * b.scale))::int END AS n,
           b.max_r * b.scale AS r
    FROM b
),
held AS (
    SELECT count(*)::int AS held, coalesce(array_agg(s.slot), '{}'::int[]) AS slots
    FROM load_budget_slots s, b
    WHERE s.expires_at > b.now_
),
st AS (
    SELECT lim.*, held.held, held.slots,
           least(lim.r * $9::float8,
                 lim.tokens + lim.r * extract(epoch FROM lim.now_ - lim.refilled_at)::float8) AS avail
    FROM lim, held
),
v AS (
    SELECT st.*, f.slot_free,
           NOT st.enabled OR (st.held < st.n AND st.avail > 0 AND f.slot_free IS NOT NULL) AS granted
    FROM st,
         LATERAL (SELECT min(g) AS slot_free FROM generate_series(0, st.n - 1) g WHERE g <> ALL (st.slots)) f
),
taken AS (
    INSERT INTO load_budget_slots AS s (slot, lease, job, holder, rows, acquired_at, expires_at)
    SELECT v.slot_free, $1, $2, $3, $4::int, v.now_, v.now_ + make_interval(secs => $5::float8)
    FROM v
    WHERE v.granted AND v.enabled
    ON CONFLICT (slot) DO UPDATE  -- only an expired lease can be in the way
        SET lease = excluded.lease, job = excluded.job, holder = excluded.holder, rows = excluded.rows,
            acquired_at = excluded.acquired_at, expires_at = excluded.expires_at
    RETURNING s.slot
),
counted AS (
    UPDATE load_budget l
    SET tokens = CASE WHEN v.enabled THEN v.avail - CASE WHEN v.granted THEN $4::int ELSE 0 END ELSE l.tokens END,
        refilled_at = v.now_,
        granted = l.granted + v.granted::int,
        denied = l.denied + (NOT v.granted)::int,
        wait_seconds = l.wait_seconds + CASE WHEN v.granted THEN $8::float8 ELSE 0 END,
        peak_in_flight = CASE WHEN v.granted AND v.enabled THEN greatest(l.peak_in_flight, v.held + 1)
                              ELSE l.peak_in_flight END
    FROM v
    WHERE l.name = 'database'
    RETURNING 1
)
SELECT v.granted, (SELECT slot FROM taken) AS slot, v.enabled, v.n AS in_flight_limit,
       v.r AS rows_per_second, v.held AS in_flight, v.scale,
       CASE WHEN v.avail <= 0 THEN (-v.avail) / v.r END AS refill_seconds,
       (SELECT count(*) FROM counted) AS counted
FROM v;

-- name: renew_slot
UPDATE load_budget_slots SET expires_at = clock_timestamp() + make_interval(secs => $3::float8)
WHERE slot = $1 AND lease = $2;

-- name: release
-- $1 slot (NULL when the budget was off), $2 lease, $3 rows done, $4 ms per 1000 rows (NULL: failed)
WITH gone AS (
    DELETE FROM load_budget_slots WHERE slot = $1 AND lease = $2 RETURNING rows
)
UPDATE load_budget
SET tokens = tokens + coalesce((SELECT greatest(0, rows - $3::int) FROM gone), 0),
    rows_done = rows_done + $3::int,
    window_ms_sum = window_ms_sum + coalesce($4::float8, 0),
    window_batches = window_batches + ($4::float8 IS NOT NULL)::int
WHERE name = 'database';

-- name: claim_adjustment
-- $1 seconds between adjustments: at most one worker adjusts per interval, with the window's batches.
UPDATE load_budget l
SET adjusted_at = clock_timestamp(), window_ms_sum = 0, window_batches = 0
FROM (SELECT window_ms_sum, window_batches FROM load_budget WHERE name = 'database') old
WHERE l.name = 'database' AND l.enabled
  AND (l.adjusted_at IS NULL OR l.adjusted_at < clock_timestamp() - make_interval(secs => $1::float8))
RETURNING l.scale, old.window_ms_sum, old.window_batches, l.latency_ms, l.max_lock_waits,
          l.max_replication_lag_seconds;

-- name: sample_stress
-- Lock waits anywhere in the cluster (players' included; advisory locks excluded: they are the
-- jobs' own turn-taking), and the lag of the slowest standby if any streams from this server.
SELECT (SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype <> 'advisory')::int AS lock_waits,
       (SELECT extract(epoch FROM max(greatest(write_lag, flush_lag, replay_lag)))::float8
        FROM pg_stat_replication) AS replication_lag;

-- name: apply_adjustment
-- $1 new scale, $2 why it shrank (NULL: healthy), $3 latency ms per 1000 rows, $4 lock waits, $5 lag
UPDATE load_budget
SET scale = $1::float8, stress = $2::text,
    stressed_at = CASE WHEN $2::text IS NOT NULL THEN clock_timestamp() ELSE stressed_at END,
    observed_latency_ms = $3::float8, observed_lock_waits = $4::int, observed_replication_lag = $5::float8
WHERE name = 'database';

-- name: budget_row
SELECT *, clock_timestamp() AS now_ FROM load_budget WHERE name = 'database';

-- name: budget_slots
SELECT slot, job, holder, rows, acquired_at, expires_at, expires_at <= clock_timestamp() AS expired
FROM load_budget_slots ORDER BY slot;

-- name: set_budget
-- For each limit: ($n change?, $n+1 value; NULL value = back to the workers' default).
UPDATE load_budget
SET enabled = coalesce($1::boolean, enabled),
    max_in_flight = CASE WHEN $2::boolean THEN $3::int ELSE max_in_flight END,
    rows_per_second = CASE WHEN $4::boolean THEN $5::float8 ELSE rows_per_second END,
    latency_ms = CASE WHEN $6::boolean THEN $7::float8 ELSE latency_ms END,
    max_lock_waits = CASE WHEN $8::boolean THEN $9::int ELSE max_lock_waits END,
    max_replication_lag_seconds = CASE WHEN $10::boolean THEN $11::float8 ELSE max_replication_lag_seconds END,
    scale = CASE WHEN $12::boolean THEN 1 ELSE scale END,
    changed_by = $13::text, changed_at = clock_timestamp(), peak_in_flight = 0
WHERE name = 'database';
