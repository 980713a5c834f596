"""The outbox relay against real Postgres, a real HTTP provider (demo.mail_provider) and real Temporal.

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
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.worker import Replayer, Worker

import outbox
import starter
from activities.cleanup import CleanupActivities
from activities.outbox import (
    OutboxRelayActivities,
    ProviderAnswer,
    classify,
    failure_summary,
    retry_after_seconds,
    safe_headers,
)
from cleanup.targets import load_targets
from core.db import service_settings
from core.errors import InputError
from core.failpoints import EXIT_CODE
from core.queries import load
from demo.mail_provider import FaultShares, MailProvider, ProviderThread, ScriptedFault
from outbox.errors import HeaderInjectionError
from outbox.models import (
    RELAY_OUTBOX_BATCH,
    OutboxRelayInput,
    RelayBatchInput,
    RelayBatchResult,
    RelayBatchSettings,
    RelayTotals,
)
from outbox.operations import outbox_status, redeliver_event, start_relays
from tests.helpers import claim_partitions, seed, wait_until
from worker import build_worker
from workflows.outbox_relay import OutboxRelayWorkflow

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
    with ProviderThread(MailProvider(token, FaultShares(hang_seconds=3), seed=11)) as served:
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


# The same proof at two volumes: 2,000 events in every run, the full 10,000 with `--slow`.
@pytest.mark.parametrize("total", [2_000, pytest.param(10_000, marks=pytest.mark.slow)])
async def test_ten_thousand_events_three_relays_one_killed_mid_batch(
    client, pool, task_queue, worker_processes, provider, token, total
):
    await seed_events(pool, total)
    provider.provider.configure(share_5xx=0.02, share_429=0.01, retry_after="1")
    env = {"MAIL_PROVIDER_URL": provider.url, "MAIL_PROVIDER_TOKEN": token}
    # This relay process dies right after sending its first batch, before recording it as delivered.
    doomed = worker_processes.start(CLEANUP_FAILPOINTS="relay_outbox_batch.after_send=exit", **env)

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
            *(client.get_workflow_handle_for(OutboxRelayWorkflow.run, r.workflow_id).result() for r in relays)
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
    assert forever["status"] == "dead" and forever["attempts"] == 4 and forever["failures"] == 4
    assert forever["dead_reason"].startswith("gave up after 4 failures: 4\u00d7 503; last: HTTP 503")

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

    def answer(status: int, **headers: str) -> ProviderAnswer:
        return ProviderAnswer(status, {k.replace("_", "-"): v for k, v in headers.items()}, b"{}")

    assert classify(answer(202), None, 1, s).kind == "delivered"
    assert classify(answer(200), None, 1, s).kind == "delivered"
    r = classify(answer(429, retry_after="7"), None, 9, s, now)
    assert (r.kind, r.delay_seconds) == ("retry", 7.0), "429 is never dead-lettered and waits Retry-After"
    assert r.failure_kind is None, "a 429 is not a failure"
    r = classify(answer(429, retry_after="Sun, 01 Nov 2026 09:00:30 GMT"), None, 1, s, now)
    assert r.delay_seconds == 30.0
    assert retry_after_seconds("garbage", s, now) is None
    assert 1.6 <= classify(answer(429), None, 1, s, now).delay_seconds <= 2.0, "no Retry-After: backoff"
    assert 6.4 <= classify(answer(503), None, 3, s, failures={"503": 2}).delay_seconds <= 8.0
    r = classify(None, "timeout: no answer", 2, s, failure_kind="timeout")
    assert (r.kind, r.failure_kind) == ("retry", "timeout")
    assert classify(None, "connection error: ConnectError", 1, s).failure_kind == "connection error"
    assert classify(answer(401), None, 1, s).kind == "retry", "credentials are configuration, not the event"
    assert classify(answer(422), None, 1, s).kind == "dead"
    assert classify(answer(500), None, 5, s, failures={"500": 4}).kind == "dead"
    assert classify(answer(500), None, 5, s, failures={"500": 3}).kind == "retry"


def test_only_real_failures_count_toward_dead_lettering():
    """Claims (429s, rows released unsent) no longer use up max_attempts; the reason says what counted."""
    s = RelayBatchSettings(max_attempts=25, backoff_initial_seconds=2, backoff_max_seconds=60)
    now = datetime(2026, 11, 1, 9, 0, tzinfo=UTC)
    unavailable = ProviderAnswer(503, {}, b"busy")
    # 24 rate-limited claims before it: the 25th claim's single 503 is the first failure, not the last.
    r = classify(unavailable, None, 25, s, now, failures={})
    assert (r.kind, r.failure_kind) == ("retry", "503") and 1.6 <= r.delay_seconds <= 2.0
    r = classify(unavailable, None, 40, s, now, failures={"503": 19, "timeout": 5})
    assert r.kind == "dead" and r.failure_kind == "503"
    assert r.error == "gave up after 25 failures: 20\u00d7 503, 5\u00d7 timeout; last: HTTP 503: busy"
    r = classify(None, "timeout: no answer within 10s", 30, s, now, failures={"503": 24}, failure_kind="timeout")
    assert (
        r.kind == "dead"
        and r.error is not None
        and r.error.startswith("gave up after 25 failures: 24\u00d7 503, 1\u00d7 timeout")
    )
    assert failure_summary({"timeout": 2, "503": 2, "connection error": 0}) == "2\u00d7 503, 2\u00d7 timeout"


def test_retry_after_is_honoured_on_503():
    s = RelayBatchSettings(backoff_initial_seconds=2, backoff_max_seconds=60, retry_after_max_seconds=120)
    now = datetime(2026, 11, 1, 9, 0, tzinfo=UTC)
    r = classify(ProviderAnswer(503, {"retry-after": "40"}), None, 1, s, now)
    assert (r.kind, r.delay_seconds, r.failure_kind) == ("retry", 40.0, "503"), "seconds"
    r = classify(ProviderAnswer(503, {"retry-after": "Sun, 01 Nov 2026 09:01:15 GMT"}), None, 1, s, now)
    assert r.delay_seconds == 75.0, "an HTTP date"
    r = classify(ProviderAnswer(503, {"retry-after": "999999"}), None, 1, s, now)
    assert r.delay_seconds == 120.0, "capped at retry_after_max_seconds"
    assert 1.6 <= classify(ProviderAnswer(503, {"retry-after": "soon"}), None, 1, s, now).delay_seconds <= 2.0
    r = classify(ProviderAnswer(503, {"retry-after": "40"}), None, 9, s, now, failures={"503": 24})
    assert r.kind == "dead", "Retry-After does not stop a 503 from counting"


def test_header_injection_guard_and_token_redaction():
    safe_headers({"Idempotency-Key": "renewal-reminder:acct_1:v1", "Authorization": "Bearer abc"})
    for headers in (
        {"Idempotency-Key": "k\r\nX-Injected: 1"},
        {"Idempotency-Key": "k\nX-Injected: 1"},
        {"X-Evil\r\nX-Injected": "1"},
        {"Bad Name": "1"},
        {"Authorization": "Bearer tok\x00"},
    ):
        with pytest.raises(HeaderInjectionError) as err:
            safe_headers(headers)
        assert "Injected" not in str(err.value) and "tok" not in str(err.value), "the error names no value"
    # A token that would inject headers is refused when the relay is built, and the error does not show it.
    with pytest.raises(HeaderInjectionError) as err:
        OutboxRelayActivities(None, "http://127.0.0.1:9", "secret-tok\r\nX-Injected: 1")
    assert "secret-tok" not in str(err.value)


# -- 3. nothing is sent for a cleanup that did not commit -------------------------------------------


async def test_no_reminder_is_sent_for_a_cleanup_that_rolled_back(client, pool, task_queue, relay_worker, provider):
    deadline = (datetime.now(UTC) - timedelta(minutes=1)).replace(microsecond=0)
    committed_account, rolled_back_account = await seed(pool, deadline, 2)
    cleanup_id = f"cleanup-test-{uuid.uuid4().hex[:6]}"
    assert committed_account < rolled_back_account
    await claim_partitions(pool, cleanup_id, deadline)
    compiled = (await CleanupActivities.create(pool, load_targets())).compiled
    batch_sql = compiled.batch_sql

    def batch_of_one(after: str) -> tuple[object, ...]:
        return compiled.batch_args(cleanup_id=cleanup_id, partition_no=0, after_account_id=after, batch_size=1)

    async with pool.acquire() as conn, conn.transaction():  # a batch of one: the first account
        row = await conn.fetchrow(batch_sql, *batch_of_one(""))
        assert row is not None and row["reminders"] == 1

    conn = await pool.acquire()
    try:
        tx = conn.transaction()
        await tx.start()
        row = await conn.fetchrow(batch_sql, *batch_of_one(committed_account))
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
    assert (
        await pool.fetchval("SELECT count(*) FROM demo_game.cloud_saves WHERE account_id = $1", rolled_back_account)
        == 2
    )


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
    assert (await outbox_status(pool)).pending == 1
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
            claim = OUTBOX_SQL.bind("claim_batch", lease_owner=owner, batch_size=300, lease_seconds=lease)
            return {r["event_id"] for r in await conn.fetch(OUTBOX_SQL.claim_batch, *claim)}

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
        delivered = outcome == "delivered"
        others = [] if delivered else ids
        args = OUTBOX_SQL.bind(
            "record_outcomes",
            lease_owner=owner,
            delivered_ids=ids if delivered else [],
            delivered_statuses=[202] * n if delivered else [],
            event_ids=others,
            outcomes=[outcome] * len(others),
            http_statuses=[503] * len(others),
            delays_seconds=[1.0] * len(others),
            errors=["HTTP 503"] * len(others),
            failure_kinds=["503"] * len(others),
        )
        return dict(await pool.fetchrow(OUTBOX_SQL.record_outcomes, *args))

    # The old owner's late 'retry' is fenced off; its 'delivered' is kept (the provider has the message).
    assert await record("relay-0", "retry") == {"delivered": 0, "retried": 0, "dead": 0, "fenced": n}
    assert (await record("relay-0", "delivered"))["delivered"] == n
    assert (await record("relay-5", "delivered"))["fenced"] == n, "recorded once"
    # The same owner recording again (its connection died after COMMIT): the same counts, no change.
    before = await pool.fetch("SELECT * FROM outbox WHERE event_id = ANY($1::bigint[]) ORDER BY event_id", ids)
    assert (await record("relay-0", "delivered")) == {"delivered": n, "retried": 0, "dead": 0, "fenced": 0}
    after = await pool.fetch("SELECT * FROM outbox WHERE event_id = ANY($1::bigint[]) ORDER BY event_id", ids)
    assert [dict(r) for r in before] == [dict(r) for r in after]


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


# -- what counts toward dead-lettering, Retry-After on 503 -------------------------------------


async def test_rate_limits_never_count_and_503_waits_its_retry_after(client, pool, task_queue, relay_worker, provider):
    p = provider.provider
    await add_event(pool, "k-after-429s")
    # Its history under the old counting: 24 claims answered 429, so `attempts` is already far past
    # max_attempts. A single 503 now is its first real failure, not a reason to give up.
    await pool.execute("UPDATE outbox SET attempts = 24 WHERE event_key = 'k-after-429s'")
    p.script("k-after-429s", ScriptedFault(503, times=1))
    await add_event(pool, "k-rate")
    p.script("k-rate", ScriptedFault(429, times=3, retry_after="0"))
    await add_event(pool, "k-503-retry-after")
    p.script("k-503-retry-after", ScriptedFault(503, times=1, retry_after="3"))
    await add_event(pool, "k-mixed")
    await pool.execute(
        "UPDATE outbox SET attempts = 2, failures = 2, failure_counts = '{\"timeout\": 2}' WHERE event_key = 'k-mixed'"
    )
    p.script("k-mixed", ScriptedFault(503, times=-1, body="down"))
    settings = FAST.model_copy(update={"max_attempts": 4})

    totals = await drain(client, task_queue, settings)

    rows = await rows_by_key(pool)
    after = rows["k-after-429s"]
    assert after["status"] == "delivered", after["dead_reason"]
    assert (after["attempts"], after["failures"], json.loads(after["failure_counts"])) == (26, 1, {"503": 1})

    rate = rows["k-rate"]
    assert rate["status"] == "delivered" and rate["attempts"] == 4
    assert (rate["failures"], json.loads(rate["failure_counts"])) == (0, {}), "429s are not failures"

    waited = rows["k-503-retry-after"]
    assert waited["status"] == "delivered" and waited["failures"] == 1
    first, second = p.times_for("k-503-retry-after")
    assert second - first >= 2.95, "the resend waited for the 503's Retry-After (backoff alone is 0.3 s)"

    mixed = rows["k-mixed"]
    assert mixed["status"] == "dead" and mixed["failures"] == 4
    reason = "gave up after 4 failures: 2\u00d7 503, 2\u00d7 timeout; last: HTTP 503: "
    assert mixed["dead_reason"] == reason + '{"error": "down"}'
    assert (totals.delivered, totals.dead) == (3, 1)


async def test_rows_released_unsent_when_the_lease_ran_short_do_not_count(
    client, pool, task_queue, relay_worker, provider
):
    p = provider.provider
    await add_event(pool, "k-hang")  # first in the batch: its request hangs until the request timeout
    await add_event(pool, "k-short")  # then the lease is too short to start another: released unsent
    p.script("k-hang", ScriptedFault(None, times=1))
    p.script("k-short", ScriptedFault(503, times=1))
    settings = FAST.model_copy(
        update={"concurrency": 1, "lease_seconds": FAST.request_timeout_seconds + 2, "max_attempts": 2}
    )

    await drain(client, task_queue, settings)

    short = (await rows_by_key(pool))["k-short"]
    sends = len(p.times_for("k-short"))
    assert short["status"] == "delivered", short["dead_reason"]
    assert sends == 2 and short["attempts"] > sends, "claimed once more than sent: released unsent at least once"
    assert (short["failures"], json.loads(short["failure_counts"])) == (1, {"503": 1})


# -- signals that arrive while a batch runs ---------------------------------------------------


class GatedRelay:
    """The real relay activity, held after chosen batches until the test releases it (a batch in flight)."""

    def __init__(self, relay: OutboxRelayActivities, hold_batches: set[int]) -> None:
        self.relay = relay
        self.hold_batches = hold_batches
        self.calls = 0
        self.held = asyncio.Event()
        self.release = asyncio.Event()

    @activity.defn(name=RELAY_OUTBOX_BATCH)
    async def relay_outbox_batch(self, input: RelayBatchInput) -> RelayBatchResult:
        self.calls += 1
        result = await self.relay.relay_outbox_batch(input)
        if self.calls in self.hold_batches:
            self.held.set()
            await self.release.wait()
        return result


@pytest_asyncio.fixture
async def gated(client, pool, task_queue, provider, token) -> AsyncIterator[GatedRelay]:
    relay = OutboxRelayActivities(pool, provider.url, token)
    g = GatedRelay(relay, hold_batches={1})
    async with build_worker(client, task_queue, [g.relay_outbox_batch]):
        yield g
        g.release.set()
    await relay.aclose()


async def test_a_nudge_during_a_batch_is_not_cleared_unseen(client, pool, task_queue, gated, provider):
    relay_id = f"relay-{uuid.uuid4().hex[:8]}"
    handle = await client.start_workflow(
        OutboxRelayWorkflow.run,
        OutboxRelayInput(relay_id=relay_id, settings=FAST, idle_sleep_seconds=3600),
        id=relay_id,
        task_queue=task_queue,
    )
    await asyncio.wait_for(gated.held.wait(), 30)  # batch 1 claimed nothing and is still in flight
    await add_event(pool, "k-late")
    await handle.signal(OutboxRelayWorkflow.nudge)  # in the history before the batch completes
    gated.release.set()

    async def delivered() -> bool:
        return bool(await pool.fetchval("SELECT status = 'delivered' FROM outbox WHERE event_key = 'k-late'"))

    # Without the nudge the relay would idle for idle_sleep_seconds (an hour) before looking again.
    await wait_until(delivered, within=60, interval=0.1)

    async def counted() -> bool:
        # The row commits before the workflow records the batch's result: its totals follow.
        return bool((await handle.query(OutboxRelayWorkflow.status)).totals.delivered >= 1)

    await wait_until(counted, within=30, interval=0.1)
    status = await handle.query(OutboxRelayWorkflow.status)
    assert status.totals.delivered == 1 and status.totals.batches >= 2
    await handle.signal(OutboxRelayWorkflow.stop)
    totals = await asyncio.wait_for(handle.result(), 60)
    assert totals.delivered == 1 and totals.runs == 1


async def test_a_stop_during_the_last_batch_before_continue_as_new_is_kept(client, pool, task_queue, gated, provider):
    await seed_events(pool, 5)
    relay_id = f"relay-{uuid.uuid4().hex[:8]}"
    handle = await client.start_workflow(
        OutboxRelayWorkflow.run,
        OutboxRelayInput(relay_id=relay_id, settings=FAST, idle_sleep_seconds=3600, batches_per_run=1),
        id=relay_id,
        task_queue=task_queue,
    )
    await asyncio.wait_for(gated.held.wait(), 30)  # batch 1 (the run's last) has sent its 5 and is in flight
    await handle.signal(OutboxRelayWorkflow.stop)
    gated.release.set()
    # Dropped, the stop would leave the next run relaying (idling for an hour); kept, the relay finishes.
    totals = await asyncio.wait_for(handle.result(), 60)
    assert (totals.delivered, totals.batches) == (5, 1)


# -- a relay whose database connection died mid-batch resumes its own lease --------------------


async def test_a_batch_whose_database_connection_died_is_recorded_once_the_database_is_back(
    client, pool, db_url, task_queue, provider, token
):
    app = f"relay-under-test-{uuid.uuid4().hex[:6]}"
    relay_pool = await asyncpg.create_pool(
        db_url, min_size=1, max_size=4, server_settings={"application_name": app, **service_settings()}
    )
    relay = OutboxRelayActivities(relay_pool, provider.url, token)
    p = provider.provider
    await seed_events(pool, 20)
    held_key = "renewal-reminder:acct_t1:v1"
    p.hold(held_key)  # keeps the batch in flight until the test has set the trap
    # A lease far longer than the test may take: delivery must not wait for it.
    settings = FAST.model_copy(update={"lease_seconds": 600, "request_timeout_seconds": 60})
    locker = await pool.acquire()
    try:
        async with build_worker(client, task_queue, [relay.relay_outbox_batch]):
            run = asyncio.create_task(drain(client, task_queue, settings))

            async def sending() -> bool:
                return len(p.times_for(held_key)) == 1

            await wait_until(sending, within=30, interval=0.05)  # claimed (committed) and sending
            leases = await pool.fetch("SELECT event_id, lease_owner, leased_until FROM outbox ORDER BY event_id")
            assert len({r["lease_owner"] for r in leases}) == 1 and all(r["leased_until"] for r in leases)
            lease_end = leases[0]["leased_until"]

            # Hold one row's lock so the batch's recording statement waits on it, then kill every
            # backend of the relay's pool while that statement is in flight.
            tx = locker.transaction()
            await tx.start()
            await locker.execute("SELECT 1 FROM outbox WHERE event_key = $1 FOR UPDATE", held_key)
            p.release(held_key)

            async def recording_blocked() -> bool:
                return bool(
                    await pool.fetchval(
                        # The relay's only statement that waits for a row lock (its claim skips
                        # locked rows); its text is longer than pg_stat_activity keeps.
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
                        "AND wait_event_type = 'Lock' AND state = 'active'",
                        app,
                    )
                )

            await wait_until(recording_blocked, within=30, interval=0.05)
            killed = await pool.fetchval(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = $1",
                app,
            )
            assert killed >= 1
            await tx.rollback()

            async def all_delivered() -> bool:
                return bool(await pool.fetchval("SELECT count(*) = 20 FROM outbox WHERE status = 'delivered'"))

            await wait_until(all_delivered, within=120, interval=0.1)
            totals = await asyncio.wait_for(run, 60)
    finally:
        await pool.release(locker)
        await relay.aclose()
        await relay_pool.close()

    rows = await pool.fetch("SELECT attempts, delivered_at, lease_owner, leased_until FROM outbox")
    # Recorded under the original lease, by its owner: nobody waited for the lease to expire, nothing
    # was claimed (or sent) a second time.
    assert all(r["delivered_at"] < lease_end for r in rows)
    assert all(r["attempts"] == 1 and r["lease_owner"] is None and r["leased_until"] is None for r in rows)
    assert totals.delivered == 20 and totals.claimed == 20
    s = stats(provider)
    assert s["unique_keys"] == 20 and s["received"] == 20 and s["duplicates"] == 0
