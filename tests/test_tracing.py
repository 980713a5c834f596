"""Tracing (OTEL_TRACING=on): one cleanup is one trace, its claim, partitions and settlement spans
children of the cleanup's workflow span, across two workers; and the option's configuration."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections import Counter
from concurrent import futures
from typing import Any

import asyncpg
import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from temporalio.contrib.opentelemetry import create_tracer_provider

from cleanup.inputs import StartCleanup
from cleanup.operations import start_cleanup
from core import tracing
from core.config import PROJECT_ROOT, Settings
from core.temporal import connect
from tests.conftest import WorkerProcesses
from tests.helpers import deadline_in, seed, wait_until
from worker import build_activities, build_worker
from workflows.renewal_cleanup import RenewalCleanupWorkflow

EXPORTER = InMemorySpanExporter()
WORKFLOW = RenewalCleanupWorkflow.__name__


@pytest.fixture(scope="module", autouse=True)
def in_memory_provider() -> None:
    provider = create_tracer_provider()
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    tracing.install_provider(provider)  # before any plugin would install the OTLP one


def ancestors(span: ReadableSpan, by_id: dict[int, ReadableSpan]) -> list[str]:
    names = []
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        names.append(span.name)
    return names


async def test_one_cleanup_is_one_trace_with_claim_partitions_and_settlement(
    pool: asyncpg.Pool, task_queue: str, temporal_address: str
) -> None:
    settings = Settings(temporal_address=temporal_address, otel_tracing=True)
    client, other = await connect(settings), await connect(settings)  # two workers, one queue
    assert any(type(p).__name__ == "OpenTelemetryPlugin" for p in client.config()["plugins"])
    activities = await build_activities(pool)
    workers = [build_worker(c, task_queue, activities) for c in (client, other)]
    deadline = deadline_in(1)
    await seed(pool, deadline, 30)
    EXPORTER.clear()
    async with workers[0], workers[1]:
        # Started from a client no worker uses (the CLI's part): the trace crosses into the workers
        # through the workflow's and the activities' headers only.
        starter = await connect(settings)
        started = await start_cleanup(starter, pool, task_queue, StartCleanup(deadline=deadline, partitions=3))
        await asyncio.wait_for(client.get_workflow_handle(started.workflow_id).result(), 120)

    spans = [s for s in EXPORTER.get_finished_spans() if s.context is not None]
    mine = [s for s in spans if (s.attributes or {}).get("temporalWorkflowID") == started.workflow_id]
    assert mine, [s.name for s in spans]
    traces = {s.context.trace_id for s in mine if s.context is not None}
    assert len(traces) == 1, "the cleanup's spans are one trace"
    (trace_id,) = traces
    in_trace = [s for s in spans if s.context is not None and s.context.trace_id == trace_id]
    by_id = {s.context.span_id: s for s in in_trace if s.context is not None}
    runs = Counter(s.name.split(":", 1)[1] for s in in_trace if s.name.startswith("RunActivity:"))
    claims = sum(n for name, n in runs.items() if name.startswith("claim_cleanup"))  # chunked claim streams
    assert claims >= 1 and runs["settle_cleanup"] == 1, runs
    assert runs["cleanup_partition"] >= 3, runs  # each partition (a retried one has more attempts)
    roots = [s for s in in_trace if s.parent is None]
    assert [r.name for r in roots] == [f"StartWorkflow:{WORKFLOW}"]
    for span in in_trace:
        if span.name.startswith("RunActivity:"):
            chain = ancestors(span, by_id)
            assert chain[-1] == roots[0].name and f"RunWorkflow:{WORKFLOW}" in chain, (span.name, chain)


def test_tracing_is_off_by_default_and_its_settings_are_read() -> None:
    assert tracing.plugins(Settings()) == []
    env = dict(os.environ, OTEL_TRACING="on", METRICS_OTLP_ENDPOINT="http://collector:4317")
    code = "from core.config import Settings; s = Settings.from_env(); print(s.otel_tracing, s.metrics_otlp_endpoint)"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert out.stdout.split() == ["True", "http://collector:4317"], out.stderr


def test_worker_refuses_prometheus_and_otlp_metrics_at_once(settings: Settings, tmp_path: object) -> None:
    assert settings.temporal_address and settings.database_url
    env = dict(
        os.environ,
        TEMPORAL_ADDRESS=settings.temporal_address,
        DATABASE_URL=settings.database_url,
        TEMPORAL_TASK_QUEUE=settings.task_queue,
        METRICS_PORT="9464",
        METRICS_OTLP_ENDPOINT="http://127.0.0.1:4317",
        CLEANUP_PLANNER="off",
    )
    done = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "worker.py")], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "METRICS_PORT (Prometheus) or METRICS_OTLP_ENDPOINT" in done.stderr and "Traceback" not in done.stderr


class MetricsCollector(metrics_service_pb2_grpc.MetricsServiceServicer):
    """An OTLP/gRPC metrics receiver of the test's own: the metric names it was sent."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def Export(self, request: Any, context: Any) -> Any:
        for resource in request.resource_metrics:
            for scope in resource.scope_metrics:
                self.names.update(m.name for m in scope.metrics)
        return metrics_service_pb2.ExportMetricsServiceResponse()


async def test_worker_pushes_its_metrics_over_otlp(worker_processes: WorkerProcesses) -> None:
    collector = MetricsCollector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        worker_processes.start(METRICS_OTLP_ENDPOINT=f"http://127.0.0.1:{port}")

        async def received() -> bool:
            return {"cleanup_accounts_cleaned", "worker_ready"} <= collector.names

        with contextlib.suppress(AssertionError):
            await wait_until(received, within=120, interval=1)
    finally:
        server.stop(grace=None)
    assert {"cleanup_accounts_cleaned", "worker_ready"} <= collector.names, (collector.names, worker_processes.logs())
    assert any(name.startswith("temporal_") for name in collector.names), collector.names
