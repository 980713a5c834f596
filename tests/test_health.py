"""Health probes of a real worker process: /healthz, and /readyz following its database; /readyz's
bounds (one check in flight, a short cache, no error text in the body) with a fake check."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from types import SimpleNamespace
from typing import cast

import asyncpg
import pytest
import yaml
from temporalio.client import Client
from temporalio.worker import Worker

from core import db, health
from core.config import PROJECT_ROOT
from demo.fixture import create_game_schema
from devstack.embedded import free_port
from tests.conftest import WorkerProcesses


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, "no answer"


async def wait_for_status(
    port: int, path: str, status: int, within: float = 120, logs: Callable[[], str] = lambda: ""
) -> str:
    deadline = time.monotonic() + within
    last = (0, "")
    while time.monotonic() < deadline:
        last = await asyncio.to_thread(get, port, path)
        if last[0] == status:
            return last[1]
        await asyncio.sleep(0.5)
    raise AssertionError(f"{path} never answered {status} within {within}s; last {last}\n{logs()[-3000:]}")


async def test_readyz_follows_the_workers_database(worker_processes: WorkerProcesses) -> None:
    from harness.private_pg import PrivatePostgres

    pg = PrivatePostgres()
    await asyncio.to_thread(pg.init)
    url = await db.create_database(pg.admin_url, "cleanup")  # migrated: workers do not migrate
    await create_game_schema(url)
    port = free_port()
    try:
        proc = worker_processes.start(DATABASE_URL=url, HEALTH_PORT=str(port), HEALTH_HOST="127.0.0.1")
        assert await wait_for_status(port, "/readyz", 200, logs=worker_processes.logs) == "ready\n"
        assert await asyncio.to_thread(get, port, "/healthz") == (200, "ok\n")
        assert (await asyncio.to_thread(get, port, "/nothing"))[0] == 404

        await asyncio.to_thread(pg.crash)
        body = await wait_for_status(port, "/readyz", 503)
        assert body == f"not ready\n- {health.DATABASE_UNAVAILABLE}\n", body
        assert "task queue" not in body, "the worker still polls: only the database is named"
        assert await asyncio.to_thread(get, port, "/healthz") == (200, "ok\n"), "alive while its database is away"

        await asyncio.to_thread(pg.restart)
        assert await wait_for_status(port, "/readyz", 200) == "ready\n"
        assert proc.poll() is None
    finally:
        worker_processes.stop_all()
        await asyncio.to_thread(pg.close)


async def test_readyz_names_the_task_queue_and_a_planner_not_seen(
    client: Client, pool: asyncpg.Pool, task_queue: str, worker: Worker
) -> None:
    """Ready with the in-process worker polling and the planner just seen; a planner not seen for
    longer than its limit, or a queue this client does not poll, is named in the reasons."""
    now = [1000.0]
    readiness = health.Readiness(
        ping_db=functools.partial(db.ping, pool),
        client=client,
        task_queue=task_queue,
        polling=True,
        planner_expected=True,
        planner_stale_seconds=60,
        _clock=lambda: now[0],
    )
    reasons = await readiness.failures()
    while any(r.startswith("task queue") for r in reasons):  # the worker's first poll reaches the server
        await asyncio.sleep(0.2)
        reasons = await readiness.failures()
    assert reasons == ["planner: last seen running never (limit 60s)"]
    readiness.planner_seen()
    assert await readiness.failures() == []
    now[0] += 61
    assert await readiness.failures() == ["planner: last seen running 61s ago (limit 60s)"]

    readiness.planner_expected = False
    readiness.task_queue = f"{task_queue}-nobody-polls"
    reasons = await readiness.failures()
    assert reasons == [health.NOT_POLLING], "a fixed reason: the identity goes to the log only"


async def test_worker_that_ensures_the_planner_gets_ready(worker_processes: WorkerProcesses) -> None:
    port = free_port()
    worker_processes.start(CLEANUP_PLANNER="on", HEALTH_PORT=str(port), HEALTH_HOST="127.0.0.1")
    assert await wait_for_status(port, "/readyz", 200, logs=worker_processes.logs) == "ready\n"


def test_image_and_compose_services_check_health() -> None:
    """The image's HEALTHCHECK and the worker's compose healthcheck read /readyz on HEALTH_PORT; every
    long-running compose service has a healthcheck (one-shot jobs are awaited by completion)."""
    dockerfile = (PROJECT_ROOT / "Dockerfile").read_text()
    port = re.search(r"^ENV HEALTH_PORT=(\d+)$", dockerfile, re.MULTILINE)
    assert port, "the image sets HEALTH_PORT"
    healthcheck = re.search(r"^HEALTHCHECK .*?CMD (.*?)$", dockerfile, re.MULTILINE | re.DOTALL)
    assert healthcheck and health.READY_PATH in healthcheck[1] and "HEALTH_PORT" in healthcheck[1]
    services = yaml.safe_load((PROJECT_ROOT / "docker-compose.yml").read_text())["services"]
    for name, service in services.items():
        if service.get("restart") == "unless-stopped":
            check = service.get("healthcheck") or {}
            assert check.get("test") and not check.get("disable"), f"{name} has no healthcheck"
    worker = services["worker"]
    assert f":{worker['environment']['HEALTH_PORT']}{health.READY_PATH}" in " ".join(worker["healthcheck"]["test"])


class FakeChecks:
    """A worker's two checks, counted: the database ping (which can fail with `error`) and Temporal's
    list of pollers (which always names this worker)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = 0
        self.running = 0
        self.most_at_once = 0
        self.error: Exception | None = None

    async def ping_db(self) -> None:
        self.started += 1
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            await asyncio.sleep(self.seconds)
            if self.error is not None:
                raise self.error
        finally:
            self.running -= 1

    def client(self) -> Client:
        async def describe_task_queue(request: object) -> object:
            return SimpleNamespace(pollers=[SimpleNamespace(identity="me")])

        service = SimpleNamespace(describe_task_queue=describe_task_queue)
        return cast(Client, SimpleNamespace(identity="me", workflow_service=service))

    def readiness(self, clock: Callable[[], float]) -> health.Readiness:
        return health.Readiness(ping_db=self.ping_db, client=self.client(), task_queue="q", polling=True, _clock=clock)


