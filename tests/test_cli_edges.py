"""Edges of the CLI: counts out of range exit 2 with a message (never a raw database error), and
`./dev down` signals only the dev server it started, never whatever a stale pid file names."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from core.config import Settings
from devstack.embedded import DevServer
from tests.helpers import deadline_in, seed
from tests.test_cleanup_input import run_cli


@pytest.mark.parametrize(
    "args, message",
    [
        (["list", "--limit", "0"], "--limit: must be between 1"),
        (["list", "--limit", "-1"], "--limit: must be between 1"),
        (["outbox", "status", "--dead", "-1"], "--dead: must be between 0"),
        (["budget", "set", "--max-lock-waits", "99999999999"], "--max-lock-waits is out of range"),
        (["budget", "set", "--rows-per-second", "nan"], "--rows-per-second is out of range"),
    ],
)
async def test_counts_out_of_range_exit_2_with_a_message(pool, settings: Settings, args, message):
    await seed(pool, deadline_in(3600), 1)
    done = run_cli(settings, *args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


def test_dev_down_leaves_a_process_named_by_a_stale_pid_file_alone(tmp_path):
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        server = DevServer(tmp_path, port=None)
        server.pid_file.write_text(str(stranger.pid))
        outcome = server.stop(timeout=2)
        assert "stale pid file" in outcome and not server.pid_file.exists()
        time.sleep(0.5)
        assert stranger.poll() is None, "the stranger named by the stale pid file was not signalled"
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.dev_server  # starts one
def test_dev_down_stops_the_server_it_started(tmp_path):
    server = DevServer(tmp_path, port=None)
    server.start()
    pid = int(server.pid_file.read_text())
    try:
        assert server.is_this_server(pid) and os.path.exists(f"/proc/{pid}")
        assert server.stop() == "stopped"
        assert not server.running() and not server.pid_file.exists()
    finally:
        if server.is_this_server(pid):  # whatever the outcome, no server of this test outlives it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
