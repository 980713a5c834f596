"""The delivery contract of the renewal cleanup, proved against real Temporal and real Postgres.

Every activity must be harmless when it runs twice, after a renewal, for an older version, and
after it committed but died before Temporal heard back. Effects are counted in the database.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from temporalio.client import WorkflowExecutionStatus
from temporalio.testing import ActivityEnvironment

import cleanup
from activities.cleanup import CleanupActivities
from budget.controller import BudgetSettings, LoadBudget
from cleanup.inputs import StartCleanup
from cleanup.models import (
    ClaimChunkedInput,
    ClaimResult,
    CleanupPartitionInput,
    CleanupResult,
    PartitionReport,
    SettleCleanupInput,
    following_partitions,
)
from cleanup.operations import renew, start_cleanup
from cleanup.targets import load_targets
from core import db
from core.queries import load
from tests.helpers import (
    activity_timeline,
    cohort_claim,
    deadline_in,
    effect_counts,
    listed_workflow_ids,
    redeliver,
    seed,
    wait_until,
)
from workflows.renewal_cleanup import RenewalCleanupWorkflow


async def claim_and_clean_twice(client, task_queue, cleanup_id, deadline, partitions):
    """Deliver claim, every partition and settlement twice each, as a retrying Temporal would."""
    claims = await redeliver(
        client,
        task_queue,
        "claim_cleanup_in_chunks",
        cohort_claim(cleanup_id, deadline, partitions),
    )
    claim = ClaimResult.model_validate(claims[0])
    reports: list[list[PartitionReport]] = []
    for p in range(partitions):
        runs = await redeliver(
            client,
            task_queue,
            "cleanup_partition",
            CleanupPartitionInput(cleanup_id=cleanup_id, partition_no=p),
        )
        reports.append([PartitionReport.model_validate(r) for r in runs])
    settlements = await redeliver(
        client,
        task_queue,
        "settle_cleanup",
        SettleCleanupInput(
            cleanup_id=cleanup_id,
            deadline=deadline,
            partitions=partitions,
            claim=claim,
            reports=[runs[0] for runs in reports],
        ),
    )
    return claims, reports, settlements


async def test_every_step_delivered_twice_has_one_effect(client, pool, task_queue, worker):
    deadline = deadline_in(-60)
    await seed(pool, deadline, 300)

    claims, reports, settlements = await claim_and_clean_twice(client, task_queue, "cohort-dup", deadline, 3)

    assert claims[0] == claims[1], "a re-delivered claim reports the same claim"
    assert sum(ClaimResult.model_validate(claims[0]).claimed_per_partition) == 300
    first, second = [sum(r[i].counts.cleaned for r in reports) for i in (0, 1)]
    assert (first, second) == (300, 0)
    assert sum(r[1].counts.already_applied for r in reports) == 300
    assert settlements[0] == settlements[1], "a re-delivered settlement returns the first one"
    counts = await effect_counts(pool)
    assert counts == {
        "applied": 300,
        "reminders": 300,
        "duplicate_reminders": 0,
        "archived_matches": 300 * 5,
        "duplicate_archives": 0,
        "cleaned_accounts": 300,
        "settlements": 1,
    }


async def test_starting_the_same_cleanup_twice_gives_one_run(client, pool, task_queue):
    deadline = deadline_in(3600)
    accounts = await seed(pool, deadline, 5)

    first = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline))
    second = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline))
    single_1 = await start_cleanup(client, pool, task_queue, StartCleanup(account_id=accounts[0]))
    single_2 = await start_cleanup(client, pool, task_queue, StartCleanup(account_id=accounts[0]))

    assert first.started and not second.started
    assert first.run_id == second.run_id
    assert single_1.started and not single_2.started and single_1.run_id == single_2.run_id
    expected = [first.workflow_id, single_1.workflow_id]
    assert sorted(await listed_workflow_ids(client, task_queue, expected)) == sorted(expected)
    for wf in (first.workflow_id, single_1.workflow_id):
        await client.get_workflow_handle(wf).terminate("test over")


async def test_a_completed_cleanup_is_not_started_again(client, pool, task_queue, worker):
    deadline = deadline_in(1)
    await seed(pool, deadline, 20)
    first = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline, partitions=2))
    await client.get_workflow_handle(first.workflow_id).result()

    again = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline, partitions=2))

    assert not again.started and again.run_id == first.run_id
    assert await listed_workflow_ids(client, task_queue, [first.workflow_id]) == [first.workflow_id]
    assert (await effect_counts(pool))["applied"] == 20


async def test_jobs_after_a_renewal_clean_nothing_and_send_no_reminder(client, pool, task_queue, worker):
    deadline = deadline_in(-60)
    accounts = await seed(pool, deadline_in(3600), 10)
    renewed = accounts[:3]
    for account_id in renewed:
        assert (await renew(client, pool, task_queue, account_id)).in_time  # in time: before the deadline
    # ... which has passed since (a renewal after it would be too late: the renewal rule).
    await pool.execute(
        "UPDATE accounts SET renewal_deadline = $1 WHERE account_id = ANY($2::text[])", deadline, accounts
    )

    claims, reports, _ = await claim_and_clean_twice(client, task_queue, "cohort-renewed", deadline, 2)

    assert ClaimResult.model_validate(claims[0]).skipped_renewed == 3
    assert sum(r[0].counts.cleaned for r in reports) == 7
    assert await pool.fetchval("SELECT count(*) FROM outbox WHERE account_id = ANY($1::text[])", renewed) == 0
    assert (
        await pool.fetchval("SELECT count(*) FROM demo_game.cloud_saves WHERE account_id = ANY($1::text[])", renewed)
        == 6
    )
    assert await pool.fetchval("SELECT count(*) FROM cleanup_applied WHERE account_id = ANY($1::text[])", renewed) == 0


async def test_renewal_signal_ends_a_single_account_cleanup_as_renewed(client, pool, task_queue, worker):
    deadline = deadline_in(3600)
    [account] = await seed(pool, deadline, 1)
    started = await start_cleanup(client, pool, task_queue, StartCleanup(account_id=account))
    handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)

    outcome = await renew(client, pool, task_queue, account)
    result: CleanupResult = await handle.result()

    assert outcome.in_time and outcome.signalled == [started.workflow_id]
    assert result.outcome == "renewed"
    counts = await effect_counts(pool)
    assert (counts["applied"], counts["reminders"], counts["settlements"]) == (0, 0, 1)


async def test_a_renewal_after_the_claim_is_reported_too_late(client, pool, task_queue, worker):
    deadline = deadline_in(-60)
    [account] = await seed(pool, deadline, 1)
    await redeliver(
        client,
        task_queue,
        "claim_cleanup_in_chunks",
        cohort_claim("cohort-late", deadline, 1),
        times=1,
    )

    late = await renew(client, pool, task_queue, account)

    assert not late.in_time and late.status_seen == "cleaning" and late.claimed_by == "cohort-late"
    row = await pool.fetchrow("SELECT outcome, status_seen FROM renewals WHERE account_id = $1", account)
    assert dict(row) == {"outcome": "too_late", "status_seen": "cleaning"}, "a late renewal is recorded, not lost"


async def test_old_version_cleanup_does_nothing_when_a_newer_version_exists(client, pool, task_queue, worker):
    """The renewal's signal is lost; the database alone stops the old version at its deadline."""
    deadline = deadline_in(2)
    [account] = await seed(pool, deadline, 1)
    old = await start_cleanup(client, pool, task_queue, StartCleanup(account_id=account))
    # Renewal committed in the database only (as if the signal never arrived): version 1 -> 2.
    sql = load(cleanup.__file__)
    renewal = sql.bind("renew_account", account_id=account, until=deadline + timedelta(seconds=3), allow_earlier=False)
    await pool.fetchrow(sql.renew_account, *renewal)

    old_result: CleanupResult = await client.get_workflow_handle_for(
        RenewalCleanupWorkflow.run, old.workflow_id
    ).result()
    assert old_result.outcome == "renewed"
    assert (await effect_counts(pool))["applied"] == 0

    new = await start_cleanup(client, pool, task_queue, StartCleanup(account_id=account))
    new_result: CleanupResult = await client.get_workflow_handle_for(
        RenewalCleanupWorkflow.run, new.workflow_id
    ).result()
    assert new_result.outcome == "cleaned"
    versions = await pool.fetch("SELECT cleanup_version FROM cleanup_applied WHERE account_id = $1", account)
    assert [r[0] for r in versions] == [2], "exactly one effect, for the newer version"


