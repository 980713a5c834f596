"""The load budget: how much cleanup and reconciliation work may run on the players' database at once.

One budget for every job together, across all worker processes and nodes, kept in Postgres
(migration 012, statements in core/budget.sql):

- **in flight**: a batch holds a row of `load_budget_slots` while it runs; at most the effective
  `max_in_flight` such rows exist. Acquires are serialised by a transaction-scoped advisory lock,
  so two workers can never both take the last slot. A holder renews its lease while the batch
  runs; one that dies stops renewing and its slot expires after `lease_seconds`.
- **rows per second**: a token bucket of rows on the same row (refilled by the database clock,
  charged the batch size up front, the unused part refunded at release).
- **adaptive back-off**: at most once per `adjust_seconds`, one worker samples the database's
  stress (the commit probe against its quiet baseline; the mean latency of the batches since the
  last adjustment, per 1,000 rows; lock waits in this database; replication lag when a standby
  streams from the server). Stressed: the scale halves (down to `min_scale`); healthy: it grows
  back by `grow_step`. Both limits are multiplied by it.
- **the commit probe**: while a process has budgeted work waiting or in flight, it times a one-row
  write that commits, as a player's commit would, every `probe_interval_seconds`; probes taken
  while no slot is held anywhere make the baseline (and when there were none for
  `baseline_seconds`, nothing is granted for `quiet_seconds` so that there are).
- **a batch blocked on a lock** (a session of this role waiting on a row lock for
  `blocked_after_seconds`) does not count against `max_in_flight`: it uses neither CPU nor WAL.
- The budget's own writes commit without waiting for the WAL flush (core/budget.sql).
- **operator control**: `starter.py budget show|set` changes the row; every acquire reads it, so a
  change reaches running partitions at their next batch (and waiting ones at their next try).

A batch that cannot have a slot or rows waits, calling `while_waiting` (the activities heartbeat
with it, so waiting is neither a failure nor a dead worker). Platform code: no job is imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
from pydantic import BaseModel, ConfigDict, Field

from core import metrics
from core.queries import load

SQL = load(__file__, "budget.sql")
log = logging.getLogger("budget")

Waiting = Callable[[dict[str, Any]], None]


class BudgetSettings(BaseModel):
    """A worker's defaults (LOAD_BUDGET_*); the operator's values in the budget row take precedence."""

    model_config = ConfigDict(allow_inf_nan=False)  # a NaN or infinite limit would be no limit

    enabled: bool = True  # LOAD_BUDGET=off: this process takes no part (no budget statements at all)
    max_in_flight: int = Field(default=1, ge=0, le=256)
    rows_per_second: float = Field(default=6000.0, gt=0)
    latency_ms: float = Field(default=1000.0, gt=0)  # mean batch latency per 1,000 rows that means stress
    max_lock_waits: int = Field(default=4, ge=0)
    max_replication_lag_seconds: float = Field(default=10.0, gt=0)
    lease_seconds: float = Field(default=10.0, gt=0)
    adjust_seconds: float = Field(default=2.0, gt=0)
    burst_seconds: float = Field(default=1.0, gt=0)
    min_scale: float = Field(default=0.5, gt=0, le=1)
    grow_step: float = Field(default=0.1, gt=0, le=1)
    max_poll_seconds: float = Field(default=0.5, gt=0)
    # the commit probe: the players' view of the database
    probe_interval_seconds: float = Field(default=0.2, gt=0)  # how often a worker with work probes
    probe_ratio: float = Field(default=1.5, gt=1)  # busy probe mean / quiet baseline that means stress
    probe_min_ms: float = Field(default=1.0, ge=0)  # ... and by at least this much (sub-ms jitter is not stress)
    baseline_seconds: float = Field(default=30.0, gt=0)  # a baseline older than this is measured again
    quiet_seconds: float = Field(default=1.0, ge=0)  # how long nothing is granted while it is (0: never)
    max_claim_rows: int = Field(default=2000, ge=1)  # the claim's chunks under the budget: at most this
    blocked_after_seconds: float = Field(default=1.0, ge=0)  # a batch blocked on a lock this long stops counting
    # A process that found the budget switched off (`budget set --enabled off`) runs its batches
    # without budget statements for this long, then asks again: switching it on takes effect within it.
    off_recheck_seconds: float = Field(default=1.0, ge=0)

    @classmethod
    def from_env(cls, **overrides: object) -> BudgetSettings:
        env = os.environ
        values: dict[str, object] = {}
        if env.get("LOAD_BUDGET"):
            values["enabled"] = env["LOAD_BUDGET"].strip().lower() not in ("off", "0", "false", "no")
        for field in cls.model_fields:
            key = f"LOAD_BUDGET_{field.upper()}"
            if field != "enabled" and env.get(key):
                values[field] = env[key]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(values)


@dataclass
class Grant:
    """A batch's permission to run: `slot` is None when the budget is off. Set `rows_done` to what
    the batch really did (unused rows are refunded)."""

    lease: str
    slot: int | None
    rows: int
    waited_seconds: float
    in_flight_limit: int | None = None
    rows_per_second: float | None = None
    rows_done: int | None = None


@contextlib.asynccontextmanager
async def under_budget(
    budget: LoadBudget | None, job: str, rows: int, while_waiting: Waiting | None = None
) -> AsyncIterator[Grant]:
    """`budget.batch(...)`, or no limit at all when `budget` is None (the benchmarks' direct runs)."""
    if budget is None:
        yield Grant(lease="", slot=None, rows=rows, waited_seconds=0.0)
        return
    async with budget.batch(job, rows, while_waiting) as grant:
        yield grant


def _holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class LoadBudget:
    """The client side of the budget; one per worker process (cheap: it holds no connection)."""

    def __init__(self, pool: asyncpg.Pool, settings: BudgetSettings | None = None) -> None:
        self.pool = pool
        self.settings = settings or BudgetSettings.from_env()
        self.holder = _holder()
        self._active = 0  # batches of this process waiting for the budget or in flight
        self._prober: asyncio.Future[None] | None = None
        self._probe_key = f"{self.holder} {uuid.uuid4().hex[:8]}"
        self._released = asyncio.Event()  # wakes this process's waiting batches when one of its slots frees
        # Until then (time.monotonic()), the operator's row said "off": no statements per batch. Two per
        # batch on one hot row otherwise, serialized by the budget's lock, for a budget that limits nothing.
        self._off_until = 0.0

    async def _probe_loop(self) -> None:
        """Time the commit probe every `probe_interval_seconds` while this process has work; each
        probe statement also records the previous one's latency (quiet or busy) for the adjustment."""
        previous: tuple[float, bool] | None = None
        while self._active > 0:
            try:
                async with self.pool.acquire() as conn:
                    started = time.perf_counter()
                    quiet = await conn.fetchval(
                        SQL.probe, self._probe_key, previous[0] if previous else None, previous[1] if previous else None
                    )
                    previous = ((time.perf_counter() - started) * 1000, bool(quiet))
            except Exception:  # a probe is an observation; the batches report the database's errors
                log.debug("load budget probe failed", exc_info=True)
            await asyncio.sleep(self.settings.probe_interval_seconds)

    @contextlib.asynccontextmanager
    async def batch(self, job: str, rows: int, while_waiting: Waiting | None = None) -> AsyncIterator[Grant]:
        """Hold a slot and `rows` rows of the budget for the body (one batch); release after it."""
        if not self.settings.enabled or time.monotonic() < self._off_until:
            yield Grant(lease="", slot=None, rows=rows, waited_seconds=0.0)
            return
        async with self._probing():
            async with self._held(job, rows, while_waiting) as grant:
                yield grant

    @contextlib.asynccontextmanager
    async def _probing(self) -> AsyncIterator[None]:
        """The commit probe runs while this process has budgeted work waiting or in flight."""
        self._active += 1
        if self._prober is None or self._prober.done():
            self._prober = asyncio.ensure_future(self._probe_loop())
        try:
            yield
        finally:
            self._active -= 1

    @contextlib.asynccontextmanager
    async def _held(self, job: str, rows: int, while_waiting: Waiting | None) -> AsyncIterator[Grant]:
        grant = await self.acquire(job, rows, while_waiting)
        renewing = asyncio.ensure_future(self._renew(grant)) if grant.slot is not None else None
        started = time.perf_counter()
        ok = False
        try:
            yield grant
            ok = True
        finally:
            if renewing is not None:
                renewing.cancel()
                with contextlib.suppress(BaseException):
                    await renewing
            seconds = time.perf_counter() - started
            done = grant.rows_done if ok and grant.rows_done is not None else rows
            ms_per_1000 = seconds * 1_000_000 / max(rows, 1) if ok else None
            try:
                await self._bookkeeping(SQL.release, grant.slot, grant.lease, done, ms_per_1000)
            except Exception:  # the lease expires by itself; never mask the batch's own outcome
                log.warning("could not release load budget slot %s; it expires by itself", grant.slot, exc_info=True)
            metrics.record_budget_rows(done)
            # The slot is free now: this process's waiters try at once instead of at their next poll
            # (waiters in other processes still poll, within max_poll_seconds).
            self._released.set()
            self._released = asyncio.Event()

    async def acquire(self, job: str, rows: int, while_waiting: Waiting | None = None) -> Grant:
        """Wait until a slot and `rows` rows are free (`while_waiting` is called on each wait)."""
        s = self.settings
        lease = uuid.uuid4().hex
        holder = f"{self.holder} {job}"
        started = time.perf_counter()
        while True:
            await self.maybe_adjust()
            waited = time.perf_counter() - started
            async with self.pool.acquire() as conn, conn.transaction():
                await conn.execute(SQL.lock_budget)
                row = await conn.fetchrow(
                    SQL.acquire,
                    lease,
                    job,
                    holder,
                    rows,
                    s.lease_seconds,
                    s.max_in_flight,
                    s.rows_per_second,
                    waited,
                    s.burst_seconds,
                    s.blocked_after_seconds,
                )
            assert row is not None
            if not row["enabled"]:
                self._off_until = time.monotonic() + s.off_recheck_seconds
            metrics.set_budget(row["in_flight_limit"], row["rows_per_second"], row["scale"])
            if row["granted"]:
                metrics.record_budget_wait(waited)
                return Grant(
                    lease=lease,
                    slot=row["slot"],
                    rows=rows,
                    waited_seconds=waited,
                    in_flight_limit=row["in_flight_limit"],
                    rows_per_second=row["rows_per_second"],
                )
            if while_waiting is not None:
                while_waiting(
                    {
                        "waiting_for_load_budget_s": round(waited, 1),
                        "in_flight": row["in_flight"],
                        "in_flight_limit": row["in_flight_limit"],
                        "rows_per_second_limit": round(row["rows_per_second"], 1),
                        "scale": round(row["scale"], 3),
                        **({"measuring_baseline": True} if row["quiet_seconds"] is not None else {}),
                    }
                )
            pause = row["refill_seconds"] if row["refill_seconds"] is not None else s.max_poll_seconds / 2
            if row["quiet_seconds"] is not None:
                pause = max(pause, row["quiet_seconds"])
            released = self._released
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(released.wait(), min(s.max_poll_seconds, pause) * random.uniform(0.8, 1.2))

    async def _bookkeeping(self, statement: str, *args: object) -> asyncpg.Record | None:
        """One of the budget's own writes, committed without waiting for the WAL flush (budget.sql)."""
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(SQL.no_commit_wait)
            return await conn.fetchrow(statement, *args)

    async def _renew(self, grant: Grant) -> None:
        while True:
            await asyncio.sleep(self.settings.lease_seconds / 3)
            try:
                await self._bookkeeping(SQL.renew_slot, grant.slot, grant.lease, self.settings.lease_seconds)
            except Exception:
                log.warning("could not renew load budget slot %s", grant.slot, exc_info=True)

    async def maybe_adjust(self) -> dict[str, Any] | None:
        """The adaptive step, by whichever worker claims it first in each interval."""
        s = self.settings
        claimed = await self.pool.fetchrow(SQL.claim_adjustment, s.adjust_seconds)
        if claimed is None:
            return None
        stress = await self.pool.fetchrow(SQL.sample_stress)
        probes = await self.pool.fetchrow(SQL.collect_probes)
        assert stress is not None and probes is not None
        latency_ms = claimed["window_ms_sum"] / claimed["window_batches"] if claimed["window_batches"] else None
        busy_ms = probes["busy_ms_sum"] / probes["busy_n"] if probes["busy_n"] else None
        baseline = claimed["probe_baseline_ms"]
        new_baseline = None
        if probes["quiet_n"]:
            quiet_ms = probes["quiet_ms_sum"] / probes["quiet_n"]
            weight = min(1.0, probes["quiet_n"] / 5)  # a few quiet probes replace the old baseline
            new_baseline = quiet_ms if baseline is None else baseline + weight * (quiet_ms - baseline)
            baseline = new_baseline
        # Work is running and no quiet probe was seen for a while: grant nothing for a moment (at
        # most once per `baseline_seconds`, even when that moment found no quiet probe either).
        stale = [claimed["baseline_age_seconds"], claimed["since_quiet_seconds"]]
        quiet = (
            s.quiet_seconds
            if s.quiet_seconds > 0
            and busy_ms is not None
            and new_baseline is None
            and all(age is None or age > s.baseline_seconds for age in stale)
            else None
        )
        verdict = judge(
            scale=claimed["scale"],
            latency_ms=latency_ms,
            lock_waits=stress["lock_waits"],
            replication_lag=stress["replication_lag"],
            latency_threshold=claimed["latency_ms"] or s.latency_ms,
            max_lock_waits=claimed["max_lock_waits"] if claimed["max_lock_waits"] is not None else s.max_lock_waits,
            max_lag=claimed["max_replication_lag_seconds"] or s.max_replication_lag_seconds,
            min_scale=s.min_scale,
            grow_step=s.grow_step,
            probe_ms=busy_ms,
            probe_baseline_ms=baseline,
            probe_ratio=claimed["probe_ratio"] or s.probe_ratio,
            probe_min_ms=s.probe_min_ms,
        )
        await self._bookkeeping(
            SQL.apply_adjustment,
            verdict["scale"],
            verdict["stress"],
            latency_ms,
            stress["lock_waits"],
            stress["replication_lag"],
            busy_ms,
            probes["busy_n"],
            new_baseline,
            quiet,
        )
        if verdict["scale"] < claimed["scale"]:
            log.info("load budget shrinks to %.2f: %s", verdict["scale"], verdict["stress"])
        return verdict


def judge(
    *,
    scale: float,
    latency_ms: float | None,
    lock_waits: int,
    replication_lag: float | None,
    latency_threshold: float,
    max_lock_waits: int,
    max_lag: float,
    min_scale: float,
    grow_step: float,
    probe_ms: float | None = None,
    probe_baseline_ms: float | None = None,
    probe_ratio: float = 1.5,
    probe_min_ms: float = 1.0,
) -> dict[str, Any]:
    """Multiplicative decrease when any signal shows stress, additive increase otherwise."""
    reasons = []
    if (
        probe_ms is not None
        and probe_baseline_ms is not None
        and probe_ms > probe_baseline_ms * probe_ratio
        and probe_ms - probe_baseline_ms > probe_min_ms
    ):
        reasons.append(f"commit probe {probe_ms:.1f} ms > {probe_ratio:g} x baseline {probe_baseline_ms:.1f} ms")
    if latency_ms is not None and latency_ms > latency_threshold:
        reasons.append(f"batch latency {latency_ms:.0f} ms per 1000 rows > {latency_threshold:.0f}")
    if lock_waits > max_lock_waits:
        reasons.append(f"{lock_waits} lock waits > {max_lock_waits}")
    if replication_lag is not None and replication_lag > max_lag:
        reasons.append(f"replication lag {replication_lag:.1f} s > {max_lag:.1f}")
    if reasons:
        return {"scale": max(min_scale, scale / 2), "stress": "; ".join(reasons)}
    return {"scale": min(1.0, scale + grow_step), "stress": None}


async def budget_status(pool: asyncpg.Pool, settings: BudgetSettings | None = None) -> dict[str, Any]:
    """What `budget show` and `planner status` print: limits (and where they come from), the
    adaptive scale and why, what is in flight now, and the counters."""
    s = settings or BudgetSettings.from_env()
    row = await pool.fetchrow(SQL.budget_row)
    assert row is not None
    slots = [dict(r) for r in await pool.fetch(SQL.budget_slots) if not r["expired"]]

    def limit(name: str) -> dict[str, Any]:
        value = row[name]
        return {
            "value": value if value is not None else getattr(s, name),
            "source": "set" if value is not None else "default",
        }

    max_n = row["max_in_flight"] if row["max_in_flight"] is not None else s.max_in_flight
    max_r = row["rows_per_second"] if row["rows_per_second"] is not None else s.rows_per_second
    effective_n = 0 if max_n == 0 else max(1, int(max_n * row["scale"]))
    return {
        "enabled": row["enabled"] and s.enabled,
        "max_in_flight": limit("max_in_flight"),
        "rows_per_second": limit("rows_per_second"),
        "latency_ms": limit("latency_ms"),
        "probe_ratio": limit("probe_ratio"),
        "max_lock_waits": limit("max_lock_waits"),
        "max_replication_lag_seconds": limit("max_replication_lag_seconds"),
        "scale": round(row["scale"], 3),
        "effective_in_flight": effective_n,
        "effective_rows_per_second": round(max_r * row["scale"], 1),
        "stress": row["stress"],
        "stressed_at": row["stressed_at"],
        "observed": {
            "latency_ms_per_1000_rows": row["observed_latency_ms"],
            "lock_waits": row["observed_lock_waits"],
            "replication_lag_seconds": row["observed_replication_lag"],
            "commit_probe_ms": row["observed_probe_ms"],
            "commit_probes": row["observed_probes"],
            "at": row["adjusted_at"],
        },
        "commit_probe_baseline_ms": row["probe_baseline_ms"],
        "commit_probe_baseline_at": row["probe_baseline_at"],
        "in_flight": len(slots),
        "slots": slots,
        "peak_in_flight": row["peak_in_flight"],
        "granted": row["granted"],
        "denied": row["denied"],
        "rows_done": row["rows_done"],
        "wait_seconds": round(row["wait_seconds"], 3),
        "changed_by": row["changed_by"],
        "changed_at": row["changed_at"],
    }


_UNCHANGED = object()


async def set_budget(
    pool: asyncpg.Pool,
    *,
    enabled: bool | None = None,
    max_in_flight: Any = _UNCHANGED,
    rows_per_second: Any = _UNCHANGED,
    latency_ms: Any = _UNCHANGED,
    max_lock_waits: Any = _UNCHANGED,
    max_replication_lag_seconds: Any = _UNCHANGED,
    probe_ratio: Any = _UNCHANGED,
    reset_scale: bool = False,
    changed_by: str | None = None,
) -> None:
    """Change the budget for every worker; a limit given as None goes back to the workers' default."""
    pairs: list[object] = []
    for value in (max_in_flight, rows_per_second, latency_ms, max_lock_waits, max_replication_lag_seconds, probe_ratio):
        pairs += [value is not _UNCHANGED, None if value is _UNCHANGED else value]
    await pool.execute(SQL.set_budget, enabled, *pairs, reset_scale, changed_by or _holder())
