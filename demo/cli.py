"""The demo game's command of starter.py: `seed` (demo accounts with their game data).

The game's own data and accounts come from the game; this command makes the demo's, in the demo
game's schema (created if missing).
"""

from __future__ import annotations

import argparse
import re

from core import embedded
from core.cli import Commands, Progress, database_pool, emit, key_values
from core.config import Settings
from core.errors import InputError, parse_instant
from demo.fixture import create_game_schema, seed_accounts


async def cmd_seed(args: argparse.Namespace, settings: Settings) -> None:
    deadline = parse_instant(args.deadline)
    if not 1 <= args.accounts <= 10_000_000:
        raise InputError(f"--accounts must be between 1 and 10,000,000, got {args.accounts}")
    prefix = args.prefix or f"s{deadline:%m%d%H%M%S}"
    if not re.fullmatch(r"[A-Za-z0-9]{1,20}", prefix):
        raise InputError(f"--prefix must be 1-20 letters or digits, got {prefix!r}")
    settings = embedded.resolve(settings)
    assert settings.database_url is not None
    async with database_pool(settings, migrate=True, max_size=2) as pool:
        await create_game_schema(settings.database_url)
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


def register(commands: Commands) -> None:
    p = commands.add("seed", cmd_seed, "seed demo accounts (with cloud saves, inventory, match history) at a deadline")
    p.add_argument("--accounts", type=int, required=True, help="how many (1 to 10,000,000)")
    p.add_argument("--deadline", required=True, help="their renewal deadline, e.g. 2026-11-01T09:00:00Z")
    p.add_argument("--prefix", help="account ID prefix (letters/digits); default from the deadline")
