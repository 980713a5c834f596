"""The cleanup contract on a game server's own schema (tests/game_server), against real Temporal and
real Postgres: deadlines registered only through the SQL function the game calls, UUID keys, children
before parents, cascades counted, the friendship removed from either side, the users row kept but
anonymized; poison rows, the dry run, retry-failed with one target set, a worker killed after its
COMMIT while players renew, and a schema error that is surfaced instead of retried forever."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio
from pydantic import SecretStr
from temporalio.client import Client, WorkflowFailureError
from temporalio.worker import Worker

from activities.cleanup import CleanupActivities, cleanup_target_set
from cleanup.batches import CompiledCleanup
from cleanup.inputs import StartCleanup
from cleanup.models import CleanupResult
from cleanup.operations import start_cleanup
from cleanup.planner import planner_status
from cleanup.review import list_failed, preview_cleanup, retry_failed
from cleanup.targets import ANONYMIZE_KEY_ENV, CleanupTargets, hmac_hex
from core.config import CleanupSettings, Settings
from core.errors import InputError
from core.failpoints import ONCE_DIR_ENV
from tests.conftest import WorkerProcesses
from tests.game_schema import (
    ANONYMIZE_KEY,
    GAME_DIR,
    GAME_TARGETS_FILE,
    PER_USER,
    create_game_schema,
    game_rows,
    game_targets,
    seed_game_users,
    worker_role_pool,
)
from tests.helpers import claim_one_partition, deadline_in, wait_until
from tests.test_cleanup_input import run_cli
from worker import build_activities, build_worker
from workflows.renewal_cleanup import RenewalCleanupWorkflow

# What the game's workers run with: their settings, read once at start.
GAME = Settings(cleanup=CleanupSettings(targets_file=GAME_TARGETS_FILE, anonymize_key=SecretStr(ANONYMIZE_KEY)))


@pytest.fixture(autouse=True)
def game_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLEANUP_TARGETS_FILE", str(GAME_TARGETS_FILE))
    monkeypatch.setenv(ANONYMIZE_KEY_ENV, ANONYMIZE_KEY)


@pytest_asyncio.fixture
async def game_pool(pool: asyncpg.Pool) -> asyncpg.Pool:
    await create_game_schema(pool)
    return pool


@pytest_asyncio.fixture
async def game_worker(client: Client, game_pool: asyncpg.Pool, task_queue: str) -> AsyncIterator[Worker]:
    async with build_worker(client, task_queue, await build_activities(game_pool, settings=GAME)) as w:
        yield w


def run_cli_with(settings: object, targets_file: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI run by an operator whose CLEANUP_TARGETS_FILE is another file than the workers'."""
    previous = os.environ["CLEANUP_TARGETS_FILE"]
    os.environ["CLEANUP_TARGETS_FILE"] = targets_file
    try:
        return run_cli(settings, *args)
    finally:
        os.environ["CLEANUP_TARGETS_FILE"] = previous


async def register(pool: asyncpg.Pool, users: list[str], deadline: datetime) -> None:
    """What the game does in its own transaction: the service's SQL function, nothing else."""
    outcomes = await pool.fetch(
        "SELECT deadline_cleanup.set_deadline(u, $2) AS outcome FROM unnest($1::text[]) u", users, deadline
    )
    assert {r["outcome"] for r in outcomes} == {"registered"}


async def run_cohort(client: Client, pool: asyncpg.Pool, task_queue: str, deadline: datetime, **options: object):
    started = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline, **options))  # type: ignore[arg-type]
    handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
    return started.workflow_id, await handle.result()


def cleaned_rows(users: int) -> dict[str, int]:
    return {
        "characters": 0,
        "inventory": 0,
        "friends": 0,
        "matches": 0,
        "archived": users * PER_USER["matches"],
        "duplicate_archives": 0,
        "users": users,
        "anonymized": users,
    }


def untouched_rows(users: int, friends: int) -> dict[str, int]:
    return {
        "characters": users * PER_USER["characters"],
        "inventory": users * PER_USER["inventory"],
        "friends": friends,
        "matches": users * PER_USER["matches"],
        "archived": 0,
        "duplicate_archives": 0,
        "users": users,
        "anonymized": 0,
    }


