"""Cohort cleanup on a game server's own schema, pipeline vs. floor: `python -m bench.game_schema --users 100000`.

The schema is the tests' game server (tests/game_server: its own schema name, UUID keys, ON DELETE
CASCADE, friends keyed by two user columns, users anonymized with a keyed hash, matches archived
into a LIKE ... INCLUDING ALL table), cleaned by its declared targets (tests/game_server/targets.toml).
Four cohorts of the same size are seeded into one fresh database (each user: 2 characters, 4 items,
3 matches, 2 friendships, with the next user of its cohort, so most friendships join two partitions)
by one INSERT ... SELECT generate_series per table (bench/game_seed.sql), the game schema's keys,
foreign keys and indexes added after the load; their accounts are registered directly (a
benchmark's seeding, not the game's contract). Order of the runs: floor, pipeline, pipeline, floor;
each path counts by its faster run. Partitions and partitions at a time: the planner's defaults.

- *floor*: `game_cleanup_floor` (bench/floor.sql), the same effects as the targets with the same
  guarantees (idempotency record and erasure receipt in the same transaction), one set-based statement per account_id
  range on as many backends as there are cores, all at once, no claim, no batches, no Temporal.
- *pipeline*: the real thing on a separate worker process compiled from the game's targets, with
  the load budget off: `start_cleanup`, the durable sleep to the deadline, the claim, the partition
  activities, the settlement (accounts/s from the deadline to the settled result).

Printed: each run, `pipeline_over_floor` (accounts/s over accounts/s, this run), the load average
around every run (the machine may be shared: read the ratio with it), the backends' CPU of each run
and the pipeline's activities; each step on stderr as it ends.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

import bench
import bench.floor
from bench.cohort_cleanup import AUTOVACUUM_OFF, DEFAULT_PARALLEL, LONG_STATEMENT_SECONDS, pipeline_cleanup, settle
from bench.common import Stack, load_average, machine, run_benchmark, stack, wait_for_worker
from cleanup.models import DEFAULTS
from cleanup.targets import ANONYMIZE_KEY_ENV, anonymize_key_pads, q
from core.config import PROJECT_ROOT
from core.queries import load

FLOOR = load(bench.__file__, "floor.sql")
SEED = load(bench.__file__, "game_seed.sql")
GAME_SCHEMA = "game_server"
GAME_DIR = PROJECT_ROOT / "tests" / "game_server"
KEY = "benchmark-anonymize-key-of-the-game-server"
# Partitions and partitions at a time: the planner's defaults, as every cohort cleanup nobody starts by hand.
DEFAULT_PARTITIONS = DEFAULTS.partitions


async def seed_cohorts(pool: asyncpg.Pool, deadlines: list[datetime], users: int) -> dict[str, float]:
    """`users` users per deadline with their game data and their accounts (bench/game_seed.sql): one
    INSERT ... SELECT per table over every cohort, the game schema's keys, foreign keys and indexes
    dropped before the load and added back after it. Returns the seconds per step."""
    steps: dict[str, float] = {}

    async def step(name: str, sql: str, *args: object) -> None:
        t = time.perf_counter()
        await pool.execute(sql, *args, timeout=LONG_STATEMENT_SECONDS)
        steps[name] = round(time.perf_counter() - t, 1)

    keys = await pool.fetch(SEED.game_keys, GAME_SCHEMA)
    indexes = await pool.fetch(SEED.game_indexes, GAME_SCHEMA)
    for k in keys:
        await pool.execute(f"ALTER TABLE {k['table_name']} DROP CONSTRAINT {q(k['name'])}")
    for i in indexes:
        await pool.execute(f"DROP INDEX {i['name']}")
    for table, sql in (
        ("users", SEED.seed_users),
        ("accounts", SEED.seed_accounts),
        ("characters", SEED.seed_characters),
        ("inventory", SEED.seed_inventory),
        ("friends", SEED.seed_friends),
        ("matches", SEED.seed_matches),
    ):
        await step(table, sql, deadlines, users)
    t = time.perf_counter()
    for k in reversed(keys):
        await pool.execute(
            f"ALTER TABLE {k['table_name']} ADD CONSTRAINT {q(k['name'])} {k['definition']}",
            timeout=LONG_STATEMENT_SECONDS,
        )
    for i in indexes:
        await pool.execute(i["definition"], timeout=LONG_STATEMENT_SECONDS)
    steps["keys_and_indexes"] = round(time.perf_counter() - t, 1)
    return steps


async def floor_cleanup(pool: asyncpg.Pool, deadline: datetime) -> dict[str, Any]:
    cleanup_id = f"floor-{deadline:%H%M%S}"
    cut = FLOOR.bind("cleanup_floor_bounds", deadline=deadline, slices=bench.floor.FLOOR_BACKENDS)
    bounds = await pool.fetchval(FLOOR.cleanup_floor_bounds, *cut)
    edges: list[str | None] = [None, *(bounds or []), None]
    inner, outer = anonymize_key_pads(KEY)
    slices = [
        FLOOR.bind(
            "game_cleanup_floor",
            cleanup_id=cleanup_id,
            deadline=deadline,
            from_account=lo,
            until_account=hi,
            inner_pad=inner,
            outer_pad=outer,
        )
        for lo, hi in itertools.pairwise(edges)
    ]
    run = await bench.floor.run_slices(pool, FLOOR.game_cleanup_floor, slices, LONG_STATEMENT_SECONDS)
    return {
        "seconds": run.seconds,
        "backends": len(slices),
        "cleaned": run.total("cleaned"),
        "rows": {k: run.total(k) for k in ("inventory", "characters", "friends", "matches", "users", "receipts")},
        "backend_cpu_s": run.backend_cpu_s,
        "load": run.load,
    }


def progress(line: str) -> None:
    """Each step as it ends, on stderr (a run at 1,000,000 users lasts an hour): stdout is the result."""
    print(f"{datetime.now(UTC):%H:%M:%S} {line}", file=sys.stderr, flush=True)


async def start_game_worker(s: Stack) -> None:
    s.start_worker(CLEANUP_TARGETS_FILE=str(GAME_DIR / "targets.toml"), **{ANONYMIZE_KEY_ENV: KEY})
    await wait_for_worker(s.client, s.settings.task_queue)
    await s.budget_off()


async def run(
    users: int, partitions: int = DEFAULT_PARTITIONS, parallel: int = DEFAULT_PARALLEL, batch_size: int = 1000
) -> dict[str, Any]:
    load_before = load_average()
    async with stack(pool_size=bench.floor.STACK_POOL_SIZE) as s:
        await s.pool.execute((GAME_DIR / "schema.sql").read_text())
        base = datetime.now(UTC).replace(microsecond=0) - timedelta(days=30)
        floor_1, pipeline_1, pipeline_2, floor_2 = (base + timedelta(hours=h) for h in range(4))
        t = time.perf_counter()
        seed_steps = await seed_cohorts(s.pool, [floor_1, pipeline_1, pipeline_2, floor_2], users)
        seed_seconds = time.perf_counter() - t
        progress(f"seeded 4 x {users} users in {seed_seconds:.0f} s: {seed_steps}")
        await s.pool.execute("VACUUM ANALYZE", timeout=LONG_STATEMENT_SECONDS)
        await s.pool.execute(AUTOVACUUM_OFF)
        await s.pool.execute(SEED.game_autovacuum_off)
        await start_game_worker(s)

        await settle(s.pool)
        floors = [await floor_cleanup(s.pool, floor_1)]
        progress(f"floor: {floors[0]['seconds']:.1f} s, load {floors[0]['load']}")
        first, lead = await pipeline_cleanup(s, pipeline_1, 10 + users / 2000, partitions, parallel, batch_size)
        progress(f"pipeline: {first['seconds_from_deadline']:.1f} s from the deadline, load {first['load']}")
        second, _ = await pipeline_cleanup(s, pipeline_2, lead, partitions, parallel, batch_size)
        progress(f"pipeline: {second['seconds_from_deadline']:.1f} s from the deadline, load {second['load']}")
        await settle(s.pool)
        floors.append(await floor_cleanup(s.pool, floor_2))
        progress(f"floor: {floors[1]['seconds']:.1f} s, load {floors[1]['load']}")
        left = await s.pool.fetchval(
            "SELECT (SELECT count(*) FROM game_server.inventory) + (SELECT count(*) FROM game_server.characters)"
            " + (SELECT count(*) FROM game_server.matches) + (SELECT count(*) FROM game_server.friends)"
        )
    floor = min(floors, key=lambda f: f["seconds"])
    pipeline = min((first, second), key=lambda p: p["seconds_from_deadline"])
    assert all(f["cleaned"] == users for f in floors), floors
    assert first["cleaned"] == second["cleaned"] == users, (first["cleaned"], second["cleaned"])
    assert left == 0, f"{left} game rows of cleaned users left"
    assert all(f["rows"]["receipts"] == users for f in floors), "the floor writes every receipt, as the pipeline"
    floor_rate = users / floor["seconds"]
    pipeline_rate = users / pipeline["seconds_from_deadline"]
    return {
        "users_per_cohort": users,
        "machine": machine(),
        "seed_seconds": round(seed_seconds, 1),
        "seed_steps_seconds": seed_steps,
        "partitions": partitions,
        "parallel": parallel,
        "batch_size": batch_size,
        "floor_backends": bench.floor.FLOOR_BACKENDS,
        "floor_runs_seconds": [round(f["seconds"], 2) for f in floors],
        "floor_rows": floor["rows"],
        "pipeline_runs_seconds_from_deadline": [round(p["seconds_from_deadline"], 2) for p in (first, second)],
        "floor_backend_cpu_s": [f["backend_cpu_s"] for f in floors],
        "pipeline_backend_cpu_s": [p["backend_cpu_s"] for p in (first, second)],
        "pipeline_orchestration_cpu_s": pipeline["orchestration_cpu_s"],
        "pipeline_activities": pipeline["activities"],
        "floor_accounts_per_s": round(floor_rate, 1),
        "pipeline_accounts_per_s": round(pipeline_rate, 1),
        "pipeline_over_floor": round(pipeline_rate / floor_rate, 3),
        "load_average": {
            "before": load_before,
            "floor": [f["load"] for f in floors],
            "pipeline": [p["load"] for p in (first, second)],
            "after": load_average(),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--users", type=int, default=100_000)
    parser.add_argument("--partitions", type=int, default=DEFAULT_PARTITIONS, help="default: the planner's")
    parser.add_argument("--parallel", type=int, default=DEFAULT_PARALLEL, help="default: the planner's")
    parser.add_argument("--batch-size", type=int, default=1000)
    args = parser.parse_args()
    print(json.dumps(run_benchmark(run(args.users, args.partitions, args.parallel, args.batch_size)), indent=2))


if __name__ == "__main__":
    main()
