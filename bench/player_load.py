"""What a cohort cleanup does to the players, and the load budget's curve: `python -m bench.player_load`.

One database holds live players (deadline a year ahead, with inventory and match history) and the
cohorts due for cleanup. Simulated players (asyncpg clients, an open loop at a fixed rate well
below saturation) run the game's typical queries against the live accounts: the profile with its
inventory, the last 20 matches, an inventory update, a match recorded. Their latency is measured
from each query's scheduled start (so a query that had to wait for a connection counts its wait).

Phases, in one run, each with the players on: the players alone; a cohort cleanup with the load
budget off; the players alone again. Then for each objective of `--objectives` (default: the
shipped objective and two others): the same cleanup of a cohort of its own with the budget on under
that objective; the players alone; the floor's statement (bench/floor.sql: the least work with the
same effects and guarantees, no Temporal, no claim, no worker) over another cohort, in slices of
`--floor-slice` accounts on one backend, paced at exactly the throughput that budgeted cleanup
measured; the players alone. The cleanup is the real pipeline (start_cleanup, a worker process,
partitions, settlement); throughput is accounts/s from the deadline to settled. Each cleanup and
paced floor phase counts the players' queries scheduled while it ran; the alone windows around it
show how far the shared machine drifted (the `_bracketed` ratios divide by their mean).

Per objective (the `curve`): the throughput, the players' p99 and its ratio to the players alone,
the paced floor's p99 at the same throughput, `p99_over_paced_floor` (goal <= 1.1: the budget wastes
nothing against ideal pacing), the cohort's lateness (each account's cleaned_at - its deadline:
p50, p99, max; `lateness_max_s` goal: the lateness objective) and `objective_held_fraction` (goal
>= 0.95): the share of the 10-second windows of the budgeted cleanup (a last partial window counts
when it lasts 5 s or more) in which the objective held. `players_p99_held_fraction` (goal >= 0.95)
judges the players' own p99 of each window by the same objective against their p99 in the
players-alone phase before it (the default: at most 5 ms above it); the paced floor's windows are
judged both ways too (`paced_floor_*`), what any pacing of the same work gives.
The objective is the budget's own (budget/controller.py): the commit probe,
a one-row write that commits as a player's would, as a mean per window, at most `probe_added_ms` above
its quiet baseline, and at most `probe_ratio` x it (unless within `probe_min_ms`) and `probe_max_ms` when set. It is not
the players' own commits: the budget never sees those. Whether it held is judged by the benchmark's
own commit probe (the same kind of statement on a connection of its own, every
`probe_interval_seconds`), with budget.controller.stress_reasons, against that probe's mean in the
players-alone window right before the phase (the budget's baseline is its probe with no batch
running and the players on). The budget's own probes are its controller's reading of itself,
summed and reset inside every adjustment: a check of the objective reads the database apart.

`--half-floor` adds the floor paced at half the unbudgeted throughput, the least the throughput
goal allows: if the players' p99 then is already more than 1.2x their p99 alone, no schedule of the
cleanup's work keeps them within +20% on this machine (docs/decisions/0007-budget-limits.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

import bench
from bench import report
from bench.common import Stack, machine, run_benchmark, stack, trace_budget, wait_for_worker
from bench.observe import Observer
from budget.controller import (
    BudgetChange,
    BudgetSettings,
    Observed,
    StressLimits,
    budget_status,
    set_budget,
    stress_reasons,
)
from cleanup.inputs import StartCleanup
from cleanup.models import CleanupResult
from cleanup.operations import start_cleanup
from core import db
from core.config import read
from core.queries import load
from demo.fixture import seed_accounts
from workflows.renewal_cleanup import RenewalCleanupWorkflow

PROFILE = """
SELECT a.account_id, a.status, a.renewal_deadline,
       (SELECT json_agg(json_build_object('item', i.item_id, 'qty', i.quantity))
        FROM demo_game.inventory_items i WHERE i.account_id = a.account_id) AS inventory
