"""One account, one key: the spellings a client sends of a UUID are one account, a renewal by any
spelling protects the player, and registrations made before the key type was recorded are
canonicalized without erasing anyone (docs/security.md, CLEANUP_ACCOUNT_KEY_TYPE)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
import pytest_asyncio

from cleanup.batches import CompiledCleanup, run_keyset_batch
from cleanup.targets import ANONYMIZE_KEY_ENV
from core import db
from core.config import Settings
from tests.game_schema import ANONYMIZE_KEY, create_game_schema, game_rows, game_targets, seed_game_users
from tests.helpers import claim_one_partition


@pytest_asyncio.fixture
async def uuid_pool(admin_db_url: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[asyncpg.Pool]:
    """A database migrated with CLEANUP_ACCOUNT_KEY_TYPE=uuid, with the test game server's schema."""
    name = f"keys_{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv(ANONYMIZE_KEY_ENV, ANONYMIZE_KEY)
    url = await db.create_database(admin_db_url, name, settings=Settings(database_account_key_type="uuid"))
    pool = await db.create_pool(url)
    try:
        await create_game_schema(pool)
        yield pool
    finally:
        await pool.close()
        await db.drop_database(admin_db_url, name)


async def test_every_spelling_of_a_uuid_is_one_account_and_a_renewal_by_any_protects_it(uuid_pool):
    pool = uuid_pool
    users = await seed_game_users(pool, 20)
    deadline = (await pool.fetchval("SELECT now()")) + timedelta(seconds=2)
    # The game registers by its uuid column (typed overload) and by an iOS-style upper-case string.
    first = await pool.fetch("SELECT set_deadline(u, $2) AS r FROM unnest($1::uuid[]) u", users, deadline)
    again = await pool.fetch("SELECT set_deadline(upper(u), $2) AS r FROM unnest($1::text[]) u", users, deadline)
    assert {r["r"] for r in first} == {"registered"} and {r["r"] for r in again} == {"moved"}
    assert await pool.fetchval("SELECT count(*) FROM accounts") == 20
    renewed = users[::2]
    next_year = datetime.now(UTC) + timedelta(days=365)
    for i, user in enumerate(renewed):  # canonical, upper-case, braces, no hyphens
        spelling = [user, user.upper(), "{" + user + "}", user.replace("-", "")][i % 4]
        assert await pool.fetchval("SELECT renew($1, $2)", spelling, next_year) == "in_time"
    invalid = await refused(pool, "SELECT set_deadline('not-a-uuid', now() + interval '1 day')")
    assert invalid.sqlstate == "DC004" and "not an account key of type uuid" in str(invalid)

    await asyncio.sleep(max(0.0, (deadline - datetime.now(UTC)).total_seconds()) + 0.5)
    await claim_one_partition(pool, "spellings", deadline)
    compiled = await CompiledCleanup.compile(pool, game_targets(), Settings.from_env().cleanup)
    result = await run_keyset_batch(pool, compiled, "spellings", 0, "", 100)
    assert result.counts.cleaned == 10
    expired = sorted(set(users) - set(renewed))
    assert (await game_rows(pool, renewed))["users"] == 10
    assert (await game_rows(pool, renewed))["anonymized"] == 0, "no renewed player was touched"
    assert (await game_rows(pool, expired))["anonymized"] == 10


async def test_registrations_from_before_the_key_type_are_canonicalized_without_erasing_anyone(admin_db_url):
    name = f"keys_{uuid.uuid4().hex[:10]}"
    url = await db.create_database(admin_db_url, name)  # key type text: spellings are separate accounts
    try:
        conn = await asyncpg.connect(url, server_settings=db.service_settings())
        try:
            player, lone = str(uuid.uuid4()), str(uuid.uuid4())
            later = datetime.now(UTC) + timedelta(days=30)
            for key in (player, player.upper(), lone.upper(), "guest-17"):
                assert await conn.fetchval("SELECT set_deadline($1, $2)", key, later) == "registered"
            await db.migrate(conn, Settings(database_account_key_type="uuid"))
            rows = {
                r["account_id"]: r["hold_reason"]
                for r in await conn.fetch("SELECT account_id, hold_reason FROM accounts ORDER BY 1")
            }
            assert rows == {
                player: None,
                player.upper(): f"another spelling of account {player}",  # held: never cleaned
                lone: None,  # renamed: its canonical spelling was not registered
                "guest-17": "not a key of type uuid",
            }
            assert await conn.fetchval("SELECT renew($1, $2)", lone.upper(), later + timedelta(days=1)) == "in_time"
            with pytest.raises(Exception, match="a key type changes only from text"):
                await db.migrate(conn, Settings(database_account_key_type="bigint"))
        finally:
            await conn.close()
    finally:
        await db.drop_database(admin_db_url, name)


async def refused(pool: asyncpg.Pool, sql: str) -> asyncpg.PostgresError:
    with pytest.raises(asyncpg.PostgresError) as caught:
        await pool.execute(sql)
    return caught.value
