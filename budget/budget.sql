-- The load budget's statements (budget/controller.py). Acquires are serialised by a transaction-scoped
-- advisory lock taken in a statement of its own, so each acquire's snapshot already sees every
-- slot taken before it (advisory waits are not counted as lock stress).
--
-- The budget's own bookkeeping (acquire, release, renew, adjust) commits without waiting for the
-- WAL flush: its writes are leases and counters that a crash may lose harmlessly (a crash ends
-- every session, and a slot lives no longer than its session), and waiting would add a flush per batch (and per denied try) to the very
-- WAL queue that the players' commits wait in. The commit probe and the batches themselves
-- commit as usual.

-- name: no_commit_wait
SET LOCAL synchronous_commit TO off;

-- name: lock_budget
SELECT pg_advisory_xact_lock(7261012), set_config('synchronous_commit', 'off', true);

-- name: session_identity
-- The session a worker process ties its slots to (a slot is live only while it exists).
SELECT pid, backend_start FROM pg_stat_get_activity(pg_backend_pid());

-- name: acquire
-- :waited_seconds is how long this caller waited. After :blocked_after_seconds a session of this
-- role blocked on a lock (a batch waiting for a player's row) stops counting: it uses neither CPU
-- nor WAL, and one such batch must not stop every other one. (:session_pid, :session_start) is the
-- caller's budget session: the slot is live only while that session is.
-- A slot is live while its lease runs and its session exists (a session of another role shows
-- no start time: its pid alone is checked). Nothing is granted to a session that is gone
-- (session_alive: false): the caller opens a new one and asks again.
-- The limits now: the operator's caps (NULL: the workers' default, which may be NULL: no cap) and
-- the adaptive limits (NULL: not throttled), the smaller of the two; n or r NULL: no limit at all.
WITH b AS (
    SELECT clock_timestamp() AS now_, enabled, scale, tokens, refilled_at, quiet_until,
           coalesce(max_in_flight, :default_max_in_flight::int) AS max_n,
           least(coalesce(rows_per_second, :default_rows_per_second::float8), rate_limit) AS max_r,
           in_flight_limit,
           EXISTS (SELECT 1 FROM pg_stat_get_activity(:session_pid::int) a WHERE a.backend_start = :session_start::timestamptz)
               AS session_alive
    FROM load_budget WHERE name = 'database'
),
lim AS (
    SELECT b.*,
           CASE WHEN b.max_n = 0 THEN 0 ELSE least(b.max_n, b.in_flight_limit) END AS n,
           b.max_r AS r
    FROM b
),
live AS (
    SELECT count(*)::int AS live, coalesce(array_agg(s.slot), '{}'::int[]) AS slots
    FROM load_budget_slots s, b
    WHERE s.expires_at > b.now_
      AND (s.backend_pid IS NULL
           OR EXISTS (SELECT 1 FROM pg_stat_get_activity(s.backend_pid) a
                      WHERE a.backend_start = s.backend_start OR a.backend_start IS NULL))
),
blocked AS (
    SELECT count(*)::int AS blocked
    FROM pg_stat_activity a, b
    WHERE a.datname = current_database() AND a.usename = current_user AND a.state = 'active'
      AND a.wait_event_type = 'Lock' AND a.wait_event <> 'advisory'
      AND a.state_change < b.now_ - make_interval(secs => :blocked_after_seconds::float8)
),
held AS (
    SELECT live.live - least(live.live, blocked.blocked) AS held, live.slots, least(live.live, blocked.blocked) AS blocked
    FROM live, blocked
),
st AS (
    SELECT lim.*, held.held, held.slots, held.blocked,
           least(lim.r * :burst_seconds::float8,
                 lim.tokens + lim.r * extract(epoch FROM lim.now_ - lim.refilled_at)::float8) AS avail,
           held.held + held.blocked AS live
    FROM lim, held
),
v AS (
    SELECT st.*, f.slot_free,
           st.session_alive AND NOT st.enabled
           OR (st.session_alive AND (st.n IS NULL OR st.held < st.n) AND (st.r IS NULL OR st.avail > 0)
               AND f.slot_free IS NOT NULL AND st.now_ >= coalesce(st.quiet_until, '-infinity')) AS granted
    FROM st,
         LATERAL (SELECT min(g) AS slot_free FROM generate_series(0, coalesce(st.n + st.blocked, st.live + 1) - 1) g
                  WHERE g <> ALL (st.slots)) f
),
taken AS (
    INSERT INTO load_budget_slots AS s (slot, lease, job, holder, rows, acquired_at, expires_at, backend_pid, backend_start)
    SELECT v.slot_free, :lease, :job, :holder, :rows::int, v.now_, v.now_ + make_interval(secs => :lease_seconds::float8), :session_pid::int, :session_start::timestamptz
    FROM v
    WHERE v.granted AND v.enabled
    ON CONFLICT (slot) DO UPDATE  -- only a dead slot (lease run out or session gone) can be in the way
        SET lease = excluded.lease, job = excluded.job, holder = excluded.holder, rows = excluded.rows,
            acquired_at = excluded.acquired_at, expires_at = excluded.expires_at,
            backend_pid = excluded.backend_pid, backend_start = excluded.backend_start
    RETURNING s.slot
),
counted AS (
    UPDATE load_budget l
    SET tokens = CASE WHEN v.r IS NULL THEN 0  -- unthrottled: a throttle starts from an empty bucket
                      WHEN v.enabled THEN v.avail - CASE WHEN v.granted THEN :rows::int ELSE 0 END ELSE l.tokens END,
        refilled_at = v.now_,
        granted = l.granted + v.granted::int,
        denied = l.denied + (NOT v.granted)::int,
        wait_seconds = l.wait_seconds + CASE WHEN v.granted THEN :waited_seconds::float8 ELSE 0 END,
        peak_in_flight = CASE WHEN v.granted AND v.enabled THEN greatest(l.peak_in_flight, v.held + 1)
                              ELSE l.peak_in_flight END,
        window_peak_in_flight = CASE WHEN v.granted AND v.enabled THEN greatest(l.window_peak_in_flight, v.held + 1)
                                     ELSE l.window_peak_in_flight END
    FROM v
    WHERE l.name = 'database'
    RETURNING 1
)
SELECT v.granted, (SELECT slot FROM taken) AS slot, v.enabled, v.session_alive, v.n AS in_flight_limit,
       v.r AS rows_per_second, v.held AS in_flight,
       CASE WHEN v.avail <= 0 THEN (-v.avail) / v.r END AS refill_seconds,
       CASE WHEN v.now_ < v.quiet_until THEN extract(epoch FROM v.quiet_until - v.now_)::float8 END AS quiet_seconds,
       (SELECT count(*) FROM counted) AS counted