FROM accounts a WHERE a.account_id = $1
"""
MATCHES = (
    "SELECT match_id, played_at, mode, result, score FROM demo_game.match_history"
    " WHERE account_id = $1 ORDER BY played_at DESC LIMIT 20"
)
SPEND = "UPDATE demo_game.inventory_items SET quantity = quantity + 1 WHERE account_id = $1 AND item_id = $2"
FLOOR = load(bench.__file__, "floor.sql")
# Each account's lateness: cleaned (by the batch's transaction clock) after its deadline, in seconds.
LATENESS = (
    "SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY extract(epoch FROM cleaned_at - renewal_deadline))"
    " AS q, max(extract(epoch FROM cleaned_at - renewal_deadline))::float8 AS max"
    " FROM accounts WHERE renewal_deadline = $1 AND status = 'cleaned'"
)
RECORD_MATCH = (
    "INSERT INTO demo_game.match_history (account_id, played_at, mode, result, score)"
    " VALUES ($1, now(), 'ranked', 'win', $2)"
)


class Players:
    """An open loop of player queries at `rate` per second over a pool of `connections`."""

    def __init__(self, pool: asyncpg.Pool, accounts: list[str], rate: float) -> None:
        self.pool = pool
        self.accounts = accounts
        self.rate = rate
        self.latencies: list[float] = []
        self.by_kind: dict[str, list[float]] = {}
        self.parts: list[tuple[float, float, float, float]] = []
        self.when: list[tuple[float, float]] = []  # (wall-clock time scheduled, latency) of this phase
        self.history: list[tuple[float, float]] = []  # ... of the whole run
        self.errors = 0
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    async def _one(self, scheduled: float) -> None:
        began = time.perf_counter()
        account = random.choice(self.accounts)
        pick = random.random()
        kind = "profile" if pick < 0.4 else "matches" if pick < 0.7 else "spend" if pick < 0.9 else "record_match"
        try:
            async with self.pool.acquire() as conn:
                connected = time.perf_counter()
                if kind == "profile":
                    await conn.fetchrow(PROFILE, account)
                elif kind == "matches":
                    await conn.fetch(MATCHES, account)
                elif kind == "spend":
                    await conn.execute(SPEND, account, f"item_{random.randint(1, 5)}")
                else:
                    await conn.execute(RECORD_MATCH, account, random.randint(0, 5000))
            done = time.perf_counter()
            latency = done - scheduled
            self.latencies.append(latency)
            self.by_kind.setdefault(kind, []).append(latency)
            # where the time went: the client's event loop late, waiting for a connection, the query
            self.parts.append((latency, began - scheduled, connected - began, done - connected))
            self.when.append((time.time() - (done - scheduled), latency))
            self.history.append(self.when[-1])
        except Exception:
            self.errors += 1

    async def run(self) -> None:
        interval = 1.0 / self.rate
        next_at = time.perf_counter()
        while not self._stop.is_set():
            task = asyncio.ensure_future(self._one(next_at))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))

    async def measure(self, during: Callable[[], Awaitable[Any]]) -> tuple[dict[str, Any], Any]:
        """Player latencies while `during()` runs (its result is returned too)."""
        self.latencies = []
        self.by_kind = {}
        self.parts = []
        self.when = []
        self.errors = 0
        result = await during()
        out = summary(list(self.latencies), self.errors)
        out["p99_ms_by_kind"] = {k: summary(v, 0).get("p99_ms") for k, v in sorted(self.by_kind.items())}
        out["slowest_1pct_mean_ms"] = tail_parts(self.parts)
        if isinstance(result, dict) and "ran" in result:
            # only while the cleanup ran (a budgeted phase starts 2 s before its deadline)
            start, end = result["ran"]
            out["while_running"] = summary([lat for at, lat in self.when if start <= at < end], 0)
        if isinstance(result, dict) and "timeline" in result:
            # the players' p99 while each step of the cleanup ran (by the Temporal server's clock)
            out["p99_ms_by_step"] = {
                step: summary([lat for at, lat in self.when if start <= at < end], 0).get("p99_ms")
                for step, (start, end) in result.pop("timeline").items()
            }
        return out, result

    async def stop(self) -> None:
        self._stop.set()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def summary(latencies: list[float], errors: int) -> dict[str, Any]:
    if not latencies:
        return {"queries": 0, "errors": errors}
    ordered = sorted(latencies)

    def q(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000, 2)

    return {
        "queries": len(ordered),
        "errors": errors,
        "p50_ms": q(0.50),
        "p99_ms": q(0.99),
        "max_ms": round(ordered[-1] * 1000, 2),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 2),
    }


def tail_parts(parts: list[tuple[float, float, float, float]]) -> dict[str, float]:
    """The slowest 1% of queries, their time split into the client's lateness (its event loop
    busy), the wait for a pooled connection and the query itself (server, network, commit)."""
    if not parts:
        return {}
    tail = sorted(parts, reverse=True)[: max(1, len(parts) // 100)]
    names = ("total", "client_late", "pool_wait", "query")
    return {n: round(statistics.fmean(p[i] for p in tail) * 1000, 2) for i, n in enumerate(names)}


async def activity_steps(handle: Any) -> dict[str, tuple[float, float]]:
    """Each activity type of a run: (first start, last completion), as wall-clock seconds."""
    names: dict[int, str] = {}
    steps: dict[str, list[float]] = {}
    for e in (await handle.fetch_history()).events:
        at = e.event_time.ToDatetime(tzinfo=UTC).timestamp()
        if e.HasField("activity_task_scheduled_event_attributes"):
            names[e.event_id] = e.activity_task_scheduled_event_attributes.activity_type.name
        elif e.HasField("activity_task_started_event_attributes"):
            span = steps.setdefault(names[e.activity_task_started_event_attributes.scheduled_event_id], [at, at])
            span[0] = min(span[0], at)
        elif e.HasField("activity_task_completed_event_attributes"):
            span = steps.setdefault(names[e.activity_task_completed_event_attributes.scheduled_event_id], [at, at])
            span[1] = max(span[1], at)
    return {k: (v[0], v[1]) for k, v in steps.items()}


async def paced_floor(
    pool: asyncpg.Pool, deadline: datetime, accounts: int, rate: float, slice_size: int
) -> dict[str, Any]:
    """The floor's statement over the cohort due at `deadline`, one slice of ~`slice_size` accounts
    (account-ID ranges cut by one untimed query) every `slice_size / rate` seconds, one transaction
    each, on one backend: the cohort's effects at `rate` accounts/s with no orchestration at all.
    A slice that falls behind its schedule runs at once after the one before."""
    slices = max(1, accounts // slice_size)
    cut = FLOOR.bind("cleanup_floor_bounds", deadline=deadline, slices=slices)
    bounds = list(await pool.fetchval(FLOOR.cleanup_floor_bounds, *cut) or [])
    ranges = list(zip([None, *bounds], [*bounds, None], strict=True))
    cleaned = behind = 0
    async with pool.acquire() as conn:
        started, ran_from = time.perf_counter(), time.time()
        for k, (low, high) in enumerate(ranges):
            wait = started + k * slice_size / rate - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            else:
                behind += 1
            async with conn.transaction():
                row = await conn.fetchrow(
                    FLOOR.cleanup_floor,
                    *FLOOR.bind(
                        "cleanup_floor",
                        cleanup_id="paced-floor",
                        deadline=deadline,
                        from_account=low,
                        until_account=high,
                    ),
                )
            assert row is not None
            cleaned += int(row["cleaned"])
        seconds = time.perf_counter() - started
    return {
        "cleaned": cleaned,
        "seconds": round(seconds, 3),
        "accounts_per_s": round(cleaned / seconds, 1),
        "paced_at_accounts_per_s": round(rate, 1),
        "slices": len(ranges),
        "slices_started_late": behind,
        "ran": [ran_from, time.time()],
    }


# The benchmark's own commit probe: a one-row write that commits, on a connection of its own.
PROBE_TABLE = "CREATE TABLE IF NOT EXISTS bench_commit_probe (probe int PRIMARY KEY, probed_at timestamptz NOT NULL)"
PROBE = (
    "INSERT INTO bench_commit_probe (probe, probed_at) VALUES (1, clock_timestamp())"
    " ON CONFLICT (probe) DO UPDATE SET probed_at = excluded.probed_at"
)
DEFAULT_OBJECTIVES = "default,added_ms=2,ratio=2"
# `--objectives` keys: the budget's settings they set (`budget set --probe-ratio / --probe-max-ms`).
OBJECTIVE_KEYS = {"added_ms": "probe_added_ms", "ratio": "probe_ratio", "max_ms": "probe_max_ms"}
WINDOW_SECONDS = 10.0
# Every cohort and the players are seeded up front: keep the database modest, the machine is shared
# (room for 100,000-account cohorts under three objectives, when 40,000 clean too fast to be judged).
MAX_SEEDED_ACCOUNTS = 800_000


@dataclass(frozen=True)
class Objective:
    """One setting of the budget's objective; None: the workers' default (LOAD_BUDGET_PROBE_*)."""

    probe_added_ms: float | None = None
    probe_ratio: float | None = None
    probe_max_ms: float | None = None

    @property
    def label(self) -> str:
        given = [(key, getattr(self, name)) for key, name in OBJECTIVE_KEYS.items()]
        return "+".join(f"{key}={value:g}" for key, value in given if value is not None) or "default"

    def limits(self, settings: BudgetSettings) -> StressLimits:
        """The commit probe's limits in force under this objective (the other signals left out)."""
        return StressLimits(
            latency_ms=math.inf,
            max_lock_waits=0,
            max_lag=math.inf,
            probe_added_ms=self.probe_added_ms or settings.probe_added_ms,
            probe_ratio=self.probe_ratio or settings.probe_ratio,
            probe_min_ms=settings.probe_min_ms,
            probe_max_ms=self.probe_max_ms or settings.probe_max_ms,
        )

    def describe(self, settings: BudgetSettings) -> str:
        limits = self.limits(settings)
        bounds = [f"baseline + {limits.probe_added_ms:g} ms"] if limits.probe_added_ms is not None else []
        bounds += [f"{limits.probe_ratio:g} x baseline"] if limits.probe_ratio is not None else []
        bounds += [f"{limits.probe_max_ms:g} ms"] if limits.probe_max_ms is not None else []
        return "commit probe <= " + " and <= ".join(bounds)


