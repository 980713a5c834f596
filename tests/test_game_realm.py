"""The game realm (tests/game_realm/: a game server's own schema of 14 tables, its targets file and its
seed) cleaned as a game would run it: the game registers its players through the typed contract
functions and in the spellings its clients send (upper case, as iOS gives a UUID, and mixed case);
a renewal by the canonical spelling protects the player; a cohort is cleaned through real Temporal
and real Postgres. After the deadline no personal column of a cleaned player keeps its value, every
counter is right, the ledger is in its archive; and the sender column without an index is reported
before the first deadline, by the worker's start-up check and by `targets check`, with the
statement that fixes it."""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio
from pydantic import SecretStr
from temporalio.client import Client
from temporalio.worker import Worker

from cleanup.operations import check_targets
from cleanup.targets import ANONYMIZE_KEY_ENV, load_targets
from core.config import CleanupSettings, Settings
from core.queries import load
from tests.helpers import deadline_in
from tests.test_game_schema_contract import run_cohort
from worker import build_activities, build_worker

REALM_DIR = Path(__file__).resolve().parent / "game_realm"
REALM_TARGETS_FILE = REALM_DIR / "targets.toml"
SEED = load(str(REALM_DIR / "schema.sql"), "seed.sql")
KEY = "test-anonymize-key-of-the-game-realm"
REALM = Settings(cleanup=CleanupSettings(targets_file=REALM_TARGETS_FILE, anonymize_key=SecretStr(KEY)))
SENDER_FIX = "CREATE INDEX CONCURRENTLY IF NOT EXISTS notifications_sender_id_idx ON realm.notifications (sender_id)"
OTHERS, GROUPS, BROADCAST = 30, 4, 12_000  # the broadcast makes notifications a table that is not tiny


def ids(cohort: str, n: int) -> list[str]:
    """The canonical spelling of the players seed.sql gives cohort `cohort` (md5 of 'cohort:n')."""
    return [str(uuid.UUID(hashlib.md5(f"{cohort}:{i}".encode()).hexdigest())) for i in range(1, n + 1)]


@pytest.fixture(autouse=True)
def realm_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLEANUP_TARGETS_FILE", str(REALM_TARGETS_FILE))
    monkeypatch.setenv("CLEANUP_ACCOUNT_KEY_TYPE", "uuid")
    monkeypatch.setenv(ANONYMIZE_KEY_ENV, KEY)


@pytest_asyncio.fixture
async def realm(pool: asyncpg.Pool) -> asyncpg.Pool:
    """The realm with its other players, a cohort of 20 players ('c') and 5 later ones ('later'),
    every counter right, analyzed as a live database is."""
    await pool.execute("UPDATE account_key_type SET key_type = 'uuid'")  # as `migrate` records it
    await pool.execute((REALM_DIR / "schema.sql").read_text())
    await pool.fetchrow(SEED.seed_others, OTHERS, "o", GROUPS, BROADCAST)
    for cohort, n in (("c", 20), ("later", 5)):
        await pool.fetchrow(SEED.seed_players, cohort, n, "o", OTHERS, GROUPS)
    await pool.execute(SEED.recount)
    await pool.execute("ANALYZE")
    return pool


@pytest_asyncio.fixture
async def realm_worker(client: Client, realm: asyncpg.Pool, task_queue: str) -> AsyncIterator[Worker]:
    async with build_worker(client, task_queue, await build_activities(realm, settings=REALM)) as w:
        yield w


async def test_the_missing_sender_index_is_reported_before_the_first_deadline_with_its_fix(realm, caplog):
    with caplog.at_level(logging.WARNING, logger="cleanup"):
        await build_activities(realm, settings=REALM)  # the worker's start-up check
    [warning] = [r.getMessage() for r in caplog.records if "no index" in r.getMessage()]
    assert warning.startswith("target realm.notifications (sender_id)") and SENDER_FIX in warning
    report = await check_targets(realm, str(REALM_TARGETS_FILE), REALM.cleanup)  # `targets check`
    assert [(m.table, m.match_column, m.fix) for m in report.missing_indexes] == [
        ("realm.notifications", "sender_id", SENDER_FIX)
    ]
    by = {(t.table, t.match_column): t for t in report.targets}
    assert all(t.index for k, t in by.items() if k != ("realm.notifications", "sender_id"))
    assert by[("realm.users", "id")].unchanged_columns == ["friend_count", "created_at"]
    assert by[("realm.purchases", "user_id")].changed_columns["buyer_ref"].startswith("keyed hash")
    await realm.execute(SENDER_FIX)
    assert not (await check_targets(realm, str(REALM_TARGETS_FILE), REALM.cleanup)).missing_indexes


