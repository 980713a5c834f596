"""The demo game: its own tables in schema `demo_game` and its seed, apart from the service.

The service's migrations create nothing of a game's; the demo, the tests, the harness and the
benchmarks create this fixture in each database they make (`create_game_schema`), and the default
cleanup/targets.toml declares its tables as targets.
"""

from __future__ import annotations

from datetime import datetime

import asyncpg

from core.db import service_settings
from core.queries import load

GAME_SCHEMA = "demo_game"
GAME_TABLES = ("cloud_saves", "inventory_items", "match_history", "match_history_archive")
SQL = load(__file__, "game_schema.sql")
SEED = load(__file__, "seed.sql")


async def create_game_schema(url: str) -> None:
    """Create the demo game's schema and tables in the database at `url` (idempotent), and let the
    worker role reach them table by table, as a game's administrator does for its declared targets."""
    conn = await asyncpg.connect(url, server_settings=service_settings())
    try:
        await conn.execute(SQL.create_game_schema)
    finally:
        await conn.close()


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
