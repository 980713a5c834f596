"""The demo's commands of `python -m devstack` (and `./dev`): `seed` (demo accounts with their game
data) and `demo` (the end-to-end demonstration with its own workers, which starts the embedded
stack for an address that is unset, as `./dev up` does).

The game's own data and accounts come from the game; `seed` makes the demo's, in the demo
game's schema (created if missing).
"""

from __future__ import annotations

import argparse
import re
import uuid

from core import addresses, db
from core.cli import Commands, Progress, bounded_int, database_pool, emit, finite_float, key_values
from core.config import Settings
from core.errors import InputError, parse_instant
from core.temporal import connect
from demo.fixture import create_game_schema, seed_accounts
from devstack import embedded


async def cmd_seed(args: argparse.Namespace, settings: Settings) -> None:
    deadline = parse_instant(args.deadline)
    if not 1 <= args.accounts <= 10_000_000:
        raise InputError(f"--accounts must be between 1 and 10,000,000, got {args.accounts}")
    prefix = args.prefix or f"s{deadline:%m%d%H%M%S}"
    if not re.fullmatch(r"[A-Za-z0-9]{1,20}", prefix):
        raise InputError(f"--prefix must be 1-20 letters or digits, got {prefix!r}")
    url = addresses.database_url(settings)  # the database only, as `./dev up` recorded it: nothing is started
    async with database_pool(settings, migrate=True, max_size=2) as pool:
        await create_game_schema(url, settings)
        bar = Progress("seeding accounts", args.accounts)
        totals: dict[str, int] = {}
        chunk = 10_000
        for start in range(0, args.accounts, chunk):
            n = min(chunk, args.accounts - start)
            part = await seed_accounts(pool, prefix=f"{prefix}{start // chunk:03d}", deadline=deadline, count=n)
            totals = {k: totals.get(k, 0) + v for k, v in part.items()}
            bar.update(start + n)
        bar.finish()
    emit(args, totals | {"deadline": deadline}, key_values)


async def cmd_demo(args: argparse.Namespace, settings: Settings) -> None:
    """Runs in a database and on a task queue of its own, so it never mixes with real work."""
    from demo.run import run_demo  # lazy: keeps `python -m devstack --help` fast to start

    resolved = embedded.resolve(settings)
    assert resolved.database_url is not None
    demo_url = await db.create_database(resolved.database_url, "deadline_cleanup_demo", replace=True, settings=resolved)
    await create_game_schema(demo_url, resolved)
    # Its own task queue, hence its own planner (`deadline-planner-demo-...`) and bucket cleanups.
    demo = resolved.model_copy(update={"database_url": demo_url, "task_queue": f"demo-{uuid.uuid4().hex[:8]}"})
    pool = await db.create_pool(demo_url, max_size=4, settings=demo)
    try:
        client = await connect(demo)
        result = await run_demo(
            demo,
            pool,
            client,
            accounts=args.accounts,
            renew_share=args.renew_share,
            workers=args.workers,
            lead_seconds=args.lead_seconds,
            spread_seconds=args.spread_seconds,
        )
    finally:
        await pool.close()
    emit(args, result, lambda d: str(d.pop("report")))


def register(commands: Commands) -> None:
    """`seed` and `demo`."""
    p = commands.add("seed", cmd_seed, "seed demo accounts (with cloud saves, inventory, match history) at a deadline")
    p.add_argument("--accounts", type=int, required=True, help="how many (1 to 10,000,000)")
    p.add_argument("--deadline", required=True, help="their renewal deadline, e.g. 2026-11-01T09:00:00Z")
    p.add_argument("--prefix", help="account ID prefix (letters/digits); default from the deadline")
    p = commands.add("demo", cmd_demo, "seed accounts, renew some, let the workers' planner clean them, print results")
    p.add_argument("--accounts", type=bounded_int(1, 10_000_000), default=3000, help="accounts to seed (default 3000)")
    p.add_argument(
        "--renew-share",
        type=finite_float(0, 1),
        default=0.1,
        help="share of accounts renewed before the deadline (default 0.1)",
    )
    p.add_argument("--workers", type=bounded_int(1, 64), default=2, help="worker processes to run (default 2)")
    p.add_argument(
        "--lead-seconds",
        type=finite_float(0, 86_400),
        default=10.0,
        help="how far ahead the first deadline is (default 10)",
    )
    p.add_argument(
        "--spread-seconds",
        type=finite_float(0, 86_400),
        default=15.0,
        help="deadlines spread over this window (default 15)",
    )
