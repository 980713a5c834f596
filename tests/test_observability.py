"""Observability: Prometheus metrics from a worker, and logs that carry the Temporal IDs."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import asyncpg
from temporalio.client import Client
from temporalio.worker import Worker

from cleanup.inputs import StartCleanup
from cleanup.operations import renew, start_cleanup
from core import logs, metrics
from core.config import PROJECT_ROOT, Settings
from core.temporal import connect
from devstack.embedded import free_port
from tests.helpers import deadline_in, seed
from tests.logging_workflow import LoggingWorkflow, log_from_activity
from worker import build_activities, build_worker
from workflows.renewal_cleanup import RenewalCleanupWorkflow

SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    found = []
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m["name"] == name:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m["labels"] or ""))
            found.append((labels, float(m["value"])))
    return found


def total(text: str, name: str, **want: str) -> float:
    return sum(v for labels, v in samples(text, name) if all(labels.get(k) == w for k, w in want.items()))


async def test_worker_metrics_endpoint_has_temporal_and_cleanup_counters(
    pool: asyncpg.Pool, task_queue: str, temporal_address: str
) -> None:
    port = free_port()
    runtime = metrics.runtime(f"127.0.0.1:{port}")
    client = await connect(Settings(temporal_address=temporal_address), runtime=runtime)
    deadline = deadline_in(2)
    accounts = await seed(pool, deadline, 40)
    for account_id in accounts[:6]:  # renewed before the claim: skipped as renewed
        assert (await renew(client, pool, task_queue, account_id)).in_time
    async with build_worker(client, task_queue, await build_activities(pool)):
        started = await start_cleanup(
            client, pool, task_queue, StartCleanup(deadline=deadline, partitions=3, batch_size=5)
        )
        result = await client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id).result()
        assert result.settlement is not None and result.settlement.cleaned == 34
        text = await asyncio.to_thread(scrape, port)

    (PROJECT_ROOT / "tests" / "artifacts").mkdir(exist_ok=True)
    (PROJECT_ROOT / "tests" / "artifacts" / "metrics.txt").write_text(text)
    # Temporal's runtime metrics ...
    assert any(line.startswith("temporal_") for line in text.splitlines()), text[:2000]
    assert total(text, "temporal_activity_execution_latency_count", task_queue=task_queue) > 0 or samples(
        text, "temporal_request"
    )
    # ... and the project's, labelled with the task queue and activity type.
    assert total(text, "cleanup_accounts_cleaned", task_queue=task_queue, activity_type="cleanup_partition") == 34
    assert total(text, "cleanup_accounts_skipped", task_queue=task_queue, reason="renewed") == 6
    assert total(text, "cleanup_accounts_skipped", task_queue=task_queue, reason="stale") == 0
    assert total(text, "cleanup_duplicates_absorbed", task_queue=task_queue) == 0
    assert total(text, "cleanup_settlements", task_queue=task_queue) == 1


async def test_metric_helpers_outside_an_activity_use_the_installed_meter() -> None:
    port = free_port()
    runtime = metrics.runtime(f"127.0.0.1:{port}")
    metrics.install(runtime.metric_meter)
    try:
        metrics.record_corrections(3)
        metrics.record_review_rows(2)
        metrics.record_outbox(delivered=5, dead=1)
        metrics.record_outbox(delivered=0, dead=0)  # zeros are fine
        text = await asyncio.to_thread(scrape, port)
    finally:
        metrics.install(None)
    assert total(text, "ledger_corrections") == 3
    assert total(text, "ledger_review_rows") == 2
    assert total(text, "outbox_delivered") == 5
    assert total(text, "outbox_dead_lettered") == 1
    metrics.record_corrections(1)  # nothing installed, not in an activity: a no-op, never an error


class Capture(logging.Handler):
    def __init__(self, formatter: logging.Formatter) -> None:
        super().__init__()
        self.setFormatter(formatter)
        self.addFilter(logs.TemporalContextFilter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


async def test_json_logs_carry_workflow_and_activity_ids(client: Client, task_queue: str) -> None:
    capture = Capture(logs.JsonFormatter(secrets=["s3cret-value"]))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(capture)
    root.setLevel(logging.INFO)
    logs.ids_as_fields_only()
    try:
        text = f"hello {uuid.uuid4().hex[:6]} s3cret-value"
        async with Worker(client, task_queue=task_queue, workflows=[LoggingWorkflow], activities=[log_from_activity]):
            workflow_id = f"logging-{uuid.uuid4().hex[:8]}"
            assert await client.execute_workflow(LoggingWorkflow.run, text, id=workflow_id, task_queue=task_queue)
    finally:
        root.removeHandler(capture)
        root.setLevel(old_level)
    records = [json.loads(line) for line in capture.lines]
    mine = [r for r in records if r.get("workflow_id") == workflow_id]
    by_message = {r["message"].split(":")[0]: r for r in mine}
    assert set(by_message) >= {"sdk workflow logger", "sdk activity logger", "plain logger in an activity"}, mine
    for kind in ("sdk activity logger", "plain logger in an activity"):
        r = by_message[kind]
        assert r["activity_type"] == "log_from_activity" and r["activity_id"], r
        assert r["workflow_type"] == "LoggingWorkflow" and r["workflow_run_id"] and r["attempt"] == 1, r
        assert r["task_queue"] == task_queue
    wf = by_message["sdk workflow logger"]
    assert wf["workflow_type"] == "LoggingWorkflow" and wf["workflow_run_id"] and "activity_id" not in wf
    for r in mine:
        assert {"ts", "level", "logger", "message"} <= set(r)
        assert "s3cret-value" not in json.dumps(r) and "***" in r["message"], "secrets are scrubbed"
        assert "{'" not in r["message"], "the IDs are fields, not appended to the message"


def test_text_logs_are_human_readable_with_the_ids_as_tags() -> None:
    record = logging.makeLogRecord(
        {
            "name": "worker",
            "levelno": logging.INFO,
            "levelname": "INFO",
            "msg": "connected to postgresql://app:pw123@db/x",
            "temporal_activity": {"workflow_id": "wf-1", "activity_id": "7", "activity_type": "cleanup_partition"},
        }
    )
    line = logs.TextFormatter().format(record)
    assert re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO worker connected to ", line), line
    assert "[workflow_id=wf-1 activity_id=7 activity_type=cleanup_partition]" in line
    assert "pw123" not in line and "postgresql://app:***@db/x" in line


def test_worker_process_logs_json_lines(tmp_path: Path, settings: Settings) -> None:
    """`worker.py --log-format json` (here via LOG_FORMAT): every line it writes is one JSON object."""
    env = dict(os.environ)
    assert settings.temporal_address and settings.database_url
    env.update(
        TEMPORAL_ADDRESS=settings.temporal_address,
        TEMPORAL_TASK_QUEUE=settings.task_queue,
        DATABASE_URL=settings.database_url,
        LOG_FORMAT="json",
        METRICS_PORT=str(free_port()),
        CLEANUP_PLANNER="off",  # the test drives its cleanups itself
    )
    proc = subprocess.Popen(
        [sys.executable, str(PROJECT_ROOT / "worker.py")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "worker polling" in line:
                break
        port = int(env["METRICS_PORT"])
        assert any(s.startswith("temporal_") for s in scrape(port).splitlines())
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        lines += out.splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    assert any("worker polling" in r["message"] for r in records)
    assert any("metrics on http://" in r["message"] for r in records)
    assert all(r["level"] and r["logger"] and r["ts"] for r in records)
    assert proc.returncode in (0, -15)
