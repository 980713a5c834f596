"""What a cohort cleanup does to the players: `python -m bench.player_load --accounts 40000`.

One database holds live players (deadline a year ahead, with inventory and match history) and two
cohorts due for cleanup. Simulated players (asyncpg clients, an open loop at a fixed rate well
below saturation) run the game's typical queries against the live accounts: the profile with its
inventory, the last 20 matches, an inventory update, a match recorded. Their latency is measured
from each query's scheduled start (so a query that had to wait for a connection counts its wait).

Phases, in one run: (1) the players alone; (2) during a cohort cleanup with the load budget off;
the players alone again; (3) during the same cleanup (the second cohort) with the default budget;
the players alone once more. The alone windows around each cleanup phase show how far the shared
machine drifted; the `_bracketed` ratios divide by their mean instead of by phase (1). The cleanup
is the real pipeline (start_cleanup, a worker process, partitions, settlement); throughput is
accounts/s from the deadline to settled.

`--paced-floor` adds two phases that bound what any budget could do on this machine: the floor's
statement (bench/floor.sql: the least work with the same effects and guarantees, no Temporal, no
claim, no worker) over two more cohorts, in slices of `--floor-slice` accounts on one backend,
paced at (4) half the unbudgeted cleanup's throughput of phase (2), the least the goal allows, and
(5) the budgeted cleanup's throughput of phase (3); each followed by the players alone. If the
players' p99 during (4) is already more than 1.2x their p99 alone, no schedule of the cleanup's
work meets both goals on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

import bench
from bench.common import machine, stack, wait_for_worker
from bench.observe import Observer
from cleanup.models import CleanupResult
from cleanup.operations import start_cleanup
from core import db
from core.budget import BudgetSettings, budget_status, set_budget
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
        self.when: list[tuple[float, float]] = []  # (wall-clock time scheduled, latency)
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
    bounds = list(await pool.fetchval(FLOOR.cleanup_floor_bounds, deadline, slices) or [])
    ranges = list(zip([None, *bounds], [*bounds, None], strict=True))
    cleaned = behind = 0
    async with pool.acquire() as conn:
        started = time.perf_counter()
        for k, (low, high) in enumerate(ranges):
            wait = started + k * slice_size / rate - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            else:
                behind += 1
            async with conn.transaction():
                row = await conn.fetchrow(FLOOR.cleanup_floor, "paced-floor", deadline, low, high)
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
    }


def with_application_name(url: str, name: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}application_name={name}"


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


async def run(
    accounts: int = 40_000,
    players: int = 20_000,
    rate: float = 150.0,
    alone_seconds: float = 15.0,
    partitions: int = 16,
    parallel: int = 8,
    batch_size: int = 1000,
    player_connections: int = 8,
    max_in_flight: int | None = None,
    rows_per_second: float | None = None,
    objective: dict[str, float] | None = None,
    paced_floor_slice: int | None = None,
) -> dict[str, Any]:
    """`max_in_flight` / `rows_per_second`: set the budget of phase 3 (default: the defaults).
    `paced_floor_slice`: add phases 4 and 5 (the floor, paced), in slices of this many accounts."""
    cohorts = 4 if paced_floor_slice else 2
    assert players + cohorts * accounts <= 200_000, "keep this benchmark modest: the machine is shared"
    async with stack() as s:
        base = datetime.now(UTC).replace(microsecond=0) - timedelta(days=30)
        seeds = {"off": base, "default": base + timedelta(hours=1)}
        if paced_floor_slice:
            seeds |= {"floor_half": base + timedelta(hours=2), "floor_budget": base + timedelta(hours=3)}
        t = time.perf_counter()
        await seed_accounts(s.pool, prefix="live", deadline=base + timedelta(days=400), count=players)
        for name, deadline in seeds.items():
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
        observer = Observer(
            url,
            {
                "cleanup worker process": worker.pid,
                "players' client (this process)": os.getpid(),
                "temporal server": s.server_pid(),
            },
        )
        loop = asyncio.ensure_future(crowd.run())
        try:
            await asyncio.sleep(min(3.0, alone_seconds))  # warm-up, not recorded

            async def cleanup(seeded: datetime) -> dict[str, Any]:
                deadline = (datetime.now(UTC) + timedelta(seconds=2)).replace(microsecond=0)
                await s.pool.execute(
                    "UPDATE accounts SET renewal_deadline = $1 WHERE renewal_deadline = $2", deadline, seeded
                )
                started = await start_cleanup(
                    s.client,
                    s.pool,
                    s.settings.task_queue,
                    deadline=deadline,
                    partitions=partitions,
                    max_parallel_partitions=parallel,
                    batch_size=batch_size,
                )
                handle = s.client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
                result: CleanupResult = await handle.result()
                seconds = (datetime.now(UTC) - deadline).total_seconds()
                assert result.settlement is not None
                steps = await activity_steps(handle)
                return {
                    "cleaned": result.settlement.cleaned,
                    "seconds_from_deadline": round(seconds, 3),
                    "accounts_per_s": round(result.settlement.cleaned / seconds, 1),
                    "steps_s_after_deadline": {
                        k: [round(a - deadline.timestamp(), 2), round(b - deadline.timestamp(), 2)]
                        for k, (a, b) in steps.items()
                    },
                    "timeline": steps,
                }

            phases: dict[str, Any] = {}
            observed: dict[str, Any] = {}
            loads: dict[str, list[float]] = {}

            async def phase(name: str, during: Callable[[], Awaitable[Any]]) -> Any:
                loads[name] = [load_average()]
                observed[name], (phases[name], result) = await observer.observe(lambda: crowd.measure(during))
                loads[name].append(load_average())
                return result

            def alone() -> Awaitable[None]:
                return asyncio.sleep(alone_seconds)

            await phase("alone", alone)
            await set_budget(s.pool, enabled=False)
            off = await phase("no_budget", lambda: cleanup(seeds["off"]))
            off_budget = (await budget_status(s.pool)).model_dump()
            await phase("alone_between", alone)

            limits: dict[str, Any] = {
                k: v for k, v in {"max_in_flight": max_in_flight, "rows_per_second": rows_per_second}.items() if v
            } | (objective or {})
            await set_budget(s.pool, enabled=True, reset_scale=True, **limits)
            on = await phase("default_budget", lambda: cleanup(seeds["default"]))
            on_budget = (await budget_status(s.pool)).model_dump()
            await phase("alone_after", alone)
            floors: dict[str, Any] = {}
            if paced_floor_slice:
                paced = {"floor_half": 0.5 * off["accounts_per_s"], "floor_budget": on["accounts_per_s"]}
                for name, pace in paced.items():
                    floors[name] = await phase(
                        f"paced_{name}",
                        functools.partial(paced_floor, s.pool, seeds[name], accounts, pace, paced_floor_slice),
                    )
                    await phase(f"alone_after_{name}", alone)
        finally:
            await crowd.stop()
            loop.cancel()
            await player_pool.close()
        memory = s.memory()

    alone_p99 = phases["alone"]["p99_ms"]
    return {
        "scenario": "player_load",
        "accounts_per_cohort": accounts,
        "live_players": players,
        "player_rate_per_s": rate,
        "player_connections": player_connections,
        "partitions": partitions,
        "parallel_partitions": parallel,
        "batch_size": batch_size,
        "seed_seconds": round(seed_seconds, 2),
        "players": phases,
        "p99_ratio_no_budget": round(phases["no_budget"]["p99_ms"] / alone_p99, 3),
        "p99_ratio_default_budget": round(phases["default_budget"]["p99_ms"] / alone_p99, 3),
        # The machine drifts between phases (other tenants): each cleanup phase against the mean of
        # the players-alone windows right before and right after it.
        "p99_ratio_no_budget_bracketed": round(
            phases["no_budget"]["p99_ms"] / statistics.fmean([alone_p99, phases["alone_between"]["p99_ms"]]), 3
        ),
        "p99_ratio_default_budget_bracketed": round(
            phases["default_budget"]["p99_ms"]
            / statistics.fmean([phases["alone_between"]["p99_ms"], phases["alone_after"]["p99_ms"]]),
            3,
        ),
        **(
            {
                "paced_floor": floors,
                "paced_floor_slice": paced_floor_slice,
                # The floor at half the unbudgeted throughput: the players' p99 no budget can beat.
                "p99_ratio_floor_at_half_throughput": round(phases["paced_floor_half"]["p99_ms"] / alone_p99, 3),
                "p99_ratio_floor_at_half_throughput_bracketed": round(
                    phases["paced_floor_half"]["p99_ms"]
                    / statistics.fmean([phases["alone_after"]["p99_ms"], phases["alone_after_floor_half"]["p99_ms"]]),
                    3,
                ),
                "p99_ratio_floor_at_budget_throughput_bracketed": round(
                    phases["paced_floor_budget"]["p99_ms"]
                    / statistics.fmean(
                        [phases["alone_after_floor_half"]["p99_ms"], phases["alone_after_floor_budget"]["p99_ms"]]
                    ),
                    3,
                ),
            }
            if paced_floor_slice
            else {}
        ),
        "cleanup_no_budget": off,
        "cleanup_default_budget": on,
        "throughput_ratio_budget_over_none": round(on["accounts_per_s"] / off["accounts_per_s"], 3),
        "ratio": round(phases["default_budget"]["p99_ms"] / alone_p99, 3),
        "target": "<= 1.2",
        "throughput_target": ">= 0.5",
        "default_budget": BudgetSettings().model_dump(),
        "budget_of_phase_3": limits or "the defaults",
        "budget_after_default_run": {
            k: on_budget[k]
            for k in (
                "doing",
                "limited_by",
                "effective_in_flight",
                "stress",
                "observed",
                "peak_in_flight",
                "granted",
                "denied",
            )
        },
        "budget_counters_after_no_budget_run": {k: off_budget[k] for k in ("granted", "rows_done")},
        "load_average_1m_before_and_after": loads,
        "observed": observed,
        **memory,
        "machine": machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--accounts", type=int, default=40_000, help="accounts per cohort (2 cohorts; 4 with --paced-floor)"
    )
    parser.add_argument("--players", type=int, default=20_000, help="live player accounts")
    parser.add_argument("--rate", type=float, default=150.0, help="player queries per second")
    parser.add_argument("--alone-seconds", type=float, default=15.0)
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--max-in-flight", type=int, help="phase 3's budget instead of the default")
    parser.add_argument("--rows-per-second", type=float, help="phase 3's budget instead of the default")
    parser.add_argument("--probe-ratio", type=float, help="phase 3's objective: commit probe / baseline")
    parser.add_argument("--probe-max-ms", type=float, help="phase 3's objective: commit probe at most this")
    parser.add_argument(
        "--paced-floor",
        action="store_true",
        help="add phases 4 and 5: the floor's statement paced at half the unbudgeted and at the budgeted throughput",
    )
    parser.add_argument("--floor-slice", type=int, default=250, help="accounts per paced floor statement")
    args = parser.parse_args()
    result = asyncio.run(
        run(
            args.accounts,
            args.players,
            args.rate,
            args.alone_seconds,
            args.partitions,
            args.parallel,
            args.batch_size,
            max_in_flight=args.max_in_flight,
            rows_per_second=args.rows_per_second,
            objective={
                k: v for k, v in {"probe_ratio": args.probe_ratio, "probe_max_ms": args.probe_max_ms}.items() if v
            },
            paced_floor_slice=args.floor_slice if args.paced_floor else None,
        )
    )
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
