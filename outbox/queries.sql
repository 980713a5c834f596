-- Named queries of the outbox relay. Loaded by core.queries.load(__file__).
-- Every statement is set-based: one per batch, whatever the batch size.

-- name: claim_batch
-- The :lease_owner is unique per claim. SKIP LOCKED: two relays claiming at once never wait for, nor take, each other's rows; a row one
-- of them has just leased fails the re-check of `leased_until` and is skipped by the other.
-- A relay that dies keeps its lease only until `leased_until`; then the rows are due again.
-- Commits without waiting for the WAL flush: a claim a database crash loses leaves its rows due at
-- once; whatever the relay sent of them is sent again under the same Idempotency-Key, and its
-- outcomes are then recorded as a lost lease's are (delivered kept, retry and dead fenced).
WITH due AS (
    SELECT event_id
    FROM outbox
    WHERE status = 'pending'
      AND next_attempt_at <= now()
      AND (leased_until IS NULL OR leased_until < now())
    ORDER BY next_attempt_at, event_id
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox o
SET lease_owner = :lease_owner,
    leased_until = now() + make_interval(secs => :lease_seconds::float8),
    attempts = o.attempts + 1,
    last_attempt_at = now()
-- By primary key (the claimed IDs as an array): never a scan of the whole outbox per claim.
WHERE o.event_id = ANY (ARRAY(SELECT event_id FROM due))
  AND (SELECT set_config('synchronous_commit', 'off', true)) = 'off'
RETURNING o.event_id, o.event_key, o.kind, o.account_id, o.source_id, o.payload, o.attempts, o.failures,
    o.failure_counts;

-- name: record_outcomes
-- The delivered events' :delivered_ids and :delivered_statuses; then one array per column for every
-- other event: :outcomes 'retry' | 'dead' ('delivered' is accepted too), an HTTP status NULL for a
-- timeout or a broken connection, the delay before the next attempt in seconds, the error text
-- (already redacted), a failure kind ('503', 'timeout', ...; NULL when the answer was no failure:
-- 429, not sent). Only a failure kind adds to `failures` / `failure_counts`.
-- The delivered events (nearly all of them) take a statement of their own within this one: two
-- arrays to send and decode instead of seven, and none of the retry bookkeeping's expressions.
-- Safe to run again with the same owner (a relay that lost its database connection does): rows it
-- already recorded (`recorded_by` is the owner) are left alone and counted as that owner's outcomes again;
-- they are looked up only when some rows were not updated (a rerun or a lost lease), never on the
-- common path. 'delivered' is recorded even if the lease was lost meanwhile (the provider has the
-- message, so a second send would only be a deduplicated duplicate); 'retry' and 'dead' are fenced
-- by the lease owner, so a relay whose lease expired cannot overwrite the outcome of the relay that
-- took the event over.
-- Commits without waiting for the WAL flush (synchronous_commit off for this transaction): a crash
-- of the database may lose the last fraction of a second of outcomes; those events are pending
-- again and sent again under the same Idempotency-Key, which the provider acknowledges without
-- delivering twice (docs/outbox.md, "Durability of the relay's bookkeeping").
WITH result AS (
    SELECT *
    FROM unnest(:event_ids::bigint[], :outcomes::text[], :http_statuses::int[], :delays_seconds::float8[], :errors::text[], :failure_kinds::text[])
        AS r(event_id, outcome, http_status, delay_seconds, error, failure_kind)
),
delivered AS (
    UPDATE outbox o
    SET status = 'delivered',
        delivered_at = now(),
        last_http_status = d.http_status,
        lease_owner = NULL,
        leased_until = NULL,
        recorded_by = :lease_owner
    FROM unnest(:delivered_ids::bigint[], :delivered_statuses::int[]) AS d(event_id, http_status)
    WHERE o.event_id = d.event_id
      -- by primary key: the batch's rows, never a scan of every pending row per batch
      AND o.event_id = ANY (:delivered_ids::bigint[])
      AND o.status = 'pending'
      AND o.recorded_by IS DISTINCT FROM :lease_owner
      AND (SELECT set_config('synchronous_commit', 'off', true)) = 'off'
    RETURNING 'delivered'::text AS outcome
),
updated AS (
    UPDATE outbox o
    SET status = CASE r.outcome WHEN 'delivered' THEN 'delivered' WHEN 'dead' THEN 'dead' ELSE 'pending' END,
        delivered_at = CASE WHEN r.outcome = 'delivered' THEN now() ELSE o.delivered_at END,
        next_attempt_at = CASE
            WHEN r.outcome = 'retry' THEN now() + make_interval(secs => r.delay_seconds)
            ELSE o.next_attempt_at END,
        dead_at = CASE WHEN r.outcome = 'dead' THEN now() ELSE o.dead_at END,
        dead_reason = CASE WHEN r.outcome = 'dead' THEN r.error ELSE o.dead_reason END,
        last_error = CASE WHEN r.outcome = 'delivered' THEN o.last_error ELSE r.error END,
        last_http_status = r.http_status,
        failures = o.failures + (r.failure_kind IS NOT NULL)::int,
        failure_counts = CASE WHEN r.failure_kind IS NULL THEN o.failure_counts
            ELSE jsonb_set(o.failure_counts, ARRAY[r.failure_kind],
                           to_jsonb(coalesce((o.failure_counts ->> r.failure_kind)::int, 0) + 1)) END,
        lease_owner = NULL,
        leased_until = NULL,
        recorded_by = :lease_owner
    FROM result r
    WHERE o.event_id = r.event_id
      AND o.event_id = ANY (:event_ids::bigint[])
      AND o.status = 'pending'
      AND (r.outcome = 'delivered' OR o.lease_owner = :lease_owner)
      AND o.recorded_by IS DISTINCT FROM :lease_owner
      AND (SELECT set_config('synchronous_commit', 'off', true)) = 'off'
    RETURNING r.outcome
),
again AS (
    SELECT r.outcome
    FROM (SELECT event_id, 'delivered'::text AS outcome FROM unnest(:delivered_ids::bigint[]) AS event_id
          UNION ALL
          SELECT event_id, outcome FROM result) r
    JOIN outbox o ON o.event_id = r.event_id
    WHERE o.recorded_by = :lease_owner
      AND o.event_id = ANY (:delivered_ids::bigint[] || :event_ids::bigint[])
),
counted AS (
    SELECT outcome FROM delivered
    UNION ALL
    SELECT outcome FROM updated
    UNION ALL
    SELECT outcome FROM again
    WHERE (SELECT count(*) FROM delivered) + (SELECT count(*) FROM updated)
        < cardinality(:delivered_ids::bigint[]) + cardinality(:event_ids::bigint[])
)
SELECT
    count(*) FILTER (WHERE outcome = 'delivered')::int AS delivered,
    count(*) FILTER (WHERE outcome = 'retry')::int AS retried,
    count(*) FILTER (WHERE outcome = 'dead')::int AS dead,
    (cardinality(:delivered_ids::bigint[]) + cardinality(:event_ids::bigint[]) - count(*))::int AS fenced
FROM counted;

-- name: release_lease
-- A claim whose answer was lost with the database connection may have committed:
-- give back whatever that owner holds, so the rows are claimable at once instead of at lease end.
-- The claim's `attempts` increment is undone (nothing was sent under it).
WITH released AS (
    UPDATE outbox
    SET lease_owner = NULL,
        leased_until = NULL,
        attempts = greatest(attempts - 1, 0)
    WHERE lease_owner = $1
      AND status = 'pending'
    RETURNING event_id
)
SELECT count(*)::int AS released FROM released;

-- name: pending_summary
-- What is left for the relays: all pending events, those claimable now, and when the next one
-- becomes claimable (a retry's next_attempt_at or an expiring lease), in seconds from now.
SELECT
    count(*)::int AS pending,
    count(*) FILTER (
        WHERE next_attempt_at <= now() AND (leased_until IS NULL OR leased_until < now()))::int AS due,
    extract(epoch FROM min(greatest(next_attempt_at, coalesce(leased_until, next_attempt_at))) - now())::float8
        AS next_due_in_seconds
FROM outbox
WHERE status = 'pending';

-- name: outbox_summary
SELECT
    count(*)::int AS total,
    count(*) FILTER (WHERE status = 'pending')::int AS pending,
    count(*) FILTER (WHERE status = 'pending' AND next_attempt_at <= now()
                     AND (leased_until IS NULL OR leased_until < now()))::int AS due_now,
    count(*) FILTER (WHERE status = 'pending' AND leased_until >= now())::int AS leased,
    count(*) FILTER (WHERE status = 'pending' AND attempts > 0)::int AS retrying,
    count(*) FILTER (WHERE status = 'delivered')::int AS delivered,
    count(*) FILTER (WHERE status = 'dead')::int AS dead,
    min(created_at) FILTER (WHERE status = 'pending') AS oldest_pending_created_at,
    min(next_attempt_at) FILTER (WHERE status = 'pending') AS next_attempt_at,
    max(delivered_at) AS last_delivered_at
FROM outbox;

-- name: dead_letters
SELECT event_key, account_id, attempts, failures, last_http_status, dead_at, dead_reason
FROM outbox
WHERE status = 'dead'
ORDER BY dead_at DESC, event_id DESC
LIMIT $1;

-- name: event_by_key
SELECT event_id, event_key, kind, account_id, source_id, status, attempts, failures, created_at,
       next_attempt_at, delivered_at, last_attempt_at, last_http_status, last_error,
       dead_at, dead_reason, lease_owner, leased_until, redeliveries
FROM outbox
WHERE event_key = $1;

-- name: redeliver
-- An operator's second chance for a dead letter (or "now" for a pending event that waits for its
-- next attempt). A live lease is left alone: that relay is sending it right now. Delivered events
-- are refused by the caller: the provider deduplicates by key, so the customer would not see it.
UPDATE outbox
SET status = 'pending',
    next_attempt_at = now(),
    attempts = CASE WHEN status = 'dead' THEN 0 ELSE attempts END,
    failures = CASE WHEN status = 'dead' THEN 0 ELSE failures END,
    failure_counts = CASE WHEN status = 'dead' THEN '{}'::jsonb ELSE failure_counts END,
    dead_at = NULL,
    dead_reason = NULL,
    redeliveries = redeliveries + 1
WHERE event_key = $1
  AND (status = 'dead' OR (status = 'pending' AND (leased_until IS NULL OR leased_until < now())))
RETURNING event_key, status, attempts, next_attempt_at, redeliveries, last_error;

-- name: dead_matching
-- The dead letters an operator's filter selects (each part NULL: not filtered; the reason's piece
-- case-insensitive): how many, and over which span.
SELECT count(*)::int AS matching, min(dead_at) AS oldest_dead_at, max(dead_at) AS newest_dead_at
FROM outbox
WHERE status = 'dead' AND (:dead_since::timestamptz IS NULL OR dead_at >= :dead_since)
  AND (:reason::text IS NULL OR strpos(lower(dead_reason), lower(:reason)) > 0);

-- name: redeliver_dead_matching
-- Every dead letter the filter selects (as dead_matching) is due again now, with its failures
-- forgotten, in one statement. Pending and delivered events are never touched.
WITH again AS (
    UPDATE outbox
    SET status = 'pending', next_attempt_at = now(), attempts = 0, failures = 0,
        failure_counts = '{}'::jsonb, dead_at = NULL, dead_reason = NULL, redeliveries = redeliveries + 1
    WHERE status = 'dead' AND (:dead_since::timestamptz IS NULL OR dead_at >= :dead_since)
      AND (:reason::text IS NULL OR strpos(lower(dead_reason), lower(:reason)) > 0)
    RETURNING 1
)
SELECT count(*)::int AS redelivered FROM again;