async def test_partition_job_for_an_older_version_is_skipped_as_stale(client, pool, task_queue, worker):
    deadline = deadline_in(-60)
    accounts = await seed(pool, deadline, 4)
    await redeliver(
        client,
        task_queue,
        "claim_cleanup_in_chunks",
        cohort_claim("cohort-old", deadline, 1),
        times=1,
    )
    # Support restores one claimed account before the partition job arrives: a newer version exists.
    await pool.execute(
        "UPDATE accounts SET status = 'active', cleanup_version = cleanup_version + 1, claimed_by = NULL"
        " WHERE account_id = $1",
        accounts[0],
    )

    [report] = await redeliver(
        client,
        task_queue,
        "cleanup_partition",
        CleanupPartitionInput(cleanup_id="cohort-old", partition_no=0),
        1,
    )

    counts = PartitionReport.model_validate(report).counts
    assert (counts.cleaned, counts.skipped_stale) == (3, 1)
    assert await pool.fetchval("SELECT count(*) FROM outbox WHERE account_id = $1", accounts[0]) == 0
    assert await pool.fetchval("SELECT status FROM accounts WHERE account_id = $1", accounts[0]) == "active"


async def test_worker_killed_after_commit_is_retried_elsewhere_without_duplicates(
    client, pool, task_queue, worker_processes
):
    """Real processes: one dies right after a partition COMMIT, the next right after settlement's."""
    deadline = deadline_in(4)
    await seed(pool, deadline, 600)
    first = worker_processes.start(CLEANUP_FAILPOINTS="cleanup_partition.after_commit=exit@2")
    started = await start_cleanup(
        client,
        pool,
        task_queue,
        StartCleanup(
            deadline=deadline, partitions=2, batch_size=100, heartbeat_timeout_seconds=2, step_timeout_seconds=5
        ),
    )
    await wait_until(lambda: _exited(first), within=90)
    assert first.returncode == 86, worker_processes.logs()
    assert await pool.fetchval("SELECT count(*) FROM cleanup_applied") >= 100, "it died after a COMMIT"

    second = worker_processes.start(CLEANUP_FAILPOINTS="settle_cleanup.after_commit=exit")
    await wait_until(lambda: _exited(second), within=90)
    assert second.returncode == 86, worker_processes.logs()
    assert await pool.fetchval("SELECT count(*) FROM cleanup_settlements") == 1

    worker_processes.start()
    handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
    result: CleanupResult = await handle.result()

    assert result.outcome == "cleaned" and result.settlement is not None
    assert result.settlement.cleaned == 600
    assert result.settlement.already_applied >= 100, "the re-run batch was absorbed, not re-applied"
    counts = await effect_counts(pool)
    assert counts["applied"] == counts["reminders"] == counts["cleaned_accounts"] == 600
    assert counts["duplicate_reminders"] == counts["duplicate_archives"] == 0
    assert counts["settlements"] == 1
    history = await handle.fetch_history()
    failed_attempts = [
        e.activity_task_started_event_attributes.attempt
        for e in history.events
        if e.HasField("activity_task_started_event_attributes")
    ]
    assert max(failed_attempts) >= 2, "Temporal retried the killed activities"


