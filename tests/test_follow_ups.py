"""Declared follow-up statements (cleanup.follow_ups) on a game server whose friendships are stored
in both directions with a per-user edge_count and whose groups keep a per-group edge_count
(tests/game_server/edges.sql): run in each batch's transaction, the counters of the remaining users
and groups are right after a cleanup, against real Postgres and real Temporal; their row counts are
in the receipt; a follow-up that fails for some accounts is isolated to them like a failing target;
a broken one is refused at start-up naming its file and line."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio
from pydantic import SecretStr
from temporalio.client import Client
from temporalio.worker import Worker

import cleanup
from cleanup.batches import CompiledCleanup, run_keyset_batch, run_subset
from cleanup.grants import grant_targets
from cleanup.history import account_history
from cleanup.review import list_failed, preview_cleanup, retry_failed
from cleanup.target_check import TargetsRefused
from cleanup.targets import ANONYMIZE_KEY_ENV, CleanupTargets, load_targets
from cleanup.targets_file import TargetsFileError
from core.config import CleanupSettings, Settings
from core.queries import load
from tests.game_schema import (
    ANONYMIZE_KEY,
    GAME_DIR,
    PER_USER,
    create_game_schema,
    seed_game_users,
    worker_role_pool,
)
from tests.helpers import claim_one_partition, deadline_in, wait_until
from tests.test_game_schema_contract import register, run_cohort
from tests.test_game_targets import run
from worker import build_activities, build_worker

CLEANUP_SQL = load(cleanup.__file__)

EDGES_TARGETS_FILE = GAME_DIR / "edges_targets.toml"
FOLLOW_UPS = ["friends_lose_their_edges", "groups_lose_their_members", "players_recounted"]
# What the game's workers run with: their settings, read once at start.
EDGES = Settings(cleanup=CleanupSettings(targets_file=EDGES_TARGETS_FILE, anonymize_key=SecretStr(ANONYMIZE_KEY)))


@pytest.fixture(autouse=True)
def edges_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLEANUP_TARGETS_FILE", str(EDGES_TARGETS_FILE))
    monkeypatch.setenv(ANONYMIZE_KEY_ENV, ANONYMIZE_KEY)


async def edged_game(pool: asyncpg.Pool, users: int, groups: int) -> list[str]:
    """`users` players, each a friend (both directions) of the next two of the ring, each a member of
    two of `groups` groups; every counter right."""
    if not await pool.fetchval("SELECT to_regclass('game_server.groups') IS NOT NULL"):
        await create_game_schema(pool)
        await pool.execute((GAME_DIR / "edges.sql").read_text())
    ids = await seed_game_users(pool, users)
    pairs = [(ids[i], ids[(i + k) % users]) for i in range(users) for k in (1, 2) if (i + k) % users != i]
    await pool.execute(
        "INSERT INTO game_server.friends (user_a, user_b)"
        " SELECT a, b FROM unnest($1::uuid[], $2::uuid[]) p (a, b)"
        " UNION SELECT b, a FROM unnest($1::uuid[], $2::uuid[]) p (a, b) ON CONFLICT DO NOTHING",
        [a for a, _ in pairs],
        [b for _, b in pairs],
    )
    made = await pool.fetch(
        "INSERT INTO game_server.groups (name) SELECT 'guild ' || g FROM generate_series(1, $1) g RETURNING id::text",
        groups,
    )
    group_ids = [r["id"] for r in made]
    members = [(group_ids[(i + k) % groups], ids[i]) for i in range(users) for k in (0, 1)]
    await pool.execute(
        "INSERT INTO game_server.group_members SELECT * FROM unnest($1::uuid[], $2::uuid[])",
        [g for g, _ in members],
        [u for _, u in members],
    )
    await pool.execute(
        "UPDATE game_server.users u"
        " SET edge_count = (SELECT count(*) FROM game_server.friends f WHERE f.user_a = u.id);"
        "UPDATE game_server.groups g"
        " SET edge_count = (SELECT count(*) FROM game_server.group_members m WHERE m.group_id = g.id)"
    )
    return ids


async def wrong_counters(pool: asyncpg.Pool) -> dict[str, int]:
    """Users and groups whose counter is not the count of their edges (0 and 0: all right)."""
    row = await pool.fetchrow(
        "SELECT (SELECT count(*) FROM game_server.users u"
        "        WHERE edge_count <> (SELECT count(*) FROM game_server.friends f WHERE f.user_a = u.id)) AS users,"
        "       (SELECT count(*) FROM game_server.groups g"
        "        WHERE edge_count <> (SELECT count(*) FROM game_server.group_members m WHERE m.group_id = g.id))"
        "        AS groups"
    )
    assert row is not None
    return dict(row)


def follow_up_totals(receipts: list[asyncpg.Record]) -> dict[str, float]:
    """Per follow-up, the rows its statements changed over every batch: each receipt holds its batch's
    count and size, so rows / batch_accounts summed over the accounts is the sum over the batches."""
    totals: dict[str, float] = {}
    for r in receipts:
        for f in json.loads(r["follow_ups"]):
            totals[f["name"]] = totals.get(f["name"], 0) + f["rows"] / f["batch_accounts"]
    return {k: round(v, 6) for k, v in totals.items()}


@pytest_asyncio.fixture
async def edges_worker(client: Client, pool: asyncpg.Pool, task_queue: str) -> AsyncIterator[Worker]:
    await create_game_schema(pool)  # the worker's start-up check needs the game's tables
    await pool.execute((GAME_DIR / "edges.sql").read_text())
    async with build_worker(client, task_queue, await build_activities(pool, settings=EDGES)) as w:
        yield w


async def test_counters_of_the_remaining_users_and_groups_are_right_after_a_cohort(
    client, pool, task_queue, edges_worker
):
    """45 of 60 players cleaned by 4 partitions in batches of 5, friends of each other across
    batches that run at once: every counter right, no player failed, the receipts holding each
    follow-up's rows."""
    ids = await edged_game(pool, users=60, groups=6)
    cohort, others = ids[:45], ids[45:]
    deadline = deadline_in(-60)
    await register(pool, cohort, deadline)
    await register(pool, others, deadline_in(3600))
    assert await wrong_counters(pool) == {"users": 0, "groups": 0}

    _, result = await run_cohort(client, pool, task_queue, deadline, partitions=4, batch_size=5)

    assert result.settlement is not None and (result.settlement.cleaned, result.settlement.failed) == (45, 0)
    assert await wrong_counters(pool) == {"users": 0, "groups": 0}
    counters = await pool.fetch("SELECT edge_count FROM game_server.users WHERE id = ANY($1::uuid[])", cohort)
    assert [r["edge_count"] for r in counters] == [0] * 45
    receipts = await pool.fetch("SELECT follow_ups::text, target_set FROM erasure_receipts")
    assert len(receipts) == 45
    assert {r["target_set"] for r in receipts} == {load_targets(EDGES_TARGETS_FILE).fingerprint}
    assert [f["name"] for f in json.loads(receipts[0]["follow_ups"])] == FOLLOW_UPS
    assert follow_up_totals(receipts)["players_recounted"] == 45  # each player's row once


