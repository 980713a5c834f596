"""The chunked claim at scale: `python -m bench.claim_chunks --accounts 1000000 [--chunk 10000]`.

Seeds one cohort (accounts only, no game data) in a fresh database on $DATABASE_URL's server,
claims it with the same function the `claim_cleanup_in_chunks` activity runs, and prints the
duration of every chunk's transaction: the longest is what bounds the claim, whatever the cohort.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta

from activities.cleanup import claim_in_chunks
from cleanup.models import ClaimChunkedInput
from core import db


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--accounts", type=int, default=1_000_000)
    parser.add_argument("--chunk", type=int, default=10_000)
    args = parser.parse_args()
    admin_url = os.environ["DATABASE_URL"]
    name = f"bench_claim_{uuid.uuid4().hex[:8]}"
    url = await db.create_database(admin_url, name)
    try:
        pool = await db.create_pool(url, max_size=2)
        deadline = datetime.now(UTC).replace(microsecond=123456) - timedelta(seconds=1)
        t0 = time.monotonic()
        for start in range(0, args.accounts, 100_000):
            n = min(100_000, args.accounts - start)
            await pool.execute(
                "INSERT INTO accounts (account_id, renewal_deadline)"
                " SELECT 'acct_b' || lpad(g::text, 9, '0'), $1 FROM generate_series($2::int, $3::int) g",
                deadline,
                start + 1,
                start + n,
            )
        await pool.execute("ANALYZE accounts")
        print(f"seeded {args.accounts:,} accounts in {time.monotonic() - t0:.1f}s")
        times: list[float] = []
        last = time.monotonic()

        def tick(_: int) -> None:
            nonlocal last
            now = time.monotonic()
            times.append(now - last)
            last = now

        t0 = time.monotonic()
        result = await claim_in_chunks(
            pool,
            ClaimChunkedInput(
                cleanup_id="bench",
                deadline_from=deadline,
                deadline_until=deadline + timedelta(microseconds=1),
                partitions=16,
                chunk_size=args.chunk,
            ),
            tick,
        )
        total = time.monotonic() - t0
        print(
            f"claimed {result.claimed:,} in {len(times)} chunks of <= {args.chunk:,} in {total:.1f}s; "
            f"chunk transaction p50 {statistics.median(times):.3f}s, max {max(times):.3f}s"
        )
        await pool.close()
    finally:
        await db.drop_database(admin_url, name)


if __name__ == "__main__":
    asyncio.run(main())
