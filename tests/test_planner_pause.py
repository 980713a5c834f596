"""An operator's pause of the planner is kept in the database: a planner started again by a
worker's watchdog is still paused, `planner status` says what the pause stops and what it does not,
and `--hold-scheduled` also holds the bucket cleanups already scheduled, until resumed."""

from __future__ import annotations

from datetime import datetime
from types import SimpleNamespace
from typing import Any

import asyncpg
from temporalio.client import Client

from cleanup.models import STATUS_QUERY, bucket_cleanup_id, planner_workflow_id
from cleanup.planner import plan_buckets, planner_pause, planner_status, signal_planner, watch_planner
from cleanup.planner_models import PlannerStatus, PlanTickInput
from core.temporal import describe_or_none
from tests.helpers import deadline_in, seed, wait_until
from tests.test_planner import FAST, all_settled, planner_worker


class RecordingClient:
    def __init__(self) -> None:
        self.started: list[str] = []

    async def start_workflow(self, workflow: str, input: Any, *, id: str, **_: Any) -> Any:
        self.started.append(id)
        return SimpleNamespace(result_run_id=f"run-{len(self.started)}")


async def _live(client: Client, task_queue: str) -> PlannerStatus | None:
    desc = await describe_or_none(client, planner_workflow_id(task_queue))
    if desc is None or desc.status is None or desc.status.name != "RUNNING":
        return None
    handle = client.get_workflow_handle(planner_workflow_id(task_queue))
    live: PlannerStatus = await handle.query(STATUS_QUERY, result_type=PlannerStatus)
    return live


async def test_a_pause_survives_the_planner_started_again_by_the_watchdog(client, pool, task_queue):
    async with planner_worker(client, pool, task_queue):
        await signal_planner(client, task_queue, "pause", "maintenance", pool=pool)
        handle = client.get_workflow_handle(planner_workflow_id(task_queue))
        await handle.terminate(reason="test: the planner dies")
        assert (await watch_planner(client, task_queue, pool=pool))[0] == "restarted"

        async def paused_again() -> bool:
            live = await _live(client, task_queue)
            return live is not None and live.phase == "paused" and live.pause_reason == "maintenance"

        await wait_until(paused_again)
        # Whichever run asks, nothing is planned while the pause is recorded.
        await seed(pool, deadline_in(30), 3)
        recording = RecordingClient()
        tick = PlanTickInput(settings=FAST, task_queue=task_queue)
        assert (await plan_buckets(pool, recording, tick, {})).buckets == 0  # type: ignore[arg-type]
        assert recording.started == []

        status = await planner_status(client, pool, task_queue)
        assert status.paused is True and status.pause_reason == "maintenance"
        effect = str(status.pause_effect)
        assert "stops planning new bucket cleanups" in effect
        assert "does not stop" in effect and "scheduled" in effect

        await signal_planner(client, task_queue, "resume", pool=pool)
        assert (await plan_buckets(pool, recording, tick, {})).buckets == 1  # type: ignore[arg-type]
        assert (await planner_status(client, pool, task_queue)).paused is False


async def test_hold_scheduled_holds_bucket_cleanups_already_scheduled_until_resumed(client, pool, task_queue):
    deadline = deadline_in(20)  # time for the planner to schedule its bucket on a loaded machine
    accounts = await seed(pool, deadline, 4)
    bucket_id = bucket_cleanup_id(deadline, 0, task_queue)  # a bucket of one instant: that instant's cleanup
    async with planner_worker(client, pool, task_queue):
        await wait_until(lambda: _exists(client, bucket_id))  # scheduled: its timer sleeps
        await signal_planner(client, task_queue, "pause", "incident", pool=pool, hold_scheduled=True)

        await wait_until(lambda: _claim_held(client, bucket_id), within=90)
        # The hold acts before the claim waits for the deadline: look once it has passed.
        await wait_until(lambda: _past(pool, deadline), within=60, interval=0.2)
        assert await _claim_held(client, bucket_id)
        assert await pool.fetchval(
            "SELECT count(*) FROM accounts WHERE account_id = ANY($1::text[]) AND status = 'active'"
            " AND renewal_deadline < cleanup_clock()",
            accounts,
        ) == len(accounts), "past their deadline, still not claimed: held"
        status = await planner_status(client, pool, task_queue)
        assert status.hold_scheduled is True and "holds the scheduled bucket cleanups" in str(status.pause_effect)

        await signal_planner(client, task_queue, "resume", pool=pool)
        await wait_until(lambda: all_settled(pool, accounts), within=90, interval=0.5)
    cleaned = await pool.fetchval(
        "SELECT count(*) FROM accounts WHERE account_id = ANY($1::text[]) AND status = 'cleaned'", accounts
    )
    assert cleaned == len(accounts)


async def _past(pool: asyncpg.Pool, deadline: datetime) -> bool:
    return bool(await pool.fetchval("SELECT cleanup_clock() > $1", deadline))


async def _exists(client: Client, workflow_id: str) -> bool:
    return await describe_or_none(client, workflow_id) is not None


async def _claim_held(client: Client, workflow_id: str) -> bool:
    desc = await client.get_workflow_handle(workflow_id).describe()
    return any(
        a.last_failure.application_failure_info.type == "HeldByPlannerPause"
        for a in desc.raw_description.pending_activities
    )


async def test_a_pause_without_a_running_planner_is_recorded_for_the_next_run(client, pool, task_queue):
    await signal_planner(client, task_queue, "pause", "before the first start", pool=pool)
    assert (await planner_status(client, pool, task_queue)).pause_reason == "before the first start"
    async with planner_worker(client, pool, task_queue):  # ensure_planner without the pool: paused by the database
        await seed(pool, deadline_in(30), 2)
        tick = PlanTickInput(settings=FAST, task_queue=task_queue)
        assert (await plan_buckets(pool, RecordingClient(), tick, {})).buckets == 0  # type: ignore[arg-type]
        await signal_planner(client, task_queue, "resume", pool=pool)
        assert (await planner_status(client, pool, task_queue)).paused is False
    assert await planner_pause(pool, task_queue) is None