async def test_a_game_cohort_is_cleaned_once_children_first_friends_either_side_users_anonymized(
    client, game_pool, task_queue, game_worker
):
    deadline = deadline_in(-60)
    users = await seed_game_users(game_pool, 40)
    others = await seed_game_users(game_pool, 5)  # another cohort, later: untouched
    await game_pool.execute(  # friendships across the cohorts, on either side
        "INSERT INTO game_server.friends (user_a, user_b) VALUES ($1, $2), ($3, $1)", others[0], users[0], users[1]
    )
    await register(game_pool, users, deadline)
    await register(game_pool, others, deadline_in(3600))

    _, result = await run_cohort(client, game_pool, task_queue, deadline, partitions=2, batch_size=7)

    assert result.outcome == "cleaned" and result.settlement is not None
    assert (result.settlement.cleaned, result.settlement.failed, result.settlement.reminders) == (40, 0, 40)
    assert await game_rows(game_pool, users) == cleaned_rows(40)
    assert await game_rows(game_pool, others) == untouched_rows(5, friends=5)  # their own ring only
    # The UNIQUE username is the keyed hash of what it was: unique, and no longer the player's name.
    username = await game_pool.fetchval("SELECT username FROM game_server.users WHERE id = $1", users[7])
    assert username == hmac_hex(ANONYMIZE_KEY, f"player_{users[7]}")
    # Each user's erasure receipt, written with its cleanup: rows per target, summed over the cohort.
    totals = await game_pool.fetch(
        "SELECT e.ordinality AS i, sum((e.value ->> 'rows')::int) AS n, count(DISTINCT r.account_id) AS users"
        " FROM erasure_receipts r, jsonb_array_elements(r.targets) WITH ORDINALITY e GROUP BY 1 ORDER BY 1"
    )
    assert [r["users"] for r in totals] == [40] * 6
    n = [r["n"] for r in totals]
    assert (n[0], n[1], n[2] + n[3], n[4], n[5]) == (160, 80, 42, 120, 40)  # the ring, and two across


async def test_rows_a_cascade_would_remove_are_counted_by_their_own_target(game_pool):
    """The batch statement's per-target counts: items (which the characters' ON DELETE CASCADE would
    remove) counted by their own target, declared first; each friendship once, on the side it met first."""
    deadline = deadline_in(-60)
    users = await seed_game_users(game_pool, 30)
    await register(game_pool, users, deadline)
    await claim_one_partition(game_pool, "cascade", deadline)
    compiled = await CompiledCleanup.compile(game_pool, game_targets(), GAME.cleanup)
    async with game_pool.acquire() as conn, conn.transaction():
        row = await conn.fetchrow(
            compiled.batch_sql,
            *compiled.batch_args(cleanup_id="cascade", partition_no=0, after_account_id="", batch_size=1000),
        )
    assert row is not None
    counts = [row[f"rows_t{i}"] for i in range(6)]
    assert counts == [30 * PER_USER["inventory"], 30 * PER_USER["characters"], 30, 0, 30 * PER_USER["matches"], 30]
    assert await game_rows(game_pool, users) == cleaned_rows(30)


async def poison(pool: asyncpg.Pool, held: list[str], bad_archive: str) -> None:
    """A trigger that refuses (P0001) to delete these users' items; a CHECK of the archive that one
    user's matches violate (23514)."""
    await pool.execute(
        """
        CREATE TABLE game_server.legal_holds (user_id uuid PRIMARY KEY);
        CREATE FUNCTION game_server.refuse_held_items() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF EXISTS (SELECT 1 FROM game_server.legal_holds WHERE user_id = OLD.user_id) THEN
                RAISE EXCEPTION 'items of % are under legal hold', OLD.user_id;
            END IF;
            RETURN OLD;
        END $$;
        CREATE TRIGGER refuse_held_items BEFORE DELETE ON game_server.inventory
            FOR EACH ROW EXECUTE FUNCTION game_server.refuse_held_items();
        ALTER TABLE game_server.matches_archive ADD CONSTRAINT archive_kills_sane CHECK (kills < 1000);
        """
    )
    await pool.execute("INSERT INTO game_server.legal_holds SELECT unnest($1::uuid[])", held)
    await pool.execute("UPDATE game_server.matches SET kills = 5000 WHERE user_id = $1", bad_archive)


