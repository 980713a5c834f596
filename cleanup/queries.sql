-- Named queries of the renewal-deadline cleanup. Loaded by core.queries.load(__file__).

-- name: claim_account
WITH claimed AS (
    UPDATE accounts
    SET status = 'cleaning', claimed_by = :cleanup_id, claimed_at = now(), claimed_namespace = :namespace
    WHERE account_id = :account_id AND renewal_deadline = :deadline AND cleanup_version = :cleanup_version
      AND status IN ('active', 'cleanup_failed') AND renewal_deadline <= cleanup_clock()
      AND held_since IS NULL  -- a legal hold: never claimed
    RETURNING account_id, cleanup_version
)
INSERT INTO cleanup_claims (cleanup_id, account_id, claimed_version, partition_no)
SELECT :cleanup_id, account_id, cleanup_version, 0 FROM claimed;

-- name: claims_per_partition
SELECT partition_no, count(*)::int AS claimed
FROM cleanup_claims WHERE cleanup_id = $1 GROUP BY partition_no;

-- name: account_state
SELECT account_id, status, cleanup_version, renewal_deadline, claimed_by, renewed_at
FROM accounts WHERE account_id = $1;

-- name: cleanup_partition_batch
-- One statement per batch: lock the batch's accounts, judge each (apply / renewed / stale /
-- already applied), record the idempotency key, apply every declared target, write the outbox
-- reminder and mark the account cleaned. All of it commits together or not at all.
-- cleanup.targets compiles it twice: the keyset batch (after :after_account_id, the last account ID
-- of the previous batch) and the subset form used to isolate a failing account (an array of account
-- IDs in its place).
-- An account recorded in cleanup_failed is still claimed ('cleanup_failed'); cleaning it later
-- (retry-failed) or finding it renewed/stale resolves its cleanup_failed row in the same statement.
WITH batch AS (
    SELECT c.account_id, c.claimed_version
    FROM cleanup_claims c
    WHERE c.cleanup_id = :cleanup_id AND c.partition_no = :partition_no AND /*batch_filter*/c.account_id > :after_account_id
    ORDER BY c.account_id
    LIMIT :batch_size
),
-- Each account is judged on the row it locked, which carries its claim (so no join of two CTEs,
-- whose sizes the planner cannot know: it would compare every row with every row), and the
-- idempotency record is probed per account by its unique key (LATERAL ... LIMIT 1: a probe of
-- cleanup_applied_once, never a join filter over the whole, ever-growing table). Cost per account
-- stays flat whatever the batch size and however stale the statistics of the claims just written.
-- The batch's accounts are fetched by primary key, one probe per account, never by a join the
-- planner may turn into a hash of the whole accounts table (every batch would read every account;
-- bench.batch_plan guards it). The batch enters as two arrays unnested (estimated at a few rows whatever its
-- size), so the plan is a nested loop over it with an index probe per account at every size; the
-- targets and `marked` reach their tables by `= ANY` of the applied accounts for the same reason.
locked AS (
    SELECT a.account_id, b.claimed_version, a.status, a.cleanup_version, a.claimed_by, a.held_since
    FROM unnest(ARRAY(SELECT account_id FROM batch), ARRAY(SELECT claimed_version FROM batch))
        AS b (account_id, claimed_version)
    JOIN accounts a ON a.account_id = b.account_id
    ORDER BY a.account_id
    FOR UPDATE OF a
),
verdicts AS (
    SELECT l.account_id, l.claimed_version, l.status AS account_status,
        CASE
            WHEN done.applied THEN 'already_applied'
            WHEN l.status = 'cleaned' AND l.cleanup_version = l.claimed_version THEN 'already_applied'
            WHEN l.cleanup_version <> l.claimed_version THEN 'stale'
            WHEN l.status = 'renewed' THEN 'renewed'
            WHEN l.status = 'cleanup_failed' AND l.held_since IS NOT NULL THEN 'held'  -- a hold after it failed
            WHEN l.status IN ('cleaning', 'cleanup_failed') AND l.claimed_by = :cleanup_id THEN 'apply'
            ELSE 'stale'
        END AS verdict
    FROM locked l
    LEFT JOIN LATERAL (
        SELECT true AS applied FROM cleanup_applied d
        WHERE d.account_id = l.account_id AND d.cleanup_version = l.claimed_version
        LIMIT 1
    ) done ON true
),
/*judged*/ -- (cleanup.targets.judge_statement: the verdicts, before anything is written)
applied AS (
    INSERT INTO cleanup_applied (account_id, cleanup_version, cleanup_id, partition_no)
    SELECT account_id, claimed_version, :cleanup_id, :partition_no FROM verdicts WHERE verdict = 'apply'
    ON CONFLICT ON CONSTRAINT cleanup_applied_once DO NOTHING
    RETURNING account_id, cleanup_version
),
/*target_ctes*/
resolved AS (
    UPDATE cleanup_failed f
    SET resolved_at = now(),
        detail = NULL,  -- resolved: nothing of the failure is kept but its reason
        resolution = CASE
            WHEN v.verdict IN ('apply', 'already_applied') THEN 'cleaned'
            WHEN v.verdict = 'renewed' OR v.account_status IN ('renewed', 'active') THEN 'renewed'
            ELSE 'stale'
        END
    FROM verdicts v
    WHERE f.account_id = v.account_id AND f.cleanup_version = v.claimed_version AND f.resolved_at IS NULL
      AND v.verdict <> 'held'
      -- by primary key: never a scan of every pending failure per judged account
      AND f.account_id = ANY (ARRAY(SELECT account_id FROM verdicts))
    RETURNING 1
),
reminders AS (
    INSERT INTO outbox (event_key, kind, account_id, source_id, payload)
    SELECT 'renewal-reminder:' || account_id || ':v' || cleanup_version, 'renewal_reminder',
           account_id, :cleanup_id,
           jsonb_build_object('account_id', account_id, 'cleanup_version', cleanup_version,
                              'cleanup_id', :cleanup_id::text)
    FROM applied
    -- CLEANUP_REMINDERS=off: the compiled statement says `false` here (cleanup.batches), the same
    -- for every worker of the deployment, and the batch writes no reminder (counted 0).
    WHERE /*reminders*/true
    ON CONFLICT (event_key) DO NOTHING
    RETURNING 1
),
marked AS (
    UPDATE accounts a SET status = 'cleaned', cleaned_at = now()
    WHERE a.account_id = ANY (ARRAY(SELECT account_id FROM applied))
    RETURNING 1
)
SELECT
    (SELECT max(account_id) FROM batch) AS last_account_id,
    (SELECT count(*) FROM batch)::int AS batch_rows,
    (SELECT count(*) FROM applied)::int AS cleaned,
    (SELECT count(*) FROM verdicts WHERE verdict = 'renewed')::int AS skipped_renewed,
    (SELECT count(*) FROM verdicts WHERE verdict = 'stale')::int AS skipped_stale,
    ((SELECT count(*) FROM verdicts WHERE verdict IN ('already_applied', 'apply'))
        - (SELECT count(*) FROM applied))::int AS already_applied,
    (SELECT count(*) FROM reminders)::int AS reminders,
    (SELECT count(*) FROM marked)::int AS marked,
    (SELECT count(*) FROM resolved)::int AS resolved
    /*target_counts*/;

