"""The nightly schedule's recent runs carry the status the Temporal UI badges them with: once a
night's run has finished, the schedule says so (not RUNNING forever). Real Temporal, real Postgres."""

from __future__ import annotations

import asyncio
import uuid
from datetime import date

import pytest
from temporalio.client import ScheduleOverlapPolicy

from core.errors import InputError
from ledger import schedule as ls
from ledger.models import ScheduledLedgerInput, ScheduledLedgerResult
from tests.helpers import wait_until
from tests.ledger_helpers import id_prefix, reconcile, seed_day


async def test_finished_scheduled_runs_are_not_shown_running(client, pool, task_queue, worker):
    dates = [date(2026, 9, 14), date(2026, 9, 15)]
    for d in dates:
        await seed_day(pool, d, payments=200, shards=2)
    schedule_id = f"ledger-nightly-{uuid.uuid4().hex[:8]}"
    options = ScheduledLedgerInput(shards=2, heartbeat_timeout_seconds=2.0, id_prefix=id_prefix(task_queue))
    await ls.create_schedule(client, task_queue, options=options, schedule_id=schedule_id)
    try:
        # The first date was reconciled by hand: its night finds the date-keyed run (`already_started`).
        await reconcile(client, pool, task_queue, dates[0])
        await ls.backfill_schedule(client, dates[0], dates[-1], schedule_id)

        async def taken() -> bool:
            return len((await ls.describe_schedule(client, schedule_id)).recent_runs) >= 2

        await wait_until(taken, within=120)
        runs = (await ls.describe_schedule(client, schedule_id)).recent_runs
        outcomes = []
        for run in runs:
            handle = client.get_workflow_handle(
                str(run.workflow_id), run_id=run.run_id, result_type=ScheduledLedgerResult
            )
            outcomes.append((await asyncio.wait_for(handle.result(), timeout=120)).outcome)
        assert sorted(outcomes) == ["already_started", "reconciled"]

        async def none_running() -> bool:
            described = await ls.describe_schedule(client, schedule_id)
            return all(r.status == "COMPLETED" for r in described.recent_runs)

        # Every run above has completed (its result was read): the schedule must learn it too.
        try:
            await wait_until(none_running, within=60)
        except AssertionError:
            statuses = [r.status for r in (await ls.describe_schedule(client, schedule_id)).recent_runs]
            raise AssertionError(f"finished runs still badged {statuses}") from None
    finally:
        await ls.delete_schedule(client, schedule_id)


async def test_create_upgrades_a_schedule_made_under_the_old_overlap_policy(client, task_queue):
    schedule_id = f"ledger-nightly-{uuid.uuid4().hex[:8]}"
    old = ls.nightly_schedule(task_queue, paused=True, schedule_id=schedule_id)
    old.policy.overlap = ScheduleOverlapPolicy.ALLOW_ALL
    await client.create_schedule(schedule_id, old)
    try:
        upgraded = await ls.create_schedule(client, task_queue, schedule_id=schedule_id)
        assert upgraded.policy_upgraded is True
        assert upgraded.overlap == "BUFFER_ALL"
        assert upgraded.paused is True, "the upgrade keeps the schedule's state"
        with pytest.raises(InputError, match="already exists"):
            await ls.create_schedule(client, task_queue, schedule_id=schedule_id)
    finally:
        await ls.delete_schedule(client, schedule_id)
