"""docs/targets.md's walk-through, run as it is written: the game schema (```sql) and the targets file
(```toml) are taken from the page, a cohort is registered by the game in mixed-case UUID spellings and
cleaned by a real worker (real Postgres, real Temporal). After it no personal column of a cleaned
player keeps its value, every counter is right, the ledger is in its archive, and every other
player is untouched: the page cannot rot."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio
from temporalio.client import Client
from temporalio.worker import Worker

from cleanup.operations import check_targets
from cleanup.targets import load_targets
from core.config import PROJECT_ROOT, CleanupSettings, Settings
from tests.helpers import deadline_in
from tests.test_game_schema_contract import run_cohort
from worker import build_activities, build_worker

PAGE = PROJECT_ROOT / "docs" / "targets.md"
SECTION = "## Walk-through"


def walkthrough_block(language: str) -> str:
    """The first fenced block of `language` in the page's walk-through section."""
    section = PAGE.read_text().split(SECTION, 1)[1]
    found = re.search(rf"^```{language}\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert found, f"docs/targets.md's walk-through has no ```{language} block"
    return found.group(1)


@pytest.fixture
def targets_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "targets.toml"
    path.write_text(walkthrough_block("toml"))
    monkeypatch.setenv("CLEANUP_TARGETS_FILE", str(path))
    monkeypatch.setenv("CLEANUP_ACCOUNT_KEY_TYPE", "uuid")
    return path


@pytest_asyncio.fixture
async def arcade(pool: asyncpg.Pool, targets_file: Path) -> asyncpg.Pool:
    await pool.execute("UPDATE account_key_type SET key_type = 'uuid'")  # as `migrate` records it
    await pool.execute(walkthrough_block("sql"))
    return pool


@pytest_asyncio.fixture
async def arcade_worker(
    client: Client, arcade: asyncpg.Pool, task_queue: str, targets_file: Path
) -> AsyncIterator[Worker]:
    settings = Settings(cleanup=CleanupSettings(targets_file=targets_file))  # the worker's, read once
    async with build_worker(client, task_queue, await build_activities(arcade, settings=settings)) as w:
        yield w


async def seed(pool: asyncpg.Pool, players: int, groups: int) -> list[str]:
    """Players with a real name and birthday in their profile; each a friend (both directions) of
    the next two of the ring and a member of two groups; a notification to each from the next player
    and one from the game; three ledger entries each; every counter right."""
    ids = sorted(str(uuid.uuid4()) for _ in range(players))
    group_ids = [str(uuid.uuid4()) for _ in range(groups)]
    friends = [(ids[i], ids[(i + k) % players]) for i in range(players) for k in (1, 2)]
    members = [(group_ids[(i + k) % groups], ids[i]) for i in range(players) for k in (0, 1)]
    await pool.execute(
        """
        INSERT INTO arcade.users (id, username, email, metadata)
        SELECT u, 'player_' || left(u::text, 8), 'p_' || u || '@example.com',
               jsonb_build_object('name', 'Real Name ' || left(u::text, 8), 'birthday', '1990-04-01')
        FROM unnest($1::uuid[]) u;
        """,
        ids,
    )
    await pool.execute(
        "INSERT INTO arcade.user_edges (source_id, destination_id)"
        " SELECT a, b FROM unnest($1::uuid[], $2::uuid[]) p (a, b)"
        " UNION SELECT b, a FROM unnest($1::uuid[], $2::uuid[]) p (a, b)",
        [a for a, _ in friends],
        [b for _, b in friends],
    )
    await pool.execute("INSERT INTO arcade.groups (id, name) SELECT g, 'guild' FROM unnest($1::uuid[]) g", group_ids)
    await pool.execute(
        "INSERT INTO arcade.group_edges SELECT * FROM unnest($1::uuid[], $2::uuid[])",
        [g for g, _ in members],
        [u for _, u in members],
    )
    await pool.execute(
        """
        INSERT INTO arcade.notifications (user_id, sender_id, content)
        SELECT u, lead(u, 1, $1[1]) OVER (ORDER BY u), '{"text": "gift"}'::jsonb FROM unnest($1::uuid[]) u
        UNION ALL SELECT u, NULL, '{"text": "welcome"}'::jsonb FROM unnest($1::uuid[]) u
        """,
        ids,
    )
    await pool.execute(
        "INSERT INTO arcade.wallet_ledger (id, user_id, changeset) SELECT gen_random_uuid(), u,"
        " jsonb_build_object('coins', n) FROM unnest($1::uuid[]) u, generate_series(1, 3) n",
        ids,
    )
    await pool.execute(
        """
        UPDATE arcade.users u SET edge_count = (SELECT count(*) FROM arcade.user_edges e WHERE e.source_id = u.id);
        UPDATE arcade.groups g SET edge_count = (SELECT count(*) FROM arcade.group_edges m WHERE m.group_id = g.id);
        """
    )
    return ids


async def wrong_counters(pool: asyncpg.Pool) -> tuple[int, int]:
    row = await pool.fetchrow(
        "SELECT (SELECT count(*) FROM arcade.users u"
        "        WHERE edge_count <> (SELECT count(*) FROM arcade.user_edges e WHERE e.source_id = u.id)),"
        "       (SELECT count(*) FROM arcade.groups g"
        "        WHERE edge_count <> (SELECT count(*) FROM arcade.group_edges m WHERE m.group_id = g.id))"
    )
    assert row is not None
    return row[0], row[1]


async def personal_left(pool: asyncpg.Pool, players: list[str]) -> dict[str, int]:
    """What of these players is left in the live tables: rows, and users columns keeping a personal value."""
    row = await pool.fetchrow(
        """
        SELECT
          (SELECT count(*) FROM arcade.users WHERE id = ANY($1::uuid[])
             AND (email IS NOT NULL OR metadata <> '{}' OR username NOT LIKE 'anon-%')) AS personal_columns,
          (SELECT count(*) FROM arcade.notifications
             WHERE user_id = ANY($1::uuid[]) OR sender_id = ANY($1::uuid[])) AS notifications,
          (SELECT count(*) FROM arcade.user_edges
             WHERE source_id = ANY($1::uuid[]) OR destination_id = ANY($1::uuid[])) AS edges,
          (SELECT count(*) FROM arcade.group_edges WHERE user_id = ANY($1::uuid[])) AS memberships,
          (SELECT count(*) FROM arcade.wallet_ledger WHERE user_id = ANY($1::uuid[])) AS ledger
        """,
        players,
    )
    assert row is not None
    return dict(row)


async def test_targets_check_says_what_the_page_says(arcade, targets_file):
    report = await check_targets(arcade, str(targets_file))
    assert len(report.targets) == 7 and all(t.index for t in report.targets)  # every match column indexed
    [users] = [t for t in report.targets if t.action == "anonymize"]
    assert users.unchanged_columns == ["edge_count", "created_at"]
    assert [(f.name, f.phase) for f in report.follow_ups] == [
        ("friends_lose_an_edge", "before"),
        ("groups_lose_a_member", "before"),
        ("players_recounted", "after"),
    ]
    assert "ANY((($1::text[])::uuid[]))" in report.follow_ups[0].statement  # the recorded key type


async def test_the_walkthrough_cleans_a_cohort_as_the_page_says(
    client, arcade, task_queue, arcade_worker, targets_file
):
    ids = await seed(arcade, players=40, groups=6)
    cohort, others = ids[:25], ids[25:]
    ledger = await arcade.fetch(
        "SELECT id, user_id, changeset::text FROM arcade.wallet_ledger WHERE user_id = ANY($1::uuid[]) ORDER BY id",
        cohort,
    )
    others_before = await arcade.fetch("SELECT * FROM arcade.users WHERE id = ANY($1::uuid[]) ORDER BY id", others)
    deadline = deadline_in(-60)
    registered = await arcade.fetch(  # the game's spelling: upper case, as iOS gives it
        "SELECT deadline_cleanup.set_deadline(upper(u), $2) FROM unnest($1::text[]) u", cohort, deadline
    )
    assert len(registered) == len(cohort)
    await arcade.execute(
        "SELECT deadline_cleanup.set_deadline(u, $2) FROM unnest($1::uuid[]) u", others, deadline_in(3600)
    )
    assert await wrong_counters(arcade) == (0, 0)

    _, result = await run_cohort(client, arcade, task_queue, deadline, partitions=2, batch_size=8)

    assert result.settlement is not None and (result.settlement.cleaned, result.settlement.failed) == (25, 0)
    assert await personal_left(arcade, cohort) == {
        "personal_columns": 0,
        "notifications": 0,
        "edges": 0,
        "memberships": 0,
        "ledger": 0,
    }
    archived = await arcade.fetch("SELECT id, user_id, changeset::text FROM arcade.wallet_ledger_archive ORDER BY id")
    assert [tuple(r) for r in archived] == [tuple(r) for r in ledger]  # the archive is what was removed
    assert await wrong_counters(arcade) == (0, 0)
    cleaned_counts = await arcade.fetch("SELECT edge_count FROM arcade.users WHERE id = ANY($1::uuid[])", cohort)
    assert {r["edge_count"] for r in cleaned_counts} == {0}
    # The other players keep every column but their friend counter (which lost the cohort's edges).
    after = await arcade.fetch("SELECT * FROM arcade.users WHERE id = ANY($1::uuid[]) ORDER BY id", others)
    assert [{**r, "edge_count": 0} for r in map(dict, after)] == [
        {**r, "edge_count": 0} for r in map(dict, others_before)
    ]
    left = await personal_left(arcade, others)
    assert (left["ledger"], left["memberships"]) == (3 * len(others), 2 * len(others))
    receipt = json.loads(await arcade.fetchval("SELECT follow_ups::text FROM erasure_receipts LIMIT 1"))
    assert [f["name"] for f in receipt] == [f.name for f in load_targets(targets_file).follow_up]
