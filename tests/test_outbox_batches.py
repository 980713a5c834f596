"""The relay sending batches to the provider's batch endpoint (MAIL_PROVIDER_BATCH_MAX > 1), against
real Postgres, a real HTTP provider (demo.mail_provider) and real Temporal.

1. A partly accepted batch records each event's own result: delivered, retried later (its own
   Retry-After honoured), dead-lettered; one event's 422 is its dead letter alone.
2. A whole batch answered 429 with Retry-After waits that long; a batch refused whole (413) is a
   failure retried, never the events' dead letter.
3. A relay process killed between sending a batch and recording it: the batch is sent again, the
   provider counts every resent key as a duplicate, and the customer gets each reminder once.
4. One activity makes several claims (`claims_per_batch`), each under its own lease and recorded
   by itself, until a claim comes back short.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from temporalio.client import Client
from temporalio.worker import Worker

from activities.outbox import (
    EventAnswer,
    OutboxRelayActivities,
    Outcome,
    ProviderAnswer,
    batch_event_answers,
    classify,
    message_json,
)
from core.failpoints import EXIT_CODE
from demo.mail_provider import FaultShares, MailProvider, ProviderThread, ScriptedFault
from outbox.models import FAILURE_BATCH_ANSWER, RelayBatchSettings, RelayTotals
from outbox.operations import start_relays
from tests.helpers import wait_until
from tests.test_outbox import FAST, add_event, drain, rows_by_key, seed_events, wait_exit
from worker import build_worker
from workflows.outbox_relay import OutboxRelayWorkflow

BATCH_MAX = 10


@pytest.fixture
def token() -> str:
    return f"tok-{secrets.token_urlsafe(24)}"


@pytest.fixture
def provider(token: str) -> Iterator[ProviderThread]:
    with ProviderThread(MailProvider(token, FaultShares(hang_seconds=3), seed=5)) as served:
        yield served


@pytest_asyncio.fixture
async def batch_worker(
    client: Client, pool: asyncpg.Pool, task_queue: str, provider: ProviderThread, token: str
) -> AsyncIterator[Worker]:
    """An in-process worker whose relay sends batches of BATCH_MAX events to the test's provider."""
    relay = OutboxRelayActivities(pool, provider.url, token, batch_max=BATCH_MAX)
    async with build_worker(client, task_queue, [relay.relay_outbox_batch]) as w:
        yield w


async def wait_for_status(pool: asyncpg.Pool, key: str, status: int) -> None:
    async def answered() -> bool:
        return bool(await pool.fetchval("SELECT last_http_status FROM outbox WHERE event_key = $1", key) == status)

    await wait_until(answered, within=20, interval=0.05)


# -- 1. a partly accepted batch ----------------------------------------------------------------------


