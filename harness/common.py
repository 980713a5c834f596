"""Shared pieces of the scenarios: the result row, profiles, ID allocators and small workloads."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

import asyncpg
from pydantic import BaseModel
from temporalio.client import Client

from demo.fixture import seed_accounts
from harness.redelivery import HarnessRedeliverWorkflow, Redelivery
from harness.stack import Harness
from ledger.seed import LedgerSeedResult, seed_ledger_day, seed_spec
from outbox.models import RelayBatchSettings

MATCHES = 2  # match-history rows seeded per account (the archive check counts them)
RELAY = RelayBatchSettings(
    batch_size=5,
    concurrency=4,
    lease_seconds=4,
    request_timeout_seconds=1,
    backoff_initial_seconds=0.3,
    backoff_max_seconds=2,
)


@dataclass
class Profile:
    name: str
    kill_runs: int
    kill_lanes: int
    rounds: int  # repetitions of the replay / race / database-fault scenarios
    scale: int  # size multiplier of the workloads


PROFILES = {
    # kill_runs: each commit point stopped once with SIGKILL and once with SIGTERM (quick), 15 times each (full)
    "quick": Profile("quick", kill_runs=14, kill_lanes=3, rounds=1, scale=1),
    "full": Profile("full", kill_runs=210, kill_lanes=3, rounds=3, scale=4),
}


@dataclass
class Row:
    scenario: str
    runs: int = 0
    duplicates: int = 0
    lost: int = 0
    recovery_seconds: float | None = None
    dead_letters: int = 0
    ordering: int = 0  # ordering violations, counted when the scenario's lanes close
    operator_visibility: bool = False
    evidence: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # Recovery per kind of work and signal (scenario 2: harness/recovery.py), for the recovery table.
    recovery: list[dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (
            not self.violations
            and self.duplicates == 0
            and self.lost == 0
            and self.ordering == 0
            and self.operator_visibility
        )

    def recovered(self, seconds: float) -> None:
        self.recovery_seconds = max(self.recovery_seconds or 0.0, round(seconds, 1))

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["passed"] = self.passed
        return out


class Ids:
    """Business keys unique within one harness run (workflow IDs derive from them)."""

    def __init__(self, rng: random.Random) -> None:
        self._n = itertools.count(1)
        self._tag = "".join(rng.choice("abcdefghjkmnpqrstuvwxyz") for _ in range(4))
        self._past = datetime(2021, 3, 1, tzinfo=UTC)
        self._days = date(2019, 1, 1)
        self._future: set[datetime] = set()

    def prefix(self, kind: str) -> str:
        return f"h{self._tag}{kind}{next(self._n)}"

    def past_deadline(self) -> datetime:
        return self._past + timedelta(seconds=next(self._n))

    def future_deadline(self, seconds: float) -> datetime:
        at = (datetime.now(UTC) + timedelta(seconds=seconds)).replace(microsecond=0) + timedelta(seconds=1)
        while at in self._future:
            at += timedelta(seconds=1)
        self._future.add(at)
        return at

    def business_date(self) -> date:
        return self._days + timedelta(days=next(self._n))


@dataclass
class Ctx:
    h: Harness
    profile: Profile
    seed: int
    ids: Ids
    inject_violation: bool = False
    inject_ordering_violation: bool = False

    def rng(self, scenario: str) -> random.Random:
        return random.Random(f"{self.seed}:{scenario}")

    @property
    def client(self) -> Client:
        return self.h.client


async def seed_cohort(pool: asyncpg.Pool, prefix: str, deadline: datetime, count: int) -> None:
    await seed_accounts(pool, prefix=prefix, deadline=deadline, count=count, saves=1, items=2, matches=MATCHES)


async def account_ids(pool: asyncpg.Pool, prefix: str) -> list[str]:
    rows = await pool.fetch("SELECT account_id FROM accounts WHERE account_id LIKE $1 ORDER BY 1", f"acct_{prefix}_%")
    return [r["account_id"] for r in rows]


async def seed_day(pool: asyncpg.Pool, business_date: date, payments: int, shards: int) -> LedgerSeedResult:
    spec = seed_spec(
        business_date=business_date,
        payments=payments,
        shards=shards,
        refund_rate=0.02,
        small_mismatch_rate=0.02,
        large_mismatch_rate=0.01,
        unsettled_rate=0.01,
        unknown_rate=0.01,
        duplicate_rate=0.02,
    )
    result = await seed_ledger_day(pool, spec)
    assert result.created
    return result


async def seed_events(pool: asyncpg.Pool, prefix: str, count: int) -> None:
    await pool.execute(
        """
        INSERT INTO outbox (event_key, kind, account_id, source_id, payload)
        SELECT 'renewal-reminder:acct_' || $2 || '_' || g || ':v1', 'renewal_reminder', 'acct_' || $2 || '_' || g,
               'harness-seed', jsonb_build_object('account_id', 'acct_' || $2 || '_' || g, 'cleanup_version', 1)
        FROM generate_series(1, $1::int) g
        """,
        count,
        prefix,
    )


async def redeliver(
    client: Client, task_queue: str, activity: str, arg: BaseModel, *, times: int = 2, stc: float = 60
) -> tuple[str, list[dict[str, Any]]]:
    """Deliver `activity(arg)` `times` times through Temporal; returns the workflow ID and each result."""
    workflow_id = f"harness-redeliver-{activity}-{uuid.uuid4().hex[:8]}"
    results = await client.execute_workflow(
        HarnessRedeliverWorkflow.run,
        Redelivery(activity=activity, arg=arg.model_dump(mode="json"), times=times, start_to_close_seconds=stc),
        id=workflow_id,
        task_queue=task_queue,
    )
    return workflow_id, results


async def wait_for(predicate: Any, within: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + within
    while not await predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval)
    return True


async def wait_while_progressing(done: Any, progress: Any, stall: float, interval: float = 0.3) -> bool:
    """True once `done()`; False once `progress()` (a figure that changes while work gets done) has
    stayed the same for `stall` seconds. A check of liveness, not of speed: a loaded machine is slow,
    and a stuck consumer makes no progress however long it is given."""
    last, since = await progress(), time.monotonic()
    while not await done():
        now_at = await progress()
        if now_at != last:
            last, since = now_at, time.monotonic()
        elif time.monotonic() - since > stall:
            return False
        await asyncio.sleep(interval)
    return True