async def test_one_batch_counts_each_follow_up_rows(pool):
    """One batch of 8 of 12 players: the before follow-ups change each remaining friend and each
    group once, the after one each player; counted in every receipt of the batch."""
    ids = await edged_game(pool, users=12, groups=5)
    cohort = ids[:8]
    friends_left = await pool.fetchval(
        "SELECT count(DISTINCT user_b) FROM game_server.friends"
        " WHERE user_a = ANY($1::uuid[]) AND NOT user_b = ANY($1::uuid[])",
        cohort,
    )
    groups_touched = await pool.fetchval(
        "SELECT count(DISTINCT group_id) FROM game_server.group_members WHERE user_id = ANY($1::uuid[])", cohort
    )
    deadline = deadline_in(-60)
    await register(pool, cohort, deadline)
    await claim_one_partition(pool, "edges", deadline)
    compiled = await CompiledCleanup.compile(pool, load_targets(EDGES_TARGETS_FILE))
    counts, failures = await run_subset(pool, compiled, "edges", 0, cohort)
    assert (counts.cleaned, failures) == (8, [])
    assert await wrong_counters(pool) == {"users": 0, "groups": 0}
    receipt = json.loads(
        await pool.fetchval("SELECT follow_ups::text FROM erasure_receipts WHERE account_id = $1", cohort[3])
    )
    assert receipt == [
        {"name": "friends_lose_their_edges", "phase": "before", "rows": friends_left, "batch_accounts": 8},
        {"name": "groups_lose_their_members", "phase": "before", "rows": groups_touched, "batch_accounts": 8},
        {"name": "players_recounted", "phase": "after", "rows": 8, "batch_accounts": 8},
    ]
    history = await account_history(pool, cohort[3])
    [cleaned] = history.cleaned
    assert [(f.name, f.rows) for f in cleaned.follow_ups or []] == [(f["name"], f["rows"]) for f in receipt]


