"""A worker stopped with SIGTERM mid-partition finishes the batch it is in and hands the partition
back at once: the other worker resumes it after that batch, without waiting out the heartbeat
timeout, and the cohort settles exactly once. (A worker that is simply cancelled at shutdown fails
the activity as `WorkerShutdown` and its in-flight batch rolls back and is redone: that is what this
test tells apart.)

Deterministic on a loaded machine: a row lock held by the test keeps the partition mid-way until
the worker has begun shutting down; the proof is in the history (the retry's last failure is the
hand-back, not a timeout), never in wall-clock time.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio.api.enums.v1 import EventType, TimeoutType
from temporalio.client import Client
from temporalio.worker import Worker

from cleanup.inputs import StartCleanup
from cleanup.models import CLEANUP_PARTITION, CleanupResult, PartitionReport
from cleanup.operations import start_cleanup
from core.config import Settings
from core.temporal import WORKFLOW_TASK_TIMEOUT, connect
from tests import handoff_workflow as hw
from tests.helpers import deadline_in, effect_counts, seed, wait_until

ACCOUNTS = 600
BATCH = 50
LOCKED_INDEX = 300  # the first account of the 7th batch: six batches commit, the seventh waits


async def test_a_worker_sigtermed_mid_partition_hands_it_back_without_a_timeout(
    client, pool, db_url, task_queue, worker_processes
):
    deadline = deadline_in(2)
    accounts = await seed(pool, deadline, ACCOUNTS)
    first = worker_processes.start()

    # The claim never touches cloud_saves; the batch that deletes this account's saves waits on it.
    locker = await pool.acquire()
    tx = locker.transaction()
    await tx.start()
    await locker.execute("SELECT 1 FROM demo_game.cloud_saves WHERE account_id = $1 FOR UPDATE", accounts[LOCKED_INDEX])
    try:
        started = await start_cleanup(
            client,
            pool,
            task_queue,
            StartCleanup(deadline=deadline, partitions=1, batch_size=BATCH, heartbeat_timeout_seconds=60),
        )

        async def applied() -> int:
            return await pool.fetchval("SELECT count(*) FROM cleanup_applied")  # type: ignore[no-any-return]

        async def mid_partition() -> bool:
            return await applied() == LOCKED_INDEX

        await wait_until(mid_partition, within=120)
        second = worker_processes.start()
        first.terminate()  # SIGTERM

        async def shutting_down() -> bool:  # (a worker that drops its work at once just exits)
            return "worker shutting down" in worker_processes.logs() or first.poll() is not None

        await wait_until(shutting_down, within=60)
        assert await applied() == LOCKED_INDEX, "still held by the lock"
    finally:
        await tx.rollback()
        await pool.release(locker)

    async def exited() -> bool:
        return first.poll() is not None

    await wait_until(exited, within=60)
    assert first.returncode == 0, worker_processes.logs()

    handle = client.get_workflow_handle(started.workflow_id, result_type=CleanupResult)
    result: CleanupResult = await asyncio.wait_for(handle.result(), timeout=120)
    assert second.poll() is None, worker_processes.logs()

    assert result.outcome == "cleaned" and result.settlement is not None
    assert result.settlement.cleaned == ACCOUNTS
    counts = await effect_counts(pool)
    assert counts["applied"] == counts["reminders"] == counts["cleaned_accounts"] == ACCOUNTS, "lost = 0"
    assert counts["duplicate_reminders"] == counts["duplicate_archives"] == 0, "duplicates = 0"
    assert counts["settlements"] == 1

    history = await handle.fetch_history()
    partition_events = {
        e.event_id
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == CLEANUP_PARTITION
    }
    [resumed] = [
        e.activity_task_started_event_attributes
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
        and e.activity_task_started_event_attributes.scheduled_event_id in partition_events
    ]
    assert resumed.attempt == 2, "one hand-back, one retry"
    assert resumed.last_failure.application_failure_info.type == "HandedBackOnShutdown", (
        "the retry followed the hand-back, not a heartbeat timeout: "
        f"{resumed.last_failure.message} {resumed.last_failure.timeout_failure_info}"
    )
    assert not resumed.last_failure.HasField("timeout_failure_info")
    assert str(second.pid) in resumed.identity, "the other worker resumed it"

    [completed] = [
        e.activity_task_completed_event_attributes
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
        and e.activity_task_completed_event_attributes.scheduled_event_id in partition_events
    ]
    report = PartitionReport.model_validate_json(completed.result.payloads[0].data)
    assert report.attempt == 2
    assert report.claimed == report.applied == ACCOUNTS, "what the database says the partition applied"
    # The retry's own work: only what the first attempt left, as the batch held by the lock was
    # finished by the first worker, not rolled back (if its cursor was not heartbeated before the
    # hand-back, the retry finds that batch already applied).
    assert 0 < report.attempt_counts.cleaned <= ACCOUNTS - LOCKED_INDEX - BATCH
    assert report.attempt_counts.cleaned + report.attempt_counts.already_applied <= ACCOUNTS - LOCKED_INDEX


async def test_work_that_finishes_during_a_shutdown_lets_the_next_step_start_on_another_worker(
    client, temporal_address, task_queue
):
    """An activity that completes while its worker shuts down gracefully: the workflow's
    next task goes to the other worker, none is dropped by the stopping one and timed out (which
    would cost WORKFLOW_TASK_TIMEOUT, or the sticky queue's timeout). No hold of the completion is
    needed for that (docs/decisions/0004-shutdown-hold-removed.md)."""

    def worker(identity: str, on: Client) -> Worker:
        return Worker(
            on,
            task_queue=task_queue,
            workflows=[hw.HandOffWorkflow],
            activities=[hw.finish_when_released, hw.next_step],
            identity=identity,
            graceful_shutdown_timeout=timedelta(seconds=30),
            sticky_queue_schedule_to_start_timeout=timedelta(seconds=3),
        )

    hw.step_started.clear()
    hw.release.clear()
    # Two processes' workers: one client each (one client takes one worker per task queue).
    other_client = await connect(Settings(temporal_address=temporal_address))
    stopping, other = worker("stopping", client), worker("other", other_client)
    await stopping.__aenter__()
    handle = await client.start_workflow(
        hw.HandOffWorkflow.run, id=f"handoff-{task_queue}", task_queue=task_queue, task_timeout=WORKFLOW_TASK_TIMEOUT
    )
    await asyncio.wait_for(hw.step_started.wait(), 30)
    async with other:
        stopping_down = asyncio.create_task(stopping.shutdown())
        # The step finishes during the shutdown, once the stopping worker has handed its sticky queue
        # back (Core's ShutdownWorker call as the shutdown begins). A completion that races that very
        # call can wait out the sticky timeout (docs/decisions/0004-shutdown-hold-removed.md).
        await asyncio.sleep(1)
        hw.release.set()
        await stopping_down
        assert await asyncio.wait_for(handle.result(), 60) == "done"
    history = await handle.fetch_history()
    # A task the stopping worker started and never completed was dropped by it; a task that waited
    # on its sticky queue timed out before it started. A task the other worker started and finished
    # late on a loaded machine is neither, and is not the premise of this test.
    by_id = {e.event_id: e for e in history.events}
    dropped = [
        e.workflow_task_timed_out_event_attributes
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT
        and (
            e.workflow_task_timed_out_event_attributes.timeout_type != TimeoutType.TIMEOUT_TYPE_START_TO_CLOSE
            or by_id[
                e.workflow_task_timed_out_event_attributes.started_event_id
            ].workflow_task_started_event_attributes.identity
            == "stopping"
        )
    ]
    assert dropped == [], "a workflow task was dropped by the stopping worker (or waited on its sticky queue)"
    started = [
        e.workflow_task_started_event_attributes.identity
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED
    ]
    assert (started[0], started[-1]) == ("stopping", "other"), started
