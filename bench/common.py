"""Shared set-up for benchmarks: a private dev server, a fresh database, worker processes, memory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
from temporalio.client import Client

from budget.controller import BudgetChange, set_budget
from cleanup.models import DEFAULTS
from core import db
from core.config import PROJECT_ROOT, Settings
from core.temporal import connect
from demo.fixture import create_game_schema
from devstack import embedded

T = TypeVar("T")


def peak_rss_mib(pid: int) -> float:
    """VmHWM: the peak resident set size of a live process, in MiB."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU a live process has used so far (/proc), or None where it cannot be read."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return None


async def database_cpu_seconds(pool: asyncpg.Pool) -> dict[int, float] | None:
    """CPU used so far by every backend connected to the pool's database, by backend PID.

    Only where Postgres runs on this machine and its processes can be read (the embedded server,
    or a local one when the benchmark runs as root); None elsewhere. CPU time is what a
    backend spent working, not waiting for a core, so it varies far less with the machine's load
    than wall-clock time does: the benchmarks print it next to the throughput.
    """
    rows = await pool.fetch("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
    used = {r["pid"]: cpu_seconds(r["pid"]) for r in rows}
    if not used or any(v is None for v in used.values()):
        return None
    return {pid: v for pid, v in used.items() if v is not None}


def cpu_used(before: dict[int, float] | None, after: dict[int, float] | None) -> float | None:
    """Backend CPU between two `database_cpu_seconds` readings (a backend opened in between counts
    from zero; one closed in between is missed: the pools keep theirs open during a run)."""
    if before is None or after is None:
        return None
    return round(sum(v - before.get(pid, 0.0) for pid, v in after.items()), 2)


def load_average() -> float:
    """The 1-minute load average (the machine is shared: every benchmark records it)."""
    return round(os.getloadavg()[0], 2)


def machine() -> str:
    cpu = "unknown cpu"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Python {platform.python_version()}"


@dataclass
class Stack:
    """A private Temporal dev server and a fresh database, so peak memory belongs to this run."""

    settings: Settings
    client: Client
    pool: asyncpg.Pool
    server: embedded.DevServer
    admin_url: str
    database: str
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    # A pool of one connection per claim stream: the claim's backends, whose CPU can be read apart.
    claim_backends: asyncpg.Pool | None = None
    # The code the workers run: a copy taken when the stack started (`snapshot_code`).
    code: Path = PROJECT_ROOT

    def start_worker(self, module: str = "bench.worker", **env: str) -> subprocess.Popen[bytes]:
        assert self.settings.temporal_address and self.settings.database_url
        full_env = {
            **os.environ,
            "TEMPORAL_ADDRESS": self.settings.temporal_address,
            "DATABASE_URL": self.settings.database_url,
            "TEMPORAL_TASK_QUEUE": self.settings.task_queue,
            "PYTHONPATH": str(self.code),
            **env,
        }
        log = open(self.server.state_dir / f"worker-{len(self.workers)}.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", module], env=full_env, stdout=log, stderr=subprocess.STDOUT, cwd=self.code
        )
        self.workers.append(proc)
        return proc

    def server_pid(self) -> int:
        return int(self.server.pid_file.read_text())

    def process_cpu(self) -> dict[str, float | None]:
        """CPU used so far by the worker processes and the Temporal server (the orchestration's share)."""
        out = {f"worker_{i}_cpu_s": cpu_seconds(p.pid) for i, p in enumerate(self.workers)}
        out["temporal_server_cpu_s"] = cpu_seconds(self.server_pid())
        return out

    async def budget_off(self) -> None:
        """Switch the load budget (docs/budget.md) off for every worker of this database.

        The throughput benchmarks measure what orchestration costs next to the same SQL run
        directly, and the direct runs take no budget; with the default budget (2 batches in flight,
        4,000 rows/s) the pipeline would measure the budget's limit instead. A worker that finds it
        off asks again once a second (`off_recheck_seconds`), not per batch. Scenario 6
        (bench/player_load.py) measures the budget.
        """
        await set_budget(self.pool, BudgetChange(enabled=False), changed_by="benchmark")

    def memory(self) -> dict[str, float]:
        out = {f"worker_{i}_peak_rss_mib": round(peak_rss_mib(p.pid), 1) for i, p in enumerate(self.workers)}
        out["temporal_server_peak_rss_mib"] = round(peak_rss_mib(self.server_pid()), 1)
        return out

    def cpu(self) -> dict[str, float]:
        """CPU seconds (user + system) used so far by the Temporal server and each worker process
        (NaN where /proc cannot be read)."""
        pids = {f"worker_{i}": p.pid for i, p in enumerate(self.workers)}
        pids["temporal_server"] = self.server_pid()
        return {name: _or_nan(cpu_seconds(pid)) for name, pid in pids.items()}


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


