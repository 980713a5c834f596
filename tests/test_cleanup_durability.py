"""The deadline sleep: days long on the time-skipping server, and across a dev server restart."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio.api.enums.v1 import EventType

from cleanup.inputs import StartCleanup
from cleanup.models import CleanupResult, CleanupStatus
from cleanup.operations import start_cleanup
from core.config import Settings
from core.temporal import connect
from devstack.embedded import DevServer
from tests.helpers import deadline_in, effect_counts, seed, shift_database_clock
from worker import build_activities, build_worker
from workflows.renewal_cleanup import RenewalCleanupWorkflow


async def test_deadline_days_away_fires_on_the_time_skipping_server(time_skipping_env, pool, task_queue):
    env = time_skipping_env
    deadline = deadline_in(3 * 24 * 3600)
    await seed(pool, deadline, 50)
    async with build_worker(env.client, task_queue, await build_activities(pool)):
        started = await start_cleanup(env.client, pool, task_queue, StartCleanup(deadline=deadline, partitions=2))
        handle = env.client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
        status: CleanupStatus = await handle.query(RenewalCleanupWorkflow.status)
        assert status.phase == "sleeping"
        assert (await effect_counts(pool))["applied"] == 0, "nothing happens before the deadline"

        # The time-skipping server skips Temporal's clock, not the database's, and the claim follows
        # the renewal rule's clock (cleanup_clock()): skip the database's clock by the same amount.
        await shift_database_clock(pool, "3 days 1 minute")
        await env.sleep(timedelta(days=3, minutes=1))
        result: CleanupResult = await handle.result()

    assert result.outcome == "cleaned"
    assert result.settlement is not None and result.settlement.cleaned == 50
    timers = [e for e in (await handle.fetch_history()).events if e.event_type == EventType.EVENT_TYPE_TIMER_FIRED]
    assert len(timers) == 1


async def test_sleep_survives_a_dev_server_restart_and_fires_once(pool, task_queue, tmp_path):
    server = DevServer(tmp_path, port=None)
    await asyncio.to_thread(server.start)
    try:
        client = await connect(Settings(temporal_address=server.address))
        deadline = deadline_in(6)
        await seed(pool, deadline, 40)
        async with build_worker(client, task_queue, await build_activities(pool)):
            started = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline, partitions=2))
            handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
            assert (await handle.query(RenewalCleanupWorkflow.status)).phase == "sleeping"

        await asyncio.to_thread(server.stop)
        assert not server.running()
        await asyncio.sleep(max(0.0, (deadline - deadline_in(0)).total_seconds()) + 2)
        assert (await effect_counts(pool))["applied"] == 0, "the deadline passed while the server was down"

        await asyncio.to_thread(server.start)
        client = await connect(Settings(temporal_address=server.address))
        async with build_worker(client, task_queue, await build_activities(pool)):
            handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
            result: CleanupResult = await handle.result()
    finally:
        await asyncio.to_thread(server.stop)

    assert result.outcome == "cleaned"
    events = (await _history_after_restart(server, started.workflow_id)).events
    assert sum(e.event_type == EventType.EVENT_TYPE_TIMER_FIRED for e in events) == 1
    counts = await effect_counts(pool)
    assert counts["applied"] == counts["reminders"] == 40
    assert counts["settlements"] == 1


async def _history_after_restart(server: DevServer, workflow_id: str):
    await asyncio.to_thread(server.start)
    try:
        client = await connect(Settings(temporal_address=server.address))
        return await client.get_workflow_handle(workflow_id).fetch_history()
    finally:
        await asyncio.to_thread(server.stop)
