"""The outbox relay against real Postgres, a real HTTP provider (outbox.mail_provider) and real Temporal.

1. 10,000 events, three relays, one relay process killed between sending and recording: nothing is
   lost, the provider saw every key at least once and absorbed the resends by key, the customer got
   each reminder exactly once.
2. 429 + Retry-After is honoured, 5xx and timeouts recover, a 4xx lands in dead letter with the answer.
3. A cleanup transaction that rolls back leaves no outbox row, and nothing is ever sent for it.
4. The bearer token appears in no log, no stored error, no Temporal history.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.worker import Replayer, Worker

import cleanup
import outbox
import starter
from activities.cleanup import CleanupActivities
from activities.outbox import OutboxRelayActivities, classify, retry_after_seconds
from cleanup.targets import load_targets
from core.errors import InputError
from core.failpoints import EXIT_CODE
from core.http_client import HttpResponse
from core.queries import load
from outbox.mail_provider import MailProvider, ProviderThread, ScriptedFault
from outbox.models import OutboxRelayInput, RelayBatchSettings, RelayTotals
from outbox.operations import outbox_status, redeliver_event, start_relays
from tests.helpers import seed, wait_until
from worker import build_worker
from workflows.outbox_relay import OutboxRelayWorkflow

CLEANUP_SQL = load(cleanup.__file__)
OUTBOX_SQL = load(outbox.__file__)
FAST = RelayBatchSettings(
    batch_size=200,
    concurrency=8,
    lease_seconds=6,
    request_timeout_seconds=1.5,
    backoff_initial_seconds=0.3,
    backoff_max_seconds=2,
)


# -- fixtures and helpers ---------------------------------------------------------------------------


@pytest.fixture
def token() -> str:
    return f"tok-{secrets.token_urlsafe(24)}"


@pytest.fixture
def provider(token: str) -> Iterator[ProviderThread]:
    with ProviderThread(MailProvider(token, seed=11, hang_seconds=3)) as served:
        yield served


@pytest_asyncio.fixture
async def relay_worker(
    client: Client, pool: asyncpg.Pool, task_queue: str, provider: ProviderThread, token: str
) -> AsyncIterator[Worker]:
    """An in-process worker whose relay talks to the test's provider."""
    relay = OutboxRelayActivities(pool, provider.url, token)
    w = build_worker(client, task_queue, [relay.relay_outbox_batch])
    async with w:
        yield w


async def seed_events(pool: asyncpg.Pool, count: int, prefix: str = "t") -> None:
    """Reminder events straight into the outbox, set-based."""
    await pool.execute(
        """
        INSERT INTO outbox (event_key, kind, account_id, source_id, payload)
        SELECT 'renewal-reminder:acct_' || $2 || g || ':v1', 'renewal_reminder', 'acct_' || $2 || g,
               'test-seed', jsonb_build_object('account_id', 'acct_' || $2 || g, 'cleanup_version', 1)
        FROM generate_series(1, $1::int) g
        """,
        count,
        prefix,
    )


async def add_event(pool: asyncpg.Pool, key: str, kind: str = "renewal_reminder") -> None:
    await pool.execute(
        "INSERT INTO outbox (event_key, kind, account_id, source_id, payload) "
        "VALUES ($1, $2, 'acct_x', 'test', '{}'::jsonb)",
        key,
        kind,
    )


async def drain(
    client: Client, task_queue: str, settings: RelayBatchSettings = FAST, relay_id: str | None = None
) -> RelayTotals:
    """One relay workflow in drain mode: returns when no pending event is left."""
    relay_id = relay_id or f"relay-{uuid.uuid4().hex[:8]}"
    return await client.execute_workflow(
        OutboxRelayWorkflow.run,
        OutboxRelayInput(relay_id=relay_id, settings=settings, idle_sleep_seconds=0.5, stop_when_drained=True),
        id=relay_id,
        task_queue=task_queue,
        execution_timeout=timedelta(seconds=90),
    )


async def rows_by_key(pool: asyncpg.Pool) -> dict[str, dict[str, Any]]:
    return {r["event_key"]: dict(r) for r in await pool.fetch("SELECT * FROM outbox")}


def stats(provider: ProviderThread) -> dict[str, Any]:
    return provider.provider.stats()


async def wait_exit(proc: subprocess.Popen[bytes], within: float) -> int:
    deadline = time.monotonic() + within
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise AssertionError("the relay process did not die at its failpoint")
        await asyncio.sleep(0.1)
    return proc.returncode