async def test_a_failing_follow_up_is_isolated_to_its_accounts_and_retried_once_fixed(pool):
    """A remaining player whose counter is already wrong (0 with 4 friends): decrementing it breaks
    its CHECK for exactly the cohort's players who are its friends. They are isolated (bisected),
    recorded with a readable reason naming the follow-up, nothing of their cleanup applied; the
    others are cleaned. Once the counter is fixed, retry-failed cleans them."""
    ids = await edged_game(pool, users=16, groups=4)
    cohort, broken = ids[:10], ids[11]  # friends of ids[9], ids[10] (not cleaned), ids[12], ids[13]
    await pool.execute("UPDATE game_server.users SET edge_count = 0 WHERE id = $1", broken)
    deadline = deadline_in(-60)
    await register(pool, cohort, deadline)
    await claim_one_partition(pool, "edges", deadline)
    targets = load_targets(EDGES_TARGETS_FILE)
    compiled = await CompiledCleanup.compile(pool, targets)
    counts, failures = await run_subset(pool, compiled, "edges", 0, cohort)
    assert (counts.cleaned, counts.failed) == (9, 1)
    [failure] = failures
    assert failure.account_id == ids[9] and failure.sqlstate == "23514"
    assert failure.target == "follow_up friends_lose_their_edges"
    [recorded] = await list_failed(pool, "edges")
    assert recorded.message == "check violation" and recorded.detail is not None
    assert 'constraint "users_edge_count_not_negative"' in recorded.detail and ids[9] not in recorded.detail
    status = await pool.fetchval("SELECT status FROM accounts WHERE account_id = $1", ids[9])
    assert status == "cleanup_failed"
    kept = await pool.fetchval("SELECT count(*) FROM game_server.characters WHERE user_id = $1", ids[9])
    assert kept == PER_USER["characters"]  # nothing of its cleanup applied
    await pool.execute(
        "UPDATE game_server.users u SET edge_count = (SELECT count(*) FROM game_server.friends f WHERE f.user_a = u.id)"
        " WHERE id = $1",
        broken,
    )
    retried = await retry_failed(pool, targets, "edges")
    assert (retried.retried, retried.cleaned, retried.still_failed) == (1, 1, 0)
    assert await wrong_counters(pool) == {"users": 0, "groups": 0}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "targets.toml"
    path.write_text(text)
    return path


async def test_a_broken_follow_up_is_refused_at_start_up_naming_file_and_line(pool, db_url, tmp_path):
    await edged_game(pool, users=3, groups=2)
    base = EDGES_TARGETS_FILE.read_text().split("[[follow_up]]")[0]
    path = write(
        tmp_path,
        base + '[[follow_up]]\nname = "recount"\nphase = "after"\n'
        'statement = "UPDATE game_server.users SET edge_cnt = 0 WHERE id = ANY($1::uuid[])"\n',
    )
    line = len(base.splitlines()) + 4
    with pytest.raises(TargetsRefused) as err:
        await CompiledCleanup.compile(pool, load_targets(path))
    message = str(err.value)
    assert f"{path}:{line}: follow_up 'recount' (statement): [42703]" in message and "edge_cnt" in message
    env = os.environ | {"DATABASE_URL": db_url}
    cli = await asyncio.to_thread(run, [sys.executable, "starter.py", "targets", "check", "--file", str(path)], env)
    assert cli.returncode == 2 and f"{path}:{line}: follow_up 'recount' (statement): [42703]" in cli.stderr
    assert "Traceback" not in cli.stderr + cli.stdout
    path = write(
        tmp_path,
        base + '[[follow_up]]\nname = "own"\nphase = "after"\n'
        'statement = "DELETE FROM deadline_cleanup.outbox WHERE account_id = ANY($1)"\n',
    )
    with pytest.raises(TargetsRefused, match=r"touches the service's own tables \(deadline_cleanup.outbox\)"):
        await CompiledCleanup.compile(pool, load_targets(path))