def parse_objectives(text: str) -> list[Objective]:
    """`default,added_ms=2,ratio=3,max_ms=20,ratio=3+max_ms=20`: settings separated by commas, each
    `default` or keys joined by `+`: `added_ms` (ms above the quiet baseline, finite, > 0), `ratio`
    (the commit probe / its quiet baseline, a finite number > 1, as `budget set --probe-ratio`
    takes) and `max_ms` (the commit probe at most this, finite, > 0)."""
    objectives: list[Objective] = []
    for item in (part.strip() for part in text.split(",")):
        objective = Objective() if item == "default" else _objective(item)
        if objective.label in {o.label for o in objectives}:
            raise argparse.ArgumentTypeError(f"objective {objective.label!r} is given twice")
        objectives.append(objective)
    return objectives


def _objective(item: str) -> Objective:
    values: dict[str, float] = {}
    for part in item.split("+"):
        key, equals, text = (s.strip() for s in part.partition("="))
        if not equals or key not in OBJECTIVE_KEYS:
            keys = ", ".join(f"{k}=N" for k in OBJECTIVE_KEYS)
            raise argparse.ArgumentTypeError(f"unknown objective {part.strip()!r}: use default, {keys} (joined by +)")
        if OBJECTIVE_KEYS[key] in values:
            raise argparse.ArgumentTypeError(f"{key} is given twice in {item!r}")
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{key} must be a number, got {text!r}") from None
        low = 1.0 if key == "ratio" else 0.0
        if not math.isfinite(value) or value <= low:
            raise argparse.ArgumentTypeError(f"{key} must be a finite number > {low:g}, got {text!r}")
        values[OBJECTIVE_KEYS[key]] = value
    return Objective(**values)


