"""A worker's health and readiness endpoints: `GET /healthz` and `GET /readyz` on `HEALTH_PORT`.

/healthz answers 200 whenever the process's event loop runs (the handler runs on it): a liveness
probe that restarts only a wedged process. /readyz answers 200 when the worker can do work now:
its database answers, it is polling its task queue on the Temporal server (the server lists this
client's identity among the queue's pollers), and, in a worker that ensures the deadline planner,
the planner was seen running within `planner_stale_seconds`. Otherwise 503, the body naming each
failed check, so `kubectl describe` and `curl` show why. The Prometheus exporter is the SDK's own
(no paths of ours can be added to it), so the probes have a port of their own.

A background loop evaluates readiness every `interval` seconds and exports it as the gauge
`worker_ready` (1/0), which the "worker not ready" alert reads (deploy/prometheus/alerts.yml).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client

from core import metrics

log = logging.getLogger(__name__)

HEALTH_PATH = "/healthz"
READY_PATH = "/readyz"
CHECK_TIMEOUT_SECONDS = 3.0
MAX_REQUEST_BYTES = 8192


@dataclass
class Readiness:
    """What /readyz checks. Parts not known yet (still starting) count as not ready."""

    ping_db: Callable[[], Awaitable[object]] | None = None
    client: Client | None = None
    task_queue: str | None = None
    namespace: str = "default"
    polling: bool = False
    planner_expected: bool = False
    planner_stale_seconds: float = 120.0
    planner_seen_at: float | None = None
    _clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def planner_seen(self) -> None:
        """The planner was seen running (started, or found running by the watchdog)."""
        self.planner_seen_at = self._clock()

    async def failures(self) -> list[str]:
        """The reasons this worker is not ready; empty when it is."""
        reasons: list[str] = []
        if self.ping_db is None or self.client is None or not self.polling:
            reasons.append("starting: the worker is not polling yet")
            return reasons
        reasons += await _check("database", self.ping_db())
        reasons += await _check("task queue", self._polled())
        if self.planner_expected:
            age = None if self.planner_seen_at is None else self._clock() - self.planner_seen_at
            if age is None or age > self.planner_stale_seconds:
                seen = "never" if age is None else f"{age:.0f}s ago"
                reasons.append(f"planner: last seen running {seen} (limit {self.planner_stale_seconds:.0f}s)")
        return reasons

    async def _polled(self) -> None:
        """The server lists this worker's identity among the workflow task queue's pollers."""
        assert self.client is not None and self.task_queue is not None
        resp = await self.client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(
                namespace=self.namespace,
                task_queue=TaskQueue(name=self.task_queue),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
            )
        )
        identities = {p.identity for p in resp.pollers}
        if self.client.identity not in identities:
            raise RuntimeError(f"the server lists no poll of {self.client.identity!r} on {self.task_queue!r}")


async def _check(name: str, step: Awaitable[object]) -> list[str]:
    try:
        await asyncio.wait_for(step, CHECK_TIMEOUT_SECONDS)
    except TimeoutError:
        return [f"{name}: no answer within {CHECK_TIMEOUT_SECONDS:.0f}s"]
    except Exception as err:
        text = getattr(err, "message", None) or str(err) or type(err).__name__
        return [f"{name}: {type(err).__name__}: {text}"[:300]]
    return []


async def _respond(readiness: Readiness, path: str) -> tuple[int, str]:
    if path == HEALTH_PATH:
        return 200, "ok\n"
    if path == READY_PATH:
        reasons = await readiness.failures()
        if reasons:
            return 503, "not ready\n" + "".join(f"- {r}\n" for r in reasons)
        return 200, "ready\n"
    return 404, "not found\n"


async def _handle(readiness: Readiness, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        parts = head[:MAX_REQUEST_BYTES].split(b"\r\n", 1)[0].decode("latin-1").split()
        path = parts[1].split("?", 1)[0] if len(parts) >= 2 else ""
        status, body = await _respond(readiness, path)
        reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
        data = body.encode()
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        await writer.drain()
    except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def serve(readiness: Readiness, host: str, port: int) -> asyncio.Server:
    """Start serving /healthz and /readyz; close the returned server to stop."""
    server = await asyncio.start_server(lambda r, w: _handle(readiness, r, w), host, port)
    log.info("health probes on http://%s:%s%s and %s", host, port, HEALTH_PATH, READY_PATH)
    return server


async def export_readiness(readiness: Readiness, interval: float = 15.0) -> None:
    """Keep the `worker_ready` gauge current (1 ready, 0 not), logging each change of state."""
    was: bool | None = None
    while True:
        reasons = await readiness.failures()
        metrics.set_ready(not reasons)
        if was is not None and was != (not reasons):
            log.warning("worker %s", "ready again" if not reasons else "not ready: " + "; ".join(reasons))
        was = not reasons
        await asyncio.sleep(interval)