def test_a_follow_up_file_mistake_names_the_line_and_the_fix(tmp_path):
    base = EDGES_TARGETS_FILE.read_text().split("[[follow_up]]")[0]
    line = len(base.splitlines()) + 3
    path = write(tmp_path, base + '[[follow_up]]\nname = "x"\nphase = "afterwards"\nstatment = "SELECT 1"\n')
    with pytest.raises(TargetsFileError) as err:
        load_targets(path)
    message = str(err.value)
    expected = "phase = 'afterwards' is not allowed (did you mean `after`?)"
    assert f"{path}:{line}: follow_up #1 (x): {expected}" in message
    assert f"{path}:{line + 1}: follow_up #1 (x): unknown key 'statment' (did you mean `statement`?)" in message
    path = write(tmp_path, base + '[[follow_up]]\nname = "x"\nphase = "after"\nstatement = "SELECT 1"\n')
    with pytest.raises(TargetsFileError, match=r"use \$1 \(their keys, an array\)"):
        load_targets(path)


def test_a_target_set_without_follow_ups_keeps_the_fingerprint_it_was_recorded_with():
    targets = load_targets(EDGES_TARGETS_FILE)
    without = CleanupTargets(target=targets.target)
    # As fingerprints were first recorded: keys added since appear only when used.
    recorded = {
        "target": [
            {k: v for k, v in t.model_dump(mode="json").items() if v or k not in ("set_columns", "random_columns")}
            for t in targets.target
        ]
    }
    canonical = json.dumps(recorded, sort_keys=True, separators=(",", ":"))
    assert without.fingerprint == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert targets.fingerprint != without.fingerprint  # the follow-ups are part of what a cleanup does


async def test_the_dry_run_lists_the_follow_ups(pool):
    ids = await edged_game(pool, users=3, groups=2)
    await register(pool, ids, deadline_in(3600))
    preview = await preview_cleanup(pool, load_targets(EDGES_TARGETS_FILE), account_id=ids[0])
    assert [(f.name, f.phase) for f in preview.follow_ups] == [
        ("friends_lose_their_edges", "before"),
        ("groups_lose_their_members", "before"),
        ("players_recounted", "after"),
    ]


async def test_a_retry_with_the_current_targets_shows_the_set_used_and_the_one_replaced(pool, db_url, tmp_path):
    """The operator fixes the failing follow-up (a counter never below 0) and retries with the file as
    it is now: the retried account's receipt, and its history, name the new set and the replaced one;
    the accounts cleaned before keep the set they were cleaned with."""
    ids = await edged_game(pool, users=16, groups=4)
    cohort, broken = ids[:10], ids[11]
    await pool.execute("UPDATE game_server.users SET edge_count = 0 WHERE id = $1", broken)
    deadline = deadline_in(-60)
    await register(pool, cohort, deadline)
    await claim_one_partition(pool, "adopt", deadline)
    targets = load_targets(EDGES_TARGETS_FILE)
    await pool.execute(  # as a worker does
        CLEANUP_SQL.record_cleanup_target_set,
        *CLEANUP_SQL.bind("record_cleanup_target_set", cleanup_id="adopt", fingerprint=targets.fingerprint),
    )
    counts, _ = await run_subset(pool, await CompiledCleanup.compile(pool, targets), "adopt", 0, cohort)
    assert (counts.cleaned, counts.failed) == (9, 1)

    text = EDGES_TARGETS_FILE.read_text()
    clamped = text.replace("edge_count = u.edge_count - f.n", "edge_count = greatest(u.edge_count - f.n, 0)")
    fixed = load_targets(write(tmp_path, clamped))
    assert fixed.fingerprint != targets.fingerprint
    assert (await retry_failed(pool, fixed, "adopt", adopt_targets=True)).cleaned == 1

    sets = await pool.fetch("SELECT account_id, target_set, replaced_target_sets FROM erasure_receipts")
    by = {r["account_id"]: (r["target_set"], r["replaced_target_sets"]) for r in sets}
    assert by.pop(ids[9]) == (fixed.fingerprint, [targets.fingerprint])
    assert set(by.values()) == {(targets.fingerprint, None)} and len(by) == 9
    [cleaned] = (await account_history(pool, ids[9])).cleaned
    assert (cleaned.target_set, cleaned.replaced_target_sets) == (fixed.fingerprint, [targets.fingerprint])
    [before] = (await account_history(pool, ids[0])).cleaned
    assert (before.target_set, before.replaced_target_sets) == (targets.fingerprint, [])
    env = os.environ | {"DATABASE_URL": db_url}
    shown = await asyncio.to_thread(run, [sys.executable, "starter.py", "account", "history", ids[9]], env)
    assert shown.returncode == 0, shown.stderr
    assert f"target set {fixed.fingerprint} (replacing {targets.fingerprint}" in shown.stdout
    assert "follow-up friends_lose_their_edges (before): 2 row(s) for its batch of 1" in shown.stdout  # 10, 11


