"""The codec endpoint's guards (token beyond loopback, body length, timeouts, a thread cap, Host
allow-list, no credentials with a wildcard origin) and payload key rotation (several decryption
keys by ID, encryption with the newest; plaintext refused when configured)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from pydantic import SecretStr
from temporalio.api.common.v1 import Payload
from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionExecutionStartWorkflow,
    ScheduleActionStartWorkflow,
    ScheduleSpec,
)
from temporalio.worker import Worker

from core.codec import KEY_ID_METADATA, EncryptionCodec, EncryptionKeyError, PlaintextPayloadError, new_key, parse_key
from core.codec_server import CodecServer
from core.config import PROJECT_ROOT, Settings
from core.temporal import connect
from tests.key_rotation_workflow import KeyRotationProbe

# --- the codec endpoint ---------------------------------------------------------------------------


@contextmanager
def serving(**options: Any) -> Iterator[CodecServer]:
    server = CodecServer(("127.0.0.1", 0), EncryptionCodec.from_config(new_key()), **options)
    # shutdown() returns once serve_forever next polls: at its default 0.5 s interval, that is most
    # of each test's time.
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def address(server: CodecServer) -> tuple[str, int]:
    return "127.0.0.1", int(server.server_address[1])


def raw_request(server: CodecServer, head: str, body: bytes = b"") -> bytes:
    """Send `head` (request line and headers, CRLF-joined, no blank line) and return the reply: up to
    the end of its body (its Content-Length) or until the server closes the connection."""
    with socket.create_connection(address(server), timeout=30) as conn:
        conn.sendall(head.encode() + b"\r\n\r\n" + body)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
            if reply_complete(reply):
                break
        return reply


def reply_complete(reply: bytes) -> bool:
    """A keep-alive reply is complete once its headers and Content-Length bytes of body arrived."""
    head, sep, body = reply.partition(b"\r\n\r\n")
    if not sep:
        return False
    lengths = [line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    return b"Connection: close" in head or (bool(lengths) and len(body) >= int(lengths[0]))


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


BODY = json.dumps({"payloads": []}).encode()


@pytest.mark.parametrize(
    "length_header",
    ["Content-Length: -1", "Content-Length: abc", "Content-Length: 1e3", "", "Transfer-Encoding: chunked"],
)
def test_a_missing_or_bad_length_or_a_chunked_body_is_refused(length_header: str) -> None:
    with serving() as server:
        head = "POST /decode HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        if length_header:
            head += "\r\n" + length_header
        assert status_of(raw_request(server, head, BODY)) == 400
        ok = raw_request(server, f"POST /decode HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(BODY)}", BODY)
        assert status_of(ok) == 200


def test_only_allowed_hosts_are_served() -> None:
    with serving(allowed_hosts=["codec.internal"]) as server:
        for host, expected in (("evil.test", 400), ("codec.internal:8081", 200), ("localhost:1", 200)):
            head = f"POST /decode HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(BODY)}"
            assert status_of(raw_request(server, head, BODY)) == expected, host


def test_a_stalled_client_is_disconnected() -> None:
    with serving(request_timeout=0.5) as server, socket.create_connection(address(server)) as conn:
        conn.settimeout(60)
        conn.sendall(b"POST /decode HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the rest
        assert conn.recv(1024) == b"", "the server closed the connection"


def test_requests_beyond_the_thread_cap_get_503() -> None:
    with serving(max_threads=1, request_timeout=30) as server:
        holder = socket.create_connection(address(server), timeout=30)
        try:
            holder.sendall(b"POST /decode HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # holds the only thread
            head = f"POST /decode HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(BODY)}"
            assert status_of(raw_request(server, head, BODY)) == 503
        finally:
            holder.close()


def test_a_wildcard_origin_never_gets_credentials() -> None:
    with serving(allowed_origins=["*"]) as server:
        reply = raw_request(server, "OPTIONS /decode HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://evil.test")
        headers = reply.split(b"\r\n\r\n")[0].decode().lower()
        assert "access-control-allow-origin: *" in headers
        assert "access-control-allow-credentials" not in headers and "evil.test" not in headers


def test_no_token_means_loopback_only() -> None:
    with pytest.raises(ValueError, match="token"):
        CodecServer(("0.0.0.0", 0), EncryptionCodec.from_config(new_key()))
    env = {**os.environ, "PAYLOAD_ENCRYPTION_KEY": new_key()}
    env.pop("CODEC_SERVER_TOKEN", None)
    refused = subprocess.run(
        [sys.executable, "-m", "core.codec_server", "--host", "0.0.0.0", "--port", "1"],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "CODEC_SERVER_TOKEN" in refused.stderr


# --- key rotation ---------------------------------------------------------------------------------


async def test_plaintext_is_refused_when_encryption_is_required() -> None:
    key = new_key()
    plain = Payload(metadata={"encoding": b"json/plain"}, data=b'"hi"')
    assert await EncryptionCodec.from_config(key).decode([plain]) == [plain], "accepted by default (old histories)"
    strict = EncryptionCodec({"k": parse_key(key)}, "k", require_encryption=True)
    with pytest.raises(PlaintextPayloadError):
        await strict.decode([plain])
    assert await strict.decode(await strict.encode([plain])) == [plain]


def rotated_settings(address: str, key: str, key_id: str, older: str | None = None) -> Settings:
    return Settings(
        temporal_address=address,
        payload_encryption_key=SecretStr(key),
        payload_encryption_key_id=key_id,
        payload_decryption_keys=SecretStr(older) if older else None,
        payload_pseudonym_key_id="A",
    )


def key_id_of(payload: Any) -> str:
    return bytes(payload.metadata[KEY_ID_METADATA]).decode()


async def test_a_workflow_and_a_schedule_started_under_key_a_complete_after_rotating_to_b(
    temporal_address: str, task_queue: str
) -> None:
    key_a, key_b = new_key(), new_key()
    before = await connect(rotated_settings(temporal_address, key_a, "A"))
    workflow_id, schedule_id = f"rotation-{uuid.uuid4().hex[:8]}", f"rotation-schedule-{uuid.uuid4().hex[:8]}"
    async with Worker(before, task_queue=task_queue, workflows=[KeyRotationProbe]):
        await before.start_workflow(
            KeyRotationProbe.run, args=["open across the rotation", True], id=workflow_id, task_queue=task_queue
        )
        await before.create_schedule(
            schedule_id,
            Schedule(
                action=ScheduleActionStartWorkflow(
                    KeyRotationProbe.run, args=["nightly", False], id=f"{schedule_id}-run", task_queue=task_queue
                ),
                spec=ScheduleSpec(),  # fires only when triggered
            ),
        )
        assert await before.get_workflow_handle(workflow_id).describe()  # it runs, waiting for its signal

    # Rotated: B encrypts from now on; A is kept to decrypt what was written under it.
    after = await connect(rotated_settings(temporal_address, key_b, "B", older=f"A:{key_a}"))
    only_b = await connect(
        rotated_settings(temporal_address, key_b, "B").model_copy(update={"payload_pseudonym_key_id": None})
    )
    async with Worker(after, task_queue=task_queue, workflows=[KeyRotationProbe]):
        await after.get_workflow_handle(workflow_id).signal(KeyRotationProbe.go)
        assert (
            await asyncio.wait_for(after.get_workflow_handle(workflow_id).result(), 120)
            == "echo open across the rotation"
        )
        schedule = after.get_schedule_handle(schedule_id)
        await schedule.trigger()
        run_id = await scheduled_run(after, schedule_id)
        assert await asyncio.wait_for(after.get_workflow_handle(run_id).result(), 120) == "echo nightly"
        await schedule.delete()

    history = await after.get_workflow_handle(workflow_id).fetch_history()
    events = history.events
    assert key_id_of(events[0].workflow_execution_started_event_attributes.input.payloads[0]) == "A"
    completed = events[-1].workflow_execution_completed_event_attributes.result.payloads[0]
    assert key_id_of(completed) == "B", "what is written after the rotation is encrypted with the newest key"
    started_input = events[0].workflow_execution_started_event_attributes.input.payloads[0]
    without_a = only_b.data_converter.payload_codec
    assert without_a is not None
    with pytest.raises(EncryptionKeyError, match="key 'A'"):
        await without_a.decode([started_input])  # A was needed: dropping it breaks the open workflow


async def scheduled_run(client: Client, schedule_id: str) -> str:
    for _ in range(600):
        description = await client.get_schedule_handle(schedule_id).describe()
        if description.info.recent_actions:
            action = description.info.recent_actions[-1].action
            assert isinstance(action, ScheduleActionExecutionStartWorkflow)
            return action.workflow_id
        await asyncio.sleep(0.2)
    raise AssertionError("the triggered schedule started nothing")


def test_settings_keep_every_decryption_key_secret() -> None:
    key_a = new_key()
    settings = Settings(payload_decryption_keys=SecretStr(f"A:{key_a},C:{new_key()}"))
    assert key_a in settings.secrets()
    assert key_a not in repr(settings)
    assert base64.b64decode(key_a)  # a real key was hidden