async def test_poison_rows_are_isolated_and_retry_failed_cleans_them_once_with_the_same_targets(
    client, game_pool, task_queue, game_worker, settings, tmp_path
):
    deadline = deadline_in(-60)
    users = await seed_game_users(game_pool, 60)
    held, bad_archive = [users[3], users[41]], users[20]
    poisoned = sorted([*held, bad_archive])
    await poison(game_pool, held, bad_archive)
    await register(game_pool, users, deadline)

    workflow_id, result = await run_cohort(client, game_pool, task_queue, deadline, partitions=2, batch_size=16)

    assert result.settlement is not None and (result.settlement.cleaned, result.settlement.failed) == (57, 3)
    healthy = sorted(set(users) - set(poisoned))
    assert await game_rows(game_pool, healthy) == cleaned_rows(57) | {"friends": 0}
    left = await game_rows(game_pool, poisoned)
    assert (left["inventory"], left["matches"], left["anonymized"]) == (3 * PER_USER["inventory"], 9, 0)
    failed = {r.account_id: r for r in await list_failed(game_pool, workflow_id)}
    assert sorted(failed) == poisoned
    assert {failed[u].target for u in held} == {"game_server.inventory"}
    assert failed[bad_archive].sqlstate == "23514" and failed[bad_archive].target == "game_server.matches_archive"

    # Another target set than the cleanup ran with: refused, naming both fingerprints.
    smaller = CleanupTargets(target=game_targets().target[:-1])  # without the anonymization
    with pytest.raises(InputError) as refused:
        await retry_failed(game_pool, smaller, workflow_id, settings=GAME.cleanup)
    assert game_targets().fingerprint in str(refused.value) and smaller.fingerprint in str(refused.value)
    other_file = tmp_path / "targets.toml"
    other_file.write_text(GAME_TARGETS_FILE.read_text().rsplit("[[target]]", 1)[0])
    cli = run_cli_with(settings, str(other_file), "retry-failed", "--cleanup", workflow_id)
    assert cli.returncode == 2 and "target set mismatch" in cli.stderr, cli.stderr
    assert await game_rows(game_pool, poisoned) == left, "nothing changed by a refused retry"

    await game_pool.execute("DELETE FROM game_server.legal_holds")
    await game_pool.execute("ALTER TABLE game_server.matches_archive DROP CONSTRAINT archive_kills_sane")
    fixed = await retry_failed(game_pool, game_targets(), workflow_id, settings=GAME.cleanup)
    assert (fixed.retried, fixed.cleaned, fixed.still_failed) == (3, 3, 0)
    assert await game_rows(game_pool, users) == cleaned_rows(60)
    again = await retry_failed(game_pool, game_targets(), workflow_id, settings=GAME.cleanup)
    assert again.retried == 0 and await game_rows(game_pool, users) == cleaned_rows(60)


async def test_the_dry_run_matches_what_the_cleanup_then_does_and_refuses_another_target_set(
    client, game_pool, task_queue, game_worker, settings, tmp_path
):
    deadline = deadline_in(-60)
    users = await seed_game_users(game_pool, 25)
    others = await seed_game_users(game_pool, 4)
    await game_pool.execute("INSERT INTO game_server.friends (user_a, user_b) VALUES ($1, $2)", others[0], users[0])
    await register(game_pool, users, deadline)
    await register(game_pool, others, deadline_in(3600))

    preview = await preview_cleanup(game_pool, game_targets(), deadline=deadline)
    iso = deadline.isoformat().replace("+00:00", "Z")
    cli = run_cli(settings, "cleanup", "--deadline", iso, "--dry-run", "--json")
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["targets"] == preview.model_dump(mode="json")["targets"]
    other_file = tmp_path / "targets.toml"
    other_file.write_text(GAME_TARGETS_FILE.read_text().rsplit("[[target]]", 1)[0])
    refused = run_cli_with(settings, str(other_file), "cleanup", "--deadline", iso, "--dry-run")
    assert refused.returncode == 2 and game_targets().fingerprint in refused.stderr, refused.stderr

    before = await game_pool.fetchrow(
        "SELECT (SELECT count(*) FROM game_server.inventory) AS inventory,"
        " (SELECT count(*) FROM game_server.characters) AS characters,"
        " (SELECT count(*) FROM game_server.friends) AS friends,"
        " (SELECT count(*) FROM game_server.matches) AS matches"
    )
    _, result = await run_cohort(client, game_pool, task_queue, deadline, partitions=3)
    assert result.settlement is not None and result.settlement.cleaned == preview.accounts_in_scope == 25
    after = await game_pool.fetchrow(
        "SELECT (SELECT count(*) FROM game_server.inventory) AS inventory,"
        " (SELECT count(*) FROM game_server.characters) AS characters,"
        " (SELECT count(*) FROM game_server.friends) AS friends,"
        " (SELECT count(*) FROM game_server.matches) AS matches"
    )
    assert before is not None and after is not None
    rows = [t.rows for t in preview.targets]
    assert before["inventory"] - after["inventory"] == rows[0]
    assert before["characters"] - after["characters"] == rows[1]
    assert before["friends"] - after["friends"] == rows[2] + rows[3] == 26  # the ring, and one across
    assert before["matches"] - after["matches"] == rows[4]
    assert rows[5] == 25 and await game_rows(game_pool, users) == cleaned_rows(25)