async def test_targets_check_shows_each_follow_up_as_compiled_with_its_tables(pool, db_url):
    await edged_game(pool, users=3, groups=2)
    env = os.environ | {"DATABASE_URL": db_url, ANONYMIZE_KEY_ENV: ANONYMIZE_KEY}
    argv = [sys.executable, "starter.py", "targets", "check", "--file", str(EDGES_TARGETS_FILE)]
    done = await asyncio.to_thread(run, [*argv, "--json"], env)
    assert done.returncode == 0, done.stderr
    follow_ups = json.loads(done.stdout)["follow_ups"]
    assert [(f["name"], f["phase"]) for f in follow_ups] == [
        ("friends_lose_their_edges", "before"),
        ("groups_lose_their_members", "before"),
        ("players_recounted", "after"),
    ]
    assert follow_ups[1]["tables"] == ["game_server.groups", "game_server.group_members"]
    assert "ANY(($1::text[])::uuid[])" in follow_ups[0]["statement"]  # $1: the keys, a typed array
    human = await asyncio.to_thread(run, argv, env)
    assert human.returncode == 0, human.stderr
    assert "players_recounted (after the targets; tables game_server.users, game_server.friends)" in human.stdout


async def test_migrate_grants_the_worker_role_what_each_follow_up_plan_uses(pool):
    await edged_game(pool, users=3, groups=2)
    async with pool.acquire() as conn:
        granted = await grant_targets(conn, load_targets(EDGES_TARGETS_FILE))
    assert "UPDATE, SELECT on game_server.groups" in granted["granted"], granted  # a table no target names
    assert "SELECT, DELETE on game_server.group_members" in granted["granted"]
    assert "follow_ups_not_granted" not in granted
    await pool.execute("DROP TABLE game_server.groups CASCADE")
    async with pool.acquire() as conn:
        granted = await grant_targets(conn, load_targets(EDGES_TARGETS_FILE))
    [problem] = granted["follow_ups_not_granted"]
    assert "follow_up 'groups_lose_their_members' (statement): [42P01]" in problem


async def test_a_receipt_without_follow_ups_names_its_target_set_and_the_replaced_one(pool):
    """Targets without follow-ups write their receipts in the batch statement itself: the set used
    and, after `retry-failed --with-current-targets` replaced one, the replaced set too."""
    ids = await edged_game(pool, users=4, groups=2)
    targets = CleanupTargets(target=load_targets(EDGES_TARGETS_FILE).target)
    deadline = deadline_in(-60)
    await register(pool, ids[:2], deadline)
    await claim_one_partition(pool, "plain", deadline)
    earlier = load_targets(EDGES_TARGETS_FILE).fingerprint
    await pool.execute(
        CLEANUP_SQL.record_cleanup_target_set,
        *CLEANUP_SQL.bind("record_cleanup_target_set", cleanup_id="plain", fingerprint=earlier),
    )
    await pool.execute(
        CLEANUP_SQL.adopt_current_target_set,
        *CLEANUP_SQL.bind("adopt_current_target_set", cleanup_id="plain", fingerprint=targets.fingerprint),
    )
    counts, _ = await run_subset(pool, await CompiledCleanup.compile(pool, targets), "plain", 0, ids[:2])
    assert counts.cleaned == 2
    rows = await pool.fetch("SELECT target_set, replaced_target_sets, follow_ups FROM erasure_receipts")
    assert {(r["target_set"], tuple(r["replaced_target_sets"]), r["follow_ups"]) for r in rows} == {
        (targets.fingerprint, (earlier,), None)
    }


async def test_a_cohort_whose_follow_up_fails_for_some_players_settles_with_them_in_review(
    client, pool, task_queue, edges_worker
):
    """Through the workflow: the players whose follow-up breaks a CHECK are bisected out of their
    batches and recorded (never retried as the deterministic error they are), the others cleaned,
    every counter right once retry-failed cleans them after the fix."""
    ids = await edged_game(pool, users=30, groups=5)
    cohort, broken = ids[:20], ids[21]  # friends of ids[19] and ids[20] among the cohort: ids[19] only
    await pool.execute("UPDATE game_server.users SET edge_count = 0 WHERE id = $1", broken)
    deadline = deadline_in(-60)
    await register(pool, cohort, deadline)

    workflow_id, result = await run_cohort(client, pool, task_queue, deadline, partitions=2, batch_size=6)

    assert result.settlement is not None and (result.settlement.cleaned, result.settlement.failed) == (19, 1)
    [failed] = await list_failed(pool, workflow_id)
    assert (failed.account_id, failed.sqlstate, failed.attempts) == (ids[19], "23514", 1)
    assert (failed.target, failed.message) == ("follow_up friends_lose_their_edges", "check violation")
    receipts = await pool.fetch("SELECT follow_ups::text FROM erasure_receipts")
    assert len(receipts) == 19 and follow_up_totals(receipts)["players_recounted"] == 19
    await pool.execute(  # the fix: its real count
        "UPDATE game_server.users u SET edge_count = (SELECT count(*) FROM game_server.friends f WHERE f.user_a = u.id)"
        " WHERE id = $1",
        broken,
    )
    retried = await retry_failed(pool, load_targets(EDGES_TARGETS_FILE), workflow_id)
    assert (retried.cleaned, retried.still_failed) == (1, 0)
    assert await wrong_counters(pool) == {"users": 0, "groups": 0}