class CommitProbe:
    """The benchmark's own commit probe (module docstring): every `interval` seconds, the latency
    of a one-row write that commits, by the wall-clock time it started."""

    def __init__(self, url: str, interval: float) -> None:
        self.url = url
        self.interval = interval
        self.samples: list[tuple[float, float]] = []  # (wall-clock start, ms)
        self.errors = 0

    async def run(self) -> None:
        settings = {"application_name": "bench-commit-probe", **db.service_settings()}
        conn = await asyncpg.connect(self.url, server_settings=settings)
        try:
            await conn.execute(PROBE_TABLE)
            while True:
                at, began = time.time(), time.perf_counter()
                try:
                    await conn.execute(PROBE)
                    self.samples.append((at, (time.perf_counter() - began) * 1000))
                except asyncpg.PostgresError:
                    self.errors += 1
                await asyncio.sleep(self.interval)
        finally:
            with contextlib.suppress(Exception):
                await conn.close(timeout=5)

    def mean_ms(self, start: float, end: float) -> float | None:
        during = [ms for at, ms in self.samples if start <= at < end]
        return statistics.fmean(during) if during else None


def objective_windows(
    probes: Sequence[tuple[float, float]],
    players: Sequence[tuple[float, float]],
    ran: Sequence[float],
    limits: StressLimits,
    baseline_ms: float | None,
    window_seconds: float = WINDOW_SECONDS,
    players_alone_p99_ms: float | None = None,
) -> list[dict[str, Any]]:
    """The span `ran` (wall-clock start, end) cut into windows of `window_seconds` (a last partial
    window counts when it lasts half a window or more); in each, the commit probes' mean (`probes`:
    (start, ms)) judged as the budget judges it (budget.controller.stress_reasons against `limits` and
    `baseline_ms`): `held`; and the players' p99 (`players`: (scheduled, seconds)) judged by the same
    objective against their p99 alone (`players_alone_p99_ms`, the players-alone phase before):
    `players_held` (the default objective: at most 5 ms above it). A window in which no probe
    started did not hold: the probe was stuck longer than the window."""
    start, end = ran
    windows = []
    at = start
    while end - at >= window_seconds / 2:
        stop = min(at + window_seconds, end)
        ms = [v for t, v in probes if at <= t < stop]
        mean = statistics.fmean(ms) if ms else None
        seen = Observed(None, lock_waits=0, replication_lag=None, probe_ms=mean, probe_baseline_ms=baseline_ms)
        why = "; ".join(stress_reasons(seen, limits).values()) if ms else "no commit probe started in the window"
        p99 = summary([lat for t, lat in players if at <= t < stop], 0).get("p99_ms")
        felt = Observed(None, lock_waits=0, replication_lag=None, probe_ms=p99, probe_baseline_ms=players_alone_p99_ms)
        players_why = "; ".join(stress_reasons(felt, limits).values()).replace("commit probe", "players' p99")
        windows.append(
            {
                "from_s": round(at - start, 1),
                "seconds": round(stop - at, 1),
                "probes": len(ms),
                "probe_mean_ms": None if mean is None else round(mean, 2),
                "players_p99_ms": p99,
                "held": not why,
                **({"why_not": why} if why else {}),
                "players_held": p99 is not None and not players_why,
                **({"players_why_not": players_why} if players_why else {}),
            }
        )
        at = stop
    return windows


