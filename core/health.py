"""A worker's health and readiness endpoints: `GET /healthz` and `GET /readyz` on `HEALTH_PORT`.

/healthz answers 200 whenever the process's event loop runs (the handler runs on it): a liveness
probe that restarts only a wedged process. /readyz answers 200 when the worker can do work now:
its database answers, it is polling its task queue on the Temporal server (the server lists this
client's identity among the queue's pollers), and, in a worker that ensures the deadline planner,
the planner was seen running within `planner_stale_seconds`. Otherwise 503, the body naming each
failed check by a fixed short reason ("database unavailable"); an error's own text, which may name
hosts, roles or addresses, goes only to the worker's log (through the redacting formatter), once per
change. The Prometheus exporter is the SDK's own (no paths of ours can be added to it), so the probes
have a port of their own.

/readyz is open to anyone who reaches the port, so its cost is bounded: at most one readiness check
runs at a time (requests that arrive meanwhile wait for it and share its answer), and an answer is
reused for `READY_CACHE_SECONDS`, so a flood of requests takes no more than one database connection
and one Temporal call per that period.

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
READY_CACHE_SECONDS = 1.0
"""How long a readiness answer is reused. Each check takes a pool connection and a Temporal call:
reusing the answer bounds what a flood of /readyz requests costs to one check per second, while a
probe (every 15 s) still sees the state of the last second."""
DATABASE_UNAVAILABLE = "database unavailable"
TEMPORAL_UNAVAILABLE = "temporal unavailable"
NOT_POLLING = "task queue: this worker is not among its pollers"
READINESS_FAILED = "readiness check failed"


class NotPolling(Exception):
    """The server answered, but does not list this worker among the task queue's pollers."""


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
    _in_flight: asyncio.Future[list[str]] | None = field(default=None, init=False, repr=False)
    _last: tuple[float, list[str]] | None = field(default=None, init=False, repr=False)
    _logged: dict[str, str] = field(default_factory=dict, init=False, repr=False)

    def planner_seen(self) -> None:
        """The planner was seen running (started, or found running by the watchdog)."""
        self.planner_seen_at = self._clock()

    async def current_failures(self) -> list[str]:
        """The reasons of a check at most READY_CACHE_SECONDS old; callers that come while a check
        runs share it (one in flight at most). A caller cancelled while waiting does not cancel it."""
        if self._last is not None and self._clock() - self._last[0] < READY_CACHE_SECONDS:
            return list(self._last[1])
        if self._in_flight is None:
            self._in_flight = asyncio.ensure_future(self._check_once())
        return list(await asyncio.shield(self._in_flight))

    async def _check_once(self) -> list[str]:
        try:
            reasons = await self.failures()
        except Exception as err:  # an answer for every waiting request, whatever broke
            self._log_detail("readiness", err)
            reasons = [READINESS_FAILED]
        finally:
            self._in_flight = None
        self._last = (self._clock(), reasons)
        return reasons

    async def failures(self) -> list[str]:
        """The reasons this worker is not ready (fixed short texts); empty when it is."""
        reasons: list[str] = []
        if self.ping_db is None or self.client is None or not self.polling:
            reasons.append("starting: the worker is not polling yet")
            return reasons
        reasons += await self._check("database", self.ping_db(), DATABASE_UNAVAILABLE)
        reasons += await self._check("temporal", self._polled(), TEMPORAL_UNAVAILABLE)
        if self.planner_expected:
            age = None if self.planner_seen_at is None else self._clock() - self.planner_seen_at
            if age is None or age > self.planner_stale_seconds:
                seen = "never" if age is None else f"{age:.0f}s ago"
                reasons.append(f"planner: last seen running {seen} (limit {self.planner_stale_seconds:.0f}s)")
        return reasons

    async def _check(self, name: str, step: Awaitable[object], reason: str) -> list[str]:
        """[] when `step` succeeds in time; else `reason` (NotPolling: its own), the detail logged."""
        try:
            await asyncio.wait_for(step, CHECK_TIMEOUT_SECONDS)
        except NotPolling as err:
            self._log_detail(name, err)
            return [NOT_POLLING]
        except Exception as err:
            self._log_detail(name, err)
            return [reason]
        self._logged.pop(name, None)
        return []

    def _log_detail(self, name: str, err: BaseException) -> None:
        """The error's own text, to the log only (redacted there), once until it changes."""
        text = getattr(err, "message", None) or str(err) or f"no answer within {CHECK_TIMEOUT_SECONDS:.0f}s"
        detail = f"{type(err).__name__}: {text}"[:300]
        if self._logged.get(name) != detail:
            self._logged[name] = detail
            log.warning("readiness: %s check failed: %s", name, detail)

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
            raise NotPolling(f"the server lists no poll of {self.client.identity!r} on {self.task_queue!r}")


async def _respond(readiness: Readiness, path: str) -> tuple[int, str]:
    if path == HEALTH_PATH:
        return 200, "ok\n"
    if path == READY_PATH:
        reasons = await readiness.current_failures()
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
        reasons = await readiness.current_failures()
        metrics.set_ready(not reasons)
        if was is not None and was != (not reasons):
            log.warning("worker %s", "ready again" if not reasons else "not ready: " + "; ".join(reasons))
        was = not reasons
        await asyncio.sleep(interval)
