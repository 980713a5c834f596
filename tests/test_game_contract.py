"""The game's side of the contract: SQL functions in the service schema, called in the game's own
transactions on connections that know nothing of the service (search_path `public`), with the
game's own keys (text, UUID, bigint printed as text)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
import pytest_asyncio

from activities.outbox import OutboxRelayActivities
from cleanup.history import account_history
from cleanup.inputs import StartCleanup
from cleanup.operations import hold_account, release_account, set_deadline, start_cleanup
from cleanup.planner import planner_status, sweep_overdue
from cleanup.planner_models import PlannerSettings, SweepInput
from core.db import service_schema
from demo.mail_provider import MailProvider, ProviderThread
from outbox.operations import start_relays
from tests.helpers import wait_until
from tests.test_cleanup_input import run_cli
from worker import build_worker
from workflows.renewal_cleanup import RenewalCleanupWorkflow

S = service_schema()


@pytest_asyncio.fixture
async def game(db_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection of the game: its own search path, the service reached only by qualified names."""
    conn = await asyncpg.connect(db_url, server_settings={"search_path": "public"})
    yield conn
    await conn.close()


async def db_now(conn: asyncpg.Connection) -> datetime:
    value: datetime = await conn.fetchval("SELECT clock_timestamp()")
    return value


async def call(conn: asyncpg.Connection, function: str, *args: object) -> str:
    placeholders = ", ".join(f"${i}" for i in range(1, len(args) + 1))
    return str(await conn.fetchval(f"SELECT {S}.{function}({placeholders})", *args))


async def test_set_deadline_registers_moves_and_is_too_late_once_claimed_with_any_key(game, pool):
    now = await db_now(game)
    key_uuid, key_bigint = str(uuid.uuid4()), "4411290"

    # In the game's own transaction: committed with it, rolled back with it.
    async with game.transaction():
        assert await call(game, "set_deadline", key_uuid, now + timedelta(hours=1)) == "registered"
    await game.execute("BEGIN")
    assert await call(game, "set_deadline", key_bigint, now + timedelta(hours=1)) == "registered"
    await game.execute("ROLLBACK")
    assert await pool.fetchval("SELECT count(*) FROM accounts WHERE account_id = $1", key_bigint) == 0
    assert await call(game, "set_deadline", key_bigint, now + timedelta(hours=1)) == "registered"

    before = await pool.fetchrow("SELECT cleanup_version FROM accounts WHERE account_id = $1", key_uuid)
    assert await call(game, "set_deadline", key_uuid, now + timedelta(hours=2)) == "moved"
    after = await pool.fetchrow(
        "SELECT renewal_deadline, cleanup_version, status FROM accounts WHERE account_id = $1", key_uuid
    )
    assert after["renewal_deadline"] == now + timedelta(hours=2) and after["status"] == "active"
    assert after["cleanup_version"] == before["cleanup_version"] + 1, "a planned cleanup of the old deadline goes stale"

    # Claimed (or cleaned): too late, nothing changes.
    await pool.execute("UPDATE accounts SET status = 'cleaning', claimed_by = 'c1' WHERE account_id = $1", key_bigint)
    assert await call(game, "set_deadline", key_bigint, now + timedelta(days=30)) == "too_late"
    assert await pool.fetchval(
        "SELECT renewal_deadline FROM accounts WHERE account_id = $1", key_bigint
    ) == now + timedelta(hours=1)
    events = await pool.fetch("SELECT account_id, kind FROM account_events ORDER BY event_id")
    assert [tuple(e) for e in events] == [
        (key_uuid, "registered"),
        (key_bigint, "registered"),
        (key_uuid, "moved"),
        (key_bigint, "refused"),
    ]

    # Only length and control characters are checked.
    for bad in ("", "x" * 201, "line\nbreak", "tab\there"):
        with pytest.raises(asyncpg.exceptions.InvalidParameterValueError, match="not an account ID"):
            await call(game, "set_deadline", bad, now)
    assert await call(game, "set_deadline", "x" * 200, now) == "registered"
    assert await call(game, "set_deadline", "player #42 (eu)", now) == "registered"
    # The Python API is the same function.
    assert (await set_deadline(pool, "acct_from_python", now + timedelta(hours=1))).result == "registered"


