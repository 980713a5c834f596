"""A server counts as started when it answers, not when its port opens."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest
from temporalio.api.workflowservice.v1 import GetSystemInfoRequest

from core.config import Settings
from core.embedded import DevServer, ServerNotReady, free_port, port_open, wait_until_serving
from core.temporal import connect


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
    server = DevServer(tmp_path, port=free_port())
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
