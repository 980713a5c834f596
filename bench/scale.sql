-- Named queries of the planner and scale benchmarks (bench/claim_chunks.py, bench/planner_lateness.py,
-- bench/planner_vs_single.py): seeding, deadlines spread over a window, lateness read back from the
-- database, and the server-wide figures (WAL position, dead tuples) a run reports.

-- name: seed_bare_accounts
-- Accounts only (no game data), IDs acct_b<g> for g from :first to :last, all with one deadline.
INSERT INTO accounts (account_id, renewal_deadline)
SELECT 'acct_b' || lpad(g::text, 9, '0'), :deadline FROM generate_series(:first::int, :last::int) g;

-- name: spread_deadlines
-- Every account's deadline spread uniformly over [:first, :first + :spread_seconds): the k-th of n
-- accounts (by ID) gets :first + k * :spread_seconds / n, so the deadlines do not follow the ID
-- order of the seed.
WITH ranked AS (
    SELECT account_id,
           row_number() OVER (ORDER BY md5(account_id)) - 1 AS k,
           count(*) OVER () AS n
    FROM accounts
)
UPDATE accounts a
SET renewal_deadline = :first::timestamptz + make_interval(secs => r.k * :spread_seconds::float8 / r.n)
FROM ranked r
WHERE a.account_id = r.account_id;

-- name: account_ids_by_deadline
SELECT account_id, renewal_deadline FROM accounts ORDER BY renewal_deadline, account_id;

-- name: cleaned_count
SELECT count(*)::int FROM accounts WHERE status = 'cleaned';

-- name: lateness_summary
-- cleaned_at - renewal_deadline of every cleaned account, in seconds, and how many were cleaned
-- more than once (idempotency records per account) or not at all.
SELECT count(*) FILTER (WHERE status = 'cleaned')::int AS cleaned,
       count(*) FILTER (WHERE status <> 'cleaned')::int AS not_cleaned,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY lateness) AS p50,
       percentile_cont(0.9) WITHIN GROUP (ORDER BY lateness) AS p90,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY lateness) AS p99,
       percentile_cont(0.999) WITHIN GROUP (ORDER BY lateness) AS p999,
       max(lateness) AS max,
       min(lateness) AS min
FROM (
    SELECT status, extract(epoch FROM cleaned_at - renewal_deadline)::float8 AS lateness FROM accounts
) l;

-- name: applied_per_account
-- Idempotency records per account: every account cleaned exactly once means max = min = 1.
SELECT count(*)::int AS accounts, coalesce(min(n), 0)::int AS min, coalesce(max(n), 0)::int AS max,
       coalesce(sum(n), 0)::int AS records
FROM (SELECT a.account_id, count(c.account_id) AS n
      FROM accounts a LEFT JOIN cleanup_applied c USING (account_id)
      GROUP BY a.account_id) x;

-- name: applied_by_kind
-- Which kind of cleanup cleaned the accounts: a planner bucket, an overdue sweep, a single account.
SELECT CASE WHEN cleanup_id LIKE 'cleanup-bucket-%' THEN 'bucket'
            WHEN cleanup_id LIKE 'cleanup-sweep-%' THEN 'sweep'
            ELSE 'other' END AS kind,
       count(*)::int AS accounts, count(DISTINCT cleanup_id)::int AS cleanups
FROM cleanup_applied GROUP BY 1 ORDER BY 1;

-- name: lateness_by_minute
-- Lateness per minute of deadlines since $1: if throughput were the limit, it would grow minute by minute.
SELECT floor(extract(epoch FROM renewal_deadline - $1::timestamptz) / 60)::int AS minute,
       count(*)::int AS accounts,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY lateness) AS p50,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY lateness) AS p99,
       max(lateness) AS max
FROM (SELECT renewal_deadline, extract(epoch FROM cleaned_at - renewal_deadline)::float8 AS lateness
      FROM accounts WHERE status = 'cleaned') l
GROUP BY 1 ORDER BY 1;

-- name: latest_accounts
-- The latest-cleaned accounts: deadline, claim and clean instants and who cleaned them.
SELECT a.account_id, a.renewal_deadline, a.claimed_at, a.cleaned_at, c.cleanup_id,
       extract(epoch FROM a.cleaned_at - a.renewal_deadline)::float8 AS lateness,
       extract(epoch FROM a.claimed_at - a.renewal_deadline)::float8 AS claim_lateness
FROM accounts a JOIN cleanup_applied c USING (account_id)
WHERE a.status = 'cleaned'
ORDER BY a.cleaned_at - a.renewal_deadline DESC
LIMIT $1;

-- name: claim_lateness
-- claimed_at - renewal_deadline: how much of the lateness is before the claim (timer, start, claim).
SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY l) AS p50,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY l) AS p99,
       max(l) AS max
FROM (SELECT extract(epoch FROM claimed_at - renewal_deadline)::float8 AS l
      FROM accounts WHERE status = 'cleaned') x;

-- name: overdue_sweeps
SELECT count(*)::int AS sweeps, coalesce(sum(accounts), 0)::int AS accounts FROM planner_sweeps WHERE kind = 'overdue';

-- name: wal_lsn
-- The server's WAL write position in bytes (all databases).
SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint;

-- name: table_stats
-- Dead tuples and vacuum activity of the claim's tables (the statistics collector's view).
SELECT relname, n_live_tup, n_dead_tup, n_tup_upd, n_tup_hot_upd, n_tup_ins, autovacuum_count,
       pg_total_relation_size(relid) AS total_bytes
FROM pg_stat_user_tables
WHERE relname = ANY ($1::text[])
ORDER BY relname;

-- name: database_clock
SELECT cleanup_clock();

-- name: cleanup_ids
SELECT DISTINCT cleanup_id FROM cleanup_applied ORDER BY cleanup_id;

-- name: account_states
-- Accounts by state (a stalled run: how many wait where).
SELECT state, count(*) AS accounts FROM accounts GROUP BY state ORDER BY state;

-- name: backends
-- What every other backend is doing (a stalled run: locks, long statements).
SELECT pid, state, wait_event_type, wait_event, now() - xact_start AS in_transaction,
       now() - query_start AS in_statement, left(query, 200) AS query
FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND datname = current_database();