async def test_renew_is_judged_by_the_database_clock_and_refuses_an_earlier_deadline(game, pool):
    now = await db_now(game)
    account = str(uuid.uuid4())
    await call(game, "set_deadline", account, now + timedelta(hours=1))

    with pytest.raises(asyncpg.exceptions.InvalidParameterValueError, match="earlier than the current one"):
        await game.fetchval(f"SELECT {S}.renew($1, $2)", account, now + timedelta(minutes=30))
    with pytest.raises(asyncpg.exceptions.InvalidParameterValueError, match="in the past by the database clock"):
        await game.fetchval(f"SELECT {S}.renew($1, $2)", account, now - timedelta(seconds=1))
    assert await pool.fetchval("SELECT count(*) FROM renewals") == 0, "a refused renewal records nothing"
    assert await pool.fetchval(
        "SELECT renewal_deadline FROM accounts WHERE account_id = $1", account
    ) == now + timedelta(hours=1)

    later = now + timedelta(hours=3)
    assert await game.fetchval(f"SELECT {S}.renew($1, $2)", account, later) == "in_time"
    earlier = now + timedelta(hours=2)
    assert await game.fetchval(f"SELECT {S}.renew($1, $2, allow_earlier => true)", account, earlier) == "in_time"
    assert await pool.fetchval("SELECT renewal_deadline FROM accounts WHERE account_id = $1", account) == earlier
    assert await game.fetchval(f"SELECT {S}.renew($1)", account) == "in_time"
    assert await pool.fetchval("SELECT status FROM accounts WHERE account_id = $1", account) == "renewed"

    # Past its deadline by the database clock: too late, and recorded as such.
    late = str(uuid.uuid4())
    await call(game, "set_deadline", late, now - timedelta(seconds=5))
    assert await game.fetchval(f"SELECT {S}.renew($1)", late) == "too_late"
    rows = await pool.fetch(
        "SELECT outcome, judged_at >= deadline_seen AS after FROM renewals WHERE account_id = $1", late
    )
    assert [tuple(r) for r in rows] == [("too_late", True)]

    with pytest.raises(asyncpg.exceptions.NoDataFoundError, match="unknown account"):
        await game.fetchval(f"SELECT {S}.renew($1)", "nobody")


async def test_hold_and_release_through_sql_and_python(game, pool):
    now = await db_now(game)
    account = str(uuid.uuid4())
    await call(game, "set_deadline", account, now + timedelta(hours=1))
    assert await call(game, "hold", account, "litigation 2026-17") == "held"
    assert await call(game, "hold", account, "again") == "already_held"
    assert (
        await pool.fetchval("SELECT hold_reason FROM accounts WHERE account_id = $1", account) == "litigation 2026-17"
    )
    assert (await release_account(pool, account)).result == "released"
    assert (await release_account(pool, account)).result == "not_held"
    assert (await hold_account(pool, account, "audit")).result == "held"
    with pytest.raises(asyncpg.exceptions.InvalidParameterValueError, match="needs a reason"):
        await call(game, "hold", account, " ")
    with pytest.raises(asyncpg.exceptions.NoDataFoundError):
        await call(game, "hold", "nobody", "x")
    claimed = str(uuid.uuid4())
    await call(game, "set_deadline", claimed, now)
    await pool.execute("UPDATE accounts SET status = 'cleaning', claimed_by = 'c1' WHERE account_id = $1", claimed)
    assert await call(game, "hold", claimed, "too late for it") == "too_late"


SWEEP_NOW = PlannerSettings(
    bucket_seconds=1.0,
    horizon_seconds=60,
    tick_seconds=1.0,
    max_idle_seconds=1.0,
    sweep_grace_seconds=0,
    lateness_objective_seconds=2,
)


