"""Edges of the outbox relay: what a dead letter's log line shows, the provider URL's scheme,
a 409 after our own timeout, redelivery by filter, and relay commands scoped to a task queue."""

from __future__ import annotations

import logging
import secrets
import uuid
from datetime import timedelta

from pydantic import SecretStr

from activities.outbox import OutboxRelayActivities
from core.codec import new_key, pseudonymize
from core.config import Settings
from core.temporal import connect
from outbox.mail_provider import MailProvider, ProviderThread, ScriptedFault
from outbox.models import OutboxRelayInput
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
    with ProviderThread(MailProvider(token, seed=3, hang_seconds=3)) as provider:
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
