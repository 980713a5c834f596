"""Security: encrypted payloads and failures in Temporal history, the codec endpoint, secrets kept out
of logs and CLI output, TLS/API-key configuration, and the least-privileged worker role."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from google.protobuf import json_format
from pydantic import SecretStr
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.client import Client, WorkflowFailureError
from temporalio.service import TLSConfig

from cleanup.inputs import StartCleanup
from cleanup.models import DEFAULTS, CleanupResult, RenewalCleanupInput
from cleanup.operations import UNREADABLE, list_cleanups, start_cleanup
from core import db, logs
from core.cli import EXIT_UNAVAILABLE
from core.codec import ENCODING, EncryptionCodec, EncryptionKeyError, new_key, parse_key
from core.codec_server import CodecServer
from core.config import PROJECT_ROOT, Settings
from core.errors import InputError
from core.temporal import connect, tls_config
from tests.helpers import deadline_in, effect_counts, seed, wait_until
from worker import build_activities, build_worker
from workflows.renewal_cleanup import RenewalCleanupWorkflow

# --- the codec ------------------------------------------------------------------------------------


async def test_codec_round_trips_and_rejects_wrong_keys() -> None:
    key = new_key()
    codec = EncryptionCodec.from_config(key, "k1")
    plain = Payload(metadata={"encoding": b"json/plain"}, data=b'{"account_id":"acct_secret_1"}')
    (sealed,) = await codec.encode([plain])
    assert sealed.metadata["encoding"] == ENCODING and sealed.metadata["encryption-key-id"] == b"k1"
    assert b"acct_secret_1" not in sealed.SerializeToString()
    assert (await codec.decode([sealed]))[0] == plain
    assert (await codec.encode([plain]))[0].data != sealed.data, "a fresh nonce every time"
    assert (await codec.decode([plain]))[0] == plain, "unencrypted payloads pass through"
    with pytest.raises(EncryptionKeyError, match="'k1'"):
        await EncryptionCodec.from_config(new_key(), "k2").decode([sealed])
    with pytest.raises(Exception):  # noqa: B017 - authentication fails (InvalidTag) with another key of the same ID
        await EncryptionCodec.from_config(new_key(), "k1").decode([sealed])
    rotated = EncryptionCodec({"k1": parse_key(key), "k2": parse_key(new_key())}, "k2")
    assert (await rotated.decode([sealed]))[0] == plain, "old payloads still decode after a rotation"


@pytest.mark.parametrize(
    "bad",
    [
        "not base64 at all!!",
        base64.b64encode(b"short").decode(),
        base64.b64encode(bytes(32)).decode(),  # placeholders: all zeros, a short pattern repeated
        base64.b64encode(b"CHANGEME" * 4).decode(),
    ],
)
def test_a_bad_key_is_refused_without_echoing_it(bad: str) -> None:
    with pytest.raises(EncryptionKeyError) as err:
        parse_key(bad)
    assert bad not in str(err.value) and "PAYLOAD_ENCRYPTION_KEY" in str(err.value)


# --- encrypted history ----------------------------------------------------------------------------


def event_bytes(history: Any) -> bytes:
    return b"".join(e.SerializeToString() for e in history.events)


async def test_history_is_encrypted_and_readable_with_the_codec(
    client: Client, pool: asyncpg.Pool, task_queue: str, temporal_address: str
) -> None:
    """Raw history (a client without the codec) holds no account ID, result or failure message in
    clear; a client with the codec reads all of them; the codec endpoint decodes the raw payloads."""
    key = new_key()
    enc = await connect(Settings(temporal_address=temporal_address, payload_encryption_key=SecretStr(key)))
    deadline = deadline_in(1)
    accounts = await seed(pool, deadline, 3)
    target = accounts[0]
    ghost = f"acct_ghost_{uuid.uuid4().hex[:8]}"
    async with build_worker(enc, task_queue, await build_activities(pool)):
        started = await start_cleanup(
            enc, pool, task_queue, StartCleanup(account_id=target, note=f"ticket for {target}")
        )
        result: CleanupResult = await enc.get_workflow_handle_for(
            RenewalCleanupWorkflow.run, started.workflow_id
        ).result()
        failing = await enc.start_workflow(
            RenewalCleanupWorkflow.run,
            RenewalCleanupInput(
                cleanup_id=f"enc-fail-{uuid.uuid4().hex[:8]}",
                deadline_from=datetime.now(UTC) - timedelta(minutes=1),
                account_id=ghost,
                expected_version=1,
                partitions=1,
                max_parallel_partitions=1,
                batch_size=DEFAULTS.batch_size,
                heartbeat_timeout_seconds=DEFAULTS.heartbeat_timeout_seconds,
                claim_chunk_size=DEFAULTS.claim_chunk_size,
                claim_streams=1,
            ),
            id=f"enc-fail-{uuid.uuid4().hex[:8]}",
            task_queue=task_queue,
        )
        with pytest.raises(WorkflowFailureError) as failed:
            await failing.result()
    assert result.outcome == "cleaned" and result.settlement is not None and result.settlement.cleaned == 1
    assert (await effect_counts(pool))["applied"] == 1

    # The codec's client decodes results and failure messages.
    messages = []
    cause: BaseException | None = failed.value
    while cause is not None:
        messages.append(str(getattr(cause, "message", cause)))
        cause = cause.__cause__
    assert any(f"unknown account {ghost}" in m for m in messages), messages

    # Without the codec: nothing in clear, not even in the workflow ID, search attributes or summary.
    assert target not in started.workflow_id
    raw = await client.get_workflow_handle(started.workflow_id).fetch_history()
    raw_bytes = event_bytes(raw)
    assert target.encode() not in raw_bytes
    assert b"cleaned" not in raw_bytes and b"ticket" not in raw_bytes
    started_event = raw.events[0].workflow_execution_started_event_attributes
    assert started_event.input.payloads[0].metadata["encoding"] == ENCODING
    desc = await client.get_workflow_handle(started.workflow_id).describe()
    assert target.encode() not in desc.raw_description.SerializeToString()
    raw_failed = await client.get_workflow_handle(failing.id).fetch_history()
    assert ghost.encode() not in event_bytes(raw_failed)
    last = raw_failed.events[-1]
    assert last.HasField("workflow_execution_failed_event_attributes")
    failure = last.workflow_execution_failed_event_attributes.failure
    chain = 0
    while True:  # the workflow's failure and every cause in its chain
        assert failure.message == "Encoded failure" and failure.encoded_attributes.metadata["encoding"] == ENCODING
        assert not failure.stack_trace
        chain += 1
        if not failure.HasField("cause"):
            break
        failure = failure.cause
    assert chain >= 1

    # The codec endpoint decodes the raw input payload for an operator with the token.
    codec = EncryptionCodec.from_config(key)
    with codec_server(codec, token="op-token") as url:
        body = json_format.MessageToDict(Payloads(payloads=[started_event.input.payloads[0]]))
        status, decoded = await asyncio.to_thread(post, f"{url}/decode", body, token="op-token")
        assert status == 200
        data = base64.b64decode(decoded["payloads"][0]["data"]).decode()
        assert json.loads(data)["account_id"] == target


# --- the codec endpoint ---------------------------------------------------------------------------


@pytest.fixture
def codec() -> EncryptionCodec:
    return EncryptionCodec.from_config(new_key())


class _Server:
    def __init__(self, codec: EncryptionCodec, token: str | None) -> None:
        self.server = CodecServer(("127.0.0.1", 0), codec, token=token)
        # shutdown() waits for serve_forever's next poll (0.5 s at its default interval).
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)


def codec_server(codec: EncryptionCodec, token: str | None = None) -> Any:
    from contextlib import contextmanager

    @contextmanager
    def run() -> Iterator[str]:
        s = _Server(codec, token)
        s.thread.start()
        try:
            yield s.server.url
        finally:
            s.server.shutdown()
            s.server.server_close()

    return run()


def post(url: str, body: dict[str, Any], token: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json", "X-Namespace": "default"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def test_codec_endpoint_round_trips_with_token_and_cors(codec: EncryptionCodec) -> None:
    plain = Payload(metadata={"encoding": b"json/plain"}, data=b'"acct_visible_9"')
    body = json_format.MessageToDict(Payloads(payloads=[plain]))
    with codec_server(codec, token="t0k3n") as url:
        status, encoded = post(f"{url}/encode", body, token="t0k3n")
        assert status == 200
        assert base64.b64decode(encoded["payloads"][0]["metadata"]["encoding"]) == ENCODING
        assert b"acct_visible_9" not in base64.b64decode(encoded["payloads"][0]["data"])
        status, decoded = post(f"{url}/decode", encoded, token="t0k3n")
        assert status == 200 and json_format.ParseDict(decoded, Payloads()).payloads[0] == plain

        assert post(f"{url}/decode", encoded)[0] == 401, "no token"
        assert post(f"{url}/decode", encoded, token="wrong")[0] == 401
        assert post(f"{url}/nothing", encoded, token="t0k3n")[0] == 404

        preflight = urllib.request.Request(
            f"{url}/decode", method="OPTIONS", headers={"Origin": "http://127.0.0.1:8233"}
        )
        with urllib.request.urlopen(preflight, timeout=10) as response:
            assert response.status == 204
            assert response.headers["Access-Control-Allow-Origin"] == "http://127.0.0.1:8233"
            assert "Authorization" in response.headers["Access-Control-Allow-Headers"]
        stranger = urllib.request.Request(f"{url}/decode", method="OPTIONS", headers={"Origin": "http://evil.test"})
        with urllib.request.urlopen(stranger, timeout=10) as response:
            assert response.headers.get("Access-Control-Allow-Origin") is None


# --- TLS and API key ------------------------------------------------------------------------------


def test_tls_settings_come_from_configuration(tmp_path: Path) -> None:
    cert, key, ca = tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "ca.pem"
    for path in (cert, key, ca):
        path.write_bytes(b"-----BEGIN TEST-----\n" + path.name.encode())
    env = {
        "TEMPORAL_TLS_CERT": str(cert),
        "TEMPORAL_TLS_KEY": str(key),
        "TEMPORAL_TLS_CA": str(ca),
        "TEMPORAL_TLS_SERVER_NAME": "temporal.internal",
        "TEMPORAL_API_KEY": "api-key-123",
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        settings = Settings.from_env()
    tls = tls_config(settings)
    assert isinstance(tls, TLSConfig)
    assert tls.client_cert == cert.read_bytes() and tls.client_private_key == key.read_bytes()
    assert tls.server_root_ca_cert == ca.read_bytes() and tls.domain == "temporal.internal"
    assert settings.temporal_api_key is not None and "api-key-123" not in repr(settings)

    assert tls_config(Settings()) is False, "plain by default (the dev server)"
    assert tls_config(Settings(temporal_api_key=SecretStr("k"))) is True, "an API key is never sent in clear by default"
    assert tls_config(Settings(temporal_api_key=SecretStr("k"), temporal_tls=False)) is False
    with pytest.raises(InputError, match="together"):
        tls_config(Settings(temporal_tls_cert=cert))
    with pytest.raises(InputError, match="cannot read TEMPORAL_TLS_KEY"):
        tls_config(Settings(temporal_tls_cert=cert, temporal_tls_key=tmp_path / "missing.pem"))


# --- secrets never printed ------------------------------------------------------------------------


def with_password(url: str, password: str) -> str:
    parts = urlsplit(url)
    user = parts.username or "postgres"
    host = parts.netloc.rsplit("@", 1)[-1] if "@" in parts.netloc else parts.netloc
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{host}"))


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`python starter.py ARGS`, or `python -m devstack ...` for args starting "devstack"."""
    entry = ["-m", *args] if args[:1] == ("devstack",) else [str(PROJECT_ROOT / "starter.py"), *args]
    return subprocess.run(
        [sys.executable, *entry],
        cwd=PROJECT_ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def start_worker(env: dict[str, str], log_file: Path) -> subprocess.Popen[bytes]:
    with open(log_file, "wb") as log:
        return subprocess.Popen(
            [sys.executable, str(PROJECT_ROOT / "worker.py")],
            env={**os.environ, "CLEANUP_PLANNER": "off", **env},  # the test drives its cleanups itself
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def run_worker_once(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "worker.py")],
        env={**os.environ, "CLEANUP_PLANNER": "off", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_settings_repr_masks_secrets() -> None:
    s = Settings(
        database_url="postgresql://app:hunter2@db:5432/x",
        temporal_api_key=SecretStr("tk-1"),
        payload_encryption_key=SecretStr("ek"),
    )
    for text in (repr(s), str(s)):
        assert "hunter2" not in text and "tk-1" not in text and "postgresql://app:***@db:5432/x" in text


ESCAPED_SECRET = 'pä"ss\\wörd'  # a quote, a backslash and non-ASCII: JSON and repr escape each


def json_log_lines(secret: str) -> list[str]:
    """Lines of the JSON format naming `secret` in the message, an argument (`%s` and `%r`), an extra
    field, and two exceptions (its text and its repr, as a KeyError shows it)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter(secrets=[secret]))
    logger = logging.getLogger(f"test.redaction.{uuid.uuid4().hex}")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.info(f"inline {secret}")
    logger.info("as args %s and %r", secret, secret, extra={"detail": secret, "nested": {"k": [secret]}})
    for err in (ValueError(f"login failed with {secret}"), KeyError(secret)):
        try:
            raise err
        except Exception:
            logger.exception("failed")
    logger.removeHandler(handler)
    return stream.getvalue().splitlines()


def test_json_logs_redact_a_secret_json_would_escape() -> None:
    lines = json_log_lines(ESCAPED_SECRET)
    assert len(lines) == 4
    forms = {ESCAPED_SECRET, json.dumps(ESCAPED_SECRET)[1:-1], json.dumps(ESCAPED_SECRET, ensure_ascii=False)[1:-1]}
    forms |= {repr(ESCAPED_SECRET)[1:-1], "ss\\w", "wörd", "w\\u00f6rd"}
    for line in lines:
        for form in forms:
            assert form not in line, (form, line)
        record = json.loads(line)
        assert ESCAPED_SECRET not in json.dumps(record, ensure_ascii=False) and "***" in line
    inline, with_args, value_error, key_error = (json.loads(line) for line in lines)
    assert inline["message"] == "inline ***"
    assert with_args["message"] == "as args *** and '***'"
    assert with_args["detail"] == "***" and with_args["nested"] == {"k": ["***"]}
    assert "ValueError: login failed with ***" in value_error["exception"]
    assert "KeyError: '***'" in key_error["exception"]


async def test_secrets_never_appear_in_worker_logs_or_cli_output(
    client: Client, pool: asyncpg.Pool, db_url: str, task_queue: str, temporal_address: str, tmp_path: Path
) -> None:
    key, api_key, password = new_key(), f"tk_{uuid.uuid4().hex}", f"pw_{uuid.uuid4().hex}"
    secrets = (key, api_key, password)
    env = {
        "TEMPORAL_ADDRESS": temporal_address,
        "TEMPORAL_TASK_QUEUE": task_queue,
        "DATABASE_URL": with_password(db_url, password),  # the embedded Postgres trusts local sockets
        "TEMPORAL_API_KEY": api_key,
        "TEMPORAL_TLS": "false",  # the dev server speaks plain gRPC
        "PAYLOAD_ENCRYPTION_KEY": key,
    }
    log_file = tmp_path / "worker.log"
    proc = start_worker(env, log_file)
    try:
        enc = await connect(Settings(temporal_address=temporal_address, payload_encryption_key=SecretStr(key)))
        deadline = deadline_in(1)
        accounts = await seed(pool, deadline, 2)
        started = await start_cleanup(enc, pool, task_queue, StartCleanup(account_id=accounts[0]))
        result = await asyncio.wait_for(enc.get_workflow_handle(started.workflow_id).result(), 60)
        assert result["outcome"] == "cleaned" if isinstance(result, dict) else result.outcome == "cleaned"
        # A client without the key still lists the run (from its search attributes), marked unreadable.
        # The listing reads visibility, which records the close a moment after the result is out.
        listed: dict[str, Any] = {}

        async def listed_closed() -> bool:
            listed.update({r.workflow_id: r for r in await list_cleanups(client, limit=1000)})
            return started.workflow_id in listed and listed[started.workflow_id].status != "RUNNING"

        await wait_until(listed_closed, within=30)
        assert listed[started.workflow_id].outcome == UNREADABLE
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    outputs = {"worker log": log_file.read_text()}
    assert "worker polling" in outputs["worker log"], outputs["worker log"]
    dev_up = run_cli("devstack", "up", "--json", env=env)
    assert dev_up.returncode == 0, dev_up.stderr
    assert json.loads(dev_up.stdout)["database_url"].count("***") == 1
    outputs["dev up"] = dev_up.stdout + dev_up.stderr
    unreachable = run_cli(
        "failed", env={**env, "DATABASE_URL": f"postgresql://app:{password}@127.0.0.1:1/x?password={password}"}
    )
    assert unreachable.returncode == EXIT_UNAVAILABLE and "unavailable" in unreachable.stderr, unreachable.stderr
    outputs["unreachable database"] = unreachable.stdout + unreachable.stderr
    bad_key = run_cli("list", env={**env, "PAYLOAD_ENCRYPTION_KEY": f"{key[:-8]}!{api_key}"})
    assert bad_key.returncode == 2 and "PAYLOAD_ENCRYPTION_KEY" in bad_key.stderr, bad_key.stderr
    outputs["bad key"] = bad_key.stdout + bad_key.stderr
    bad_worker = run_worker_once({**env, "PAYLOAD_ENCRYPTION_KEY": f"{key}{password}"})
    assert bad_worker.returncode == 2 and "PAYLOAD_ENCRYPTION_KEY" in bad_worker.stderr, bad_worker.stderr
    outputs["worker with a bad key"] = bad_worker.stdout + bad_worker.stderr
    for where, text in outputs.items():
        for secret in secrets:
            assert secret not in text, f"a secret leaked into {where}"
            assert secret[:12] not in text, f"part of a secret leaked into {where}"


# --- least privilege in Postgres ------------------------------------------------------------------


def as_user(url: str, user: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1] if "@" in parts.netloc else parts.netloc
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))


async def test_worker_role_can_clean_but_not_change_the_schema(
    client: Client, pool: asyncpg.Pool, db_url: str, task_queue: str
) -> None:
    login = f"cleanup_worker_t{uuid.uuid4().hex[:8]}"
    await pool.execute(f"CREATE ROLE {login} LOGIN PASSWORD 'unused-locally' IN ROLE cleanup_worker")
    worker_url = as_user(db_url, login)
    worker_pool: asyncpg.Pool | None = None
    try:
        await db.check_schema_url(worker_url)  # what a worker does at start-up: read-only, no DDL
        worker_pool = await db.create_pool(worker_url, max_size=4)
        assert await worker_pool.fetchval("SELECT current_user") == login
        deadline = deadline_in(1)
        await seed(pool, deadline, 30)  # seeding is the game backend's job, as the owner
        async with build_worker(client, task_queue, await build_activities(worker_pool)):
            started = await start_cleanup(
                client, worker_pool, task_queue, StartCleanup(deadline=deadline, partitions=2)
            )
            result = await client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id).result()
        assert result.outcome == "cleaned" and result.settlement is not None and result.settlement.cleaned == 30
        assert (await effect_counts(pool))["archived_matches"] == 30 * 5

        forbidden = [
            "DROP TABLE accounts",
            "ALTER TABLE accounts ADD COLUMN sneaky int",
            "TRUNCATE cleanup_applied",
            "CREATE INDEX sneaky_idx ON accounts (status)",
            "DELETE FROM schema_migrations",
            "ALTER ROLE cleanup_worker SUPERUSER",
        ]
        if await worker_pool.fetchval("SHOW server_version_num") >= "150000":
            forbidden.append("CREATE TABLE sneaky (x int)")  # PUBLIC lost CREATE on schema public in PG 15
        async with worker_pool.acquire() as conn:
            for statement in forbidden:
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await conn.execute(statement)
        owned = await pool.fetchval(
            "SELECT count(*) FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner "
            "WHERE r.rolname IN ('cleanup_worker', $1)",
            login,
        )
        assert owned == 0
    finally:
        if worker_pool is not None:
            await worker_pool.close()
        await pool.execute(f"DROP ROLE IF EXISTS {login}")


async def test_worker_role_migration_is_idempotent_across_databases(pool: asyncpg.Pool) -> None:
    """The role is cluster-wide; every cloned or fresh database re-runs the grants without error."""
    sql = (PROJECT_ROOT / "core" / "sql" / "migrations" / "004_worker_role.sql").read_text()
    async with pool.acquire() as conn:
        await conn.execute(sql)  # the role exists already: grants only
        await conn.execute(sql)
        privileges = await conn.fetchval(
            "SELECT has_table_privilege('cleanup_worker', 'accounts', 'TRUNCATE') OR "
            "has_table_privilege('cleanup_worker', 'schema_migrations', 'INSERT')"
        )
        assert privileges is False
        assert await conn.fetchval(
            "SELECT has_table_privilege('cleanup_worker', 'outbox', 'SELECT, INSERT, UPDATE, DELETE')"
        )


async def test_grants_are_per_table_and_a_missing_privilege_is_named_at_start_up(pool, db_url, settings) -> None:
    """No grant on a whole schema nor on future objects: a table the game adds later is out of the
    worker's reach; the declared targets get exactly what their statements use, and a worker whose
    role lacks one refuses to start, naming the table and the privilege, until `migrate` grants it."""
    from cleanup.batches import CompiledCleanup
    from cleanup.targets import load_targets
    from tests.test_cleanup_input import run_cli

    assert await pool.fetchval("SELECT count(*) FROM pg_default_acl") == 0, "no default privileges"
    await pool.execute("CREATE TABLE demo_game.player_emails (account_id text, email text)")
    await pool.execute("CREATE TABLE new_service_table (x int)")  # created after the grants: not reachable
    for table in ("demo_game.player_emails", "new_service_table"):
        assert not await pool.fetchval("SELECT has_table_privilege('cleanup_worker', $1, 'SELECT')", table), table
    assert not await pool.fetchval("SELECT has_table_privilege('cleanup_worker', 'demo_game.cloud_saves', 'UPDATE')")

    login = f"cleanup_worker_t{uuid.uuid4().hex[:8]}"
    await pool.execute(f"CREATE ROLE {login} LOGIN IN ROLE cleanup_worker")
    worker_pool = await db.create_pool(as_user(db_url, login), max_size=2)
    try:
        await pool.execute("REVOKE DELETE ON demo_game.inventory_items FROM cleanup_worker")
        with pytest.raises(ValueError, match=r"lacks DELETE on demo_game\.inventory_items") as refused:
            await CompiledCleanup.compile(worker_pool, load_targets())
        assert "starter.py migrate" in str(refused.value)

        migrated = run_cli(settings, "migrate", "--json")
        assert migrated.returncode == 0, migrated.stderr
        granted = json.loads(migrated.stdout)["granted"]
        assert "SELECT, DELETE on demo_game.inventory_items" in granted
        assert "SELECT, INSERT on demo_game.match_history_archive" in granted
        await CompiledCleanup.compile(worker_pool, load_targets())  # starts now
        assert not await pool.fetchval(
            "SELECT has_table_privilege('cleanup_worker', 'demo_game.player_emails', 'SELECT')"
        )
    finally:
        await worker_pool.close()
        await pool.execute(f"DROP ROLE IF EXISTS {login}")


async def test_the_service_schema_is_a_setting(admin_db_url: str) -> None:
    name = f"cleanup_schema_{uuid.uuid4().hex[:8]}"
    url = await db.create_database(admin_db_url, name, settings=Settings(database_schema="game_cleanup"))
    try:
        conn = await asyncpg.connect(url)
        try:
            tables = await conn.fetchval(
                "SELECT count(*) FROM pg_tables WHERE schemaname = 'game_cleanup' AND tablename = 'accounts'"
            )
            assert tables == 1
            assert await conn.fetchval("SELECT to_regclass('deadline_cleanup.accounts')") is None
            assert await conn.fetchval("SELECT to_regclass('public.accounts')") is None
            now = await conn.fetchval("SELECT now()")
            assert await conn.fetchval("SELECT game_cleanup.set_deadline('p1', $1)", now) == "registered"
        finally:
            await conn.close()
    finally:
        await db.drop_database(admin_db_url, name)
    with pytest.raises(InputError, match="CLEANUP_SCHEMA is not a schema name"):
        db.service_schema(Settings(database_schema="Robert'); DROP"))