async def _exited(proc) -> bool:
    return proc.poll() is not None


async def test_settlement_runs_once_and_only_after_every_partition_reported(client, pool, task_queue, worker):
    deadline = deadline_in(2)
    await seed(pool, deadline, 400)
    started = await start_cleanup(
        client, pool, task_queue, StartCleanup(deadline=deadline, partitions=8, max_parallel_partitions=3)
    )
    handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
    await handle.result()

    timeline = activity_timeline(await handle.fetch_history())
    partition_done = [i for i, what, name in timeline if what == "completed" and name == "cleanup_partition"]
    settle = [i for i, what, name in timeline if name == "settle_cleanup"]
    # A cohort of one instant cleans while it claims: 3 partitions (all that may run at once) of the 8.
    assert len(partition_done) == following_partitions(8, 3) == 3, timeline
    assert len(settle) == 1, timeline
    assert settle[0] > max(partition_done)
    row = await pool.fetchrow(
        "SELECT (SELECT count(*) FROM cleanup_settlements) AS n,"
        " (SELECT min(settled_at) FROM cleanup_settlements) >= (SELECT max(reported_at)"
        "  FROM cleanup_partition_reports) AS after_all_reports"
    )
    assert dict(row) == {"n": 1, "after_all_reports": True}


async def test_settlement_refuses_to_run_before_the_join(pool):
    deadline = deadline_in(-60)
    await seed(pool, deadline, 10)
    activities = await CleanupActivities.create(pool, load_targets())
    env = ActivityEnvironment()
    claim = await env.run(activities.claim_cleanup_in_chunks, cohort_claim("early", deadline, 2))

    with pytest.raises(Exception, match=r"partitions \[[0-9, ]+\] have not reported"):
        await env.run(
            activities.settle_cleanup,
            SettleCleanupInput(cleanup_id="early", deadline=deadline, partitions=2, claim=claim, reports=[]),
        )
    assert await pool.fetchval("SELECT count(*) FROM cleanup_settlements") == 0


