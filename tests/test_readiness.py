"""A server counts as started when it answers, not when its port opens."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest
from temporalio.api.workflowservice.v1 import GetSystemInfoRequest

from core.config import Settings
from core.temporal import connect
from devstack import embedded
from devstack.embedded import DevServer, ServerExited, ServerNotReady, port_open, wait_until_serving


def test_an_open_port_that_does_not_serve_is_not_ready(tmp_path: Path) -> None:
    log_file = tmp_path / "temporal.log"
    with socket.socket() as listener:  # accepts connections, never speaks gRPC
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        host, port = listener.getsockname()
        address = f"{host}:{port}"
        assert port_open(host, port)
        started = time.monotonic()
        with pytest.raises(ServerNotReady) as caught:
            wait_until_serving(address, deadline=time.monotonic() + 2, log_file=log_file)
    assert time.monotonic() - started < 40, "the wait is bounded"
    assert str(log_file) in str(caught.value) and address in str(caught.value)


@pytest.mark.dev_server
async def test_a_started_dev_server_answers_the_first_call_without_retry(tmp_path: Path) -> None:
    server = DevServer(tmp_path, port=None)
    try:
        for _ in range(3):  # a cold start and two restarts on the same SQLite file
            await asyncio.to_thread(server.start)
            client = await connect(Settings(temporal_address=server.address), ready_timeout=0)
            info = await client.workflow_service.get_system_info(GetSystemInfoRequest())
            assert info.server_version
            await asyncio.to_thread(server.stop)
            assert not server.running()
    finally:
        await asyncio.to_thread(server.stop)


@pytest.mark.dev_server
async def test_a_server_whose_port_is_taken_before_it_binds_starts_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race CI lost once: a free port chosen, then taken by someone else before the server binds."""
    with socket.socket() as thief:  # bound, not listening: the port looks closed, yet cannot be bound
        thief.bind(("127.0.0.1", 0))
        taken = thief.getsockname()[1]
        ports = iter([taken])
        real_free_port = embedded.free_port
        monkeypatch.setattr(embedded, "free_port", lambda: next(ports, None) or real_free_port())
        server = DevServer(tmp_path, port=None)
        assert server.port == taken and not server.running()
        try:
            await asyncio.to_thread(server.start)
            assert server.port != taken
            client = await connect(Settings(temporal_address=server.address), ready_timeout=0)
            assert (await client.workflow_service.get_system_info(GetSystemInfoRequest())).server_version
            first_log = tmp_path / f"temporal-{taken}.log"
            assert "address already in use" in first_log.read_text(), "the first attempt failed for that reason"
            restarted_on = server.port
            await asyncio.to_thread(server.stop)
            await asyncio.to_thread(server.start)
            assert server.port == restarted_on, "a restart keeps its address"
        finally:
            await asyncio.to_thread(server.stop)


async def test_a_server_that_cannot_start_says_why_each_attempt_exited(tmp_path: Path) -> None:
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", 0))
        server = DevServer(tmp_path, port=thief.getsockname()[1])  # a fixed port: every attempt hits it
        with pytest.raises(ServerExited) as caught:
            await asyncio.to_thread(server.start, 30.0)
    message = str(caught.value)
    assert message.count("address already in use") == DevServer.START_ATTEMPTS, message
    assert "attempt 3" in message and not server.pid_file.exists()