async def test_a_privilege_lost_after_start_up_is_retried_a_few_times_then_surfaced(
    client, game_pool, db_url, task_queue
):
    """42501 at run time: never 'cleaning' forever. After the bounded attempts the accounts are
    recorded as failed with the error; the cleanup fails loudly naming it; `planner status` counts them."""
    deadline = deadline_in(-60)
    users = await seed_game_users(game_pool, 12)
    await register(game_pool, users, deadline)
    async with worker_role_pool(db_url) as role_pool:
        role = await role_pool.fetchval("SELECT current_user")
        async with build_worker(client, task_queue, await build_activities(role_pool, settings=GAME)):
            await game_pool.execute(f"REVOKE DELETE ON game_server.characters FROM {role}")
            with pytest.raises(WorkflowFailureError) as failed:  # bounded: never retried forever
                await asyncio.wait_for(
                    run_cohort(client, game_pool, task_queue, deadline, partitions=1, max_failed=0), 300
                )
    assert "12 account(s): [42501] insufficient privilege" in str(failed.value.cause)
    statuses = await game_pool.fetch("SELECT status, count(*) AS n FROM accounts GROUP BY status")
    assert {r["status"]: r["n"] for r in statuses} == {"cleanup_failed": 12}
    recorded = await list_failed(game_pool)
    assert {r.sqlstate for r in recorded} == {"42501"} and len(recorded) == 12
    status = await planner_status(client, game_pool, task_queue)
    assert (status.failed_pending_review, status.failed_by_schema_error) == (12, 12)
    assert await game_rows(game_pool, users) == untouched_rows(12, friends=12)


async def test_a_worker_killed_after_its_commit_while_players_renew_cleans_each_user_once(
    client, game_pool, task_queue, worker_processes: WorkerProcesses
):
    deadline = deadline_in(6)
    users = await seed_game_users(game_pool, 300)
    await register(game_pool, users, deadline)
    renewing = users[::10]
    first = worker_processes.start(
        CLEANUP_FAILPOINTS="cleanup_partition.after_commit=exit@2",
        CLEANUP_TARGETS_FILE=str(GAME_TARGETS_FILE),
        CLEANUP_ANONYMIZE_KEY=ANONYMIZE_KEY,
    )
    started = await start_cleanup(
        client,
        game_pool,
        task_queue,
        StartCleanup(
            deadline=deadline, partitions=2, batch_size=50, heartbeat_timeout_seconds=2, step_timeout_seconds=5
        ),
    )
    renewed = await game_pool.fetch(  # the game's renewals, in its own transactions, before the deadline
        "SELECT deadline_cleanup.renew(u) AS outcome FROM unnest($1::text[]) u", renewing
    )
    assert {r["outcome"] for r in renewed} == {"in_time"}

    async def exited() -> bool:
        return first.poll() is not None

    await wait_until(exited, within=120)
    assert first.returncode == 86, worker_processes.logs()
    worker_processes.start(CLEANUP_TARGETS_FILE=str(GAME_TARGETS_FILE), CLEANUP_ANONYMIZE_KEY=ANONYMIZE_KEY)
    handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
    result: CleanupResult = await handle.result()

    assert result.settlement is not None and result.settlement.cleaned == 270
    assert result.settlement.already_applied >= 1, "the killed attempt's batch was absorbed, not re-applied"
    cleaned = sorted(set(users) - set(renewing))
    rows = await game_rows(game_pool, cleaned)
    assert {k: rows[k] for k in ("characters", "inventory", "matches", "duplicate_archives")} == dict.fromkeys(
        ("characters", "inventory", "matches", "duplicate_archives"), 0
    )
    assert (rows["archived"], rows["anonymized"]) == (270 * PER_USER["matches"], 270)
    kept = await game_rows(game_pool, renewing)
    assert (kept["characters"], kept["inventory"], kept["matches"], kept["anonymized"]) == (
        30 * PER_USER["characters"],
        30 * PER_USER["inventory"],
        30 * PER_USER["matches"],
        0,
    )
    assert await game_pool.fetchval("SELECT count(*) FROM outbox WHERE kind = 'renewal_reminder'") == 270