async def test_the_claim_has_connections_of_its_own(pool, db_url):
    """Partitions that follow a claim hold every connection of the worker's pool with their batches;
    the claim they wait for must not queue behind them for one (it did: 4x slower in the worker)."""
    deadline = deadline_in(-60)
    await seed(pool, deadline, 30)
    claim_pool = await db.create_pool(db_url, max_size=1)
    held = [await pool.acquire() for _ in range(8)]  # the partitions' batches, all in flight
    try:
        activities = await CleanupActivities.create(claim_pool, load_targets())  # compiles on claim_pool
        activities = CleanupActivities(
            pool,
            activities.partition_batch_sql,
            activities.compiled,
            LoadBudget(pool, BudgetSettings(enabled=False)),
            claim_pool=claim_pool,
        )
        claim = ClaimChunkedInput(
            cleanup_id="own-pool",
            deadline_from=deadline,
            deadline_until=deadline + timedelta(microseconds=1),
            partitions=2,
        )
        # Without a pool of its own this waits forever for a connection: the timeout only ends the test.
        result = await asyncio.wait_for(ActivityEnvironment().run(activities.claim_cleanup_in_chunks, claim), 60)
    finally:
        for conn in held:
            await pool.release(conn)
        await claim_pool.close()
    assert result.claimed == 30


async def test_real_worker_process_runs_asyncpg_activities(client, pool, task_queue, worker_processes):
    """The known asyncpg/sandbox crash would kill this process; it must run a cleanup to the end."""
    deadline = deadline_in(2)
    [account] = await seed(pool, deadline, 1)
    proc = worker_processes.start()
    started = await start_cleanup(client, pool, task_queue, StartCleanup(account_id=account))

    result: CleanupResult = await client.get_workflow_handle_for(
        RenewalCleanupWorkflow.run, started.workflow_id
    ).result()

    assert result.outcome == "cleaned"
    assert proc.poll() is None, worker_processes.logs()
    desc = await client.get_workflow_handle(started.workflow_id).describe()
    assert desc.status == WorkflowExecutionStatus.COMPLETED
    assert (await effect_counts(pool))["reminders"] == 1