# -- 1. 10,000 events, three relays, one killed mid-batch -------------------------------------------


async def test_ten_thousand_events_three_relays_one_killed_mid_batch(
    client, pool, task_queue, worker_processes, provider, token
):
    total = 10_000
    await seed_events(pool, total)
    provider.provider.configure(share_5xx=0.02, share_429=0.01, retry_after="1")
    env = {"MAIL_PROVIDER_URL": provider.url, "MAIL_PROVIDER_TOKEN": token}
    # This relay process dies right after sending its first batch, before recording it as delivered.
    doomed = worker_processes.start(CLEANUP_FAILPOINTS="outbox_relay.after_send=exit", **env)

    async def polling() -> bool:
        return "worker polling" in worker_processes.logs()

    await wait_until(polling, within=30)
    for _ in range(2):
        worker_processes.start(**env)

    relays = await start_relays(
        client,
        task_queue,
        relays=3,
        settings=FAST,
        idle_sleep_seconds=0.5,
        stop_when_drained=True,
        id_prefix=f"{task_queue}-relay-",
    )
    assert await wait_exit(doomed, within=60) == EXIT_CODE
    results: list[RelayTotals] = await asyncio.wait_for(
        asyncio.gather(
            *(client.get_workflow_handle_for(OutboxRelayWorkflow.run, r["workflow_id"]).result() for r in relays)
        ),
        timeout=120,
    )

    by_status = dict(await pool.fetch("SELECT status, count(*) FROM outbox GROUP BY status"))
    assert by_status == {"delivered": total}, "lost = 0: every event delivered, none pending or dead"
    assert sum(r.delivered for r in results) == total, "each event recorded as delivered exactly once"
    assert all(r.batches >= 1 for r in results) and sum(r.delivered > 0 for r in results) >= 2, results

    s = stats(provider)
    keys = {r["event_key"] for r in await pool.fetch("SELECT event_key FROM outbox")}
    assert s["unique_keys"] == total, "the provider received every key at least once"
    assert s["delivered"] == total, "the customer sees each reminder once"
    mailbox = provider.provider.messages()
    assert len({m["idempotency_key"] for m in mailbox}) == len(mailbox) == total
    assert {m["idempotency_key"] for m in mailbox} == keys
    # The killed batch had been sent but not recorded: it was sent again and deduplicated by key.
    assert s["duplicates"] >= 1, s
    assert set(s["duplicates_by_key"]) <= keys
    assert s["received"] == total + s["duplicates"] + s["faults"].get("429", 0) + s["faults"].get("503", 0)
    resent = await pool.fetchval("SELECT count(*) FROM outbox WHERE attempts > 1")
    assert resent >= s["duplicates"]
    assert token not in worker_processes.logs()


# -- 2. provider errors: 429 Retry-After, 5xx, timeouts, 4xx dead letter ----------------------------


