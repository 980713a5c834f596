"""What the relay's row writes cost Postgres, per 100,000 events:
`python -m bench.outbox_writes --events 100000 --claim 5000`.

No HTTP and no Temporal: the relay's two statements against the real schema (migrations applied),
each event claimed and then recorded delivered, in claims of `--claim` events, and beside them what
the same events cost written once at their outcome instead (decision record 0019):

- `claim_as_shipped`: `claim_batch` (outbox/queries.sql): row locks, then a HOT update per row (the
  lease columns, `attempts`).
- `record_as_shipped`: `record_outcomes`, every event delivered: a non-HOT update per row (`status`
  and `delivered_at` are indexed), so a new row version and an entry in each of the outbox's indexes
  that hold it (primary key, `event_key`, `source_id`, `delivered_at`).
- `claim_lock_only`: the same selection locked `FOR UPDATE SKIP LOCKED` and returned, no row
  updated: what a claim costs when the lease is one row per claim instead of columns of every event.
- `record_into_log`: the delivered events deleted from the outbox and inserted into a narrow log
  (event ID, time, HTTP status, owner, key, cleanup; a logged table with its primary key only).
- `record_into_indexed_log`: the same log with the indexes its readers need (key, cleanup, time).

Backend CPU seconds (the work Postgres did, far less sensitive to other load than wall-clock time)
and WAL bytes, per 100,000 events; `ratio` = shipped (claim + record) / written once (lock-only claim
+ log), all measured in this one run, each variant on a freshly seeded outbox.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

from activities.outbox import SQL, Outcome, record_arguments
from bench.common import cpu_seconds, load_average, machine, run_benchmark
from bench.outbox_delivery import SEED
from core import db
from core.config import Settings
from devstack import embedded

LOG = """
CREATE TABLE delivered_log (
    event_id bigint PRIMARY KEY, delivered_at timestamptz NOT NULL, http_status int, recorded_by text,
    event_key text, source_id text
)
"""
# What the readers of delivered events look them up by (history and `outbox show`: the key; the
# settlement's count and retention: the cleanup), as the outbox's own indexes do.
LOG_INDEXES = """
CREATE UNIQUE INDEX ON delivered_log (event_key);
CREATE INDEX ON delivered_log (source_id);
CREATE INDEX ON delivered_log (delivered_at)
"""
LOCK_ONLY = """
SELECT event_id, event_key, kind, account_id, source_id, payload, attempts, failures, failure_counts
FROM outbox
WHERE status = 'pending' AND next_attempt_at <= now() AND (leased_until IS NULL OR leased_until < now())
ORDER BY next_attempt_at, event_id
LIMIT $1
FOR UPDATE SKIP LOCKED
"""
INTO_LOG = """
WITH gone AS (
    DELETE FROM outbox o
    USING unnest($1::bigint[], $2::int[]) AS d(event_id, http_status)
    WHERE o.event_id = d.event_id AND o.status = 'pending'
    RETURNING o.event_id, d.http_status, o.event_key, o.source_id
)
INSERT INTO delivered_log SELECT event_id, now(), http_status, $3, event_key, source_id FROM gone
"""


async def variant(
    conn: Any, pid: int, events: int, claim: int, shipped: bool, indexed_log: bool = False
) -> dict[str, dict[str, float]]:
    """Claim and record `events` seeded events, by claims of `claim`; the claim's and the recording's
    backend CPU and WAL, each summed over the claims."""
    spent = {"claim": [0.0, 0.0], "record": [0.0, 0.0]}
    tag = uuid.uuid4().hex[:6]
    await conn.execute("TRUNCATE outbox")
    await conn.execute(SEED, events, tag)
    await conn.execute("VACUUM ANALYZE outbox")
    if not shipped:
        await conn.execute("DROP TABLE IF EXISTS delivered_log")
        await conn.execute(LOG)
        if indexed_log:
            await conn.execute(LOG_INDEXES)

    async def measured(what: str, statement: Any) -> Any:
        wal, cpu = await conn.fetchval("SELECT pg_current_wal_insert_lsn()"), cpu_seconds(pid) or 0.0
        async with conn.transaction():
            await conn.execute("SET LOCAL synchronous_commit = off")
            result = await statement
        spent[what][0] += (cpu_seconds(pid) or 0.0) - cpu
        spent[what][1] += float(await conn.fetchval("SELECT pg_current_wal_insert_lsn() - $1::pg_lsn", wal))
        return result

    for n in range(events // claim):
        owner = f"bench/{tag}/{n}"
        if shipped:
            bound = SQL.bind("claim_batch", lease_owner=owner, batch_size=claim, lease_seconds=120)
            rows = await measured("claim", conn.fetch(SQL.claim_batch, *bound))
            ids = [r["event_id"] for r in rows]
            args = record_arguments(owner, ids, {i: Outcome("delivered", 202) for i in ids})
            recorded = await measured("record", conn.fetchrow(SQL.record_outcomes, *args))
            assert recorded is not None and recorded["delivered"] == len(ids)
        else:
            rows = await measured("claim", conn.fetch(LOCK_ONLY, claim))
            ids = [r["event_id"] for r in rows]
            await measured("record", conn.execute(INTO_LOG, ids, [202] * len(ids), owner))
        assert len(ids) == claim
    per = 100_000 / events
    return {
        k: {"backend_cpu_s_per_100k": round(cpu * per, 3), "wal_mb_per_100k": round(wal * per / 1e6, 1)}
        for k, (cpu, wal) in spent.items()
    }


async def run(events: int = 100_000, claim: int = 5000) -> dict[str, Any]:
    base = Settings.from_env()
    admin_url = base.database_url or embedded.embedded_postgres_url(base.state_dir)
    database = f"bench_{uuid.uuid4().hex[:10]}"
    url = await db.create_database(admin_url, database, migrate=False)
    load_before = load_average()
    started = time.perf_counter()
    try:
        await db.migrate_url(url)
        pool = await db.create_pool(url, max_size=1)
        try:
            async with pool.acquire() as conn:
                pid = await conn.fetchval("SELECT pg_backend_pid()")
                shipped = await variant(conn, pid, events, claim, shipped=True)
                once = await variant(conn, pid, events, claim, shipped=False)
                indexed = await variant(conn, pid, events, claim, shipped=False, indexed_log=True)
        finally:
            await pool.close()
    finally:
        await db.drop_database(admin_url, database)
    shipped_cpu = sum(v["backend_cpu_s_per_100k"] for v in shipped.values())
    once_cpu = sum(v["backend_cpu_s_per_100k"] for v in once.values())
    return {
        "scenario": "outbox_writes",
        "machine": machine(),
        "events": events,
        "claim_batch_size": claim,
        "claim_as_shipped": shipped["claim"],
        "record_as_shipped": shipped["record"],
        "claim_lock_only": once["claim"],
        "record_into_log": once["record"],
        "record_into_indexed_log": indexed["record"],
        "shipped_backend_cpu_s_per_100k": round(shipped_cpu, 3),
        "written_once_backend_cpu_s_per_100k": round(once_cpu, 3),
        "ratio": round(shipped_cpu / once_cpu, 2) if once_cpu else None,
        "seconds": round(time.perf_counter() - started, 1),
        "load_average_1m_before_and_after": [load_before, load_average()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--claim", type=int, default=5000, help="events per claim (the relay's batch_size)")
    args = parser.parse_args()
    print(json.dumps(run_benchmark(run(args.events, args.claim)), indent=2))


if __name__ == "__main__":
    main()
