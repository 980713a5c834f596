-- Sessions that a paused client left holding locks (core/sessions.py).

-- name: end_stalled_lock_holders
-- This service's sessions (by the application_name prefix of core.db.APPLICATION_NAME) inside a
-- transaction, waiting for their client in the middle of a statement's exchange for longer than
-- :stalled_seconds, while another session waits for a lock they
-- hold. asyncpg prepares a statement it has not cached with Parse/Describe and a Flush (no Sync),
-- then sends Bind/Execute/Sync: a client paused in between (a worker frozen, its VM paused, a long
-- GC) leaves its backend 'active' and reading, where idle_in_transaction_session_timeout does not
-- apply (PostgreSQL 17's transaction_timeout does), so its row and advisory locks stay held until
-- it wakes. Matched by application_name, never by role: a login shared with the game (or a
-- pooler's) must not expose the game's sessions to this rule. COPY FROM STDIN is the one exchange
-- where a client is read from for long; never ended. The query text is not returned: it is
-- another session's SQL, literals included.
WITH waited_on AS (
    SELECT pid, count(*) AS waiters
    FROM (
        SELECT unnest(pg_blocking_pids(w.pid)) AS pid
        FROM pg_stat_activity w
        WHERE w.datname = current_database() AND w.wait_event_type = 'Lock'
    ) blockers
    GROUP BY pid
)
SELECT a.pid, a.application_name, waited_on.waiters,
       extract(epoch FROM clock_timestamp() - a.state_change)::float8 AS stalled_seconds,
       pg_terminate_backend(a.pid) AS ended
FROM pg_stat_activity a
JOIN waited_on USING (pid)
WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
  AND left(a.application_name, length(:application_prefix::text)) = :application_prefix::text
  AND a.state = 'active' AND a.wait_event_type = 'Client' AND a.wait_event = 'ClientRead'
  AND a.xact_start IS NOT NULL
  AND a.query !~* '^\s*copy\s'
  AND a.state_change < clock_timestamp() - make_interval(secs => :stalled_seconds::float8);