async def test_retry_after_backoff_and_dead_letter(client, pool, task_queue, relay_worker, provider):
    p = provider.provider
    await seed_events(pool, 20, prefix="ok")
    for key in ("k-429", "k-503", "k-timeout", "k-400", "k-503-forever"):
        await add_event(pool, key)
    await add_event(pool, "k-bad-kind", kind="no_such_template")
    await add_event(pool, "k-injection\r\nX-Injected: 1")
    p.script("k-429", ScriptedFault(429, times=1, retry_after="3"))
    p.script("k-503", ScriptedFault(503, times=2))
    p.script("k-timeout", ScriptedFault(None, times=1))
    p.script("k-400", ScriptedFault(400, times=-1, body="invalid recipient address"))
    p.script("k-503-forever", ScriptedFault(503, times=-1))
    settings = FAST.model_copy(update={"max_attempts": 4})

    run = asyncio.create_task(drain(client, task_queue, settings))

    async def rate_limited() -> bool:
        return bool(await pool.fetchval("SELECT last_http_status FROM outbox WHERE event_key = 'k-429'") == 429)

    await wait_until(rate_limited, within=20, interval=0.05)
    waited = await pool.fetchval(
        "SELECT extract(epoch FROM next_attempt_at - last_attempt_at) FROM outbox WHERE event_key = 'k-429'"
    )
    # Counted from the claim; the outcome is recorded once the whole batch has its answers (the slowest
    # is k-timeout, after request_timeout), so the wait is 3 s plus at most that batch's duration.
    assert 3.0 <= waited < 3.0 + settings.request_timeout_seconds + 1.5, f"Retry-After: 3 not respected: {waited}"
    totals = await run

    rows = await rows_by_key(pool)
    assert rows["k-429"]["status"] == "delivered" and rows["k-429"]["attempts"] == 2
    first, second = p.times_for("k-429")
    assert second - first >= 2.95, "the resend waited for Retry-After"

    assert rows["k-503"]["status"] == "delivered" and rows["k-503"]["attempts"] == 3, "5xx recovers"
    assert len(p.times_for("k-503")) == 3
    assert rows["k-503"]["last_error"].startswith("HTTP 503")

    # A timeout after the provider took the message: resent, acknowledged as a duplicate, delivered once.
    assert rows["k-timeout"]["status"] == "delivered" and rows["k-timeout"]["attempts"] == 2
    assert "timeout" in rows["k-timeout"]["last_error"]
    assert stats(provider)["duplicates_by_key"] == {"k-timeout": 1}

    dead = rows["k-400"]
    assert dead["status"] == "dead" and dead["attempts"] == 1, "a 4xx is not retried"
    assert dead["last_http_status"] == 400
    assert "HTTP 400" in dead["dead_reason"] and "invalid recipient address" in dead["dead_reason"]
    assert len(p.times_for("k-400")) == 1
    assert rows["k-bad-kind"]["status"] == "dead"
    assert "no template for kind 'no_such_template'" in rows["k-bad-kind"]["dead_reason"]

    forever = rows["k-503-forever"]
    assert forever["status"] == "dead" and forever["attempts"] == 4
    assert forever["dead_reason"].startswith("gave up after 4 attempts; last: HTTP 503")

    assert sum(1 for r in rows.values() if r["status"] == "delivered") == 23
    injection = rows["k-injection\r\nX-Injected: 1"]
    assert injection["status"] == "dead" and "not a valid Idempotency-Key" in injection["dead_reason"]
    assert stats(provider)["unique_keys"] == 23 + 3, "a key that is no valid header value is never sent"

    assert totals.delivered == 23 and totals.dead == 4
    delivered_keys = [m["idempotency_key"] for m in p.messages()]
    assert len(delivered_keys) == len(set(delivered_keys)) == 23


def test_retry_policy_is_a_pure_function():
    s = RelayBatchSettings(backoff_initial_seconds=2, backoff_max_seconds=60, max_attempts=5)
    now = datetime(2026, 11, 1, 9, 0, tzinfo=UTC)

    def answer(status: int, **headers: str) -> HttpResponse:
        return HttpResponse(status, {k.replace("_", "-"): v for k, v in headers.items()}, b"{}")

    assert classify(answer(202), None, 1, s).kind == "delivered"
    assert classify(answer(200), None, 1, s).kind == "delivered"
    r = classify(answer(429, retry_after="7"), None, 9, s, now)
    assert (r.kind, r.delay_seconds) == ("retry", 7.0), "429 is never dead-lettered and waits Retry-After"
    r = classify(answer(429, retry_after="Sun, 01 Nov 2026 09:00:30 GMT"), None, 1, s, now)
    assert r.delay_seconds == 30.0
    assert retry_after_seconds("garbage", s, now) is None
    assert 1.6 <= classify(answer(429), None, 1, s, now).delay_seconds <= 2.0, "no Retry-After: backoff"
    assert 6.4 <= classify(answer(503), None, 3, s).delay_seconds <= 8.0
    assert classify(None, "timeout", 2, s).kind == "retry"
    assert classify(answer(401), None, 1, s).kind == "retry", "credentials are configuration, not the event"
    assert classify(answer(422), None, 1, s).kind == "dead"
    assert classify(answer(500), None, 5, s).kind == "dead"
    assert classify(answer(500), None, 4, s).kind == "retry"


# -- 3. nothing is sent for a cleanup that did not commit -------------------------------------------


