"""Operate the reminder outbox and its relays: status, redelivery, starting and stopping relays.

Plain functions the CLI, the demo and the tests call. Bad input raises InputError (exit 2).
"""

from __future__ import annotations

import contextlib
import re
from datetime import datetime
from typing import Any

import asyncpg
from pydantic import ValidationError
from temporalio.client import Client
from temporalio.service import RPCError

import outbox
from core import db
from core.errors import InputError
from core.heartbeat import DEFAULT_HEARTBEAT_TIMEOUT_SECONDS
from core.queries import load
from core.temporal import WorkflowStart, start_idempotently
from outbox.models import (
    RELAY_NUDGE_SIGNAL,
    RELAY_STOP_SIGNAL,
    RELAY_WORKFLOW,
    DeadLetter,
    DeadRedelivery,
    OutboxRelayInput,
    OutboxStatus,
    RedeliveredEvent,
    RelayBatchSettings,
    RelayTotals,
    RunningRelay,
    StartedRelay,
)

SQL = load(outbox.__file__)

RELAY_ID_PREFIX = "outbox-relay-"
_EVENT_KEY = re.compile(r"^\S{1,500}$")


def check_event_key(value: str) -> str:
    if not _EVENT_KEY.match(value):
        raise InputError(
            f"malformed event key {value!r}: expected 1-500 characters without spaces, "
            "e.g. renewal-reminder:acct_123:v1"
        )
    return value


def _task_queue_filter(task_queue: str | None) -> str:
    if task_queue is None:
        return ""
    if not re.fullmatch(r"[\w.:/-]{1,200}", task_queue):
        raise InputError(f"malformed task queue name {task_queue!r}")
    return f" AND TaskQueue = '{task_queue}'"


async def running_relays(client: Client, task_queue: str | None = None) -> list[RunningRelay]:
    """The running relay workflows: of one task queue (this deployment's), or of the namespace."""
    rows: list[RunningRelay] = []
    async for wf in client.list_workflows(
        f"WorkflowType = '{RELAY_WORKFLOW}' AND ExecutionStatus = 'Running'{_task_queue_filter(task_queue)}",
        limit=100,
    ):
        memo = await wf.memo()
        rows.append(
            RunningRelay(
                workflow_id=wf.id,
                task_queue=wf.task_queue,
                delivered=memo.get("delivered"),
                dead=memo.get("dead"),
                batches=memo.get("batches"),
            )
        )
    return rows


async def outbox_status(pool: asyncpg.Pool, client: Client | None = None, dead_limit: int = 10) -> OutboxStatus:
    """What an operator asks: how much is pending, due, leased, delivered, dead, and why dead."""
    if dead_limit < 0:
        raise InputError(f"--dead must be 0 or more, got {dead_limit}")
    summary = await pool.fetchrow(SQL.outbox_summary)
    assert summary is not None
    dead = [DeadLetter.from_row(r) for r in await pool.fetch(SQL.dead_letters, dead_limit)] if dead_limit else []
    relays: list[RunningRelay] | None = None
    relays_error: str | None = None
    if client is not None:
        try:
            relays = await running_relays(client)
        except RPCError as err:  # visibility is optional for this report
            relays_error = str(err)
    return OutboxStatus.from_row(summary, dead_letters=dead, relays=relays, relays_error=relays_error)


async def redeliver_event(
    pool: asyncpg.Pool, event_key: str, client: Client | None = None, task_queue: str | None = None
) -> RedeliveredEvent:
    """Make a dead (or waiting) event due now; refuse delivered or currently leased ones."""
    check_event_key(event_key)
    async with pool.acquire() as conn, db.transaction(conn):
        current = await conn.fetchrow(SQL.event_by_key + " FOR UPDATE", event_key)
        if current is None:
            raise InputError(f"no outbox event with key {event_key!r}")
        if current["status"] == "delivered":
            raise InputError(
                f"event {event_key} was delivered at {current['delivered_at'].isoformat()}; the provider "
                "deduplicates by key, so a resend would not reach the customer again"
            )
        row = await conn.fetchrow(SQL.redeliver, event_key)
        if row is None:
            raise InputError(
                f"event {event_key} is being sent right now by {current['lease_owner']} "
                f"(lease until {current['leased_until'].isoformat()}); nothing to do"
            )
    nudged = await nudge_relays(client, task_queue) if client is not None and task_queue is not None else None
    return RedeliveredEvent.from_row(
        row, previous_status=current["status"], previous_error=current["last_error"], nudged=nudged
    )


