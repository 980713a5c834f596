"""The chunked claim at scale: `python -m bench.claim_chunks --accounts 10000000 [--chunk 10000] [--streams 2]`.

Seeds one cohort (accounts only, no game data, one deadline) in a fresh database on $DATABASE_URL's
server, claims it with the same function the `claim_cleanup_in_chunks` activity runs, in as many
claim streams at once as a cohort's cleanup uses (`DEFAULTS.claim_streams`), and prints one
JSON document: every statement's duration as the client saw it (the longest one is what bounds the
claim, whatever the cohort), every chunk's transaction, the total, the WAL the server wrote during
the claim (`pg_current_wal_lsn` before and after; server-wide, so another database's writes count
too: the WAL of an idle stretch of the same length before the claim is printed beside it) and the
dead tuples of the claim's tables afterwards (`pg_stat_user_tables`, read after the claim's
connections closed so their statistics are flushed).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import operator
import os
import resource
import statistics
import time
import uuid
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

import bench
import cleanup
from activities.cleanup import claim_in_chunks
from bench.common import machine, run_benchmark
from cleanup.models import CLAIM_RUN_ACCOUNTS, DEFAULTS, ClaimChunkedInput
from core import db
from core.queries import load

SQL = load(bench.__file__, "scale.sql")
CLAIM_SQL = load(cleanup.__file__)
CLAIM_TABLES = ["accounts", "cleanup_claims", "cleanup_claim_progress"]


def _statement_name(query: str) -> str:
    text = query.strip().rstrip(";")
    names: dict[str, str] = {body: name for name, body in dict.items(CLAIM_SQL)}
    if text in names:
        return names[text]
    return " ".join(text.split())[:60]


async def _wal(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval(SQL.wal_lsn))


async def chunk_wal_sample(url: str, deadline: datetime, chunk: int, partitions: int) -> dict[str, Any]:
    """One chunk of the claim (the first) under EXPLAIN (ANALYZE, WAL), rolled back: the WAL this
    statement itself writes, whatever else the server does meanwhile (commit record not included)."""
    conn = await asyncpg.connect(url, server_settings=db.service_settings())
    try:
        tr = conn.transaction()
        await tr.start()
        await conn.execute(CLAIM_SQL.claim_chunk_plan)
        plan = await conn.fetchval(
            "EXPLAIN (ANALYZE, WAL, FORMAT JSON) " + CLAIM_SQL.claim_chunk,
            *CLAIM_SQL.bind(
                "claim_chunk",
                cleanup_id="wal-sample",
                deadline_from=deadline,
                deadline_until=deadline + timedelta(microseconds=1),
                cursor_deadline=datetime(1, 1, 1, tzinfo=UTC),
                cursor_account="",
                chunk_size=chunk,
                stream_partitions=partitions,
                claimed_before=0,
                streams=1,  # one claim stream: the whole range
                stream=0,
                run_accounts=CLAIM_RUN_ACCOUNTS,
                namespace="bench",
            ),
        )
        await tr.rollback()
    finally:
        await conn.close()
    top = json.loads(plan)[0]
    node = top["Plan"]
    return {
        "accounts": chunk,
        "execution_ms": round(top["Execution Time"], 1),
        "wal_records": node.get("WAL Records"),
        "wal_fpi": node.get("WAL FPI"),
        "wal_bytes": node.get("WAL Bytes"),
    }


async def run(
    accounts: int,
    chunk: int = 10_000,
    streams: int = DEFAULTS.claim_streams,
    partitions: int = 16,
    idle_seconds: float = 10.0,
) -> dict[str, Any]:
    admin_url = os.environ["DATABASE_URL"]
    load_before = round(os.getloadavg()[0], 2)
    name = f"bench_claim_{uuid.uuid4().hex[:8]}"
    url = await db.create_database(admin_url, name)
    try:
        deadline = datetime.now(UTC).replace(microsecond=123456) - timedelta(seconds=1)
        t0 = time.monotonic()
        seed = await db.create_pool(url, max_size=1)
        for start in range(0, accounts, 100_000):
            end = start + min(100_000, accounts - start)
            await seed.execute(
                SQL.seed_bare_accounts, *SQL.bind("seed_bare_accounts", deadline=deadline, first=start + 1, last=end)
            )
        await seed.execute("VACUUM ANALYZE accounts")
        await seed.close()
        seed_seconds = time.monotonic() - t0

        # Every statement the claim sends, timed by the client (asyncpg's query logger).
        durations: dict[str, list[float]] = defaultdict(list)

        def logged(q: asyncpg.connection.LoggedQuery) -> None:
            durations[_statement_name(q.query)].append(q.elapsed)

        async def init(conn: asyncpg.Connection) -> None:
            conn.add_query_logger(logged)

        wal_sample = await chunk_wal_sample(url, deadline, chunk, partitions)
        probe = await asyncpg.connect(url, server_settings=db.service_settings())
        idle_from = await _wal(probe)
        await asyncio.sleep(idle_seconds)
        idle_wal = await _wal(probe) - idle_from
        pool = await asyncpg.create_pool(
            url,
            min_size=max(2, streams),
            max_size=max(2, streams),
            init=init,
            command_timeout=300,
            server_settings=db.service_settings(),
        )
        chunks: list[float] = []
        last: dict[int, float] = {}

        def tick(stream: int, _: int) -> None:
            now = time.monotonic()
            chunks.append(now - last[stream])
            last[stream] = now

        wal_from = await _wal(probe)
        t0 = time.monotonic()
        last.update({k: t0 for k in range(streams)})
        # The claim streams of one cohort run at once, as the cleanup's claim activities do.
        results = await asyncio.gather(
            *(
                claim_in_chunks(
                    pool,
                    ClaimChunkedInput(
                        cleanup_id="bench",
                        deadline_from=deadline,
                        deadline_until=deadline + timedelta(microseconds=1),
                        partitions=partitions,
                        chunk_size=chunk,
                        stream=k,
                        streams=streams,
                    ),
                    functools.partial(tick, k),
                )
                for k in range(streams)
            )
        )
        result = functools.reduce(operator.add, results)
        total = time.monotonic() - t0
        wal_bytes = await _wal(probe) - wal_from
        await pool.close()  # the backends flush their table statistics as they exit
        await asyncio.sleep(1.0)
        stats = [dict(r) for r in await probe.fetch(SQL.table_stats, CLAIM_TABLES)]
        await probe.close()
    finally:
        await db.drop_database(admin_url, name)
    longest = {k: round(max(v), 3) for k, v in durations.items()}
    slowest = max(longest, key=lambda k: longest[k])
    return {
        "scenario": "claim_chunks",
        "accounts": accounts,
        "chunk_size": chunk,
        "claim_streams": streams,
        "partitions": partitions,
        "database": "the $DATABASE_URL server, a fresh database",
        "seed_seconds": round(seed_seconds, 1),
        "claimed": result.claimed,
        "chunks": len(chunks),
        "claim_seconds": round(total, 1),
        "accounts_per_s": round(result.claimed / total, 1),
        "chunk_transaction_seconds": {
            "p50": round(statistics.median(chunks), 3),
            "p99": round(statistics.quantiles(chunks, n=100, method="inclusive")[98], 3)
            if len(chunks) > 1
            else round(chunks[0], 3),
            "max": round(max(chunks), 3),
        },
        # Does a chunk grow as the cursor advances? The median chunk of each tenth of the claim.
        "chunk_transaction_p50_by_tenth": [
            round(statistics.median(chunks[i * len(chunks) // 10 : (i + 1) * len(chunks) // 10] or [0.0]), 3)
            for i in range(10)
        ],
        "longest_statement": {"name": slowest, "seconds": longest[slowest]},
        "statements": {
            k: {"count": len(v), "p50": round(statistics.median(v), 4), "max": round(max(v), 3)}
            for k, v in sorted(durations.items())
        },
        "goal": "no statement over about 5 s",
        "wal_bytes_during_claim": wal_bytes,
        "wal_bytes_per_account": round(wal_bytes / max(1, result.claimed), 1),
        f"wal_bytes_idle_{idle_seconds:g}s_before_claim": idle_wal,
        "wal_bytes_during_claim_note": "server-wide: includes every other database's WAL meanwhile",
        "one_chunk_under_explain_wal_rolled_back": wal_sample,
        "wal_bytes_estimate_from_one_chunk": round(wal_sample["wal_bytes"] * result.claimed / chunk)
        if wal_sample["wal_bytes"] is not None
        else None,
        "tables_after_claim": stats,
        "bench_process_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "load_average_1m_before_and_after": [load_before, round(os.getloadavg()[0], 2)],
        "machine": machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--accounts", type=int, default=1_000_000)
    parser.add_argument("--chunk", type=int, default=10_000)
    parser.add_argument("--streams", type=int, default=DEFAULTS.claim_streams, help="claim streams at once")
    args = parser.parse_args()
    print(json.dumps(run_benchmark(run(args.accounts, args.chunk, args.streams)), indent=2, default=str))


if __name__ == "__main__":
    main()
