"""Record ledger-reconciliation histories for the replay tests.

`python -m tests.record_ledger_histories [--prefix v1] [--recheck]` (with DATABASE_URL pointing at
a Postgres server; a private Temporal dev server and a scratch database are started and removed):
a night of a small ledger day (`ledger_night.json`) and, with `--recheck`, a re-check after late
data (`ledger_recheck.json`). `v1_ledger_night.json` was recorded by the code before settlement revisions (run
from a checkout of it with `--prefix v1`) and stays, so test_replay.py proves that runs started
before the change still replay.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import uuid
from datetime import date
from pathlib import Path

from core import db, embedded
from core.config import Settings
from core.temporal import connect
from tests.ledger_helpers import reconcile, seed_day
from worker import build_activities, build_worker

HISTORIES = Path(__file__).resolve().parent / "histories"
D = date(2026, 10, 25)


async def main(prefix: str, recheck: bool) -> None:
    admin_url = os.environ["DATABASE_URL"]
    name = f"record_ledger_{uuid.uuid4().hex[:8]}"
    server = embedded.DevServer(Path(tempfile.mkdtemp()), port=None)
    await asyncio.to_thread(server.start)
    url = await db.create_database(admin_url, name)
    try:
        pool = await db.create_pool(url, max_size=4)
        client = await connect(Settings(temporal_address=server.address))
        task_queue = f"record-{uuid.uuid4().hex[:8]}"
        async with build_worker(client, task_queue, await build_activities(pool)):
            await seed_day(pool, D, payments=200, shards=2)
            night = await reconcile(client, pool, task_queue, D, batch_size=50)
            runs = [("ledger_night", night.workflow_id)]
            if recheck:
                await pool.execute(
                    "INSERT INTO ledger_report_rows (business_date, shard, game, payment_id, amount_cents, currency,"
                    " status) VALUES ($1, ledger_shard_of('game-1', 'pay-late', 2), 'game-1', 'pay-late', 100, 'EUR',"
                    " 'settled')",
                    D,
                )
                again = await reconcile(client, pool, task_queue, D, batch_size=50, recheck=True)
                runs.append(("ledger_recheck", again.workflow_id))
            for label, workflow_id in runs:
                history = await client.get_workflow_handle(workflow_id).fetch_history()
                (HISTORIES / f"{prefix}{label}.json").write_text(history.to_json())
                print(f"recorded {prefix}{label}: {len(history.events)} events")
        await pool.close()
    finally:
        await db.drop_database(admin_url, name)
        await asyncio.to_thread(server.stop)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefix", default="", help="file name prefix, e.g. v1 for an older checkout")
    parser.add_argument("--recheck", action="store_true")
    args = parser.parse_args()
    asyncio.run(main(f"{args.prefix}_" if args.prefix else "", args.recheck))