-- name: batch_accounts
-- The accounts of one keyset batch (the same selection as the batch statement's `batch`), read
-- only when that statement failed deterministically and the batch is bisected.
SELECT account_id FROM cleanup_claims
WHERE cleanup_id = :cleanup_id AND partition_no = :partition_no AND account_id > :after_account_id
ORDER BY account_id
LIMIT :batch_size;

-- name: record_failed
-- Isolated accounts (:account_ids, one or a batch that a schema error failed as a whole): record why, and
-- mark them 'cleanup_failed' (still claimed by this cleanup, renewable). Nothing of their cleanup
-- was applied: their statement rolled back. A repeated failure (retry-failed, a redelivered batch)
-- updates the row and counts the attempt. Returns the accounts recorded.
WITH acct AS (
    SELECT c.account_id, c.claimed_version
    FROM cleanup_claims c JOIN accounts a USING (account_id)
    WHERE c.cleanup_id = :cleanup_id AND c.partition_no = :partition_no AND c.account_id = ANY (:account_ids::text[])
      AND a.status IN ('cleaning', 'cleanup_failed') AND a.claimed_by = :cleanup_id
      AND a.cleanup_version = c.claimed_version
      AND NOT EXISTS (SELECT 1 FROM cleanup_applied d
                      WHERE d.account_id = c.account_id AND d.cleanup_version = c.claimed_version)
    FOR UPDATE OF a
),
failed AS (
    INSERT INTO cleanup_failed
        (account_id, cleanup_version, cleanup_id, partition_no, target, sqlstate, message, detail)
    SELECT account_id, claimed_version, :cleanup_id, :partition_no, :target, :sqlstate, :message, :detail FROM acct
    ON CONFLICT (account_id, cleanup_version) DO UPDATE
    SET cleanup_id = EXCLUDED.cleanup_id, partition_no = EXCLUDED.partition_no, target = EXCLUDED.target,
        sqlstate = EXCLUDED.sqlstate, message = EXCLUDED.message, detail = EXCLUDED.detail, failed_at = now(),
        attempts = cleanup_failed.attempts + 1, resolved_at = NULL, resolution = NULL
    RETURNING account_id
),
marked AS (
    UPDATE accounts a SET status = 'cleanup_failed'
    FROM failed f WHERE a.account_id = f.account_id
    RETURNING a.account_id
)
SELECT account_id FROM marked ORDER BY account_id;

-- name: failed_reasons
-- Why a cleanup's accounts still fail, as codes and counts (a Temporal payload: no account, no text
-- of the game's), the most frequent first.
SELECT count(*) || ' account(s): [' || sqlstate || '] ' || message || coalesce(' in ' || target, '') AS reason
FROM cleanup_failed
WHERE cleanup_id = :cleanup_id AND resolved_at IS NULL
GROUP BY sqlstate, message, target
ORDER BY count(*) DESC, sqlstate, target
LIMIT :most;

-- name: list_failed
SELECT account_id, cleanup_version, cleanup_id, partition_no, target, sqlstate, message, detail,
       failed_at, attempts, resolved_at, resolution
FROM cleanup_failed
WHERE (:cleanup_id::text IS NULL OR cleanup_id = :cleanup_id) AND (:include_resolved::bool OR resolved_at IS NULL)
ORDER BY cleanup_id, account_id
LIMIT :limit;

-- name: failed_to_retry
-- A held account is not retried while it is held (the batch's verdict re-checks it on the locked row).
SELECT cleanup_id, partition_no, array_agg(account_id ORDER BY account_id) AS account_ids
FROM cleanup_failed f
WHERE resolved_at IS NULL AND ($1::text IS NULL OR cleanup_id = $1)
  AND NOT EXISTS (SELECT 1 FROM accounts a WHERE a.account_id = f.account_id AND a.held_since IS NOT NULL)
GROUP BY cleanup_id, partition_no
ORDER BY cleanup_id, partition_no;

-- name: preview_cleanup
-- The dry run: what the cleanup would do now, in one read-only statement. cleanup.targets
-- compiles it per scope (/*scope*/ = a cohort's deadline or one account, as $1) and adds a row
-- count per declared target.
WITH scope AS (
    SELECT a.account_id, a.cleanup_version FROM accounts a
    WHERE a.status = 'active' AND a.held_since IS NULL AND /*scope*/
)
SELECT
    (SELECT count(*) FROM scope)::int AS accounts_in_scope,
    (SELECT count(*) FROM accounts a WHERE a.status = 'renewed' AND /*scope*/)::int AS already_renewed,
    (SELECT count(*) FROM scope s
     WHERE /*reminders*/true AND NOT EXISTS (SELECT 1 FROM outbox o
                       WHERE o.event_key = 'renewal-reminder:' || s.account_id || ':v' || s.cleanup_version)
    )::int AS reminders
    /*target_counts*/;

-- name: record_partition_report
-- A retried partition replaces its report until the cleanup settles; after that the reports the
-- settlement was made from stay as they were (a late or re-delivered partition changes nothing).
INSERT INTO cleanup_partition_reports AS r
    (cleanup_id, partition_no, cleaned, skipped_renewed, skipped_stale, already_applied, failed)
VALUES (:cleanup_id, :partition_no, :cleaned, :skipped_renewed, :skipped_stale, :already_applied, :failed)
ON CONFLICT (cleanup_id, partition_no) DO UPDATE
SET reported_at = now(), recorded_at = clock_timestamp(), cleaned = EXCLUDED.cleaned,
    skipped_renewed = EXCLUDED.skipped_renewed, skipped_stale = EXCLUDED.skipped_stale,
    already_applied = EXCLUDED.already_applied, failed = EXCLUDED.failed
WHERE NOT EXISTS (SELECT 1 FROM cleanup_settlements s WHERE s.cleanup_id = r.cleanup_id);

-- name: unreported_partitions
-- The partitions with claims (one descent of the primary key per partition, not a read of every
-- claim of the cohort) that have no report.
WITH RECURSIVE claimed AS (
    (SELECT partition_no FROM cleanup_claims WHERE cleanup_id = $1 ORDER BY partition_no LIMIT 1)
    UNION ALL
    SELECT (SELECT c.partition_no FROM cleanup_claims c
            WHERE c.cleanup_id = $1 AND c.partition_no > claimed.partition_no
            ORDER BY c.partition_no LIMIT 1)
    FROM claimed WHERE claimed.partition_no IS NOT NULL
)
SELECT partition_no
FROM claimed p
WHERE p.partition_no IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM cleanup_partition_reports r
                  WHERE r.cleanup_id = $1 AND r.partition_no = p.partition_no)
ORDER BY 1;

-- name: settle_cleanup
-- Written once: a re-delivered settlement finds the row and changes nothing.
INSERT INTO cleanup_settlements
    (cleanup_id, deadline, account_id, partitions, claimed, cleaned, reminders,
     skipped_renewed, skipped_stale, already_applied, failed)
SELECT :cleanup_id, :deadline, :account_id, :partitions,
       (SELECT count(*) FROM cleanup_claims WHERE cleanup_id = :cleanup_id),
       (SELECT count(*) FROM cleanup_applied WHERE cleanup_id = :cleanup_id),
       (SELECT count(*) FROM outbox WHERE source_id = :cleanup_id AND kind = 'renewal_reminder'),
       :skipped_renewed, :skipped_stale, :already_applied,
       (SELECT count(*) FROM cleanup_failed WHERE cleanup_id = :cleanup_id AND resolved_at IS NULL)
ON CONFLICT (cleanup_id) DO NOTHING;

-- name: get_settlement
SELECT cleanup_id, claimed, cleaned, reminders, skipped_renewed, skipped_stale, already_applied,
       settled_at, failed
FROM cleanup_settlements WHERE cleanup_id = $1;

-- name: renew_account
-- The database is the source of truth for a renewal: the service's function renew_account (the
-- one the game's renew() calls too) judges it by the database clock after the row lock, marks it
-- and bumps the version in one transaction, and records every attempt. A NULL `until`: renewed
-- for good. No row: unknown account.
SELECT status_seen, old_deadline, old_version, claimed_by, outcome, version_after, judged_at
FROM renew_account(:account_id, :until, :allow_earlier);

-- name: set_deadline
SELECT set_deadline($1, $2);

-- name: hold_account
SELECT hold($1, $2);

-- name: dismiss_account
SELECT dismiss($1, $2);

-- name: adopt_current_target_set
-- `retry-failed --with-current-targets`: the cleanup runs with target set :fingerprint from now on;
-- the one it ran with before is kept beside it.
UPDATE cleanup_target_runs
SET replaced_fingerprints = array_append(replaced_fingerprints, fingerprint), fingerprint = :fingerprint
WHERE cleanup_id = :cleanup_id AND fingerprint <> :fingerprint;

-- name: release_account
SELECT release($1);

-- name: cohort_accounts
-- The accounts a cohort's claim is to claim, for the load budget's deadline objective: the due
-- ones of the range [$1, $2) not held (an index-only count on accounts_due_idx's range).
SELECT count(*)::int FROM accounts
WHERE status = 'active' AND renewal_deadline >= $1 AND renewal_deadline < $2 AND held_since IS NULL;

-- name: claim_progress_start
INSERT INTO cleanup_claim_progress (cleanup_id, claimed_per_partition, deadline_from, deadline_until)
VALUES (:progress_id, array_fill(0, ARRAY[:partitions::int]), :deadline_from, :deadline_until)
ON CONFLICT (cleanup_id) DO NOTHING;

-- name: claim_progress_lock
SELECT cursor_deadline, cursor_account, claimed_per_partition, skipped_renewed, chunks, max_chunk_rows, done
FROM cleanup_claim_progress WHERE cleanup_id = $1
FOR UPDATE;

-- name: claim_progress_done
-- Whether a claim stream (by its progress row's ID) has claimed its last chunk, and how many chunks it
-- committed (no row: not started yet). A partition that follows the claim runs a batch only when a
-- chunk committed since its last short batch, and ends after a short batch that began once `done`
-- was true.
SELECT done, chunks FROM cleanup_claim_progress WHERE cleanup_id = $1;

-- name: claim_chunk
-- One chunk of a cohort's claim: the next :chunk_size accounts of the deadline range
-- [:deadline_from, :deadline_until) after the keyset cursor (:cursor_deadline, :cursor_account) on
-- accounts_due_idx, whatever the cohort's size. Active accounts whose deadline has passed by the
-- database clock move to 'cleaning' (a renewal that committed first changed the row, and the UPDATE
-- re-checks the row it locks); renewed ones are counted. Claim stream :stream of :streams takes only
-- the accounts whose ID hashes to it (one stream: all of them) and feeds only its own partitions,
-- :stream + :streams * i for i below :stream_partitions, round-robin in runs of :run_accounts
-- consecutive accounts from :claimed_before (accounts this stream claimed in its earlier chunks): so
-- each partition's claims come in account order, and few partitions write to any one page.
WITH scan AS (
    SELECT ctid, account_id, renewal_deadline, status
    FROM accounts
    WHERE status IN ('active', 'renewed')
      AND renewal_deadline >= :deadline_from AND renewal_deadline < :deadline_until
      AND (renewal_deadline, account_id) > (:cursor_deadline::timestamptz, :cursor_account::text)
      AND (:streams::int = 1 OR (hashtext(account_id) & 2147483647) % :streams::int = :stream::int)
    ORDER BY renewal_deadline, account_id
    LIMIT :chunk_size
),
claimed AS (
    -- By the row versions the scan just read (a TID scan: no second descent of the primary key
    -- per account, ~10% of a chunk); the UPDATE re-checks each row it locks, and a row changed
    -- since the scan is re-checked on its newest version or left to the overdue sweep.
    UPDATE accounts a
    SET status = 'cleaning', claimed_by = :cleanup_id, claimed_at = now(), claimed_namespace = :namespace
    WHERE a.ctid = ANY (ARRAY(SELECT ctid FROM scan))
      AND a.status = 'active' AND a.renewal_deadline >= :deadline_from AND a.renewal_deadline < :deadline_until
      AND a.renewal_deadline <= cleanup_clock()
      AND a.held_since IS NULL  -- a legal hold: never claimed
    RETURNING a.account_id, a.cleanup_version
),
inserted AS (
    INSERT INTO cleanup_claims (cleanup_id, account_id, claimed_version, partition_no)
    SELECT :cleanup_id, account_id, cleanup_version,
           :stream::int + :streams::int * ((((:claimed_before::bigint + row_number() OVER (ORDER BY account_id)) - 1) / :run_accounts::int) % :stream_partitions)
    FROM claimed
    ON CONFLICT DO NOTHING
    RETURNING partition_no
),
last AS (
    SELECT renewal_deadline, account_id FROM scan ORDER BY renewal_deadline DESC, account_id DESC LIMIT 1
)
SELECT
    (SELECT count(*) FROM scan)::int AS scanned,
    (SELECT count(*) FROM scan WHERE status = 'renewed')::int AS renewed,
    (SELECT renewal_deadline FROM last) AS last_deadline,
    (SELECT account_id FROM last) AS last_account,
    (SELECT coalesce(array_agg(partition_no), '{}') FROM inserted) AS partitions;

-- name: claim_chunk_plan
-- Each chunk must walk the keyset in index order and stop after its LIMIT: a bitmap scan (or a
-- sort) would read the rest of the cohort first, so a chunk would grow with the cohort. The stream
-- filter's selectivity is a guess (1/200), so on a small table the planner would rather read all of
-- it and sort (measured: a sequential scan of 200,000 rows for a chunk of 10,000).
SET LOCAL enable_bitmapscan = off; SET LOCAL enable_seqscan = off;

-- name: claim_progress_update
UPDATE cleanup_claim_progress
SET cursor_deadline = coalesce(:cursor_deadline, cursor_deadline),
    cursor_account = coalesce(:cursor_account, cursor_account),
    claimed_per_partition = :claimed_per_partition, skipped_renewed = skipped_renewed + :renewed,
    chunks = chunks + 1, max_chunk_rows = greatest(max_chunk_rows, :chunk_rows), done = :done, updated_at = now()
WHERE cleanup_id = :progress_id;

-- name: seconds_until
-- How far the database clock is from an instant (negative once it has passed).
SELECT extract(epoch FROM ($1::timestamptz - cleanup_clock()))::float8;

-- name: partition_reports_of_cleanup
-- What `status` shows per partition.
SELECT partition_no, cleaned, skipped_renewed, skipped_stale, already_applied, failed
FROM cleanup_partition_reports WHERE cleanup_id = $1 ORDER BY partition_no;

-- name: partitions_with_work
-- Partitions that claimed at least one account.
SELECT count(DISTINCT partition_no) FROM cleanup_claims WHERE cleanup_id = $1;

-- name: active_accounts_at_deadline
-- Accounts a cohort cleanup of this deadline would claim now.
SELECT count(*) FROM accounts WHERE renewal_deadline = $1 AND status = 'active';

-- name: failed_of_cleanup
-- Failed accounts ever recorded for a cleanup (resolved or not).
SELECT count(*) FROM cleanup_failed WHERE cleanup_id = $1;

-- name: failed_counts_of_cleanup
-- What `status` shows of a cleanup's failed accounts.
SELECT count(*) FILTER (WHERE resolved_at IS NULL)::int AS pending, count(*)::int AS total
FROM cleanup_failed WHERE cleanup_id = $1;

-- name: partition_applied
-- What the database says one partition of a cleanup claimed and applied, over every attempt (the
-- settlement counts the same tables).
SELECT (SELECT count(*) FROM cleanup_claims WHERE cleanup_id = :cleanup_id AND partition_no = :partition_no) AS claimed,
       (SELECT count(*) FROM cleanup_applied WHERE cleanup_id = :cleanup_id AND partition_no = :partition_no) AS applied;

-- name: record_cleanup_target_set
-- A cleanup runs with one target set: the first partition to run records its fingerprint, every
-- later one reads it back. :fingerprint is this worker's; returns the recorded one.
-- DO UPDATE (to the value already there) returns the committed row even when another partition's
-- insert committed while this one waited on it; DO NOTHING plus a SELECT in the same statement
-- would read the snapshot from before that commit and find no row.
INSERT INTO cleanup_target_runs (cleanup_id, fingerprint) VALUES (:cleanup_id, :fingerprint)
ON CONFLICT (cleanup_id) DO UPDATE SET fingerprint = cleanup_target_runs.fingerprint
RETURNING fingerprint;

-- name: record_worker_target_set
-- The target set a worker started with (what `--dry-run` compares with before any cleanup ran).
INSERT INTO cleanup_target_sets (fingerprint, targets) VALUES (:fingerprint, :targets::jsonb)
ON CONFLICT (fingerprint) DO UPDATE SET last_started_at = now();

-- name: cleanup_target_set
-- The fingerprint a cleanup ran with (no row: none of its partitions ran yet).
SELECT fingerprint FROM cleanup_target_runs WHERE cleanup_id = $1;

-- name: latest_worker_target_set
SELECT fingerprint FROM cleanup_target_sets ORDER BY last_started_at DESC LIMIT 1;

-- name: target_set_of
-- The targets (JSON) of a recorded target set.
SELECT targets::text FROM cleanup_target_sets WHERE fingerprint = $1;

-- name: record_database_clock_behind
-- A worker's claim found the database clock :behind_seconds behind the :instant it waited for.
INSERT INTO database_clock_behind (task_queue, behind_seconds, instant, cleanup_id)
VALUES (:task_queue, :behind_seconds, :instant, :cleanup_id)
ON CONFLICT (task_queue) DO UPDATE
SET behind_seconds = EXCLUDED.behind_seconds, instant = EXCLUDED.instant, cleanup_id = EXCLUDED.cleanup_id,
    observed_at = now();

-- name: insert_deferred_receipts
-- The receipts of a batch with follow-up statements, written after its "after" follow-ups in the
-- batch's transaction: :receipts as the batch statement returned them (account, version, rows per
-- target), with the cleanup's target set and the follow-ups' counts.
INSERT INTO erasure_receipts
    (account_id, cleanup_version, cleanup_id, targets, target_set, replaced_target_sets, follow_ups)
SELECT r.account_id, r.cleanup_version, :cleanup_id, r.targets, :fingerprint,
       (SELECT nullif(t.replaced_fingerprints, '{}') FROM cleanup_target_runs t WHERE t.cleanup_id = :cleanup_id),
       :follow_ups::jsonb
FROM jsonb_to_recordset(:receipts::jsonb) AS r (account_id text, cleanup_version integer, targets jsonb)
ON CONFLICT DO NOTHING;

-- name: follow_up_batches_one_at_a_time
-- Batches with follow-up statements run one at a time, the lock held to their COMMIT: a follow-up
-- reads the game's rows in its own snapshot and writes rows that another batch's follow-ups write
-- (a friend of players of two batches), so two at once could act on what the other is changing
-- (a decrement re-applied to a counter the other batch just recounted). Taken first in the batch's
-- transaction, every statement after it sees every batch committed before.
SELECT pg_advisory_xact_lock(hashtext('deadline_cleanup.follow_ups'));