FROM v;

-- name: renew_slot
UPDATE load_budget_slots SET expires_at = clock_timestamp() + make_interval(secs => :lease_seconds::float8)
WHERE slot = :slot AND lease = :lease;

-- name: release
-- :slot is NULL when the budget was off, :ms_per_1000_rows NULL when the batch failed or had no rows.
-- :held_seconds, how long the slot was held (a claim's chunk too): with the rows done, the slot
-- time an account takes in all.
-- :cohort, the cohort the batch worked for (NULL: none): its accounts count as done there, and the
-- cohort is alive (one whose batches stop releasing, a cleanup finished with the budget
-- switched off or cancelled, is forgotten: deadline_demand).
WITH gone AS (
    DELETE FROM load_budget_slots WHERE slot = :slot AND lease = :lease RETURNING rows
),
cohort AS (
    UPDATE load_budget_cohorts SET done = done + :rows_done::int, updated_at = clock_timestamp()
    WHERE cohort = :cohort::text
)
UPDATE load_budget
SET tokens = tokens + coalesce((SELECT greatest(0, rows - :rows_done::int) FROM gone), 0),
    rows_done = rows_done + :rows_done::int,
    window_ms_sum = window_ms_sum + coalesce(:ms_per_1000_rows::float8, 0),
    window_batches = window_batches + (:ms_per_1000_rows::float8 IS NOT NULL)::int,
    window_slot_seconds = window_slot_seconds + CASE WHEN EXISTS (SELECT 1 FROM gone) THEN :held_seconds::float8 ELSE 0 END
WHERE name = 'database';

-- name: register_cohort
-- A cohort the deadline objective serves: :deadline is its earliest account's. A second
-- registration (a retried claim, another claim stream) keeps what is done.
-- Not while the operator has the budget off: its batches then count nothing done.
INSERT INTO load_budget_cohorts (cohort, deadline, accounts, updated_at)
SELECT :cohort, :deadline, :accounts, clock_timestamp() FROM load_budget WHERE name = 'database' AND enabled
ON CONFLICT (cohort) DO UPDATE
SET deadline = least(load_budget_cohorts.deadline, excluded.deadline),
    accounts = greatest(load_budget_cohorts.accounts, excluded.accounts),
    updated_at = excluded.updated_at;

-- name: deadline_demand
-- The rate that finishes every cohort with accounts left :plan_seconds after its deadline (a share
-- of :lateness_objective_seconds: room for a slow window): each cohort's accounts left over the
-- time to that plan, at least one second (a cohort past it asks for all it has left within the
-- next second). `target` is the latest deadline + :lateness_objective_seconds, the promise. Cohorts
-- done, or untouched for :forgotten_after_seconds (their cleanup ended without saying so), are forgotten.
WITH gone AS (
    DELETE FROM load_budget_cohorts
    WHERE done >= accounts OR updated_at < clock_timestamp() - make_interval(secs => :forgotten_after_seconds::float8)
    RETURNING cohort
),
open AS (
    SELECT accounts - done AS left_, deadline + make_interval(secs => :lateness_objective_seconds::float8) AS target,
           deadline + make_interval(secs => :plan_seconds::float8) AS plan
    FROM load_budget_cohorts
    WHERE done < accounts AND updated_at >= clock_timestamp() - make_interval(secs => :forgotten_after_seconds::float8)
)
SELECT count(*)::int AS cohorts, coalesce(sum(left_), 0)::bigint AS accounts_left,
       coalesce(sum(left_ / greatest(1.0, extract(epoch FROM plan - clock_timestamp())::float8)), 0)::float8
           AS rows_per_second,
       max(target) AS target
FROM open;

-- name: claim_adjustment
-- At most one worker adjusts per interval of :adjust_seconds, with the window's batches (their
-- latency, the rows they did per second, the most in flight at once, the seconds slots were held)
-- and the last verdict's binding objective and presence.
UPDATE load_budget l
SET adjusted_at = clock_timestamp(), window_ms_sum = 0, window_batches = 0,
    window_rows_done = l.rows_done, window_peak_in_flight = 0, window_slot_seconds = 0