def _stopped(pid: int) -> bool:
    """The process is stopped by a signal ('T' in /proc/PID/stat): frozen at its failpoint."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


async def test_a_zombie_attempt_frozen_in_its_batch_changes_nothing_when_it_wakes(
    client, game_pool, task_queue, worker_processes: WorkerProcesses, tmp_path
):
    """A worker freezes inside a batch's open transaction; the retry on another worker cleans the
    cohort; the zombie, woken, finds its transaction ended: no row of the game changes after."""
    deadline = deadline_in(-60)
    users = await seed_game_users(game_pool, 120)
    await register(game_pool, users, deadline)
    game_env = {
        "CLEANUP_TARGETS_FILE": str(GAME_TARGETS_FILE),
        "CLEANUP_ANONYMIZE_KEY": ANONYMIZE_KEY,
        "CLEANUP_FAILPOINTS": "cleanup_partition.in_batch=stop@2",
        ONCE_DIR_ENV: str(tmp_path),  # only the first process to get there freezes
        "DB_IDLE_IN_TRANSACTION_TIMEOUT_SECONDS": "2",
    }
    zombie = worker_processes.start(**game_env)
    started = await start_cleanup(
        client,
        game_pool,
        task_queue,
        StartCleanup(deadline=deadline, partitions=1, batch_size=40, heartbeat_timeout_seconds=2),
    )

    async def frozen() -> bool:
        return _stopped(zombie.pid)

    await wait_until(frozen, within=120)
    worker_processes.start(**game_env)
    handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
    result: CleanupResult = await handle.result()
    assert result.settlement is not None and result.settlement.cleaned == 120
    done = await game_rows(game_pool, users)
    assert done == cleaned_rows(120)

    os.kill(zombie.pid, signal.SIGCONT)
    zombie.terminate()  # a graceful stop: whatever it does late (its statement, its COMMIT) is done by then
    await asyncio.to_thread(zombie.wait, 60)
    assert await game_rows(game_pool, users) == done
    assert await game_pool.fetchval("SELECT count(*) FROM cleanup_applied") == 120
    assert await game_pool.fetchval("SELECT count(*) FROM outbox WHERE kind = 'renewal_reminder'") == 120


async def test_a_bigint_key_is_compared_as_a_bigint(game_pool):
    """A game whose players are numbered: the target compares `player_no = ANY(keys::bigint[])`."""
    await game_pool.execute(
        "CREATE TABLE game_server.scores (player_no bigint NOT NULL, points integer NOT NULL);"
        "CREATE INDEX scores_player_idx ON game_server.scores (player_no);"
        "INSERT INTO game_server.scores SELECT g, g FROM generate_series(1000, 1019) g"
    )
    deadline = deadline_in(-60)
    await register(game_pool, [str(n) for n in range(1000, 1010)], deadline)
    await claim_one_partition(game_pool, "numbered", deadline)
    targets = CleanupTargets.model_validate(
        {"target": [{"table": "game_server.scores", "match_column": "player_no", "action": "delete"}]}
    )
    compiled = await CompiledCleanup.compile(game_pool, targets, GAME.cleanup)
    async with game_pool.acquire() as conn, conn.transaction():
        row = await conn.fetchrow(
            compiled.batch_sql,
            *compiled.batch_args(cleanup_id="numbered", partition_no=0, after_account_id="", batch_size=1000),
        )
    assert row is not None and (row["cleaned"], row["rows_t0"]) == (10, 10)
    assert await game_pool.fetchval("SELECT array_agg(player_no ORDER BY 1) FROM game_server.scores") == list(
        range(1010, 1020)
    )


async def test_a_worker_with_another_target_set_runs_a_cleanup_with_the_set_it_started_with(game_pool):
    """A deploy changed the targets mid-cleanup: the new worker runs that cleanup's partitions with
    the set the cleanup recorded (compiled and checked like its own), never with a smaller one."""
    started = await CleanupActivities.create(game_pool, game_targets(), settings=GAME.cleanup)
    assert await cleanup_target_set(game_pool, started.compiled, "mid-deploy") is started.compiled
    smaller = CleanupTargets(target=game_targets().target[:-1])
    deployed = await CleanupActivities.create(game_pool, smaller, settings=GAME.cleanup)
    used = await cleanup_target_set(game_pool, deployed.compiled, "mid-deploy")
    assert used.fingerprint == game_targets().fingerprint != smaller.fingerprint
    assert used.batch_sql == started.compiled.batch_sql
    assert (await cleanup_target_set(game_pool, deployed.compiled, "after-deploy")).fingerprint == smaller.fingerprint


async def test_two_partitions_recording_the_target_set_at_once_both_read_the_recorded_one(game_pool):
    """The second partition's record waits on the first's uncommitted insert; once that commits it
    reads the fingerprint the first recorded (never "no set", which would refuse the partition)."""
    started = await CleanupActivities.create(game_pool, game_targets(), settings=GAME.cleanup)
    async with game_pool.acquire() as first, game_pool.acquire() as second:
        tx = first.transaction()
        await tx.start()
        await first.execute(
            "INSERT INTO cleanup_target_runs (cleanup_id, fingerprint) VALUES ($1, $2)",
            "at-once",
            started.compiled.fingerprint,
        )
        waiting = asyncio.create_task(cleanup_target_set(second, started.compiled, "at-once"))
        pid = second.get_server_pid()

        async def blocked_on_the_insert() -> bool:
            return bool(
                await game_pool.fetchval("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid)
            )

        await wait_until(blocked_on_the_insert, within=30)
        await tx.commit()
        assert (await waiting) is started.compiled


async def test_two_partitions_meeting_the_same_friendships_wait_for_each_other_instead_of_deadlocking(game_pool):
    """Partition 0 cleans a1 and b2, partition 1 cleans a2 and b1; the friendships are (a1, b1) and
    (a2, b2), so both batches meet both rows. Partition 1 waits behind a lock another transaction
    holds on (a2, b2), partition 0 starts behind it, then the lock goes: the two friends targets are
    one pass over the table, in its order, so the second batch waits for the first and finds the rows
    gone (two passes, by user_a then by user_b, lock them in opposite orders: a deadlock, retried)."""
    a1, a2, b2, b1 = users = [str(uuid.UUID(int=n)) for n in range(1, 5)]  # in account order
    await game_pool.fetchrow((GAME_DIR / "seed.sql").read_text(), [uuid.UUID(u) for u in users])
    await game_pool.execute("DELETE FROM game_server.friends")
    await game_pool.execute(
        "INSERT INTO game_server.friends (user_a, user_b) VALUES ($1, $2), ($3, $4)",
        *(uuid.UUID(u) for u in (a1, b1, a2, b2)),
    )
    deadline = deadline_in(-60)
    await register(game_pool, users, deadline)
    await claim_one_partition(game_pool, "shared-friends", deadline)
    await game_pool.execute(
        "UPDATE cleanup_claims SET partition_no = 1 WHERE cleanup_id = 'shared-friends' AND account_id = ANY($1)",
        [a2, b1],
    )
    compiled = await CompiledCleanup.compile(game_pool, game_targets(), GAME.cleanup)

    async def batch(partition_no: int) -> asyncpg.Record:
        async with game_pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(
                compiled.batch_sql,
                *compiled.batch_args(
                    cleanup_id="shared-friends", partition_no=partition_no, after_account_id="", batch_size=1000
                ),
            )
        assert row is not None
        return row

    async def waiting(n: int) -> bool:
        found: int = await game_pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return found == n

    async with game_pool.acquire() as holder:
        lock = holder.transaction()
        await lock.start()
        await holder.execute("SELECT 1 FROM game_server.friends WHERE user_a = $1 FOR UPDATE", uuid.UUID(a2))
        second = asyncio.create_task(batch(1))
        await wait_until(lambda: waiting(1))
        first = asyncio.create_task(batch(0))
        await wait_until(lambda: waiting(2))
        await lock.rollback()
    rows = await asyncio.gather(second, first)  # a deadlock raises DeadlockDetectedError here
    assert [r["cleaned"] for r in rows] == [2, 2]
    assert sum(r["rows_t2"] + r["rows_t3"] for r in rows) == 2  # each friendship once
    assert await game_rows(game_pool, users) == cleaned_rows(4)