async def get_async(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    response = (await reader.read()).decode()
    writer.close()
    head, _, body = response.partition("\r\n\r\n")
    return int(head.split()[1]), body


async def test_concurrent_readyz_requests_share_one_check_and_a_cached_answer() -> None:
    now = [1000.0]
    checks = FakeChecks(seconds=0.3)
    server = await health.serve(checks.readiness(lambda: now[0]), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        answers = await asyncio.gather(*(get_async(port, health.READY_PATH) for _ in range(50)))
        assert answers == [(200, "ready\n")] * 50
        assert checks.started == 1 and checks.most_at_once == 1, "one check served all 50 requests"

        now[0] += health.READY_CACHE_SECONDS / 2
        assert await get_async(port, health.READY_PATH) == (200, "ready\n")
        assert checks.started == 1, "an answer younger than READY_CACHE_SECONDS is reused"

        now[0] += health.READY_CACHE_SECONDS
        for _ in range(3):  # a wave per period: one check each
            await asyncio.gather(*(get_async(port, health.READY_PATH) for _ in range(20)))
            now[0] += health.READY_CACHE_SECONDS
        assert checks.started == 4 and checks.most_at_once == 1
    finally:
        server.close()
        await server.wait_closed()


async def test_a_failing_check_answers_a_fixed_reason_and_logs_its_detail_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [1000.0]
    checks = FakeChecks(seconds=0)
    detail = "password authentication failed for user cleanup_worker_app at 10.1.2.3:5432"
    checks.error = RuntimeError(detail)
    server = await health.serve(checks.readiness(lambda: now[0]), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with caplog.at_level(logging.WARNING, logger=health.__name__):
            for _ in range(3):
                status, body = await get_async(port, health.READY_PATH)
                assert (status, body) == (503, f"not ready\n- {health.DATABASE_UNAVAILABLE}\n")
                assert "10.1.2.3" not in body and "RuntimeError" not in body
                now[0] += health.READY_CACHE_SECONDS
        assert checks.started == 3
        logged = [r.getMessage() for r in caplog.records if detail in r.getMessage()]
        assert logged == [f"readiness: database check failed: RuntimeError: {detail}"], "once until it changes"
    finally:
        server.close()
        await server.wait_closed()