FROM (SELECT window_ms_sum, window_batches, rows_done - window_rows_done AS window_rows, window_peak_in_flight,
             window_slot_seconds,
             extract(epoch FROM clock_timestamp() - adjusted_at)::float8 AS window_seconds
      FROM load_budget WHERE name = 'database') old
WHERE l.name = 'database' AND l.enabled
  AND (l.adjusted_at IS NULL OR l.adjusted_at < clock_timestamp() - make_interval(secs => :adjust_seconds::float8))
RETURNING l.rate_limit, l.probe_max_ms, l.binding, l.observed_players_present,
          old.window_rows, old.window_seconds, old.window_peak_in_flight, old.window_slot_seconds,
          old.window_ms_sum, old.window_batches, l.latency_ms, l.max_lock_waits,
          l.max_replication_lag_seconds, l.probe_ratio, l.probe_baseline_ms, l.probe_added_ms,
          l.lateness_objective_seconds, l.deadline_max_in_flight,
          extract(epoch FROM clock_timestamp() - l.probe_baseline_at)::float8 AS baseline_age_seconds,
          extract(epoch FROM clock_timestamp() - l.quiet_until)::float8 AS since_quiet_seconds,
          l.probe_baseline_server_start IS DISTINCT FROM pg_postmaster_start_time() AS server_restarted;

-- name: sample_players
-- Whether a player is at work now: a client session of this database that is not this service's (by
-- application_name, whatever the login: :service_name_prefix is core.db.APPLICATION_NAME)
-- running a statement in a transaction that writes (it holds a transaction ID until its commit is
-- flushed: the commit the players' objective protects). Idle sessions (a pool, a statement that
-- ended), reads (a monitoring poll, a progress query, a report), sessions idle in a transaction and
-- background processes (autovacuum) are not. Another role's session shows no state
-- (nor backend type) unless this role has pg_read_all_stats: it counts as running, so without the
-- grant the game's open connections read as players. One sample is one look; presence is the busy
-- share of the samples over a window (collect_probes), so a short query now and then is no player.
-- The function rather than the view pg_stat_activity: half the cost (the view's joins are planned
-- at every execution). Run before each probe, outside its timing: the probe times a player's commit.
SELECT EXISTS (
    SELECT 1 FROM pg_stat_get_activity(NULL) a
    WHERE a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
      AND a.pid <> pg_backend_pid()
      AND coalesce(a.backend_type, 'client backend') = 'client backend'
      AND left(coalesce(a.application_name, ''), length(:service_name_prefix::text)) <> :service_name_prefix::text
      AND (a.state IS NULL OR a.state IN ('active', 'fastpath function call') AND a.backend_xid IS NOT NULL)
) AS players;

