"""A game server's own schema for the tests (tests/game_server/): creating it, seeding its users,
a worker role of its own, and counting what cleanup did to it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import asyncpg

from cleanup.targets import CleanupTargets, load_targets
from core import db

GAME_DIR = Path(__file__).resolve().parent / "game_server"
GAME_TARGETS_FILE = GAME_DIR / "targets.toml"
ANONYMIZE_KEY = "test-anonymize-key-of-the-game-server"
# Rows per seeded user (tests/game_server/seed.sql).
PER_USER = {"characters": 2, "inventory": 4, "matches": 3}


PROFILES_TARGETS_FILE = GAME_DIR / "profiles_targets.toml"


def game_targets() -> CleanupTargets:
    return load_targets(GAME_TARGETS_FILE)


async def add_profiles(pool: asyncpg.Pool, users: list[str], notifications: int) -> None:
    """The JSON profiles (NOT NULL) of the seeded users and `notifications` rows: two per seeded
    user (one received, one sent), the rest between strangers; analyzed, as a live table is."""
    await pool.execute((GAME_DIR / "profiles.sql").read_text())
    await pool.execute(
        """
        INSERT INTO game_server.notifications (recipient_id, sender_id, body)
        SELECT u, NULL, 'welcome' FROM unnest($1::uuid[]) u
        UNION ALL SELECT gen_random_uuid(), u, 'gift' FROM unnest($1::uuid[]) u
        UNION ALL SELECT gen_random_uuid(), gen_random_uuid(), 'news' FROM generate_series(1, $2) g;
        """,
        users,
        max(notifications - 2 * len(users), 0),
    )
    await pool.execute("ANALYZE game_server.notifications")


async def create_game_schema(pool: asyncpg.Pool) -> None:
    await pool.execute((GAME_DIR / "schema.sql").read_text())


async def seed_game_users(pool: asyncpg.Pool, count: int) -> list[str]:
    """`count` users with their game data; their IDs (UUIDs, as text), sorted."""
    ids = sorted(uuid.uuid4() for _ in range(count))
    await pool.fetchrow((GAME_DIR / "seed.sql").read_text(), ids)
    return [str(i) for i in ids]


async def game_rows(pool: asyncpg.Pool, users: list[str]) -> dict[str, int]:
    """The game rows of these users, per table (a friendship counts if either side is one of them)."""
    row = await pool.fetchrow(
        """
        SELECT
          (SELECT count(*) FROM game_server.characters WHERE user_id = ANY($1::uuid[])) AS characters,
          (SELECT count(*) FROM game_server.inventory WHERE user_id = ANY($1::uuid[])) AS inventory,
          (SELECT count(*) FROM game_server.friends
            WHERE user_a = ANY($1::uuid[]) OR user_b = ANY($1::uuid[])) AS friends,
          (SELECT count(*) FROM game_server.matches WHERE user_id = ANY($1::uuid[])) AS matches,
          (SELECT count(*) FROM game_server.matches_archive WHERE user_id = ANY($1::uuid[])) AS archived,
          (SELECT count(*) - count(DISTINCT id) FROM game_server.matches_archive) AS duplicate_archives,
          (SELECT count(*) FROM game_server.users WHERE id = ANY($1::uuid[])) AS users,
          (SELECT count(*) FROM game_server.users WHERE id = ANY($1::uuid[])
             AND email IS NULL AND profile IS NULL AND username !~ '^player_') AS anonymized
        """,
        users,
    )
    assert row is not None
    return dict(row)


@asynccontextmanager
async def worker_role_pool(db_url: str, *, without: tuple[str, str] | None = None) -> AsyncIterator[asyncpg.Pool]:
    """A pool logged in as a worker role of its own (a member of cleanup_worker, with DML on the game
    tables), minus one privilege (`without` = (privilege, table)) when asked."""
    role = f"game_worker_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(db_url)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN IN ROLE cleanup_worker")
        await admin.execute(
            f"GRANT USAGE ON SCHEMA game_server TO {role};"
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA game_server TO {role}"
        )
        if without is not None:
            await admin.execute(f"REVOKE {without[0]} ON game_server.{without[1]} FROM {role}")
        pool = await asyncpg.create_pool(
            db_url, user=role, min_size=1, max_size=4, server_settings=db.service_settings()
        )
        assert pool is not None
        try:
            yield pool
        finally:
            await pool.close()
    finally:
        await admin.execute(f"DROP OWNED BY {role}; DROP ROLE {role}")
        await admin.close()
