"""The ledger's and the outbox relay's heartbeat timeouts: 7 s by default (core.heartbeat), set by
the environment or the CLI, and a bad value named (exit 2). The cleanup's are tested with its
reporting (test_cleanup_reporting.py)."""

from __future__ import annotations

import asyncio
import json
from datetime import date
from typing import Any

from core.config import Settings
from core.heartbeat import DEFAULT_HEARTBEAT_TIMEOUT_SECONDS
from ledger.operations import ReconcileRequest, start_reconciliation
from outbox.models import RelayBatchSettings
from outbox.operations import start_relays
from tests.ledger_helpers import id_prefix, seed_day
from tests.test_cleanup_input import run_cli

DAY = date(2011, 3, 7)


async def test_ledger_and_relay_heartbeat_timeouts_come_from_the_cli_or_the_environment(
    client, pool, settings, task_queue, monkeypatch
):
    async def input_of(workflow_id: str) -> dict[str, Any]:
        history = await client.get_workflow_handle(workflow_id).fetch_history()
        started = history.events[0].workflow_execution_started_event_attributes
        data: dict[str, Any] = json.loads(started.input.payloads[0].data)
        return data

    started: list[str] = []
    for name in ("LEDGER_HEARTBEAT_TIMEOUT_SECONDS", "OUTBOX_HEARTBEAT_TIMEOUT_SECONDS"):
        monkeypatch.delenv(name, raising=False)
    assert DEFAULT_HEARTBEAT_TIMEOUT_SECONDS <= 8, "a dead worker's work resumes within 10 s"

    await seed_day(pool, DAY, payments=40, shards=2)
    by_default = await start_reconciliation(
        client, pool, task_queue, ReconcileRequest(business_date=DAY, id_prefix=id_prefix(task_queue))
    )
    started.append(by_default.workflow_id)
    assert (await input_of(by_default.workflow_id))["heartbeat_timeout_seconds"] == DEFAULT_HEARTBEAT_TIMEOUT_SECONDS
    relay = RelayBatchSettings(request_timeout_seconds=2, lease_seconds=5)
    [default_relay] = await start_relays(client, task_queue, settings=relay, id_prefix=f"{task_queue}-a-")
    started.append(default_relay.workflow_id)
    relay_input = await input_of(default_relay.workflow_id)
    assert relay_input["settings"]["heartbeat_timeout_seconds"] == DEFAULT_HEARTBEAT_TIMEOUT_SECONDS

    monkeypatch.setenv("LEDGER_HEARTBEAT_TIMEOUT_SECONDS", "5")
    monkeypatch.setenv("OUTBOX_HEARTBEAT_TIMEOUT_SECONDS", "6")
    read_once = Settings.from_env()  # the environment is read into the settings, once, and passed down
    from_env = await start_reconciliation(
        client,
        pool,
        task_queue,
        ReconcileRequest(business_date=DAY, id_prefix=f"{id_prefix(task_queue)}-env"),
        read_once.ledger,
    )
    started.append(from_env.workflow_id)
    assert (await input_of(from_env.workflow_id))["heartbeat_timeout_seconds"] == 5.0
    with_env = relay.model_copy(update={"heartbeat_timeout_seconds": read_once.outbox.heartbeat_timeout_seconds})
    [env_relay] = await start_relays(client, task_queue, settings=with_env, id_prefix=f"{task_queue}-b-")
    started.append(env_relay.workflow_id)
    assert (await input_of(env_relay.workflow_id))["settings"]["heartbeat_timeout_seconds"] == 6.0

    # The CLI's flag wins over the environment; the CLI's runs use the default workflow IDs.
    done = await asyncio.to_thread(
        run_cli, settings, "reconcile", "--date", DAY.isoformat(), "--heartbeat-timeout", "4", "--json"
    )
    assert done.returncode == 0, done.stderr
    started.append(json.loads(done.stdout)["workflow_id"])
    assert (await input_of(started[-1]))["heartbeat_timeout_seconds"] == 4.0
    done = await asyncio.to_thread(
        run_cli, settings, "outbox", "relay", "start", "--relays", "1", "--heartbeat-timeout", "3", "--json"
    )
    assert done.returncode == 0, done.stderr
    started.append(json.loads(done.stdout)[0]["workflow_id"])
    assert (await input_of(started[-1]))["settings"]["heartbeat_timeout_seconds"] == 3.0

    monkeypatch.setenv("LEDGER_HEARTBEAT_TIMEOUT_SECONDS", "soon")
    bad = await asyncio.to_thread(run_cli, settings, "reconcile", "--date", "2011-03-08")
    assert bad.returncode == 2 and "LEDGER_HEARTBEAT_TIMEOUT_SECONDS" in bad.stderr, bad.stderr
    monkeypatch.delenv("LEDGER_HEARTBEAT_TIMEOUT_SECONDS")  # a bad variable stops every command
    bad = await asyncio.to_thread(run_cli, settings, "outbox", "relay", "start", "--heartbeat-timeout", "0")
    assert bad.returncode == 2 and "heartbeat_timeout_seconds" in bad.stderr, bad.stderr

    for workflow_id in started:
        await client.get_workflow_handle(workflow_id).terminate("test over")