async def register(realm: asyncpg.Pool, players: list[str], deadline: object) -> list[str]:
    """The game's registrations: the typed uuid function for the even players, the text function
    with the spelling a client sent (upper case, or mixed) for the odd ones."""
    typed, spelled = players[::2], players[1::2]
    spellings = [p.upper() if i % 2 else p[:18].upper() + p[18:] for i, p in enumerate(spelled)]
    outcomes = await realm.fetch(
        "SELECT deadline_cleanup.set_deadline(u, $2) AS o FROM unnest($1::uuid[]) u", typed, deadline
    )
    outcomes += await realm.fetch(
        "SELECT deadline_cleanup.set_deadline(u, $2) AS o FROM unnest($1::text[]) u", spellings, deadline
    )
    return [r["o"] for r in outcomes]


async def test_a_cohort_is_cleaned_through_temporal_leaving_nothing_personal_and_counters_right(
    client, realm, task_queue, realm_worker
):
    cohort, later = ids("c", 20), ids("later", 5)
    renewer, cleaned = cohort[7], [p for p in cohort if p != cohort[7]]
    before_others = await realm.fetch("SELECT * FROM realm.users WHERE handle LIKE 'o\\_%' ORDER BY id")
    registered_at = deadline_in(3600)
    assert set(await register(realm, cohort, registered_at)) == {"registered"}
    assert set(await register(realm, later, deadline_in(7200))) == {"registered"}
    assert await realm.fetchval("SELECT count(*) FROM accounts") == 25
    # The game renews by its own column (the canonical spelling) what an iOS client registered.
    assert await realm.fetchval("SELECT deadline_cleanup.renew($1::uuid, $2)", renewer, deadline_in(7200)) == (
        "in_time"
    )
    # The cohort's deadline brought forward in the other spelling: the same accounts, never new ones.
    deadline = deadline_in(2)
    moved = await realm.fetch(
        "SELECT deadline_cleanup.set_deadline(upper(u), $2, allow_earlier => true) AS o FROM unnest($1::text[]) u",
        cleaned,
        deadline,
    )
    assert {r["o"] for r in moved} == {"moved"}
    assert await realm.fetchval("SELECT count(*) FROM accounts") == 25

    _, result = await run_cohort(client, realm, task_queue, deadline, partitions=2, batch_size=5)

    assert result.settlement is not None and (result.settlement.cleaned, result.settlement.failed) == (19, 0)
    left = dict(await realm.fetchrow(SEED.personal_left, cleaned))
    assert left == dict.fromkeys(left, 0) | {"archived": 2 * 19}
    kept = dict(await realm.fetchrow(SEED.personal_left, [renewer, *later]))
    assert kept["users_personal"] == kept["purchases_personal"] == 6 and kept["devices"] == 6
    assert (kept["ledger"], kept["archived"], kept["memberships"]) == (12, 0, 6)
    assert tuple(await realm.fetchrow(SEED.wrong_counters)) == (0, 0)
    counts = await realm.fetch("SELECT friend_count FROM realm.users WHERE id = ANY($1::uuid[])", cleaned)
    assert {r["friend_count"] for r in counts} == {0}
    # The other players keep every column but their friend counter (they lost the cohort's edges).
    after_others = await realm.fetch("SELECT * FROM realm.users WHERE handle LIKE 'o\\_%' ORDER BY id")
    assert [{**r, "friend_count": 0} for r in map(dict, after_others)] == [
        {**r, "friend_count": 0} for r in map(dict, before_others)
    ]
    receipt = json.loads(await realm.fetchval("SELECT follow_ups::text FROM erasure_receipts LIMIT 1"))
    assert [f["name"] for f in receipt] == [f.name for f in load_targets(REALM_TARGETS_FILE).follow_up]