async def test_no_reminder_is_sent_for_a_cleanup_that_rolled_back(client, pool, task_queue, relay_worker, provider):
    deadline = (datetime.now(UTC) - timedelta(minutes=1)).replace(microsecond=0)
    committed_account, rolled_back_account = await seed(pool, deadline, 2)
    cleanup_id = f"cleanup-test-{uuid.uuid4().hex[:6]}"
    await pool.execute(CLEANUP_SQL.claim_cohort, cleanup_id, deadline, 2)  # one account per partition
    batch_sql = (await CleanupActivities.create(pool, load_targets())).partition_batch_sql

    async with pool.acquire() as conn, conn.transaction():
        row = await conn.fetchrow(batch_sql, cleanup_id, 0, "", 100)
        assert row is not None and row["reminders"] == 1

    conn = await pool.acquire()
    try:
        tx = conn.transaction()
        await tx.start()
        row = await conn.fetchrow(batch_sql, cleanup_id, 1, "", 100)
        assert row is not None and row["reminders"] == 1, "the reminder row exists inside the open transaction"
        # A relay drains while that cleanup is still in flight: it can neither see nor send that row.
        during = await drain(client, task_queue)
        await tx.rollback()  # the cleanup fails: its reminder never existed
    finally:
        await pool.release(conn)
    after = await drain(client, task_queue)

    assert (during.delivered, after.delivered, after.claimed) == (1, 0, 0)
    keys = [r["event_key"] for r in await pool.fetch("SELECT event_key FROM outbox")]
    assert keys == [f"renewal-reminder:{committed_account}:v1"]
    s = stats(provider)
    assert s["received"] == 1 and s["delivered"] == 1
    assert [m["account_id"] for m in provider.provider.messages()] == [committed_account]
    state = dict(await pool.fetch("SELECT account_id, status FROM accounts"))
    assert state == {committed_account: "cleaned", rolled_back_account: "cleaning"}
    assert await pool.fetchval("SELECT count(*) FROM cloud_saves WHERE account_id = $1", rolled_back_account) == 2


# -- 4. the token is never logged, stored or put into Temporal ---------------------------------------


async def test_token_never_appears_in_logs_errors_or_history(
    client, pool, task_queue, relay_worker, provider, token, caplog
):
    caplog.set_level(logging.DEBUG)
    p = provider.provider
    await seed_events(pool, 5)
    await add_event(pool, "k-echo")
    await add_event(pool, "k-flaky")
    # A provider that echoes the header back in its error must not get the token into the database.
    p.script("k-echo", ScriptedFault(400, times=-1, body=f"bad request; you sent Authorization: Bearer {token}"))
    p.script("k-flaky", ScriptedFault(503, times=1, body=f"upstream trouble for {token}"))
    relay_id = f"relay-{uuid.uuid4().hex[:8]}"
    await drain(client, task_queue, relay_id=relay_id)

    # A relay with the wrong token: refused (401), retried, then given up; its token stays secret too.
    wrong = f"wrong-{secrets.token_urlsafe(16)}"
    await add_event(pool, "k-wrong-token")
    wrong_queue = f"{task_queue}-wrong"
    bad = OutboxRelayActivities(pool, provider.url, wrong)
    async with build_worker(client, wrong_queue, [bad.relay_outbox_batch]):
        await drain(client, wrong_queue, FAST.model_copy(update={"max_attempts": 2}), relay_id=f"{relay_id}-wrong")

    # An unconfigured relay fails at once, non-retryably, with a message that says what to set.
    unconfigured_queue = f"{task_queue}-unconfigured"
    missing = OutboxRelayActivities(pool, None, None)
    async with build_worker(client, unconfigured_queue, [missing.relay_outbox_batch]):
        with pytest.raises(WorkflowFailureError) as failure:
            await drain(client, unconfigured_queue, relay_id=f"{relay_id}-unconfigured")
    cause = failure.value.cause
    assert isinstance(cause, ActivityError) and isinstance(cause.cause, ApplicationError)
    assert cause.cause.type == "RelayNotConfigured" and cause.cause.non_retryable
    assert "MAIL_PROVIDER_URL and MAIL_PROVIDER_TOKEN" in str(cause.cause)

    rows = await rows_by_key(pool)
    assert "***" in rows["k-echo"]["dead_reason"] and rows["k-echo"]["status"] == "dead"
    assert rows["k-flaky"]["status"] == "delivered" and "***" in rows["k-flaky"]["last_error"]
    assert rows["k-wrong-token"]["status"] == "dead"
    assert "refused the relay's credentials" in rows["k-wrong-token"]["dead_reason"]
    assert p.stats()["unauthorized"] == 2

    stored = json.dumps(list(rows.values()), default=str)
    histories = ""
    for wf_id in (relay_id, f"{relay_id}-wrong", f"{relay_id}-unconfigured"):
        histories += (await client.get_workflow_handle(wf_id).fetch_history()).to_json()
    for secret in (token, wrong):
        assert secret not in caplog.text
        assert secret not in stored
        assert secret not in histories
        assert secret not in repr(OutboxRelayActivities(pool, provider.url, token)) + repr(bad)
    assert "dead-lettered" in caplog.text, "the logs do say what happened"


# -- operators: outbox status / redeliver -----------------------------------------------------------


