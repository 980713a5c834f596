"""Edges of the outbox relay: what a dead letter's log line shows, the provider URL's scheme,
a 409 after our own timeout, redelivery by filter, and relay commands scoped to a task queue."""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
import uuid
from datetime import timedelta

import pytest
from pydantic import SecretStr

from activities.outbox import OutboxRelayActivities, ProviderAnswer, classify
from core.codec import new_key, pseudonymize
from core.config import Settings
from core.temporal import connect
from demo.mail_provider import FaultShares, MailProvider, ProviderThread, ScriptedFault
from outbox.models import FAILURE_TIMEOUT, RELAY_NUDGE_SIGNAL, RELAY_STOP_SIGNAL, OutboxRelayInput
from outbox.operations import nudge_relays, stop_relays
from tests.helpers import wait_until
from tests.test_cleanup_input import run_cli
from tests.test_outbox import FAST
from worker import build_worker
from workflows.outbox_relay import OutboxRelayWorkflow


async def test_a_dead_letter_log_line_shows_the_pseudonym_and_a_short_scrubbed_reply(
    pool, task_queue, temporal_address, caplog
):
    caplog.set_level(logging.INFO)
    token = f"tok-{secrets.token_urlsafe(24)}"
    enc = await connect(Settings(temporal_address=temporal_address, payload_encryption_key=SecretStr(new_key())))
    account = f"acct_private_{uuid.uuid4().hex[:8]}"
    tail = f"TAIL-{uuid.uuid4().hex}"
    await pool.execute(
        "INSERT INTO outbox (event_key, kind, account_id, source_id, payload)"
        " VALUES ('k-echo', 'renewal_reminder', $1, 'test', jsonb_build_object('account_id', $1::text))",
        account,
    )
    reply = f"rejected recipient of {account}\n" + "x" * 400 + tail
    with ProviderThread(MailProvider(token, FaultShares(hang_seconds=3), seed=3)) as provider:
        provider.provider.script("k-echo", ScriptedFault(422, times=-1, body=reply))
        relay = OutboxRelayActivities(pool, provider.url, token)
        relay_id = f"relay-{uuid.uuid4().hex[:8]}"
        async with build_worker(enc, task_queue, [relay.relay_outbox_batch]):
            await enc.execute_workflow(
                OutboxRelayWorkflow.run,
                OutboxRelayInput(relay_id=relay_id, settings=FAST, idle_sleep_seconds=0.5, stop_when_drained=True),
                id=relay_id,
                task_queue=task_queue,
                execution_timeout=timedelta(seconds=90),
            )
    assert await pool.fetchval("SELECT status FROM outbox WHERE event_key = 'k-echo'") == "dead"
    [line] = [r.getMessage() for r in caplog.records if "dead-lettered" in r.getMessage()]
    assert account not in line, "the raw account ID stays out of the logs under payload encryption"
    assert pseudonymize(enc.data_converter.payload_codec, account) in line
    assert tail not in line and "\n" not in line, "the provider's reply is cut short, on one line"


# -- the provider URL -------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["http://mail.example.com", "http://10.1.2.3:8025", "http://[2001:db8::1]/"])
def test_plain_http_beyond_loopback_is_refused_unless_allowed(url, monkeypatch):
    with pytest.raises(ValueError, match="in clear"):
        OutboxRelayActivities(None, url, "tok")
    monkeypatch.setenv("MAIL_PROVIDER_URL", url)
    monkeypatch.setenv("MAIL_PROVIDER_TOKEN", "tok")
    with pytest.raises(ValueError, match="MAIL_PROVIDER_ALLOW_HTTP"):
        OutboxRelayActivities.from_settings(None, Settings.from_env().outbox)
    monkeypatch.setenv("MAIL_PROVIDER_ALLOW_HTTP", "1")
    OutboxRelayActivities.from_settings(None, Settings.from_env().outbox)
    for fine in ("https://mail.example.com", "http://127.0.0.1:8025", "http://localhost:8025", "http://[::1]:8025"):
        OutboxRelayActivities(None, fine, "tok")


# -- the local provider's fault settings --------------------------------------------------------------


