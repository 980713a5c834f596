"""The Postgres floor on as many backends as there are cores (the statements: bench/floor.sql).

The floor is the least work that has the same effects with the same guarantees, as set-based
statements on as many backends as there are cores, with no orchestration. Each benchmark cuts its
work into `FLOOR_BACKENDS` disjoint slices with one untimed query, then `run_slices` runs one
statement per slice (the ledger: `run_slice_sequences`, one statement per shard of the slice, in
turn), each in its own transaction, each slice on its own connection, all at once, and times them
together: from the start of the first to the end of the last.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from bench.common import cpu_used, database_cpu_seconds, load_average

# One slice, one statement, one backend per core.
FLOOR_BACKENDS = os.cpu_count() or 2
# The benchmarks' pool: 8 connections as ever, more where the floor's backends and the connection
# that reads their CPU need more (a floor run holds one connection per slice, plus that one).
STACK_POOL_SIZE = max(8, FLOOR_BACKENDS + 1)


@dataclass(frozen=True)
class SlicedRun:
    rows: list[asyncpg.Record]
    seconds: float
    backend_cpu_s: float | None
    load: list[float]

    def total(self, column: str) -> int:
        """A count summed over the slices' result rows."""
        return sum(int(r[column]) for r in self.rows)


async def run_slices(
    pool: asyncpg.Pool, sql: str, slices: Sequence[Sequence[Any]], statement_limit_s: float
) -> SlicedRun:
    """`sql` once per slice (the slice is its arguments), each in its own transaction on its own
    connection of `pool`, all at once (`asyncio.gather`); timed from the start of the first to the
    end of the last. `statement_limit_s`: the client-side timeout of each statement."""
    return await run_slice_sequences(pool, sql, [[args] for args in slices], statement_limit_s)


async def run_slice_sequences(
    pool: asyncpg.Pool, sql: str, slices: Sequence[Sequence[Sequence[Any]]], statement_limit_s: float
) -> SlicedRun:
    """Each slice a sequence of statements (`sql` with each arguments in turn, one transaction each)
    on its own connection of `pool`, the slices all at once; timed from the start of the first to
    the end of the last. For work whose set-based statement is cheapest over a part of a slice (a
    ledger shard: read in the order of its index, no sort).

    The connections are taken from the pool before the clock starts, and the Postgres CPU is read
    (`database_cpu_seconds`: every backend of the database, summed) while they are still held, so
    every slice's backend is counted in `backend_cpu_s`.
    """
    if len(slices) >= pool.get_max_size():
        raise ValueError(
            f"{len(slices)} floor slices need {len(slices) + 1} connections; the pool has {pool.get_max_size()}"
        )

    async def one(conn: asyncpg.Connection, statements: Sequence[Sequence[Any]]) -> list[asyncpg.Record]:
        rows = []
        for args in statements:
            async with conn.transaction():
                row = await conn.fetchrow(sql, *args, timeout=statement_limit_s)
            assert row is not None
            rows.append(row)
        return rows

    async with contextlib.AsyncExitStack() as held:
        conns = [await held.enter_async_context(pool.acquire()) for _ in slices]
        load_before, cpu_before = load_average(), await database_cpu_seconds(pool)
        t0 = time.perf_counter()
        per_slice = await asyncio.gather(*(one(c, s) for c, s in zip(conns, slices, strict=True)))
        seconds = time.perf_counter() - t0
        cpu_after = await database_cpu_seconds(pool)
    return SlicedRun(
        rows=[row for rows in per_slice for row in rows],
        seconds=seconds,
        backend_cpu_s=cpu_used(cpu_before, cpu_after),
        load=[load_before, load_average()],
    )