async def redeliver_dead(
    pool: asyncpg.Pool,
    *,
    dead_since: datetime | None,
    reason: str | None,
    confirmed: bool,
    client: Client | None = None,
    task_queue: str | None = None,
) -> DeadRedelivery:
    """The dead letters selected by a filter (dead since, a piece of the reason): counted, and
    redelivered in one statement only when `confirmed` (the count is what an operator checks first)."""
    if dead_since is None and not reason:
        raise InputError("give a filter: --dead-since TIME and/or --reason TEXT (or one EVENT_KEY)")
    matching = await pool.fetchrow(
        SQL.dead_matching, *SQL.bind("dead_matching", dead_since=dead_since, reason=reason or None)
    )
    assert matching is not None
    found = DeadRedelivery.from_row(matching, dead_since=dead_since, reason=reason, redelivered=0, confirmed=False)
    if not confirmed:
        return found
    redeliver = SQL.bind("redeliver_dead_matching", dead_since=dead_since, reason=reason or None)
    redelivered = await pool.fetchval(SQL.redeliver_dead_matching, *redeliver)
    update: dict[str, Any] = {"redelivered": redelivered, "confirmed": True}
    if client is not None and task_queue is not None and redelivered:
        update["nudged"] = await nudge_relays(client, task_queue)
    return found.model_copy(update=update)


async def nudge_relays(client: Client, task_queue: str) -> list[str]:
    """Wake this task queue's relays (another deployment's relays share the namespace, not the outbox)."""
    nudged: list[str] = []
    with contextlib.suppress(RPCError):
        for relay in await running_relays(client, task_queue):
            with contextlib.suppress(RPCError):
                await client.get_workflow_handle(relay.workflow_id).signal(RELAY_NUDGE_SIGNAL)
                nudged.append(relay.workflow_id)
    return nudged


async def start_relays(
    client: Client,
    task_queue: str,
    *,
    relays: int = 1,
    settings: RelayBatchSettings | None = None,
    idle_sleep_seconds: float = 5.0,
    stop_when_drained: bool = False,
    id_prefix: str = RELAY_ID_PREFIX,
) -> list[StartedRelay]:
    """Start (or find) relays `<prefix>1..N`; a relay already running is left as it is."""
    if not 1 <= relays <= 64:
        raise InputError(f"--relays must be between 1 and 64, got {relays}")
    settings = settings or RelayBatchSettings()
    if settings.heartbeat_timeout_seconds is None:  # the outbox settings' default (CleanupClient passes its own)
        settings = settings.model_copy(update={"heartbeat_timeout_seconds": DEFAULT_HEARTBEAT_TIMEOUT_SECONDS})
    started: list[StartedRelay] = []
    for n in range(1, relays + 1):
        workflow_id = f"{id_prefix}{n}"
        try:
            input = OutboxRelayInput(
                relay_id=workflow_id,
                settings=settings,
                idle_sleep_seconds=idle_sleep_seconds,
                stop_when_drained=stop_when_drained,
            )
        except ValidationError as err:
            raise InputError(str(err)) from None
        outcome = await start_idempotently(
            client,
            WorkflowStart(
                RELAY_WORKFLOW,
                input,
                workflow_id=workflow_id,
                task_queue=task_queue,
                result_type=RelayTotals,
                summary=f"outbox relay {n} of {relays}",
                repeat_closed=True,
            ),
        )
        started.append(StartedRelay(workflow_id=workflow_id, run_id=outcome.run_id))
    return started


async def stop_relays(client: Client, task_queue: str) -> list[str]:
    """Ask this task queue's running relays to stop after their batch."""
    stopped: list[str] = []
    for relay in await running_relays(client, task_queue):
        with contextlib.suppress(RPCError):
            await client.get_workflow_handle(relay.workflow_id).signal(RELAY_STOP_SIGNAL)
            stopped.append(relay.workflow_id)
    return stopped
