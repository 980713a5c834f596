"""The demo game: its own tables in schema `demo_game` and its seed, apart from the service.

The service's migrations create nothing of a game's; the demo, the tests, the harness and the
benchmarks create this fixture in each database they make (`create_game_schema`, whose DDL sits
beside the built-in cleanup/targets.toml that declares its tables as targets).
"""

from __future__ import annotations

from datetime import datetime

import asyncpg

from cleanup.grants import create_demo_game
from core.queries import load

GAME_SCHEMA = "demo_game"
GAME_TABLES = ("cloud_saves", "inventory_items", "match_history", "match_history_archive")
SEED = load(__file__, "seed.sql")
# The tables beside the built-in targets file that declares them: `migrate --demo-game` creates them too.
create_game_schema = create_demo_game


async def seed_accounts(
    pool: asyncpg.Pool,
    *,
    prefix: str,
    deadline: datetime,
    count: int,
    game: str = "arena",
    saves: int = 2,
    items: int = 5,
    matches: int = 5,
) -> dict[str, int]:
    """`count` accounts at `deadline` with their game data; IDs `acct_{prefix}_{0000001..}`."""
    row = await pool.fetchrow(SEED.seed_accounts, prefix, game, deadline, count, saves, items, matches)
    assert row is not None
    return dict(row)