async def test_a_held_account_is_never_claimed_and_is_cleaned_once_released(game, client, pool, task_queue, worker):
    now = await db_now(game)
    deadline = (now - timedelta(seconds=30)).replace(microsecond=0)
    accounts = [str(uuid.uuid4()) for _ in range(4)]
    async with game.transaction():  # the game registers its players and writes their data together
        for account in accounts:
            assert await call(game, "set_deadline", account, deadline) == "registered"
            await game.execute(
                "INSERT INTO demo_game.cloud_saves (account_id, slot, size_bytes, checksum) VALUES ($1, 1, 10, 'x')",
                account,
            )
    held = accounts[0]
    assert await call(game, "hold", held, "legal hold") == "held"

    started = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline))
    result = await client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id).result()
    assert result.settlement is not None and result.settlement.claimed == 3
    state = {r["account_id"]: r["status"] for r in await pool.fetch("SELECT account_id, status FROM accounts")}
    assert state == {held: "active"} | {a: "cleaned" for a in accounts[1:]}
    assert await pool.fetchval("SELECT count(*) FROM demo_game.cloud_saves WHERE account_id = $1", held) == 1

    # Past its deadline and held: counted apart, never handed to a sweep.
    status = await planner_status(client, pool, task_queue)
    assert (status.held_overdue, status.overdue) == (1, 0), status
    assert (
        await sweep_overdue(
            pool, client, SweepInput(settings=SWEEP_NOW, task_queue=task_queue, as_of=datetime.now(UTC))
        )
    ).overdue == 0
    single = await start_cleanup(client, pool, task_queue, StartCleanup(account_id=held))
    await client.get_workflow_handle(single.workflow_id).result()
    assert await pool.fetchval("SELECT status FROM accounts WHERE account_id = $1", held) == "active"

    # Released after its deadline: the planner's overdue sweep cleans it at once.
    assert await call(game, "release", held) == "released"
    sweep = await sweep_overdue(
        pool, client, SweepInput(settings=SWEEP_NOW, task_queue=task_queue, as_of=datetime.now(UTC))
    )
    assert sweep.overdue == 1 and sweep.sweep_cleanup_id is not None
    await client.get_workflow_handle(sweep.sweep_cleanup_id).result()
    assert await pool.fetchval("SELECT status FROM accounts WHERE account_id = $1", held) == "cleaned"
    assert await pool.fetchval("SELECT count(*) FROM demo_game.cloud_saves WHERE account_id = $1", held) == 0
    assert (await planner_status(client, pool, task_queue)).held_overdue == 0


async def test_cli_renew_prints_both_deadlines_refuses_earlier_and_holds(game, pool, settings):
    now = await db_now(game)
    account = str(uuid.uuid4())
    current = (now + timedelta(hours=2)).replace(microsecond=0)
    await call(game, "set_deadline", account, current)
    earlier = (current - timedelta(hours=1)).isoformat()

    refused = run_cli(settings, "renew", account, "--until", earlier)
    assert refused.returncode == 2 and "earlier than the current one" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    assert await pool.fetchval("SELECT renewal_deadline FROM accounts WHERE account_id = $1", account) == current

    done = run_cli(settings, "renew", account, "--until", earlier, "--allow-earlier")
    assert done.returncode == 0, done.stderr
    z = "%Y-%m-%dT%H:%M:%SZ"
    assert f"deadline: {current:{z}} -> {current - timedelta(hours=1):{z}}" in done.stdout, done.stdout
    shown = run_cli(settings, "renew", account, "--until", (current + timedelta(hours=5)).isoformat(), "--json")
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert datetime.fromisoformat(data["old_deadline"]) == datetime.fromisoformat(earlier)
    assert datetime.fromisoformat(data["new_deadline"]) == current + timedelta(hours=5)

    held = run_cli(settings, "hold", account, "--reason", "case 9", "--json")
    assert held.returncode == 0 and json.loads(held.stdout)["result"] == "held", held.stderr
    released = run_cli(settings, "release", account)
    assert released.returncode == 0 and "released" in released.stdout, released.stderr
    unknown = run_cli(settings, "hold", "nobody", "--reason", "x")
    assert unknown.returncode == 2 and "unknown account" in unknown.stderr, unknown.stderr