class LoadSampler:
    """The 1-minute load average, sampled every `every` seconds while a run lasts."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self.samples: list[float] = [os.getloadavg()[0]]
        self._task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._task = asyncio.get_running_loop().create_task(self._loop())
        return self

    def __exit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict[str, float]:
        s = self.samples
        return {
            "before": round(s[0], 2),
            "after": round(s[-1], 2),
            "mean": round(sum(s) / len(s), 2),
            "max": round(max(s), 2),
            "samples": len(s),
        }


def snapshot_code(target: Path) -> Path:
    """A copy of the project's code for the stack's workers to run.

    The workflow sandbox imports a workflow's module from disk again for each run it starts or
    replays, so a worker running from the working tree picks up any file edited while a benchmark
    runs: a workflow module that no longer matches the modules the process already holds fails every
    activation from then on (a planner stuck on a failing task). With a copy, what a benchmark
    measures is the code it started with."""
    code = target / "code"
    shutil.copytree(
        PROJECT_ROOT,
        code,
        ignore=shutil.ignore_patterns(".git", ".venv", ".state", "__pycache__", "*.pyc", ".mypy_cache", ".ruff_cache"),
    )
    return code


@contextlib.asynccontextmanager
async def stack(pool_size: int = 8) -> AsyncIterator[Stack]:
    base = Settings.from_env()
    admin_url = base.database_url or embedded.embedded_postgres_url(base.state_dir)
    database = f"bench_{uuid.uuid4().hex[:10]}"
    url = await db.create_database(admin_url, database, migrate=False)
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp, _dev_server(Path(tmp)) as server:
        settings = base.model_copy(
            update={
                "temporal_address": server.address,
                "database_url": url,
                "task_queue": f"bench-{uuid.uuid4().hex[:8]}",
            }
        )
        await db.migrate_url(url)
        await create_game_schema(url)
        pool = await db.create_pool(url, max_size=pool_size)
        client = await connect(settings)
        claim_backends = await db.create_pool(url, min_size=DEFAULTS.claim_streams, max_size=DEFAULTS.claim_streams)
        s = Stack(
            settings,
            client,
            pool,
            server,
            admin_url,
            database,
            claim_backends=claim_backends,
            code=snapshot_code(Path(tmp)),
        )
        try:
            yield s
        finally:
            for p in s.workers:
                p.terminate()
            for p in s.workers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=30)
            await claim_backends.close()
            await pool.close()
            await db.drop_database(admin_url, database)


def run_benchmark(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` for a benchmark's command line. Without DATABASE_URL a benchmark uses the
    embedded Postgres; one this run started is stopped when it ends, so no server of the benchmark's
    outlives it to share the cores with the next. The tests call the benchmarks' `run` inside their
    session instead, which owns the embedded Postgres its workers share."""
    base = Settings.from_env()
    started_here = base.database_url is None and embedded.embedded_postgres_pid(base.state_dir) is None
    try:
        return asyncio.run(main)
    finally:
        if started_here:
            embedded.stop_embedded_postgres(base.state_dir)


@contextlib.contextmanager
def _dev_server(state_dir: Path) -> Iterator[embedded.DevServer]:
    """A Temporal dev server of the benchmark's own, stopped whatever happens after it started."""
    server = embedded.DevServer(state_dir, port=None)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def wait_for_worker(client: Client, task_queue: str, within: float = 60, pid: int | None = None) -> None:
    """Block until a worker polls the task queue (so start-up is not billed to the pipeline).

    `pid`: until that worker process polls (its identity, the SDK's default `pid@host`): the server
    keeps listing a stopped worker's pollers for a while."""
    from temporalio.api.enums.v1 import TaskQueueType
    from temporalio.api.taskqueue.v1 import TaskQueue
    from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        resp = await client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(
                namespace=client.namespace,
                task_queue=TaskQueue(name=task_queue),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
            )
        )
        if any(pid is None or p.identity.startswith(f"{pid}@") for p in resp.pollers):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("no worker polled the task queue in time")


BUDGET_TRACE = """
SELECT extract(epoch FROM clock_timestamp())::float8 AS at, rate_limit, in_flight_limit, observed_probe_ms,
       probe_baseline_ms, observed_rows_per_second, observed_latency_ms, stress,
       (SELECT count(*) FROM load_budget_slots s WHERE s.expires_at > clock_timestamp())::int AS in_flight
FROM load_budget WHERE name = 'database'
"""


async def trace_budget(pool: asyncpg.Pool, into: list[dict[str, Any]], interval: float = 1.0) -> None:
    """The budget row every `interval` seconds (until cancelled): how the controller moved. A read
    that fails (the database restarting) is skipped."""
    while True:
        with contextlib.suppress(asyncpg.PostgresError, OSError, asyncpg.InterfaceError):
            row = await pool.fetchrow(BUDGET_TRACE)
            if row is not None:
                into.append({k: round(v, 2) if isinstance(v, float) else v for k, v in dict(row).items()})
        await asyncio.sleep(interval)