async def test_a_partly_accepted_batch_records_each_events_result(client, pool, task_queue, batch_worker, provider):
    p = provider.provider
    await seed_events(pool, 15, prefix="ok")
    for key in ("k-429", "k-503", "k-400"):
        await add_event(pool, key)
    await add_event(pool, "k-bad-kind", kind="no_such_template")
    p.script("k-429", ScriptedFault(429, times=1, retry_after="3"))
    p.script("k-503", ScriptedFault(503, times=2))
    p.script("k-400", ScriptedFault(400, times=-1, body="invalid recipient address"))

    run = asyncio.create_task(drain(client, task_queue, FAST))
    await wait_for_status(pool, "k-429", 429)
    first = await pool.fetchrow("SELECT next_attempt_at, last_attempt_at FROM outbox WHERE event_key = 'k-429'")
    assert (first["next_attempt_at"] - first["last_attempt_at"]).total_seconds() >= 3.0, "its own Retry-After"
    totals = await run

    rows = await rows_by_key(pool)
    assert rows["k-429"]["status"] == "delivered" and rows["k-429"]["attempts"] == 2
    assert rows["k-429"]["failures"] == 0, "a rate limit inside a batch is no failure either"
    assert rows["k-429"]["delivered_at"] >= first["next_attempt_at"], "not sent again before its Retry-After"
    sent_at = p.times_for("k-429")
    assert len(sent_at) == 2 and sent_at[1] - sent_at[0] >= 2.95
    assert rows["k-503"]["status"] == "delivered" and rows["k-503"]["attempts"] == 3
    assert rows["k-503"]["failure_counts"] in ({"503": 2}, json.dumps({"503": 2}))
    assert rows["k-400"]["status"] == "dead" and rows["k-400"]["attempts"] == 1
    assert rows["k-400"]["dead_reason"] == "HTTP 400: invalid recipient address"
    assert rows["k-bad-kind"]["status"] == "dead"
    assert "no template for kind 'no_such_template'" in rows["k-bad-kind"]["dead_reason"]
    delivered = [k for k, r in rows.items() if r["status"] == "delivered"]
    assert len(delivered) == 17 and totals.delivered == 17 and totals.dead == 2

    s = p.stats()
    assert s["received"] == s["batch_messages"], "every event went through the batch endpoint"
    # 19 events in batches of at most 10, then the retried ones: fewer requests than events.
    assert 2 <= s["batch_requests"] < s["batch_messages"]
    assert s["batch_results"]["429"] == 1 and s["batch_results"]["503"] == 2 and s["batch_results"]["400"] == 1
    mailbox = [m["idempotency_key"] for m in p.messages()]
    assert sorted(mailbox) == sorted(delivered), "each delivered event once in the customer's mailbox"


# -- 2. a batch answered, or refused, as a whole ------------------------------------------------------


async def test_a_whole_batch_429_waits_its_retry_after_and_a_refused_batch_is_retried(
    client, pool, task_queue, batch_worker, provider
):
    p = provider.provider
    await seed_events(pool, 6, prefix="whole")
    p.script_batch(ScriptedFault(429, times=1, retry_after="3"))
    p.script_batch(ScriptedFault(413, times=1, body="batch too large today"))
    key = "renewal-reminder:acct_whole1:v1"

    run = asyncio.create_task(drain(client, task_queue, FAST))
    await wait_for_status(pool, key, 429)
    limited = await pool.fetch("SELECT next_attempt_at - last_attempt_at AS waited, failures FROM outbox")
    assert all(r["waited"].total_seconds() >= 3.0 and r["failures"] == 0 for r in limited), limited
    await run

    rows = await rows_by_key(pool)
    assert {r["status"] for r in rows.values()} == {"delivered"}
    # Claimed three times: the 429 (no failure), the 413 (a failure of the batch, not a dead letter), delivered.
    assert {(r["attempts"], r["failures"]) for r in rows.values()} == {(3, 1)}
    assert {r["last_error"] for r in rows.values()} == {
        'the provider refused the whole batch: HTTP 413: {"error": "batch too large today"}'
    }
    s = p.stats()
    assert s["faults"] == {"batch 429": 1, "batch 413": 1} and s["delivered"] == 6


def judge(answered: EventAnswer, s: RelayBatchSettings) -> Outcome:
    answer, failure, failure_kind = answered
    return classify(answer, failure, 1, s, failure_kind=failure_kind)