-- name: probe
-- The commit probe: a one-row write that commits, timed by the caller. :previous_ms is the latency of
-- this holder's previous probe (NULL: none yet), :previous_quiet whether that one was quiet, :players whether the
-- sample taken just before saw a player at work (one presence sample, NULL: none taken; the
-- holder's samples start afresh once older than :presence_window_seconds). Returns whether this
-- one is quiet: no budget slot held anywhere while it ran.
INSERT INTO load_budget_probes AS p (holder, probed_at, busy_ms_sum, busy_n, quiet_ms_sum, quiet_n, players_seen_at,
                                     presence_n, presence_busy, presence_since)
VALUES (:holder, clock_timestamp(),
        CASE WHEN :previous_ms::float8 IS NOT NULL AND NOT :previous_quiet::boolean THEN :previous_ms::float8 ELSE 0 END,
        CASE WHEN :previous_ms::float8 IS NOT NULL AND NOT :previous_quiet::boolean THEN 1 ELSE 0 END,
        CASE WHEN :previous_ms::float8 IS NOT NULL AND :previous_quiet::boolean THEN :previous_ms::float8 ELSE 0 END,
        CASE WHEN :previous_ms::float8 IS NOT NULL AND :previous_quiet::boolean THEN 1 ELSE 0 END,
        CASE WHEN :players::boolean THEN clock_timestamp() END,
        (:players::boolean IS NOT NULL)::int, coalesce(:players::boolean::int, 0), clock_timestamp())
ON CONFLICT (holder) DO UPDATE
SET probed_at = excluded.probed_at,
    busy_ms_sum = p.busy_ms_sum + excluded.busy_ms_sum, busy_n = p.busy_n + excluded.busy_n,
    quiet_ms_sum = p.quiet_ms_sum + excluded.quiet_ms_sum, quiet_n = p.quiet_n + excluded.quiet_n,
    players_seen_at = coalesce(excluded.players_seen_at, p.players_seen_at),
    presence_n = CASE WHEN p.presence_since > clock_timestamp() - make_interval(secs => :presence_window_seconds::float8)
                      THEN p.presence_n ELSE 0 END + (:players::boolean IS NOT NULL)::int,
    presence_busy = CASE WHEN p.presence_since > clock_timestamp() - make_interval(secs => :presence_window_seconds::float8)
                         THEN p.presence_busy ELSE 0 END + coalesce(:players::boolean::int, 0),
    presence_since = CASE WHEN p.presence_since > clock_timestamp() - make_interval(secs => :presence_window_seconds::float8)
                          THEN p.presence_since ELSE clock_timestamp() END
RETURNING NOT EXISTS (
    SELECT 1 FROM load_budget_slots s
    WHERE s.expires_at > clock_timestamp()
      AND (s.backend_pid IS NULL
           OR EXISTS (SELECT 1 FROM pg_stat_get_activity(s.backend_pid) a
                      WHERE a.backend_start = s.backend_start OR a.backend_start IS NULL))
) AS quiet;

-- name: learn_idle_baseline
-- A quiet probe taken while the worker had no budgeted work: the baseline moves :weight of the way to its
-- latency :latency_ms (ms); a baseline of an earlier run of the server is replaced (a restart is not load).
UPDATE load_budget
SET probe_baseline_ms = CASE
        WHEN probe_baseline_ms IS NULL OR probe_baseline_server_start IS DISTINCT FROM pg_postmaster_start_time()
        THEN :latency_ms::float8
        ELSE probe_baseline_ms + :weight::float8 * (:latency_ms::float8 - probe_baseline_ms) END,
    probe_baseline_at = clock_timestamp(),
    probe_baseline_server_start = pg_postmaster_start_time()
WHERE name = 'database' AND enabled;

-- name: collect_probes
-- The adjustment takes every holder's probes and presence samples since the last one (and forgets
-- holders silent for a day), keeps the samples as one row of load_budget_presence and forgets rows
-- older than :presence_window_seconds: `samples` and `busy` are the window's, this adjustment's
-- included.
WITH old AS (
    SELECT holder, busy_ms_sum, busy_n, quiet_ms_sum, quiet_n, probed_at, presence_n, presence_busy, presence_since
    FROM load_budget_probes FOR UPDATE
),
taken AS (
    UPDATE load_budget_probes p
    SET busy_ms_sum = 0, busy_n = 0, quiet_ms_sum = 0, quiet_n = 0, presence_n = 0, presence_busy = 0,
        presence_since = NULL
    FROM old WHERE p.holder = old.holder AND old.probed_at >= clock_timestamp() - interval '1 day'
    RETURNING old.busy_ms_sum, old.busy_n, old.quiet_ms_sum, old.quiet_n,
              CASE WHEN old.presence_since > clock_timestamp() - make_interval(secs => :presence_window_seconds::float8)
                   THEN old.presence_n ELSE 0 END AS presence_n,
              CASE WHEN old.presence_since > clock_timestamp() - make_interval(secs => :presence_window_seconds::float8)
                   THEN old.presence_busy ELSE 0 END AS presence_busy
),
gone AS (
    DELETE FROM load_budget_probes p USING old
    WHERE p.holder = old.holder AND old.probed_at < clock_timestamp() - interval '1 day'
),
now_ AS (
    SELECT coalesce(sum(busy_ms_sum), 0)::float8 AS busy_ms_sum, coalesce(sum(busy_n), 0)::int AS busy_n,
           coalesce(sum(quiet_ms_sum), 0)::float8 AS quiet_ms_sum, coalesce(sum(quiet_n), 0)::int AS quiet_n,
           coalesce(sum(presence_n), 0)::int AS samples, coalesce(sum(presence_busy), 0)::int AS busy
    FROM taken
),
kept AS (
    INSERT INTO load_budget_presence (at, samples, busy)
    SELECT clock_timestamp(), samples, busy FROM now_ WHERE samples > 0
),
expired AS (
    DELETE FROM load_budget_presence WHERE at <= clock_timestamp() - make_interval(secs => :presence_window_seconds::float8)
),
earlier AS (
    SELECT coalesce(sum(samples), 0)::int AS samples, coalesce(sum(busy), 0)::int AS busy
    FROM load_budget_presence WHERE at > clock_timestamp() - make_interval(secs => :presence_window_seconds::float8)
)
SELECT now_.busy_ms_sum, now_.busy_n, now_.quiet_ms_sum, now_.quiet_n,
       now_.samples + earlier.samples AS presence_samples, now_.busy + earlier.busy AS presence_busy