def held_fraction(windows: Sequence[dict[str, Any]], key: str = "held") -> float | None:
    """The share of the windows in which the objective held (`key`: by the commit probe, `held`, or
    by the players' p99, `players_held`; None: no window to judge)."""
    return round(sum(w[key] for w in windows) / len(windows), 3) if windows else None


def with_application_name(url: str, name: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}application_name={name}"


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


@dataclass
class Phases:
    """The run's phases, each measured with the players on: their latencies (`players`), where their
    time went (`observed`), the load average before and after, and when each ran (`spans`)."""

    crowd: Players
    observer: Observer
    alone_seconds: float
    players: dict[str, Any] = field(default_factory=dict)
    observed: dict[str, Any] = field(default_factory=dict)
    loads: dict[str, list[float]] = field(default_factory=dict)
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)

    async def run(self, name: str, during: Callable[[], Awaitable[Any]]) -> Any:
        self.loads[name] = [load_average()]
        began = time.time()
        self.observed[name], (self.players[name], result) = await self.observer.observe(
            lambda: self.crowd.measure(during)
        )
        self.spans[name] = (began, time.time())
        self.loads[name].append(load_average())
        return result

    async def alone(self, name: str) -> None:
        await self.run(name, lambda: asyncio.sleep(self.alone_seconds))

    def p99(self, name: str) -> float:
        """The players' p99 during the phase: while its cleanup ran, when it had one."""
        phase = self.players[name]
        running = phase.get("while_running", {})
        return float(running["p99_ms"] if running.get("queries") else phase["p99_ms"])

    def bracketed(self, name: str, before: str, after: str) -> float:
        """The phase's p99 over the mean of the players-alone windows right before and after it."""
        return round(self.p99(name) / statistics.fmean([self.p99(before), self.p99(after)]), 3)


async def cleanup(s: Stack, seeded: datetime, partitions: int, parallel: int, batch_size: int) -> dict[str, Any]:
    """The cohort seeded at `seeded` cleaned by the real pipeline, its deadline 2 s from now;
    `ran`: (deadline, settled) as wall-clock times."""
    deadline = (datetime.now(UTC) + timedelta(seconds=2)).replace(microsecond=0)
    await s.pool.execute("UPDATE accounts SET renewal_deadline = $1 WHERE renewal_deadline = $2", deadline, seeded)
    started = await start_cleanup(
        s.client,
        s.pool,
        s.settings.task_queue,
        StartCleanup(deadline=deadline, partitions=partitions, max_parallel_partitions=parallel, batch_size=batch_size),
    )
    handle = s.client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
    result: CleanupResult = await handle.result()
    seconds = (datetime.now(UTC) - deadline).total_seconds()
    assert result.settlement is not None
    steps = await activity_steps(handle)
    late = await s.pool.fetchrow(LATENESS, deadline)
    assert late is not None and late["q"] is not None
    return {
        "cleaned": result.settlement.cleaned,
        "seconds_from_deadline": round(seconds, 3),
        "lateness_seconds": {
            "p50": round(late["q"][0], 2),
            "p99": round(late["q"][1], 2),
            "max": round(late["max"], 2),
        },
        "accounts_per_s": round(result.settlement.cleaned / seconds, 1),
        "steps_s_after_deadline": {
            k: [round(a - deadline.timestamp(), 2), round(b - deadline.timestamp(), 2)] for k, (a, b) in steps.items()
        },
        "timeline": steps,
        "ran": [deadline.timestamp(), deadline.timestamp() + seconds],
    }


BUDGET_STATUS_KEYS = (
    *("doing", "limited_by", "effective_in_flight", "stress", "last_stress", "observed"),
    *("commit_probe_baseline_ms", "peak_in_flight", "granted", "denied"),
)


@dataclass(frozen=True)
class Measured:
    """What one objective's phases measured."""

    objective: Objective
    cleanup: dict[str, Any]
    floor: dict[str, Any]
    budget_after: dict[str, Any]
    before: str  # the players-alone phase right before the budgeted cleanup

    @property
    def phase(self) -> str:
        return f"budget[{self.objective.label}]"