def test_batch_answers_are_judged_event_by_event():
    s = RelayBatchSettings(backoff_initial_seconds=2, backoff_max_seconds=60)
    keys = ["a", "b", "c"]
    results = {
        "results": [
            {"idempotency_key": "a", "status": 202},
            {"idempotency_key": "b", "status": 429, "retry_after": "7", "error": "slow down"},
        ]
    }
    each = batch_event_answers(ProviderAnswer(200, {}, json.dumps(results).encode()), None, None, keys)
    assert judge(each["a"], s).kind == "delivered"
    r = classify(each["b"][0], None, 1, s)
    assert (r.kind, r.delay_seconds, r.failure_kind) == ("retry", 7.0, None)
    assert each["c"][1:] == ("no result for this event in the provider's batch answer", FAILURE_BATCH_ANSWER)
    whole = batch_event_answers(ProviderAnswer(503, {"retry-after": "9"}, b"down"), None, None, keys)
    assert {judge(whole[k], s).delay_seconds for k in keys} == {9.0}, "a whole-batch 503 is every event's"
    refused = batch_event_answers(ProviderAnswer(400, {}, b"bad json"), None, None, keys)
    assert {judge(refused[k], s).kind for k in keys} == {"retry"}, "a refused batch is no event's dead letter"
    garbled = batch_event_answers(ProviderAnswer(200, {}, b"<html>"), None, None, keys)
    assert {garbled[k][2] for k in keys} == {FAILURE_BATCH_ANSWER}
    lost = batch_event_answers(None, "timeout: no answer within 1s", "timeout", keys)
    assert {judge(lost[k], s).failure_kind for k in keys} == {"timeout"}
    row = {"event_key": "k", "kind": "renewal_reminder", "account_id": "a", "source_id": "s", "payload": '{"x": 1}'}
    assert json.loads(message_json(row)) == {
        "idempotency_key": "k",
        "event_key": "k",
        "kind": "renewal_reminder",
        "account_id": "a",
        "source_id": "s",
        "payload": {"x": 1},
    }


# -- 3. a batch sent again after its relay was killed -------------------------------------------------


async def test_a_batch_resent_after_its_relay_was_killed_duplicates_nothing(
    client, pool, task_queue, worker_processes, provider, token
):
    total = 1_000
    await seed_events(pool, total, prefix="kill")
    provider.provider.configure(share_5xx=0.02, share_429=0.01, retry_after="1")
    env = {"MAIL_PROVIDER_URL": provider.url, "MAIL_PROVIDER_TOKEN": token, "MAIL_PROVIDER_BATCH_MAX": "50"}
    # This relay process dies right after sending its first claim's batches, before recording them.
    doomed = worker_processes.start(CLEANUP_FAILPOINTS="relay_outbox_batch.after_send=exit", **env)

    async def polling() -> bool:
        return "worker polling" in worker_processes.logs()

    await wait_until(polling, within=30)
    worker_processes.start(**env)
    relays = await start_relays(
        client,
        task_queue,
        relays=2,
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

    assert dict(await pool.fetch("SELECT status, count(*) FROM outbox GROUP BY status")) == {"delivered": total}
    assert sum(r.delivered for r in results) == total, "each event recorded as delivered exactly once"
    s: dict[str, Any] = provider.provider.stats()
    assert s["batch_requests"] > 0 and s["received"] == s["batch_messages"], "sent in batches only"
    assert s["delivered"] == s["unique_keys"] == total, "the customer got each reminder once"
    mailbox = [m["idempotency_key"] for m in provider.provider.messages()]
    assert len(mailbox) == len(set(mailbox)) == total
    # The killed claim's batches were sent and never recorded: sent again, each resent key counted as
    # a duplicate by the provider and delivered to nobody.
    assert s["duplicates"] >= 1, s
    faults = s["faults"].get("429", 0) + s["faults"].get("503", 0)
    assert s["received"] == total + s["duplicates"] + faults
    assert token not in worker_processes.logs()


# -- 4. several claims per activity ---------------------------------------------------------------


async def test_one_activity_makes_several_claims_each_under_its_own_lease(
    client, pool, task_queue, batch_worker, provider
):
    await seed_events(pool, 95, prefix="multi")
    settings = FAST.model_copy(update={"batch_size": 20, "claims_per_batch": 3})
    totals = await drain(client, task_queue, settings)

    assert (totals.claimed, totals.delivered, totals.fenced) == (95, 95, 0)
    # Claims of 20: three full ones in the first activity, then a full one and the short one that
    # ends the second activity (and tells the relay the outbox is drained).
    assert totals.batches == 2
    owners = await pool.fetch("SELECT recorded_by, count(*) AS n FROM outbox GROUP BY recorded_by ORDER BY n DESC")
    assert [r["n"] for r in owners] == [20, 20, 20, 20, 15], "each claim its own lease owner, recorded by itself"
    rows = await rows_by_key(pool)
    assert {(r["status"], r["attempts"]) for r in rows.values()} == {("delivered", 1)}
    assert provider.provider.stats()["delivered"] == 95