async def test_cli_status_and_redeliver_a_dead_letter(
    client, pool, task_queue, relay_worker, provider, db_url, temporal_address, capsys
):
    await add_event(pool, "k-dead")
    provider.provider.script("k-dead", ScriptedFault(422, times=1, body="template rejected"))
    await add_event(pool, "k-fine")
    await drain(client, task_queue)

    base = ["--database-url", db_url, "--temporal-address", temporal_address, "--task-queue", task_queue]

    async def cli(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = await asyncio.to_thread(starter.main, [*base, "outbox", *args])
        out, err = capsys.readouterr()
        return rc, out, err

    rc, out, _ = await cli("status", "--json")
    status = json.loads(out)
    assert rc == 0 and (status["delivered"], status["dead"], status["pending"]) == (1, 1, 0)
    assert status["dead_letters"][0]["event_key"] == "k-dead"
    assert "template rejected" in status["dead_letters"][0]["dead_reason"]

    rc, out, _ = await cli("redeliver", "k-dead", "--json")
    assert rc == 0 and json.loads(out)["previous_status"] == "dead"
    assert (await outbox_status(pool))["pending"] == 1
    for bad_key, message in (("k-fine", "was delivered"), ("k-none", "no outbox event"), ("a b", "malformed")):
        rc, _, err = await cli("redeliver", bad_key)
        assert rc == 2 and message in err, err
    with pytest.raises(InputError):
        await redeliver_event(pool, "k-fine")

    await drain(client, task_queue)
    row = await pool.fetchrow("SELECT status, redeliveries FROM outbox WHERE event_key = 'k-dead'")
    assert dict(row) == {"status": "delivered", "redeliveries": 1}
    rc, out, _ = await cli("status")
    assert rc == 0 and "delivered  2" in out


# -- leases and the drain loop ----------------------------------------------------------------------


async def test_concurrent_claims_are_disjoint_and_an_expired_lease_is_taken_over(pool):
    await seed_events(pool, 1000)

    async def claim(owner: str, lease: float = 30) -> set[int]:
        async with pool.acquire() as conn:
            return {r["event_id"] for r in await conn.fetch(OUTBOX_SQL.claim_batch, owner, 300, lease)}

    claims = await asyncio.gather(*(claim(f"relay-{i}") for i in range(5)))
    assert sum(len(c) for c in claims) == 1000, "five claims of 300 share 1000 events"
    assert len(set().union(*claims)) == 1000, "no event was claimed twice"
    assert await claim("late") == set(), "everything is leased"

    # A relay that dies keeps its events only until its lease runs out; then another takes them over.
    await pool.execute("UPDATE outbox SET leased_until = now() - interval '1 second' WHERE lease_owner = 'relay-0'")
    taken_over = await claim("relay-5")
    assert taken_over == claims[0]
    ids = sorted(taken_over)
    n = len(ids)

    async def record(owner: str, outcome: str) -> dict[str, int]:
        row = await pool.fetchrow(
            OUTBOX_SQL.record_outcomes, owner, ids, [outcome] * n, [503] * n, [1.0] * n, ["HTTP 503"] * n
        )
        return dict(row)

    # The old owner's late 'retry' is fenced off; its 'delivered' is kept (the provider has the message).
    assert await record("relay-0", "retry") == {"delivered": 0, "retried": 0, "dead": 0, "fenced": n}
    assert (await record("relay-0", "delivered"))["delivered"] == n
    assert (await record("relay-5", "delivered"))["fenced"] == n, "recorded once"


async def test_relay_continues_as_new_and_keeps_its_totals(client, pool, task_queue, relay_worker, provider):
    await seed_events(pool, 30)
    relay_id = f"relay-{uuid.uuid4().hex[:8]}"
    totals: RelayTotals = await client.execute_workflow(
        OutboxRelayWorkflow.run,
        OutboxRelayInput(
            relay_id=relay_id,
            settings=FAST.model_copy(update={"batch_size": 5}),
            stop_when_drained=True,
            batches_per_run=2,
        ),
        id=relay_id,
        task_queue=task_queue,
        execution_timeout=timedelta(seconds=60),
    )
    assert totals.delivered == 30 and totals.runs >= 4, totals
    assert stats(provider)["delivered"] == 30
    history = await client.get_workflow_handle(relay_id).fetch_history()
    assert len(history.events) < 40, "each run's history stays short"
    replayer = Replayer(workflows=[OutboxRelayWorkflow], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(history)  # deterministic: the recorded run replays without error