FROM now_, earlier;

-- name: sample_stress
-- Lock waits in this database (players' included; advisory locks excluded: they are the jobs' own
-- turn-taking; other databases of the server are not this budget's business), and the lag of the
-- slowest standby if any streams from this server.
SELECT (SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
        WHERE NOT l.granted AND l.locktype <> 'advisory' AND a.datname = current_database())::int AS lock_waits,
       (SELECT extract(epoch FROM max(greatest(write_lag, flush_lag, replay_lag)))::float8
        FROM pg_stat_replication) AS replication_lag;

-- name: apply_adjustment
-- NULL :rate_limit or :in_flight_limit: unthrottled; NULL :stress: healthy; NULL :new_baseline_ms:
-- unchanged. :quiet_seconds grants nothing for that long so that the probes measure a baseline
-- (NULL: none). :forget_baseline: the server restarted since the baseline was measured
-- (:new_baseline_ms may be the new one already). :projected_finish is when the last cohort would
-- finish at the rate granted.
UPDATE load_budget
SET observed_busy_fraction = :busy_fraction::float8, binding = :binding::text, deadline_rows_per_second = :deadline_rows_per_second::float8,
    deadline_accounts_left = :deadline_accounts_left::bigint, deadline_target = :deadline_target::timestamptz, projected_finish = :projected_finish::timestamptz,
    rate_limit = :rate_limit::float8, in_flight_limit = :in_flight_limit::int, limited_by = :limited_by::text,
    observed_rows_per_second = :window_rows_per_second::float8, stress = :stress::text, observed_players_present = :players_present::boolean,
    stressed_at = CASE WHEN :stress::text IS NOT NULL THEN clock_timestamp() ELSE stressed_at END,
    last_stress = coalesce(:stress::text, last_stress),
    observed_latency_ms = :latency_ms::float8, observed_lock_waits = :lock_waits::int, observed_replication_lag = :replication_lag::float8,
    observed_probe_ms = :probe_ms::float8, observed_probes = :probes::int,
    probe_baseline_ms = CASE WHEN :new_baseline_ms::float8 IS NOT NULL THEN :new_baseline_ms::float8
                             WHEN :forget_baseline::boolean THEN NULL ELSE probe_baseline_ms END,
    probe_baseline_at = CASE WHEN :new_baseline_ms::float8 IS NOT NULL THEN clock_timestamp()
                             WHEN :forget_baseline::boolean THEN NULL ELSE probe_baseline_at END,
    probe_baseline_server_start = CASE WHEN :new_baseline_ms::float8 IS NOT NULL OR :forget_baseline::boolean THEN pg_postmaster_start_time()
                                       ELSE probe_baseline_server_start END,
    quiet_until = CASE WHEN :quiet_seconds::float8 IS NOT NULL THEN clock_timestamp() + make_interval(secs => :quiet_seconds::float8)
                       ELSE quiet_until END
WHERE name = 'database';

-- name: budget_row
SELECT *, clock_timestamp() AS now_ FROM load_budget WHERE name = 'database';

-- name: budget_slots
SELECT slot, job, holder, rows, acquired_at, expires_at, backend_pid,
       NOT (s.expires_at > clock_timestamp()
            AND (s.backend_pid IS NULL
                 OR EXISTS (SELECT 1 FROM pg_stat_get_activity(s.backend_pid) a
                            WHERE a.backend_start = s.backend_start OR a.backend_start IS NULL))) AS expired
FROM load_budget_slots s ORDER BY slot;

-- name: set_budget
-- For each limit: whether it changes (:change_<limit>) and its value (:<limit>; NULL = back to the
-- workers' default).
UPDATE load_budget
SET enabled = coalesce(:enabled::boolean, enabled),
    max_in_flight = CASE WHEN :change_max_in_flight::boolean THEN :max_in_flight::int ELSE max_in_flight END,
    rows_per_second = CASE WHEN :change_rows_per_second::boolean THEN :rows_per_second::float8 ELSE rows_per_second END,
    latency_ms = CASE WHEN :change_latency_ms::boolean THEN :latency_ms::float8 ELSE latency_ms END,
    max_lock_waits = CASE WHEN :change_max_lock_waits::boolean THEN :max_lock_waits::int ELSE max_lock_waits END,
    max_replication_lag_seconds = CASE WHEN :change_max_replication_lag_seconds::boolean THEN :max_replication_lag_seconds::float8 ELSE max_replication_lag_seconds END,
    probe_ratio = CASE WHEN :change_probe_ratio::boolean THEN :probe_ratio::float8 ELSE probe_ratio END,
    probe_max_ms = CASE WHEN :change_probe_max_ms::boolean THEN :probe_max_ms::float8 ELSE probe_max_ms END,
    probe_added_ms = CASE WHEN :change_probe_added_ms::boolean THEN :probe_added_ms::float8 ELSE probe_added_ms END,
    lateness_objective_seconds = CASE WHEN :change_lateness_objective_seconds::boolean THEN :lateness_objective_seconds::float8 ELSE lateness_objective_seconds END,
    deadline_max_in_flight = CASE WHEN :change_deadline_max_in_flight::boolean THEN :deadline_max_in_flight::int ELSE deadline_max_in_flight END,
    rate_limit = CASE WHEN :reset_scale::boolean THEN NULL ELSE rate_limit END,
    in_flight_limit = CASE WHEN :reset_scale::boolean THEN NULL ELSE in_flight_limit END,
    limited_by = CASE WHEN :reset_scale::boolean THEN NULL ELSE limited_by END,
    quiet_until = CASE WHEN :reset_scale::boolean THEN NULL ELSE quiet_until END,
    changed_by = :changed_by::text, changed_at = clock_timestamp(), peak_in_flight = 0
WHERE name = 'database';