async def test_account_history_is_an_erasure_receipt_without_personal_data(
    game, client, pool, task_queue, worker, settings
):
    now = await db_now(game)
    account, other = str(uuid.uuid4()), str(uuid.uuid4())
    deadline = (now + timedelta(hours=1)).replace(microsecond=0)
    async with game.transaction():
        for who, saves, matches in ((account, 2, 3), (other, 1, 1)):
            await call(game, "set_deadline", who, deadline)
            await game.execute(
                "INSERT INTO demo_game.cloud_saves (account_id, slot, size_bytes, checksum)"
                " SELECT $1, s, 10, 'private-save-' || s FROM generate_series(1, $2) s",
                who,
                saves,
            )
            await game.execute(
                "INSERT INTO demo_game.match_history (account_id, played_at, mode, result, score)"
                " SELECT $1, now(), 'private-mode', 'win', 1 FROM generate_series(1, $2)",
                who,
                matches,
            )
    await call(game, "hold", account, "case 7")
    await call(game, "release", account)
    renewed_until = await db_now(game) + timedelta(seconds=2)
    assert await game.fetchval(f"SELECT {S}.renew($1, $2, true)", account, renewed_until) == "in_time"

    started = await start_cleanup(client, pool, task_queue, StartCleanup(account_id=account))
    result = await client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id).result()
    assert result.outcome == "cleaned"
    assert await pool.fetchval("SELECT count(*) FROM demo_game.cloud_saves WHERE account_id = $1", account) == 0

    shown = run_cli(settings, "account", "history", account, "--json")
    assert shown.returncode == 0, shown.stderr
    assert "private-" not in shown.stdout, "the receipt holds no game data"
    receipt = json.loads(shown.stdout)
    assert receipt["status"] == "cleaned" and receipt["held"] is False
    assert [e["kind"] for e in receipt["events"]] == ["registered", "held", "released"]
    assert [(r["outcome"], r["version_after"]) for r in receipt["renewals"]] == [("in_time", 2)]
    assert receipt["claim"]["cleanup_id"] == started.workflow_id
    [cleaned] = receipt["cleaned"]
    assert (cleaned["cleanup_version"], cleaned["cleanup_id"]) == (2, started.workflow_id)
    assert cleaned["targets"] == [
        {"target": "demo_game.cloud_saves", "match_column": "account_id", "action": "delete", "rows": 2},
        {"target": "demo_game.inventory_items", "match_column": "account_id", "action": "delete", "rows": 0},
        {"target": "demo_game.match_history", "match_column": "account_id", "action": "archive", "rows": 3},
    ]
    assert cleaned["reminder"]["status"] == "pending" and cleaned["reminder"]["delivered_at"] is None

    # The reminder delivered by the relay: the receipt says when.
    token, relay_queue = f"tok-{uuid.uuid4().hex}", f"{task_queue}-relay"
    with ProviderThread(MailProvider(token, seed=3)) as provider:
        relay = OutboxRelayActivities(pool, provider.url, token)
        async with build_worker(client, relay_queue, [relay.relay_outbox_batch]):
            [started_relay] = await start_relays(
                client, relay_queue, relays=1, idle_sleep_seconds=0.2, stop_when_drained=True, id_prefix=relay_queue
            )
            await client.get_workflow_handle(started_relay.workflow_id).result()
    delivered = (await account_history(pool, account)).cleaned[0].reminder
    assert delivered is not None and delivered.status == "delivered" and delivered.delivered_at is not None
    # The other account's rows were not counted in this one's receipt, and it was not touched.
    assert await pool.fetchval("SELECT count(*) FROM demo_game.cloud_saves WHERE account_id = $1", other) == 1

    unknown = run_cli(settings, "account", "history", "nobody")
    assert unknown.returncode == 2 and "unknown account 'nobody'" in unknown.stderr


async def test_a_hold_committed_while_a_claim_waits_on_the_row_is_respected(game, pool):
    """The claim re-checks the row it locks: a hold that commits while the claim waits wins; a hold
    that comes after the claim is too late."""
    import asyncio

    from tests.helpers import claim_partitions

    deadline = (await db_now(game) - timedelta(seconds=1)).replace(microsecond=0)
    held, free = str(uuid.uuid4()), str(uuid.uuid4())
    for account in (held, free):
        await call(game, "set_deadline", account, deadline)

    await game.execute("BEGIN")
    assert await call(game, "hold", held, "court order") == "held"  # row locked, not committed
    claim = asyncio.create_task(claim_partitions(pool, "claim-1", deadline))

    async def claim_waits_on_the_row() -> bool:
        # The claim statement's text is longer than track_activity_query_size: match the session
        # that waits on a lock in this database, which only the claim can be (the game holds it).
        waiting = (
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND datname = current_database() AND query LIKE '%claim%'"
        )
        return bool(await pool.fetchval(waiting))

    await wait_until(claim_waits_on_the_row, within=30)
    assert not claim.done()
    await game.execute("COMMIT")
    await claim
    claimed = {r[0] for r in await pool.fetch("SELECT account_id FROM cleanup_claims WHERE cleanup_id = 'claim-1'")}
    assert claimed == {free}
    assert await call(game, "hold", free, "too late now") == "too_late"
