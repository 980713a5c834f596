"""The game realm at scale: `python -m bench.game_realm --users 100000` (`--spread 600`).

The schema, targets file and seed are the tests' game realm (tests/game_realm: 14 tables, UUID
players with a JSON profile, friendships both ways with a friend counter, groups with a member
counter, notifications by recipient and sender, a wallet ledger archived, three follow-up
statements). Three cohorts of `users` players each (devices, storage objects, friendships with the
next player and with one of `users / 10` other players, memberships of `users / 50` groups, ...),
their registrations waiting far beyond the planner's horizon; the load budget as shipped; nothing
else on the database.

Before the workers start, `targets check` reports the sender column's missing index; the
benchmark runs the `CREATE INDEX CONCURRENTLY` it names, as an operator would before the first
deadline. Then, in one run:

- *floor*: the first cohort cleaned by `realm_floor` (bench/game_realm.sql), one set-based
  statement per slice of the cohort on as many backends as there are cores, all at once: the
  targets' effects, the follow-ups' counters, the idempotency records, receipts and reminders.
- *pipeline*: the second cohort registered by the game's `set_deadline` at one instant; the
  planner's bucket cleanup cleans it (bench.planner_cohort.through_planner), timed from the
  deadline to the last account cleaned. `ratio` = its accounts/s over the floor's.
- *lateness*: the third cohort registered by `set_deadline` with deadlines spread over `spread`
  seconds; `cleaned_at - renewal_deadline` of each, p50/p90/p99/max.

Afterwards every cleaned player is checked: no personal column keeps its value, every counter is
right. Printed beside the figures: the load average, and how often a batch waited for the
follow-ups' advisory lock (backends sampled while the pipeline ran).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
from pydantic import SecretStr

import bench
import bench.floor
from bench.cohort_cleanup import LONG_STATEMENT_SECONDS, settle
from bench.common import LoadSampler, Stack, load_average, machine, run_benchmark, stack, wait_for_worker
from bench.planner_cohort import FAR, floor_pool, lead_for, through_planner
from bench.planner_lateness import parse_overrides, planner_worker_env
from budget.controller import BudgetChange, set_budget
from cleanup.operations import check_targets
from cleanup.targets import ANONYMIZE_KEY_ENV, anonymize_key_pads
from core.config import PROJECT_ROOT, CleanupSettings, PlannerSettings
from core.queries import load

REALM_DIR = PROJECT_ROOT / "tests" / "game_realm"
TARGETS_FILE = REALM_DIR / "targets.toml"
SQL = load(bench.__file__, "game_realm.sql")
FLOOR = load(bench.__file__, "floor.sql")
SEED = load(str(REALM_DIR / "schema.sql"), "seed.sql")
# The game's announcements to the other players: the notifications table is not tiny at any size,
# so the sender column's missing index is reported at every size.
BROADCAST = 12_000
KEY = "benchmark-anonymize-key-of-the-game-realm"
COHORTS = {
    "floor": FAR + timedelta(hours=1),
    "pipeline": FAR + timedelta(days=366),
    "lateness": FAR + timedelta(days=732),
}


def progress(line: str) -> None:
    print(f"{datetime.now(UTC):%H:%M:%S} {line}", file=sys.stderr, flush=True)


async def seed_realm(pool: asyncpg.Pool, users: int) -> float:
    """The realm's schema, its other players and groups, three cohorts with their registrations
    (at `COHORTS`), every counter right, vacuumed and analyzed; seconds taken."""
    t = time.perf_counter()
    await pool.execute("UPDATE account_key_type SET key_type = 'uuid'")  # as `migrate` records it
    await pool.execute((REALM_DIR / "schema.sql").read_text())
    others, groups = max(users // 10, 10), max(users // 50, 2)
    await pool.fetchrow(SEED.seed_others, others, "o", groups, BROADCAST, timeout=LONG_STATEMENT_SECONDS)
    for name, at in COHORTS.items():
        await pool.fetchrow(SEED.seed_players, name, users, "o", others, groups, timeout=LONG_STATEMENT_SECONDS)
        await pool.execute(SQL.seed_accounts, name, users, at, timeout=LONG_STATEMENT_SECONDS)
    await pool.execute(SEED.recount, timeout=LONG_STATEMENT_SECONDS)
    await pool.execute("VACUUM ANALYZE", timeout=LONG_STATEMENT_SECONDS)
    return time.perf_counter() - t


async def fix_missing_indexes(pool: asyncpg.Pool, settings: CleanupSettings) -> list[dict[str, str]]:
    """What `targets check` reports missing, each fixed by the statement it names."""
    report = await check_targets(pool, str(TARGETS_FILE), settings)
    for m in report.missing_indexes:
        await pool.execute(m.fix, timeout=LONG_STATEMENT_SECONDS)
    assert not (await check_targets(pool, str(TARGETS_FILE), settings)).missing_indexes
    return [{"target": m.target, "fix": m.fix} for m in report.missing_indexes]


async def start_workers(s: Stack, workers: int, planner: dict[str, str]) -> None:
    env = {
        **planner_worker_env(planner),
        "CLEANUP_TARGETS_FILE": str(TARGETS_FILE),
        "CLEANUP_ACCOUNT_KEY_TYPE": "uuid",
        ANONYMIZE_KEY_ENV: KEY,
    }
    for _ in range(workers):
        s.start_worker("worker", **env)
    await wait_for_worker(s.client, s.settings.task_queue)


async def floor_cleanup(pool: asyncpg.Pool, deadline: datetime) -> dict[str, Any]:
    """The cohort due at `deadline` cleaned by `realm_floor`, one slice per backend, all at once."""
    bounds = await pool.fetchval(
        FLOOR.cleanup_floor_bounds,
        *FLOOR.bind("cleanup_floor_bounds", deadline=deadline, slices=bench.floor.FLOOR_BACKENDS),
    )
    edges: list[str | None] = [None, *(bounds or []), None]
    inner, outer = anonymize_key_pads(KEY)
    slices = [("floor-realm", deadline, lo, hi, inner, outer) for lo, hi in itertools.pairwise(edges)]
    run = await bench.floor.run_slices(pool, SQL.realm_floor, slices, LONG_STATEMENT_SECONDS)
    columns = ("cleaned", "notifications", "friendships", "archived", "users", "friends_counted", "receipts")
    return {
        "seconds": round(run.seconds, 3),
        "backends": len(slices),
        **{c: run.total(c) for c in columns},
        "backend_cpu_s": run.backend_cpu_s,
        "load": run.load,
    }


async def sample_lock_waits(pool: asyncpg.Pool, into: list[tuple[int, int]], every: float = 0.2) -> None:
    """(backends running a statement, backends waiting for the follow-ups' advisory lock), sampled
    every `every` seconds until cancelled."""
    while True:
        with contextlib.suppress(asyncpg.PostgresError, OSError):
            row = await pool.fetchrow(SQL.lock_waits)
            if row is not None:
                into.append((row["active"], row["advisory"]))
        await asyncio.sleep(every)


def lock_wait_summary(samples: list[tuple[int, int]]) -> dict[str, Any]:
    busy = [s for s in samples if s[0] > 0]
    return {
        "samples": len(samples),
        "samples_with_a_backend_waiting_for_the_follow_up_lock": sum(1 for s in busy if s[1] > 0),
        "mean_backends_waiting_for_it": round(sum(s[1] for s in busy) / len(busy), 2) if busy else 0.0,
        "mean_backends_active": round(sum(s[0] for s in busy) / len(busy), 2) if busy else 0.0,
    }


def idle_lead(planner: PlannerSettings) -> float:
    """A registration the game makes while the planner sleeps is planned when it wakes: at most
    `max_idle_seconds` later, then within a tick. Each cohort is registered at least this far ahead
    of its first deadline (plus what registering it takes), as a game registers days ahead."""
    return planner.max_idle_seconds + 2 * planner.tick_seconds


async def pipeline_run(s: Stack, users: int, drain: float, planner: PlannerSettings) -> dict[str, Any]:
    samples: list[tuple[int, int]] = []
    sampler = asyncio.create_task(sample_lock_waits(s.pool, samples))
    try:
        lead = lead_for(users) + idle_lead(planner)
        product = await through_planner(s, COHORTS["pipeline"], users, drain, lead, planner.tick_seconds)
    finally:
        sampler.cancel()
    return product | {"follow_up_lock": lock_wait_summary(samples)}


async def lateness_run(s: Stack, users: int, spread: float, drain: float, planner: PlannerSettings) -> dict[str, Any]:
    """The third cohort registered with deadlines spread over `spread` seconds, from a lead that
    covers the registration and two planner ticks; lateness of each account once all are cleaned."""
    await settle(s.pool)
    lead = 20.0 + users / 4000 + idle_lead(planner)
    first: datetime = (await s.pool.fetchval(SQL.database_clock)) + timedelta(seconds=lead)
    end = first + timedelta(seconds=spread)
    with LoadSampler() as load:
        moved = await s.pool.fetchval(
            SQL.spread_cohort, COHORTS["lateness"], first, spread, timeout=LONG_STATEMENT_SECONDS
        )
        assert moved == users, moved
        give_up = time.monotonic() + lead + spread + drain
        while True:
            if not await s.pool.fetchval(SQL.window_pending, first, end) or time.monotonic() > give_up:
                break
            await asyncio.sleep(2.0)
    row = await s.pool.fetchrow(SQL.window_lateness, first, end)
    assert row is not None
    late = {k: None if row[k] is None else round(row[k], 3) for k in ("p50", "p90", "p99", "max")}
    return {
        "cleaned": row["cleaned"],
        "not_cleaned": row["not_cleaned"],
        "lead_seconds": round(lead, 1),
        "lateness_seconds": late,
        "load_average_1m": load.summary(),
    }


async def left_behind(pool: asyncpg.Pool, users: int) -> dict[str, Any]:
    """Of every cleaned player: rows or personal values left (each 0 but the archived ledger), and
    the counters that are wrong."""
    out: dict[str, Any] = {}
    for name in COHORTS:
        ids = await pool.fetchval(SQL.cohort_ids, name, users)
        left = dict(await pool.fetchrow(SEED.personal_left, ids, timeout=LONG_STATEMENT_SECONDS) or {})
        out[name] = {k: v for k, v in left.items() if v}
    row = await pool.fetchrow(SEED.wrong_counters, timeout=LONG_STATEMENT_SECONDS)
    assert row is not None
    out["wrong_counters"] = {"players": row["players"], "groups": row["groups"]}
    return out


async def run(
    users: int,
    spread: float = 600.0,
    workers: int = 2,
    drain: float = 300.0,
    planner: dict[str, str] | None = None,
) -> dict[str, Any]:
    """`planner`: PlannerSettings overrides for the workers (none: as shipped)."""
    planner = planner or {}
    planner_settings = PlannerSettings(**planner)  # type: ignore[arg-type]
    load_before = load_average()
    settings = CleanupSettings(targets_file=TARGETS_FILE, anonymize_key=SecretStr(KEY))
    async with stack(pool_size=bench.floor.STACK_POOL_SIZE) as s:
        seed_seconds = await seed_realm(s.pool, users)
        progress(f"seeded 3 x {users} players in {seed_seconds:.0f} s")
        fixed = await fix_missing_indexes(s.pool, settings)
        await s.pool.execute(SQL.realm_autovacuum_off)
        await start_workers(s, workers, planner)
        await set_budget(s.pool, BudgetChange(enabled=True), changed_by="benchmark")  # as shipped
        assert s.settings.database_url is not None
        ahead = await floor_pool(s.settings.database_url, bench.floor.STACK_POOL_SIZE)
        try:
            await settle(s.pool)
            floor = await floor_cleanup(ahead, COHORTS["floor"])
        finally:
            await ahead.close()
        progress(f"floor: {floor['seconds']:.1f} s, load {floor['load']}")
        product = await pipeline_run(s, users, drain, planner_settings)
        progress(f"pipeline: {product['seconds_deadline_to_last_cleaned']} s, load {product['load']}")
        lateness = await lateness_run(s, users, spread, drain, planner_settings)
        progress(f"lateness: {lateness['lateness_seconds']}, load {lateness['load_average_1m']}")
        left = await left_behind(s.pool, users)
        memory = s.memory()
    return summary(users, floor, product, lateness) | {
        "workers": workers,
        "planner_overrides": planner,
        "seed_seconds": round(seed_seconds, 1),
        "missing_indexes_reported_and_built": fixed,
        "left_behind": left,
        "load_average_1m_before_and_after": [load_before, load_average()],
        **memory,
        "machine": machine(),
    }


def summary(users: int, floor: dict[str, Any], product: dict[str, Any], lateness: dict[str, Any]) -> dict[str, Any]:
    floor_rate = floor["cleaned"] / floor["seconds"]
    rate = product["accounts_per_s"] or 0.0
    return {
        "scenario": "game_realm",
        "users_per_cohort": users,
        "load_budget": "default",
        "ratio": round(rate / floor_rate, 3),
        "target": ">= 0.6",
        "lateness_p99_seconds": lateness["lateness_seconds"]["p99"],
        "lateness_p99_seconds_target": "<= 2",
        "floor_accounts_per_s": round(floor_rate, 1),
        "pipeline_accounts_per_s": rate,
        "floor": floor,
        "pipeline": product,
        "lateness": lateness,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=100_000, help="players per cohort (smaller for a smoke run)")
    parser.add_argument("--spread", type=float, default=600.0, help="the lateness cohort's deadlines over this many s")
    parser.add_argument("--workers", type=int, default=2, help="worker processes, the planner on in each")
    parser.add_argument("--drain", type=float, default=300.0, help="give up this long after a last deadline")
    parser.add_argument(
        "--planner", action="append", default=[], metavar="KEY=VALUE", help="a PlannerSettings field (default: shipped)"
    )
    args = parser.parse_args()
    overrides = parse_overrides(args.planner)
    result = run_benchmark(run(args.users, args.spread, args.workers, args.drain, overrides))
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