def curve_point(
    m: Measured, ph: Phases, probe: CommitProbe, off: dict[str, Any], window_seconds: float
) -> dict[str, Any]:
    """One objective's point of the curve, and the windows its `objective_held_fraction` counts."""
    settings = read(BudgetSettings)
    label, limits = m.objective.label, m.objective.limits(settings)
    budget_p99, floor_p99 = ph.p99(m.phase), ph.p99(f"paced_floor[{label}]")
    baseline = probe.mean_ms(*ph.spans[m.before])
    alone = ph.p99(m.before)
    windows = objective_windows(
        probe.samples, ph.crowd.history, m.cleanup["ran"], limits, baseline, window_seconds, alone
    )
    # The floor paced at the same throughput, judged the same way: what any pacing of this work gives.
    floor_alone = ph.p99(f"alone_after[{label}]")
    floor_windows = objective_windows(
        probe.samples,
        ph.crowd.history,
        m.floor["ran"],
        limits,
        probe.mean_ms(*ph.spans[f"alone_after[{label}]"]),
        window_seconds,
        floor_alone,
    )
    lateness = m.cleanup["lateness_seconds"]
    point = {
        "objective": label,
        "means": m.objective.describe(settings),
        "accounts_per_s": m.cleanup["accounts_per_s"],
        "throughput_over_no_budget": round(m.cleanup["accounts_per_s"] / off["accounts_per_s"], 3),
        "players_p99_ms": budget_p99,
        "players_p99_over_alone": round(budget_p99 / ph.p99("alone"), 3),
        "players_p99_over_alone_bracketed": ph.bracketed(m.phase, m.before, f"alone_after[{label}]"),
        "paced_floor_accounts_per_s": m.floor["accounts_per_s"],
        "paced_floor_players_p99_ms": floor_p99,
        "paced_floor_p99_over_alone_bracketed": ph.bracketed(
            f"paced_floor[{label}]", f"alone_after[{label}]", f"alone_after_floor[{label}]"
        ),
        "p99_over_paced_floor": round(budget_p99 / floor_p99, 3),
        "objective_held_fraction": held_fraction(windows),
        "objective_windows": len(windows),
        "players_p99_held_fraction": held_fraction(windows, "players_held"),
        "players_alone_p99_ms": alone,
        "paced_floor_players_p99_held_fraction": held_fraction(floor_windows, "players_held"),
        "paced_floor_objective_held_fraction": held_fraction(floor_windows),
        "paced_floor_windows": len(floor_windows),
        "lateness_p99_s": lateness["p99"],
        "lateness_max_s": lateness["max"],
        "lateness_objective_s": settings.lateness_objective_seconds,
        "lateness_met": lateness["max"] <= settings.lateness_objective_seconds,
        "probe_baseline_ms": None if baseline is None else round(baseline, 2),
    }
    return {"point": point, "windows": windows, "floor_windows": floor_windows}


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


