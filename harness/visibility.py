"""Operator visibility: is the fault visible where an operator looks?

In Temporal (what the UI shows, read with fetch_history): an activity retried (attempt > 1, with
the previous attempt's failure message), a failed or timed-out activity event, or a timed-out
workflow task (a worker died while running a local activity). And in `starter.py status`: the
functions the CLI calls (cleanup_status, ledger_status, outbox_status).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any

from temporalio.client import Client
from temporalio.service import RPCError

from core.model import Report


def _marker_attempt(event: Any) -> tuple[str, int] | None:
    data = event.marker_recorded_event_attributes.details.get("data")
    if data is None or not data.payloads:
        return None
    try:
        marker = json.loads(data.payloads[0].data)
    except ValueError:
        return None
    if "activity_type" not in marker:
        return None
    return str(marker["activity_type"]), int(marker.get("attempt", 1))


async def temporal_evidence(client: Client, workflow_id: str, run_id: str | None = None) -> list[str]:
    """Readable lines about failures and retries in one workflow's history (empty: nothing visible)."""
    try:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
    except RPCError:
        return []
    scheduled: dict[int, str] = {}
    out: list[str] = []
    for e in history.events:
        if e.HasField("activity_task_scheduled_event_attributes"):
            scheduled[e.event_id] = e.activity_task_scheduled_event_attributes.activity_type.name
        elif e.HasField("activity_task_started_event_attributes"):
            a = e.activity_task_started_event_attributes
            if a.attempt > 1:
                name = scheduled.get(a.scheduled_event_id, "?")
                reason = a.last_failure.message if a.HasField("last_failure") else "no failure recorded"
                out.append(f"{name} attempt {a.attempt} after: {reason}")
        elif e.HasField("activity_task_failed_event_attributes"):
            a2 = e.activity_task_failed_event_attributes
            out.append(f"{scheduled.get(a2.scheduled_event_id, '?')} failed: {a2.failure.message}")
        elif e.HasField("activity_task_timed_out_event_attributes"):
            a3 = e.activity_task_timed_out_event_attributes
            out.append(f"{scheduled.get(a3.scheduled_event_id, '?')} timed out: {a3.failure.message}")
        elif e.HasField("workflow_task_timed_out_event_attributes"):
            out.append("workflow task timed out (its worker died while running it, e.g. in a local activity)")
        elif e.HasField("workflow_task_failed_event_attributes"):
            f = e.workflow_task_failed_event_attributes.failure
            out.append(f"workflow task failed: {f.message}")
        elif e.HasField("marker_recorded_event_attributes"):
            found = _marker_attempt(e)
            if found and found[1] > 1:
                out.append(f"local activity {found[0]} attempt {found[1]}")
    return out


async def pending_evidence(client: Client, workflow_id: str) -> list[str]:
    """What the UI shows for a running workflow: pending activities with attempts and last failures."""
    try:
        desc = await client.get_workflow_handle(workflow_id).describe()
    except RPCError:
        return []
    out = []
    for p in desc.raw_description.pending_activities:
        line = f"pending {p.activity_type.name} attempt {p.attempt}"
        if p.HasField("last_failure"):
            line += f" after: {p.last_failure.message}"
        if p.HasField("last_heartbeat_time"):
            line += f", last heartbeat {p.last_heartbeat_time.ToDatetime():%H:%M:%S}"
        out.append(line)
    return out


async def given(report: Awaitable[Report]) -> dict[str, Any]:
    """A status report as the dict the harness keeps as evidence: the fields its sources gave."""
    return (await report).given()


async def best_effort(coro: Any, within: float = 5.0) -> Any:
    """A status call during a fault may wait for a worker; never let it hang the harness."""
    try:
        return await asyncio.wait_for(coro, within)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}