@pytest.mark.parametrize("bad", [{"share_5xx": float("nan")}, {"share_429": 1.5}, {"hang_seconds": -1.0}])
def test_the_provider_refuses_bad_fault_settings_and_keeps_the_ones_it_has(bad):
    with pytest.raises(ValueError, match="must be between"):
        FaultShares(**bad)
    provider = MailProvider("tok", FaultShares(share_4xx=0.25))
    with pytest.raises(ValueError, match="must be between"):
        provider.configure(share_timeout=0.5, **bad)
    assert provider.shares == FaultShares(share_4xx=0.25), "a bad setting changes none"
    name, value = next(iter(bad.items()))
    run = subprocess.run(
        [sys.executable, "-m", "demo.mail_provider", f"--{name.replace('_', '-')}", str(value)],
        env=dict(os.environ, MAIL_PROVIDER_TOKEN="tok"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and f"{name} must be between" in run.stderr


# -- a 409 after our own timeout ----------------------------------------------------------------------


def test_a_409_after_our_timeout_is_asked_again_other_409s_are_dead_letters():
    answer = ProviderAnswer(409, {}, b'{"error": "a request with this Idempotency-Key is still in progress"}')
    again = classify(answer, None, 2, FAST, failures={FAILURE_TIMEOUT: 1})
    assert again.kind == "retry" and again.failure_kind is None and "in progress" in (again.error or "")
    assert classify(answer, None, 1, FAST).kind == "dead", "a 409 out of the blue is the provider's rejection"


async def test_an_event_whose_request_timed_out_is_delivered_once_not_dead_lettered_on_409(pool, task_queue, client):
    token = f"tok-{secrets.token_urlsafe(24)}"
    await pool.execute(
        "INSERT INTO outbox (event_key, kind, account_id, source_id, payload)"
        " VALUES ('k-slow', 'renewal_reminder', 'acct_slow', 'test', '{}'::jsonb)"
    )
    # The first request is delivered but answered only after our timeout; meanwhile the provider
    # answers 409 "in progress" to the same key, then 200 "duplicate" once it has finished.
    provider_state = MailProvider(token, FaultShares(hang_seconds=8), seed=5, conflict_while_processing=True)
    provider_state.script("k-slow", ScriptedFault(None, times=1))
    with ProviderThread(provider_state) as provider:
        relay = OutboxRelayActivities(pool, provider.url, token)
        async with build_worker(client, task_queue, [relay.relay_outbox_batch]):
            relay_id = f"relay-{uuid.uuid4().hex[:8]}"
            await client.execute_workflow(
                OutboxRelayWorkflow.run,
                OutboxRelayInput(relay_id=relay_id, settings=FAST, idle_sleep_seconds=0.5, stop_when_drained=True),
                id=relay_id,
                task_queue=task_queue,
                execution_timeout=timedelta(seconds=120),
            )
        stats = provider.provider.stats()
    row = await pool.fetchrow("SELECT status, dead_reason FROM outbox WHERE event_key = 'k-slow'")
    assert provider_state.responses[409] >= 1, "the scenario happened: the provider answered 409 in progress"
    assert row["status"] == "delivered", row["dead_reason"]
    assert [m["idempotency_key"] for m in provider_state.messages()] == ["k-slow"], stats


# -- redelivery by filter -----------------------------------------------------------------------------


async def _dead(pool, key: str, reason: str, dead_at: str) -> None:
    await pool.execute(
        "INSERT INTO outbox (event_key, kind, account_id, source_id, payload, status, attempts, failures,"
        " dead_at, dead_reason) VALUES ($1, 'renewal_reminder', 'acct_x', 'test', '{}'::jsonb, 'dead', 4, 4,"
        " $3::text::timestamptz, $2)",
        key,
        reason,
        dead_at,
    )


async def test_redelivery_by_filter_counts_first_and_acts_only_when_confirmed(pool, settings):
    await _dead(pool, "k-outage-1", "gave up after 4 failures: 4x 503; last: HTTP 503", "2026-12-01T10:00:00Z")
    await _dead(pool, "k-outage-2", "gave up after 4 failures: 4x timeout", "2026-12-01T11:00:00Z")
    await _dead(pool, "k-old", "gave up after 4 failures: 4x 503", "2026-11-20T10:00:00Z")
    await _dead(pool, "k-rejected", "HTTP 422: template rejected", "2026-12-01T12:00:00Z")
    filter_args = ["outbox", "redeliver", "--dead-since", "2026-12-01T00:00:00Z", "--dead-reason", "GAVE UP"]

    counted = run_cli(settings, *filter_args, "--json")
    assert counted.returncode == 0, counted.stderr
    assert json.loads(counted.stdout)["matching"] == 2 and json.loads(counted.stdout)["redelivered"] == 0
    assert await pool.fetchval("SELECT count(*) FROM outbox WHERE status = 'dead'") == 4, "a count changes nothing"

    done = run_cli(settings, *filter_args, "--yes")
    assert done.returncode == 0, done.stderr
    assert "2 dead letter(s) redelivered" in done.stdout
    rows = {r["event_key"]: r for r in await pool.fetch("SELECT event_key, status, attempts FROM outbox")}
    assert {k for k, r in rows.items() if r["status"] == "pending"} == {"k-outage-1", "k-outage-2"}
    assert rows["k-outage-1"]["attempts"] == 0
    assert rows["k-old"]["status"] == rows["k-rejected"]["status"] == "dead"

    nothing = run_cli(settings, "outbox", "redeliver", "--yes")
    assert nothing.returncode == 2 and "give a filter" in nothing.stderr


# -- relay commands scoped to this task queue ---------------------------------------------------------


async def test_relay_stop_and_nudge_act_on_this_task_queues_relays_only(client, task_queue):
    ours, theirs = f"relay-ours-{uuid.uuid4().hex[:8]}", f"relay-theirs-{uuid.uuid4().hex[:8]}"
    other_queue = f"{task_queue}-other"
    # No worker polls either queue: the relays stay running, and what they were sent stays in history.
    for workflow_id, queue in ((ours, task_queue), (theirs, other_queue)):
        await client.start_workflow(
            OutboxRelayWorkflow.run,
            OutboxRelayInput(relay_id=workflow_id, settings=FAST),
            id=workflow_id,
            task_queue=queue,
        )
    try:
        await wait_until(lambda: _visible(client, [ours, theirs]))
        assert await nudge_relays(client, task_queue) == [ours]
        assert await stop_relays(client, task_queue) == [ours]
        assert await _signals(client, ours) == [RELAY_NUDGE_SIGNAL, RELAY_STOP_SIGNAL]
        assert await _signals(client, theirs) == []
    finally:
        for workflow_id in (ours, theirs):
            await client.get_workflow_handle(workflow_id).terminate("test over")


async def _visible(client, workflow_ids: list[str]) -> bool:
    query = " OR ".join(f"WorkflowId = '{w}'" for w in workflow_ids)
    return len([wf async for wf in client.list_workflows(f"ExecutionStatus = 'Running' AND ({query})")]) == len(
        workflow_ids
    )


async def _signals(client, workflow_id: str) -> list[str]:
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    return [
        e.workflow_execution_signaled_event_attributes.signal_name
        for e in history.events
        if e.HasField("workflow_execution_signaled_event_attributes")
    ]