async def run(
    accounts: int = 100_000,
    players: int = 20_000,
    rate: float = 150.0,
    alone_seconds: float = 15.0,
    partitions: int = 16,
    parallel: int = 8,
    batch_size: int = 1000,
    player_connections: int = 8,
    *,
    objectives: Sequence[Objective] | None = None,
    caps: dict[str, float] | None = None,
    floor_slice: int = 250,
    half_floor: bool = False,
    window_seconds: float = WINDOW_SECONDS,
) -> dict[str, Any]:
    """The phases of the module docstring. `objectives`: default `DEFAULT_OBJECTIVES`; `caps`
    (`max_in_flight`, `rows_per_second`) apply to every budgeted phase; `floor_slice`: accounts per
    paced floor statement; `half_floor`: add the floor paced at half the unbudgeted throughput."""
    objectives = list(objectives or parse_objectives(DEFAULT_OBJECTIVES))
    cohorts = ["off", *(f"{kind}_{i}" for i in range(len(objectives)) for kind in ("budget", "floor"))]
    cohorts += ["floor_half"] if half_floor else []
    if players + len(cohorts) * accounts > MAX_SEEDED_ACCOUNTS:
        raise ValueError(f"{len(cohorts)} cohorts of {accounts} and {players} players: more than {MAX_SEEDED_ACCOUNTS}")
    async with stack() as s:
        base = datetime.now(UTC).replace(microsecond=0) - timedelta(days=30)
        seeds = {name: base + timedelta(hours=k) for k, name in enumerate(cohorts)}
        t = time.perf_counter()
        await seed_accounts(s.pool, prefix="live", deadline=base + timedelta(days=400), count=players)
        for name, deadline in seeds.items():  # one set-based statement per cohort
            await seed_accounts(s.pool, prefix=name, deadline=deadline, count=accounts)
        seed_seconds = time.perf_counter() - t
        await s.pool.execute("VACUUM ANALYZE")
        live = [
            r["account_id"]
            for r in await s.pool.fetch("SELECT account_id FROM accounts WHERE account_id LIKE 'acct_live_%'")
        ]

        url = s.settings.database_url
        assert url is not None
        worker = s.start_worker(DATABASE_URL=with_application_name(url, "cleanup-worker"))
        await wait_for_worker(s.client, s.settings.task_queue)
        player_pool = await asyncpg.create_pool(
            url,
            min_size=player_connections,
            max_size=player_connections,
            server_settings={"application_name": "players", **db.service_settings()},
        )
        assert player_pool is not None
        crowd = Players(player_pool, live, rate)
        probe = CommitProbe(url, read(BudgetSettings).probe_interval_seconds)
        observer = Observer(
            url,
            {
                "cleanup worker process": worker.pid,
                "players' client (this process)": os.getpid(),
                "temporal server": s.server_pid(),
            },
        )
        ph = Phases(crowd, observer, alone_seconds)
        loops = [asyncio.ensure_future(crowd.run()), asyncio.ensure_future(probe.run())]
        try:
            await asyncio.sleep(min(3.0, alone_seconds))  # warm-up, not recorded
            clean = functools.partial(cleanup, s, partitions=partitions, parallel=parallel, batch_size=batch_size)
            await ph.alone("alone")
            await set_budget(s.pool, BudgetChange(enabled=False))
            off = await ph.run("no_budget", lambda: clean(seeds["off"]))
            off_budget = (await budget_status(s.pool)).model_dump()
            await ph.alone("alone_between")
            measured: list[Measured] = []
            before = "alone_between"
            for i, objective in enumerate(objectives):
                label = objective.label
                change = BudgetChange(
                    enabled=True,
                    reset_scale=True,
                    probe_added_ms=objective.probe_added_ms,
                    probe_ratio=objective.probe_ratio,
                    probe_max_ms=objective.probe_max_ms,
                    max_in_flight=_int_or_none((caps or {}).get("max_in_flight")),  # None: the workers' default
                    rows_per_second=(caps or {}).get("rows_per_second"),
                )
                await set_budget(s.pool, change)
                trace: list[dict[str, Any]] = []
                tracing = asyncio.ensure_future(trace_budget(s.pool, trace))
                try:
                    on = await ph.run(f"budget[{label}]", functools.partial(clean, seeds[f"budget_{i}"]))
                finally:
                    tracing.cancel()
                    await asyncio.gather(tracing, return_exceptions=True)
                on["budget_trace"] = [{**t, "at": round(t["at"] - on["ran"][0], 1)} for t in trace]
                status = (await budget_status(s.pool)).model_dump()
                await ph.alone(f"alone_after[{label}]")
                pace = functools.partial(
                    paced_floor, s.pool, seeds[f"floor_{i}"], accounts, on["accounts_per_s"], floor_slice
                )
                floor = await ph.run(f"paced_floor[{label}]", pace)
                await ph.alone(f"alone_after_floor[{label}]")
                budget_after = {k: status[k] for k in BUDGET_STATUS_KEYS}
                measured.append(Measured(objective, on, floor, budget_after, before))
                before = f"alone_after_floor[{label}]"
            half: dict[str, Any] = {}
            if half_floor:
                pace = functools.partial(
                    paced_floor, s.pool, seeds["floor_half"], accounts, 0.5 * off["accounts_per_s"], floor_slice
                )
                half = await ph.run("paced_floor_half", pace)
                await ph.alone("alone_after_floor_half")
        finally:
            await crowd.stop()
            for loop in loops:
                loop.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await player_pool.close()
        memory = s.memory()

    return {
        "scenario": "player_load",
        "accounts_per_cohort": accounts,
        "live_players": players,
        "player_rate_per_s": rate,
        "player_connections": player_connections,
        "partitions": partitions,
        "parallel_partitions": parallel,
        "batch_size": batch_size,
        "cohorts": len(cohorts),
        "seed_seconds": round(seed_seconds, 2),
        **summarize(measured, ph, probe, off, window_seconds),
        "budget_counters_after_no_budget_run": {k: off_budget[k] for k in ("granted", "rows_done")},
        **({"paced_floor_half": half, **half_floor_ratios(ph)} if half_floor else {}),
        "default_budget": BudgetSettings().model_dump(),
        "caps": caps or "none",
        "floor_slice": floor_slice,
        "window_seconds": window_seconds,
        "commit_probe_errors": probe.errors,
        "load_average_1m_before_and_after": ph.loads,
        "players": ph.players,
        "observed": ph.observed,
        **memory,
        "machine": machine(),
    }