async def test_two_batches_of_friends_at_once_run_one_after_the_other(pool):
    """Two friends cleaned by two batches at once: the second waits for the first to commit, so its
    before follow-up no longer sees the friendship the first removed. (Both at once, the second's
    decrement of the first player's counter would land on the 0 the first's recount wrote: -1.)"""
    ids = await edged_game(pool, users=8, groups=2)
    deadline = deadline_in(-60)
    await register(pool, ids[:2], deadline)
    await claim_one_partition(pool, "pair", deadline)
    compiled = await CompiledCleanup.compile(pool, load_targets(EDGES_TARGETS_FILE))
    async with pool.acquire() as first:
        tx = first.transaction()
        await tx.start()
        await compiled.run(first, compiled.subset_sql, ("pair", 0, [ids[1]], 1))
        second = asyncio.create_task(run_subset(pool, compiled, "pair", 0, [ids[0]]))

        async def waiting() -> bool:
            return bool(
                await pool.fetchval(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE wait_event_type = 'Lock' AND datname = current_database()"
                )
            )

        await wait_until(waiting)
        assert not second.done()
        await tx.commit()
    counts, failures = await second
    assert (counts.cleaned, failures) == (1, [])
    assert await wrong_counters(pool) == {"users": 0, "groups": 0}


async def test_a_batch_reports_how_long_it_waited_for_another_batchs_follow_ups(pool):
    """The wait for the follow-ups' lock is the batch's own figure (the load budget leaves it out of
    the latency it reads as the database's stress): zero when no other batch holds it."""
    ids = await edged_game(pool, users=8, groups=2)
    deadline = deadline_in(-60)
    await register(pool, ids[:3], deadline)
    await claim_one_partition(pool, "waits", deadline)
    compiled = await CompiledCleanup.compile(pool, load_targets(EDGES_TARGETS_FILE))
    async with pool.acquire() as first:
        tx = first.transaction()
        await tx.start()
        await compiled.run(first, compiled.subset_sql, ("waits", 0, [ids[2]], 1))
        second = asyncio.create_task(run_keyset_batch(pool, compiled, "waits", 0, "", 1))

        async def waiting() -> bool:
            return bool(
                await pool.fetchval(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE wait_event_type = 'Lock' AND wait_event = 'advisory' AND datname = current_database()"
                )
            )

        await wait_until(waiting)
        blocked_from = time.perf_counter()
        await asyncio.sleep(0.2)
        blocked_for = time.perf_counter() - blocked_from  # the second waits at least this long
        await tx.commit()
    waited = await second
    assert waited.counts.cleaned == 1 and waited.follow_up_lock_seconds >= blocked_for


async def test_a_batch_with_follow_ups_runs_under_the_worker_role(pool, db_url):
    """The worker's own role: the advisory lock, the follow-ups on the game's tables, the receipts
    with their new columns (the audit table stays append-only for it)."""
    ids = await edged_game(pool, users=6, groups=2)
    deadline = deadline_in(-60)
    await register(pool, ids[:3], deadline)
    await claim_one_partition(pool, "role", deadline)
    async with worker_role_pool(db_url) as worker:
        compiled = await CompiledCleanup.compile(worker, load_targets(EDGES_TARGETS_FILE))
        counts, failures = await run_subset(worker, compiled, "role", 0, ids[:3])
    assert (counts.cleaned, failures) == (3, [])
    assert await wrong_counters(pool) == {"users": 0, "groups": 0}
    assert await pool.fetchval("SELECT count(*) FROM erasure_receipts WHERE follow_ups IS NOT NULL") == 3
