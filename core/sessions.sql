-- Sessions that a paused client left holding locks (core/sessions.py).

-- name: end_stalled_lock_holders
-- $1 seconds. Sessions of this role inside a transaction, waiting for their client in the middle of
-- a statement's exchange for longer than $1 seconds, while another session waits for a lock they
-- hold. asyncpg prepares a statement it has not cached with Parse/Describe and a Flush (no Sync),
-- then sends Bind/Execute/Sync: a client paused in between (a worker frozen, its VM paused, a long
-- GC) leaves its backend 'active' and reading, where idle_in_transaction_session_timeout does not
-- apply (PostgreSQL 15 has no transaction_timeout), so its row and advisory locks stay held until
-- it wakes. COPY FROM STDIN is the one exchange where a client is read from for long; never ended.
WITH waited_on AS (
    SELECT DISTINCT unnest(pg_blocking_pids(w.pid)) AS pid
    FROM pg_stat_activity w
    WHERE w.datname = current_database() AND w.wait_event_type = 'Lock'
)
SELECT a.pid, extract(epoch FROM clock_timestamp() - a.state_change)::float8 AS stalled_seconds,
       left(a.query, 80) AS query, pg_terminate_backend(a.pid) AS ended
FROM pg_stat_activity a
JOIN waited_on USING (pid)
WHERE a.datname = current_database() AND a.usename = current_user AND a.pid <> pg_backend_pid()
  AND a.state = 'active' AND a.wait_event_type = 'Client' AND a.wait_event = 'ClientRead'
  AND a.xact_start IS NOT NULL
  AND a.query !~* '^\s*copy\s'
  AND a.state_change < clock_timestamp() - make_interval(secs => $1::float8);
