"""Batch sizes side by side, in one run: `python -m bench.batch_sizes --accounts 1000000`.

The batch-size sweep of `bench.cohort_cleanup` cleans one cohort per size, one after the other, and
on a shared 2-core machine one size's runs spread more than the few percent
the sizes differ by. Here the sizes share the same seconds instead: one cohort, claimed into
`--parallel` partitions (the planner's 4 partitions at a time by default), all of them running at
once, each on its own backend; every partition walks its accounts in cycles that give each size
the same number of accounts (10 batches of 500, 5 of 1,000 and 1 of 5,000, shuffled), so at any
moment the other backends run the same mix whatever size this one runs, and a slow minute of the
machine weighs on every size alike.

Each statement is the worker's compiled batch statement with its COMMIT (`run_keyset_batch`),
measured by its own backend: wall time, CPU time and time runnable but waiting for a core
(`/proc/PID/schedstat`, nanoseconds). Counted are full batches run while every partition was still
running (a partition's short last batch and the tail after the first partition ends are left out
and counted apart). Per size: microseconds of wall time per account on its backend (the speed: with
every backend busy, the machine's throughput is `parallel` / that) and of CPU. Per step to the next
size: the speed ratio (previous size's time per account / this one's; >= 1 is "no slower") and its
95% interval by a paired bootstrap over the cycles (each cycle holds every size), the same by CPU,
and the ratio in each quarter of the run.

`--together N`: the sizes as a cleanup runs them instead, every partition on the same size at
once: each partition runs N accounts at the first size, all wait for each other, then all run N
at the next (rounds in the given order, then reversed: ABC CBA ...). The paired unit is a round;
`phase_accounts_per_s` is the machine's accounts per second within each size's phases (from the
phase's first statement to its last, so the partitions that finish a phase early count against it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.batch_plan import fresh_database_url
from bench.cohort_cleanup import (
    AUTOVACUUM_OFF,
    DEFAULT_PARALLEL,
    LONG_STATEMENT_SECONDS,
    claim_in_streams,
    seed_cohort,
    settle,
)
from bench.common import load_average, machine, run_benchmark
from bench.observe import schedstat
from cleanup.batches import CompiledCleanup, run_keyset_batch
from cleanup.models import DEFAULTS
from cleanup.targets import load_targets
from core import db

BOOTSTRAP_RESAMPLES = 2000
PhaseHook = Callable[[int], Awaitable[None]]
# The logical work of every statement the partitions ran in this database (pg_stat_statements,
# when the server preloads it): what a size costs the database per account, apart from its speed.
WORK_SQL = """
SELECT coalesce(sum(calls), 0)::float8 AS calls, coalesce(sum(total_exec_time), 0)::float8 AS exec_ms,
       coalesce(sum(shared_blks_hit), 0)::float8 AS shared_blks_hit,
       coalesce(sum(shared_blks_read), 0)::float8 AS shared_blks_read,
       coalesce(sum(shared_blks_dirtied), 0)::float8 AS shared_blks_dirtied,
       coalesce(sum(shared_blks_written), 0)::float8 AS shared_blks_written,
       coalesce(sum(temp_blks_written), 0)::float8 AS temp_blks_written,
       coalesce(sum(wal_records), 0)::float8 AS wal_records, coalesce(sum(wal_fpi), 0)::float8 AS wal_fpi,
       coalesce(sum(wal_bytes), 0)::float8 AS wal_bytes,
       (SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter)::float8 AS checkpoints
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND query NOT ILIKE '%pg_stat_statements%'
"""
QUARTERS = 4


@dataclass(frozen=True)
class Statement:
    partition: int
    cycle: int
    size: int
    rows: int
    started: float
    ended: float
    cpu_ns: int
    runnable_ns: int

    @property
    def wall_ns(self) -> float:
        return (self.ended - self.started) * 1e9


def cycle_of(sizes: tuple[int, ...]) -> list[int]:
    """One cycle: each size as often as gives it the largest size's accounts."""
    largest = max(sizes)
    if any(largest % s for s in sizes):
        raise SystemExit(f"every size must divide the largest ({largest}): {sizes}")
    return [s for s in sizes for _ in range(largest // s)]


async def run_partition(
    url: str,
    compiled: CompiledCleanup,
    cleanup_id: str,
    partition: int,
    sizes: tuple[int, ...],
    together: int | None = None,
    barrier: asyncio.Barrier | None = None,
    on_phase: PhaseHook | None = None,
) -> tuple[list[Statement], float]:
    """One partition to its end on a backend of its own; returns its statements and when it ended.

    `together` (with `barrier`): every partition runs the same size at once, `together` accounts
    each, then all switch to the next size (rounds in the order given, then reversed, ...);
    `Statement.cycle` is the round. `on_phase(size)` runs once per phase that every partition
    finished, while all of them wait (the database's counters then hold that phase alone)."""
    pool = await db.create_pool(url, min_size=1, max_size=1)
    try:
        pid = await pool.fetchval("SELECT pg_backend_pid()")
        rng = random.Random(partition)
        out: list[Statement] = []
        last = ""
        cycle = 0
        while True:
            if together is None:
                order = cycle_of(sizes)
                rng.shuffle(order)
            else:
                rounds = sizes if cycle % 2 == 0 else sizes[::-1]
                order = [size for size in rounds for _ in range(together // size)]
            for i, size in enumerate(order):
                before, t0 = schedstat(pid), time.perf_counter()
                result = await run_keyset_batch(pool, compiled, cleanup_id, partition, last, size)
                t1, after = time.perf_counter(), schedstat(pid)
                assert before is not None and after is not None, "the backend's /proc/PID/schedstat"
                out.append(
                    Statement(
                        partition, cycle, size, result.batch_rows, t0, t1, after[0] - before[0], after[1] - before[1]
                    )
                )
                if result.batch_rows < size:
                    if barrier is not None:
                        await barrier.abort()  # the others run their last phases unsynchronized
                    return out, t1
                last = result.last_account_id
                phase_ends = i + 1 == len(order) or order[i + 1] != size
                if barrier is not None and phase_ends and not barrier.broken:
                    with contextlib.suppress(asyncio.BrokenBarrierError):
                        first = await barrier.wait() == 0
                        if on_phase is not None:
                            if first:
                                await on_phase(size)
                            await barrier.wait()
            cycle += 1
    finally:
        await pool.close()


def per_account(statements: list[Statement], size: int) -> tuple[float, float, float, int]:
    """(wall us, CPU us, runnable-waiting us) per account and the accounts, of one size's statements."""
    mine = [s for s in statements if s.size == size]
    accounts = sum(s.rows for s in mine)
    if not accounts:
        return float("nan"), float("nan"), float("nan"), 0
    return (
        sum(s.wall_ns for s in mine) / accounts / 1e3,
        sum(s.cpu_ns for s in mine) / accounts / 1e3,
        sum(s.runnable_ns for s in mine) / accounts / 1e3,
        accounts,
    )


def step_ratios(statements: list[Statement], smaller: int, larger: int) -> tuple[float, float]:
    """(speed ratio, CPU ratio) of `larger` against `smaller`: >= 1 means `larger` no slower / cheaper."""
    w_small, c_small, _, _ = per_account(statements, smaller)
    w_large, c_large, _, _ = per_account(statements, larger)
    return w_small / w_large, c_small / c_large


def phase_throughput(units: list[list[Statement]], sizes: tuple[int, ...]) -> dict[str, Any]:
    per_size = {}
    for size in sizes:
        rows = seconds = 0.0
        for unit in units:
            mine = [s for s in unit if s.size == size]
            rows += sum(s.rows for s in mine)
            seconds += max(s.ended for s in mine) - min(s.started for s in mine)
        per_size[str(size)] = round(rows / seconds, 1) if seconds else float("nan")
    return per_size


def interval(values: list[float]) -> list[float]:
    ordered = sorted(values)
    return [round(ordered[int(0.025 * len(ordered))], 4), round(ordered[int(0.975 * len(ordered)) - 1], 4)]


def summarize(
    statements: list[Statement], ends: list[float], sizes: tuple[int, ...], parallel: int, together: int | None
) -> dict[str, Any]:
    steady_until = min(ends)
    counted = [s for s in statements if s.rows == s.size and s.ended <= steady_until]
    # The paired units: one partition's cycle with every size in it (`together`: one round of every
    # partition), all of it counted.
    cycles: dict[tuple[int, int], list[Statement]] = {}
    for s in counted:
        cycles.setdefault((s.partition if together is None else 0, s.cycle), []).append(s)
    full = len(cycle_of(sizes)) if together is None else sum(parallel * (together // size) for size in sizes)
    units = [v for _, v in sorted(cycles.items(), key=lambda kv: min(s.started for s in kv[1])) if len(v) == full]
    by_size = []
    for size in sizes:
        wall, cpu, runnable, accounts = per_account(counted, size)
        by_size.append(
            {
                "batch_size": size,
                "statements": sum(1 for s in counted if s.size == size),
                "accounts": accounts,
                "wall_us_per_account": round(wall, 2),
                "cpu_us_per_account": round(cpu, 2),
                "runnable_waiting_us_per_account": round(runnable, 2),
                "machine_accounts_per_s": round(parallel * 1e6 / wall, 1),
            }
        )
    rng = random.Random(0)
    steps: list[dict[str, Any]] = []
    for smaller, larger in itertools.pairwise(sizes):
        speed, cpu = step_ratios(counted, smaller, larger)
        boot_speed, boot_cpu = [], []
        for _ in range(BOOTSTRAP_RESAMPLES):
            sample = [s for unit in rng.choices(units, k=len(units)) for s in unit]
            bs, bc = step_ratios(sample, smaller, larger)
            boot_speed.append(bs)
            boot_cpu.append(bc)
        quarter = max(1, len(units) // QUARTERS)
        quarters = [
            round(step_ratios([s for u in units[i : i + quarter] for s in u], smaller, larger)[0], 4)
            for i in range(0, quarter * QUARTERS, quarter)
            if units[i : i + quarter]
        ]
        steps.append(
            {
                "from": smaller,
                "to": larger,
                "speed_ratio": round(speed, 4),
                "speed_ratio_95": interval(boot_speed),
                "cpu_ratio": round(cpu, 4),
                "cpu_ratio_95": interval(boot_cpu),
                "speed_ratio_by_quarter": quarters,
            }
        )
    phases = phase_throughput(units, sizes) if together is not None else None
    return {
        "sizes": by_size,
        "steps": steps,
        # `together`: accounts per second of the whole machine in each size's phases, from the
        # phase's first statement to its last (the partitions that finish a phase early included).
        "phase_accounts_per_s": phases,
        "each_no_slower_than_the_one_before": all(s["speed_ratio"] >= 1 for s in steps),
        # The stricter reading: no slower even at the low end of the 95% interval.
        "each_no_slower_at_95": all(s["speed_ratio_95"][0] >= 1 for s in steps),
        "each_no_costlier_by_cpu": all(s["cpu_ratio"] >= 1 for s in steps),
        "cycles_counted": len(units),
        "statements_counted": len(counted),
        "left_out": {
            "short_last_batches": sum(1 for s in statements if s.rows < s.size),
            "tail_statements": sum(1 for s in statements if s.rows == s.size and s.ended > steady_until),
        },
        "seconds_all_running": round(steady_until - min(s.started for s in statements), 3),
        "partition_end_spread_s": round(max(ends) - steady_until, 3),
    }


async def work_counters(pool: Any) -> dict[str, float] | None:
    """The database's statement counters now, or None when pg_stat_statements is not preloaded."""
    try:
        row = await pool.fetchrow(WORK_SQL)
    except Exception:  # not in shared_preload_libraries (or not installed): not measured
        return None
    return dict(row)


def work_per_account(phases: list[tuple[int, dict[str, float]]], sizes: tuple[int, ...], accounts: int) -> Any:
    """Per size: the counters' sums over its phases, per account (`accounts` per phase); the
    statement time in microseconds; and the phases that met a checkpoint."""
    out = {}
    for size in sizes:
        mine = [d for s, d in phases if s == size]
        if not mine:
            continue
        n = len(mine) * accounts
        keys = [k for k in mine[0] if k not in ("checkpoints", "exec_ms")]
        out[str(size)] = {
            "phases": len(mine),
            "exec_us": round(sum(d["exec_ms"] for d in mine) * 1000 / n, 2),
            **{k: round(sum(d[k] for d in mine) / n, 3) for k in keys},
            "phases_with_a_checkpoint": sum(1 for d in mine if d["checkpoints"] > 0),
        }
    return out


async def run(
    accounts: int,
    sizes: tuple[int, ...],
    parallel: int,
    statements_file: str | None = None,
    together: int | None = None,
) -> dict[str, Any]:
    """`statements_file`: where to write every statement measured (JSON lines), for a closer look.
    `together`: all partitions run one size at once, `together` accounts each, then switch together
    (as a cleanup runs: every partition at its batch size), instead of the sizes interleaved."""
    if together is not None and any(together % size for size in sizes):
        raise SystemExit(f"--together must be a multiple of every size: {sizes}")
    load_before = load_average()
    async with fresh_database_url() as url:
        pool = await db.create_pool(url, max_size=4)
        try:
            deadline = datetime.now(UTC).replace(microsecond=0) - timedelta(days=30)
            t = time.perf_counter()
            await seed_cohort(pool, "z", deadline, accounts)
            seed_seconds = time.perf_counter() - t
            await pool.execute("VACUUM ANALYZE", timeout=LONG_STATEMENT_SECONDS)
            await pool.execute(AUTOVACUUM_OFF)
            cleanup_id = "batch-sizes"
            await claim_in_streams(pool, cleanup_id, deadline, parallel, min(DEFAULTS.claim_streams, parallel))
            compiled = await CompiledCleanup.compile(pool, load_targets())
            await settle(pool)
            load_at_start = load_average()
            t = time.perf_counter()
            temp_sql = "SELECT temp_files, temp_bytes FROM pg_stat_database WHERE datname = current_database()"
            temp_before = await pool.fetchrow(temp_sql)
            barrier = asyncio.Barrier(parallel) if together is not None else None
            phases: list[tuple[int, dict[str, float]]] = []
            on_phase: PhaseHook | None = None
            if together is not None:
                with contextlib.suppress(Exception):  # where it is not installed, not measured
                    await pool.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            last = await work_counters(pool) if together is not None else None
            if last is not None:

                async def on_phase(size: int) -> None:
                    nonlocal last
                    now = await work_counters(pool)
                    assert now is not None and last is not None
                    phases.append((size, {k: now[k] - last[k] for k in now}))
                    last = now

            results = await asyncio.gather(
                *(
                    run_partition(url, compiled, cleanup_id, p, sizes, together, barrier, on_phase)
                    for p in range(parallel)
                )
            )
            seconds = time.perf_counter() - t
            await asyncio.sleep(1.5)  # the partitions' backends have closed; their statistics flushed
            temp_after = await pool.fetchrow(temp_sql)
            cleaned = await pool.fetchval("SELECT count(*) FROM accounts WHERE status = 'cleaned'")
        finally:
            await pool.close()
    statements = [s for part, _ in results for s in part]
    if statements_file is not None:
        t0 = min(s.started for s in statements)
        lines = [json.dumps({**asdict(s), "started": s.started - t0, "ended": s.ended - t0}) for s in statements]
        await asyncio.to_thread(Path(statements_file).write_text, "\n".join(lines) + "\n")
    summary = summarize(statements, [end for _, end in results], sizes, parallel, together)
    speed = [s["speed_ratio"] for s in summary["steps"]]
    return {
        "scenario": "batch_sizes",
        "accounts": accounts,
        "partitions_at_once": parallel,
        "mode": "interleaved" if together is None else f"together, {together} accounts per partition per phase",
        "cycle": cycle_of(sizes) if together is None else None,
        "seed_seconds": round(seed_seconds, 1),
        "seconds": round(seconds, 3),
        "cleaned": cleaned,
        # Temporary files the batches wrote (a CTE over work_mem spills): none expected.
        "temp_files": temp_after["temp_files"] - temp_before["temp_files"],
        "temp_mib": round((temp_after["temp_bytes"] - temp_before["temp_bytes"]) / 2**20, 1),
        # `together` with pg_stat_statements preloaded: each size's work per account, summed over
        # the phases every partition finished (None: not measured).
        "work_per_account": work_per_account(phases, sizes, parallel * together) if phases and together else None,
        **summary,
        # For run_all's summary: the worst step's speed ratio.
        "ratio": min(speed),
        "target": ">= 1.0",
        "statements_median_wall_ms": {
            str(size): round(statistics.median(s.wall_ns / 1e6 for s in statements if s.size == size), 2)
            for size in sizes
        },
        "load_average_1m_before_start_after": [load_before, load_at_start, round(os.getloadavg()[0], 2)],
        "machine": machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accounts", type=int, default=200_000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 1000, 5000])
    parser.add_argument("--parallel", type=int, default=DEFAULT_PARALLEL, help="partitions (and backends) at once")
    parser.add_argument("--statements", metavar="FILE", help="write every statement measured here (JSON lines)")
    parser.add_argument(
        "--together",
        type=int,
        metavar="N",
        help="all partitions on one size at once, N accounts each per phase, then the next size together",
    )
    args = parser.parse_args()
    result = run_benchmark(run(args.accounts, tuple(args.sizes), args.parallel, args.statements, args.together))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
