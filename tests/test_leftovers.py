"""No process started by a test session outlives it: the session-finish check of tests/conftest.py
lists and kills what a session left running, and fails that session."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.config import PROJECT_ROOT
from devstack import embedded
from tests import leftovers
from tests.conftest import STATE_DIR


def probe_session(mode: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], int]:
    pid_file = tmp_path / "probe.pid"
    done = subprocess.run(
        # Its one test that needs no server: the probe's other test would start Temporal and Postgres
        # for its fixtures before skipping (seconds each way, and this test is in the fast tier).
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/leak_probe.py::test_start_a_process"],
        cwd=PROJECT_ROOT,
        # A short grace: the probe has reaped what it stopped before its session ends, and a process
        # left running is waited for the whole grace.
        env=dict(os.environ, LEAK_PROBE=mode, LEAK_PROBE_PID_FILE=str(pid_file), **{leftovers.GRACE_ENV: "0.2"}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done, int(pid_file.read_text())


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]


def test_a_session_that_leaves_a_process_running_fails_and_kills_it(tmp_path: Path) -> None:
    done, pid = probe_session("leave", tmp_path)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "still running" in done.stdout and f"pid {pid}" in done.stdout, done.stdout
    assert not alive(pid), "the check kills what the session left"


def test_a_session_that_stops_what_it_started_passes(tmp_path: Path) -> None:
    done, pid = probe_session("stop", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "still running" not in done.stdout
    assert not alive(pid)


def test_this_session_carries_a_token_its_children_inherit() -> None:
    token = os.environ[leftovers.SESSION_ENV]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdin=subprocess.DEVNULL)
    try:
        assert child.pid in leftovers.carrying(token)
    finally:
        child.kill()
        child.wait()
    assert child.pid not in leftovers.carrying(token)


@pytest.fixture
def postgres_state_dir() -> Iterator[Path]:
    """A state dir the embedded Postgres's own user (`pgserver`, when the tests run as root) can
    reach: not under pytest's tmp_path, whose root pytest keeps at mode 0700 (under xdist a worker
    can reset it while another worker's server is initializing its data directory)."""
    state = STATE_DIR / f"dev-down-{uuid.uuid4().hex[:8]}"
    try:
        yield state
    finally:
        if embedded.embedded_postgres_pid(state) is not None:
            embedded.stop_embedded_postgres(state)
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.server
def test_dev_down_stops_the_embedded_postgres(postgres_state_dir: Path) -> None:
    tmp_path = postgres_state_dir
    embedded.embedded_postgres_url(tmp_path)
    assert embedded.embedded_postgres_pid(tmp_path) is not None
    env = {k: v for k, v in os.environ.items() if k not in ("TEMPORAL_ADDRESS", "DATABASE_URL")}
    done = subprocess.run(
        [sys.executable, "-m", "devstack", "down", "--json"],
        cwd=PROJECT_ROOT,
        env=dict(env, CLEANUP_STATE_DIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert embedded.embedded_postgres_pid(tmp_path) is None
    assert '"postgres": "stopped"' in done.stdout, done.stdout


# The session runs with SIGINT at its default (as in a terminal), whatever this one's is.
DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
)


@pytest.mark.server
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_session_stops_the_servers_it_started(tmp_path: Path, signum: int, admin_db_url: str) -> None:
    """The probe session finds the suite's embedded Postgres running (`admin_db_url` starts it first)
    and leaves it to the suite, whose other tests use it meanwhile; its own Temporal server it stops."""
    token_file = tmp_path / "token"
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/leak_probe.py", "-k", "wait"]
    session = subprocess.Popen(
        [sys.executable, "-c", DEFAULT_SIGINT, *pytest_cmd],
        cwd=PROJECT_ROOT,
        env=dict(os.environ, LEAK_PROBE="wait", LEAK_PROBE_PID_FILE=str(token_file)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the signal goes to it as a terminal's Ctrl-C would
    )
    try:
        while not token_file.exists():
            assert session.poll() is None, session.communicate()[0]
            time.sleep(0.2)
        token = token_file.read_text()
        assert leftovers.carrying(token), "the session's servers run while it waits"
        os.killpg(session.pid, signum)
        output = session.communicate(timeout=180)[0].decode(errors="replace")
    finally:
        if session.poll() is None:
            os.killpg(session.pid, signal.SIGKILL)
    assert session.returncode != 0, output
    assert "KeyboardInterrupt" in output, output
    assert "still running" not in output, output
    assert not leftovers.carrying(token), output