async def test_a_partition_blocked_on_a_lock_keeps_heartbeating_and_is_not_run_twice(client, pool, task_queue, worker):
    """A batch waiting 3x the heartbeat timeout on a row lock is slow, not dead: one attempt only."""
    deadline = deadline_in(1)
    accounts = await seed(pool, deadline, 30)
    async with pool.acquire() as blocker:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute("SELECT 1 FROM demo_game.cloud_saves WHERE account_id = $1 FOR UPDATE", accounts[0])
        started = await start_cleanup(
            client, pool, task_queue, StartCleanup(deadline=deadline, partitions=1, heartbeat_timeout_seconds=2)
        )
        handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)

        async def partition_started() -> bool:
            return any(name == "cleanup_partition" for _, _, name in activity_timeline(await handle.fetch_history()))

        await wait_until(partition_started, within=30)
        await asyncio.sleep(6)  # 3x the heartbeat timeout, holding the lock the batch waits for
        await tx.rollback()
    result: CleanupResult = await handle.result()

    assert result.settlement is not None and result.settlement.cleaned == 30
    events = (await handle.fetch_history()).events
    attempts = [
        e.activity_task_started_event_attributes.attempt
        for e in events
        if e.HasField("activity_task_started_event_attributes")
    ]
    assert set(attempts) == {1}, "the blocked partition (nor the claim) was not retried as if dead"
    assert not any(e.HasField("activity_task_timed_out_event_attributes") for e in events)
    assert (await effect_counts(pool))["applied"] == 30


async def test_partitions_clean_while_the_claim_still_claims_and_every_account_once(client, pool, task_queue, worker):
    """A cohort's partitions start with its claim and clean each chunk as it commits. A player's
    open transaction holds one account in the middle of the cohort: the claim waits on it, chunks
    before it are cleaned meanwhile, and once it is released every account ends cleaned once."""
    deadline = deadline_in(3)
    accounts = await seed(pool, deadline, 400)
    renewed = accounts[:3]
    for account_id in renewed:
        await renew(client, pool, task_queue, account_id)
    held = accounts[250]
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        await conn.execute("SELECT 1 FROM accounts WHERE account_id = $1 FOR UPDATE", held)
        started = await start_cleanup(
            client,
            pool,
            task_queue,
            StartCleanup(
                deadline=deadline, partitions=4, max_parallel_partitions=4, batch_size=25, claim_chunk_size=40
            ),
        )

        async def cleaned_while_claim_waits() -> bool:
            row = await pool.fetchrow(
                "SELECT (SELECT count(*) FROM accounts WHERE renewal_deadline = $1 AND status = 'cleaned') AS n,"
                " (SELECT bool_and(done) FROM cleanup_claim_progress WHERE cleanup_id LIKE $2 || '%') AS done",
                deadline,
                started.workflow_id,
            )
            assert row is not None and row["done"] is not True, "the claim finished past a held row"
            return bool(row["n"] >= 100)

        await wait_until(cleaned_while_claim_waits, within=60)
        await tx.rollback()

    handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
    result: CleanupResult = await handle.result()
    assert result.outcome == "cleaned" and result.settlement is not None
    assert result.settlement.cleaned == result.settlement.claimed == 397
    assert result.settlement.skipped_renewed == 3
    counts = await effect_counts(pool)
    assert counts["applied"] == counts["reminders"] == counts["cleaned_accounts"] == 397
    assert counts["duplicate_reminders"] == counts["duplicate_archives"] == 0
    timeline = activity_timeline(await handle.fetch_history())
    claim_done = next(i for i, what, name in timeline if what == "completed" and name == "claim_cleanup_in_chunks")
    first_partition = min(i for i, what, name in timeline if what == "scheduled" and name == "cleanup_partition")
    assert first_partition < claim_done, timeline
    streams = await pool.fetch(
        "SELECT cleanup_id, chunks, done FROM cleanup_claim_progress WHERE cleanup_id LIKE $1 || '%' ORDER BY 1",
        started.workflow_id,
    )
    assert [r["cleanup_id"] for r in streams] == [started.workflow_id, f"{started.workflow_id}#claim-1"]
    assert all(r["done"] for r in streams) and sum(r["chunks"] for r in streams) >= 10
    claims = [n for i, what, n in timeline if what == "scheduled" and n == "claim_cleanup_in_chunks"]
    assert len(claims) == 2, "two claim streams at once"
    # Each partition is fed by one stream, the one its accounts hash to: its claims come in account order.
    crossed = await pool.fetchval(
        "SELECT count(*) FROM cleanup_claims WHERE cleanup_id = $1"
        " AND (hashtext(account_id) & 2147483647) % 2 <> partition_no % 2",
        started.workflow_id,
    )
    assert crossed == 0
