"""Bad input gets a clear error, exit code 2, and starts nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from cleanup.inputs import StartCleanup
from cleanup.operations import start_cleanup
from core.cli import EXIT_UNAVAILABLE
from core.config import PROJECT_ROOT
from core.envelope import PayloadTooLargeError
from core.errors import InputError
from tests.helpers import deadline_in, seed, workflow_ids


def run_cli(settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        TEMPORAL_ADDRESS=settings.temporal_address,
        DATABASE_URL=settings.database_url,
        TEMPORAL_TASK_QUEUE=settings.task_queue,
    )
    return subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "starter.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def run_cli_all(settings, commands: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    """Independent CLI runs side by side (each is mostly interpreter start-up), in order."""
    with ThreadPoolExecutor(4) as runs:
        return list(runs.map(lambda args: run_cli(settings, *args), commands))


async def test_cli_rejects_bad_input_clearly_and_starts_nothing(client, pool, settings, task_queue):
    deadline = deadline_in(3600)
    accounts = await seed(pool, deadline, 3)
    iso = deadline.isoformat().replace("+00:00", "Z")
    cases = [
        (["cleanup", "--account", "bad\nid"], "malformed account ID"),
        (["cleanup", "--account", "acct_nobody"], "unknown account 'acct_nobody'"),
        (["cleanup", "--deadline", "2026-11-01T09:00:00"], "has no timezone"),
        (["cleanup", "--deadline", "next tuesday"], "not an ISO-8601 datetime"),
        (["cleanup", "--deadline", iso, "--partitions", "0"], "partitions must be between 1 and 256"),
        (["cleanup", "--deadline", iso, "--partitions", "1000"], "partitions must be between 1 and 256"),
        (["cleanup", "--deadline", "2026-01-01T00:00:00Z"], "no active account has renewal deadline"),
        (["renew", accounts[0], "--until", "2020-01-01T00:00:00Z"], "is in the past"),
        (["renew", accounts[0], "--until", "2030-01-01T00:00:00"], "has no timezone"),
        (["renew", "acct_nobody"], "unknown account 'acct_nobody'"),
        (["renew", "x" * 201], "malformed account ID"),
        (["renew", ""], "malformed account ID"),
    ]
    for (args, message), done in zip(cases, run_cli_all(settings, [args for args, _ in cases]), strict=True):
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert message in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr

    assert await workflow_ids(client, task_queue) == []
    assert await pool.fetchval("SELECT count(*) FROM renewals") == 0
    assert await pool.fetchval("SELECT count(*) FROM accounts WHERE cleanup_version <> 1") == 0


async def test_input_over_the_256_kib_envelope_is_rejected_before_temporal(client, pool, task_queue):
    deadline = deadline_in(3600)
    await seed(pool, deadline, 3)

    with pytest.raises(PayloadTooLargeError, match=r"over the 256 KiB envelope; nothing was started"):
        await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline, note="x" * (300 * 1024)))

    assert issubclass(PayloadTooLargeError, InputError)
    assert await workflow_ids(client, task_queue) == []
    started = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline, note="x" * (200 * 1024)))
    assert started.started, "just under the envelope is fine"
    await client.get_workflow_handle(started.workflow_id).terminate("test over")


async def test_status_and_list_print_json(client, pool, settings, task_queue, worker):
    import json

    deadline = deadline_in(1)
    await seed(pool, deadline, 10)
    started = await start_cleanup(client, pool, task_queue, StartCleanup(deadline=deadline, partitions=2))
    await client.get_workflow_handle(started.workflow_id).result()

    status = json.loads(run_cli(settings, "status", started.workflow_id, "--json").stdout)
    assert status["settled"] is True and status["partitions_reported"] == "2/2"
    assert status["settlement"]["cleaned"] == 10 and status["outcome"] == "cleaned"
    listed = json.loads(run_cli(settings, "list", "--json").stdout)
    assert started.workflow_id in [row["workflow_id"] for row in listed]


async def test_an_unreachable_temporal_address_exits_75_naming_the_setting(settings):
    """Unavailable, not bad input: EX_TEMPFAIL (75), so a caller knows to try again later."""
    wrong = settings.model_copy(update={"temporal_address": "127.0.0.1:1"})
    out = run_cli(wrong, "renew", "acct_nobody")
    assert out.returncode == EXIT_UNAVAILABLE, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert "TEMPORAL_ADDRESS" in out.stderr and "127.0.0.1:1" in out.stderr, out.stderr


def test_a_database_that_accepts_and_never_answers_fails_fast_naming_it(settings):
    import socket

    with socket.socket() as silent:  # accepts connections, never speaks the Postgres protocol
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"postgresql://app:s3cret@127.0.0.1:{silent.getsockname()[1]}/game"
        env = dict(os.environ, DATABASE_URL=url, CONNECT_TIMEOUT_SECONDS="2")
        env["TEMPORAL_ADDRESS"] = settings.temporal_address
        out = subprocess.run(
            [sys.executable, str(PROJECT_ROOT / "starter.py"), "failed"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == EXIT_UNAVAILABLE, out.stderr
    assert "is unavailable (TimeoutError" in out.stderr and "s3cret" not in out.stderr, out.stderr
    assert f"127.0.0.1:{url.rsplit(':', 1)[1].split('/')[0]}" in out.stderr, out.stderr
