"""Small helpers shared by tests: seeding and counting in the real database."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
from pydantic import BaseModel
from temporalio.client import Client, WorkflowHistory

from activities.cleanup import claim_in_chunks
from cleanup.models import ClaimChunkedInput
from demo.fixture import seed_accounts
from tests.redelivery import RedeliverActivityWorkflow, Redelivery


def deadline_in(seconds: float) -> datetime:
    """A deadline with random microseconds: cohort workflow IDs of different tests never collide."""
    return (datetime.now(UTC) + timedelta(seconds=seconds)).replace(microsecond=random.randint(1, 999_999))


async def seed(pool: asyncpg.Pool, deadline: datetime, count: int, prefix: str | None = None) -> list[str]:
    prefix = prefix or uuid.uuid4().hex[:8]
    await seed_accounts(pool, prefix=prefix, deadline=deadline, count=count)
    rows = await pool.fetch(
        "SELECT account_id FROM accounts WHERE account_id LIKE $1 ORDER BY account_id", f"acct_{prefix}_%"
    )
    return [r["account_id"] for r in rows]


async def effect_counts(pool: asyncpg.Pool) -> dict[str, int]:
    """Everything that must be exactly once, counted in the database."""
    row = await pool.fetchrow(
        """
        SELECT
          (SELECT count(*) FROM cleanup_applied) AS applied,
          (SELECT count(*) FROM outbox WHERE kind = 'renewal_reminder') AS reminders,
          (SELECT count(*) - count(DISTINCT account_id) FROM outbox
             WHERE kind = 'renewal_reminder') AS duplicate_reminders,
          (SELECT count(*) FROM demo_game.match_history_archive) AS archived_matches,
          (SELECT count(*) - count(DISTINCT match_id) FROM demo_game.match_history_archive) AS duplicate_archives,
          (SELECT count(*) FROM accounts WHERE status = 'cleaned') AS cleaned_accounts,
          (SELECT count(*) FROM cleanup_settlements) AS settlements
        """
    )
    assert row is not None
    return dict(row)


async def wait_until(predicate: Callable[[], Awaitable[bool]], within: float = 60, interval: float = 0.2) -> None:
    deadline = time.monotonic() + within
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(interval)


async def redeliver(client: Client, task_queue: str, activity: str, arg: BaseModel, times: int = 2) -> list[Any]:
    """Deliver the same activity task `times` times through Temporal; returns each result."""
    return await client.execute_workflow(
        RedeliverActivityWorkflow.run,
        Redelivery(activity=activity, arg=arg.model_dump(mode="json"), times=times),
        id=f"redeliver-{activity}-{uuid.uuid4().hex[:8]}",
        task_queue=task_queue,
    )


async def workflow_ids(client: Client, task_queue: str) -> list[str]:
    return [wf.id async for wf in client.list_workflows(f"TaskQueue = '{task_queue}'")]


async def listed_workflow_ids(client: Client, task_queue: str, expected: list[str], within: float = 10) -> list[str]:
    """The task queue's workflows as the listing shows them, once it shows `expected` (visibility
    records a start a moment after it), or as it shows them after `within` seconds."""
    ids: list[str] = []

    async def shown() -> bool:
        ids[:] = await workflow_ids(client, task_queue)
        return sorted(ids) == sorted(expected)

    with contextlib.suppress(AssertionError):
        await wait_until(shown, within=within)
    return ids


def activity_timeline(history: WorkflowHistory) -> list[tuple[int, str, str]]:
    """(event id, what, activity type) for scheduled, completed and local activities, in order."""
    scheduled: dict[int, str] = {}
    out: list[tuple[int, str, str]] = []
    for e in history.events:
        if e.HasField("activity_task_scheduled_event_attributes"):
            scheduled[e.event_id] = e.activity_task_scheduled_event_attributes.activity_type.name
            out.append((e.event_id, "scheduled", scheduled[e.event_id]))
        elif e.HasField("activity_task_completed_event_attributes"):
            name = scheduled[e.activity_task_completed_event_attributes.scheduled_event_id]
            out.append((e.event_id, "completed", name))
        elif e.HasField("marker_recorded_event_attributes"):
            data = e.marker_recorded_event_attributes.details.get("data")
            if data is not None and data.payloads:
                marker = json.loads(data.payloads[0].data)
                if "activity_type" in marker:
                    out.append((e.event_id, "local", marker["activity_type"]))
    return out


def cohort_claim(cleanup_id: str, deadline: datetime, partitions: int) -> ClaimChunkedInput:
    """The claim of the accounts of exactly `deadline`, as production's cohort cleanup asks for it
    (one stream): the range [deadline, deadline + 1 µs)."""
    return ClaimChunkedInput(
        cleanup_id=cleanup_id,
        deadline_from=deadline,
        deadline_until=deadline + timedelta(microseconds=1),
        partitions=partitions,
    )


async def claim_partitions(pool: asyncpg.Pool, cleanup_id: str, deadline: datetime, partitions: int = 1) -> None:
    """Claim the accounts of exactly `deadline` into `partitions`, with the production claim."""
    await claim_in_chunks(pool, cohort_claim(cleanup_id, deadline, partitions))


async def claim_one_partition(pool: asyncpg.Pool, cleanup_id: str, deadline: datetime) -> None:
    """Claim the accounts of exactly `deadline` into one partition, as a cleanup's claim does."""
    await claim_partitions(pool, cleanup_id, deadline)


async def shift_database_clock(pool: asyncpg.Pool, offset: str | None) -> None:
    """Move this test database's renewal clock (`cleanup_clock()`) by `offset` (an interval; None:
    back to the database's clock). The production function has no such hook: a test replaces it in
    its own database, as the time-skipping server cannot skip the database's clock."""
    shifted = f"clock_timestamp() + interval '{offset}'" if offset else "clock_timestamp()"
    await pool.execute(
        "CREATE OR REPLACE FUNCTION cleanup_clock() RETURNS timestamptz LANGUAGE sql VOLATILE"
        f" AS $$ SELECT {shifted} $$"
    )