def summarize(
    measured: Sequence[Measured], ph: Phases, probe: CommitProbe, off: dict[str, Any], window_seconds: float
) -> dict[str, Any]:
    """The curve (one point per objective, beside the unbudgeted cleanup) and its figures: the
    default objective's (the first objective's when the default is not measured)."""
    points = {m.objective.label: curve_point(m, ph, probe, off, window_seconds) for m in measured}
    curve = [p["point"] for p in points.values()]
    main = next((p for p in curve if p["objective"] == "default"), curve[0])
    return {
        "figures_for_objective": main["objective"],
        # the budget's players' p99 / the paced floor's at the same throughput
        "ratio": main["p99_over_paced_floor"],
        "target": "<= 1.1",
        "objective_held_fraction": main["objective_held_fraction"],
        "objective_held_fraction_target": ">= 0.95",
        # the issue's reading: the players' p99 per window within the objective (vs their p99 alone)
        "players_p99_held_fraction": main["players_p99_held_fraction"],
        "paced_floor_players_p99_held_fraction": main["paced_floor_players_p99_held_fraction"],
        "lateness_p99_s": main["lateness_p99_s"],
        "lateness_max_s": main["lateness_max_s"],
        "lateness_objective_s": main["lateness_objective_s"],
        "players_p99_held_fraction_target": ">= 0.95",
        "lateness_max_s_target": f"<= {main['lateness_objective_s']:g}",
        "players_alone_p99_ms": ph.p99("alone"),
        "no_budget": {
            "accounts_per_s": off["accounts_per_s"],
            "players_p99_ms": ph.p99("no_budget"),
            "players_p99_over_alone": round(ph.p99("no_budget") / ph.p99("alone"), 3),
            "players_p99_over_alone_bracketed": ph.bracketed("no_budget", "alone", "alone_between"),
            "lateness_p99_s": off["lateness_seconds"]["p99"],
        },
        "curve": curve,
        "cleanup_no_budget": {k: v for k, v in off.items() if k != "timeline"},
        "by_objective": {
            m.objective.label: {
                "cleanup": {k: v for k, v in m.cleanup.items() if k != "timeline"},
                "paced_floor": m.floor,
                "budget_after_run": m.budget_after,
                "windows": points[m.objective.label]["windows"],
                "paced_floor_windows": points[m.objective.label]["floor_windows"],
            }
            for m in measured
        },
    }


def half_floor_ratios(ph: Phases) -> dict[str, float]:
    """The floor at half the unbudgeted throughput: the players' p99 that no budget can beat."""
    last = [name for name in ph.players if name.startswith("alone_after_floor[")][-1]
    bracketed = ph.bracketed("paced_floor_half", last, "alone_after_floor_half")
    return {
        "p99_ratio_floor_at_half_throughput": round(ph.p99("paced_floor_half") / ph.p99("alone"), 3),
        "p99_ratio_floor_at_half_throughput_bracketed": bracketed,
    }


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accounts", type=int, default=100_000, help="accounts per cohort (2 per objective, +1)")
    parser.add_argument("--players", type=int, default=20_000, help="live player accounts")
    parser.add_argument("--rate", type=float, default=150.0, help="player queries per second")
    parser.add_argument("--alone-seconds", type=float, default=15.0)
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument(
        "--objectives",
        type=parse_objectives,
        default=DEFAULT_OBJECTIVES,
        help=f"the budget's objectives, one budgeted cleanup each (default: {DEFAULT_OBJECTIVES}); "
        "`default`, or `added_ms=A` (ms above the quiet baseline), `ratio=R` (commit probe / its quiet"
        " baseline, > 1), `max_ms=M` (commit probe, ms), "
        "joined by + (ratio=3+max_ms=20), separated by commas",
    )
    parser.add_argument("--max-in-flight", type=int, help="a cap on every budgeted phase (default: none)")
    parser.add_argument("--rows-per-second", type=float, help="a cap on every budgeted phase (default: none)")
    parser.add_argument(
        "--half-floor",
        "--paced-floor",
        dest="half_floor",
        action="store_true",
        help="add the floor's statement paced at half the unbudgeted throughput",
    )
    parser.add_argument("--floor-slice", type=int, default=250, help="accounts per paced floor statement")
    parser.add_argument(
        "--window-seconds",
        type=positive_seconds,
        default=WINDOW_SECONDS,
        help="the objective's windows (10 s; shorter only for smoke runs)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    caps = {k: v for k, v in {"max_in_flight": args.max_in_flight, "rows_per_second": args.rows_per_second}.items()}
    result = run_benchmark(
        run(
            args.accounts,
            args.players,
            args.rate,
            args.alone_seconds,
            args.partitions,
            args.parallel,
            args.batch_size,
            objectives=args.objectives,
            caps={k: v for k, v in caps.items() if v is not None},
            floor_slice=args.floor_slice,
            half_floor=args.half_floor,
            window_seconds=args.window_seconds,
        )
    )
    print(json.dumps(result, indent=2, default=str))
    print("\n".join(report.curve_table(result)), file=sys.stderr)


if __name__ == "__main__":
    main()
