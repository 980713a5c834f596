"""Shared set-up for benchmarks: a private dev server, a fresh database, worker processes, memory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
from temporalio.client import Client

from core import db, embedded
from core.config import PROJECT_ROOT, Settings
from core.temporal import connect


def peak_rss_mib(pid: int) -> float:
    """VmHWM: the peak resident set size of a live process, in MiB."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (/proc/<pid>/stat), in seconds."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return float("nan")


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

    def start_worker(self, module: str = "bench.worker", **env: str) -> subprocess.Popen[bytes]:
        assert self.settings.temporal_address and self.settings.database_url
        full_env = {
            **os.environ,
            "TEMPORAL_ADDRESS": self.settings.temporal_address,
            "DATABASE_URL": self.settings.database_url,
            "TEMPORAL_TASK_QUEUE": self.settings.task_queue,
            **env,
        }
        log = open(self.server.state_dir / f"worker-{len(self.workers)}.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", module], env=full_env, stdout=log, stderr=subprocess.STDOUT, cwd=PROJECT_ROOT
        )
        self.workers.append(proc)
        return proc

    def server_pid(self) -> int:
        return int(self.server.pid_file.read_text())

    def memory(self) -> dict[str, float]:
        out = {f"worker_{i}_peak_rss_mib": round(peak_rss_mib(p.pid), 1) for i, p in enumerate(self.workers)}
        out["temporal_server_peak_rss_mib"] = round(peak_rss_mib(self.server_pid()), 1)
        return out

    def cpu(self) -> dict[str, float]:
        """CPU seconds (user + system) used so far by the Temporal server and each worker process."""
        out = {f"worker_{i}": cpu_seconds(p.pid) for i, p in enumerate(self.workers)}
        out["temporal_server"] = cpu_seconds(self.server_pid())
        return out


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


@contextlib.asynccontextmanager
async def stack(pool_size: int = 8) -> AsyncIterator[Stack]:
    base = Settings.from_env()
    admin_url = base.database_url or embedded.embedded_postgres_url(base.state_dir)
    database = f"bench_{uuid.uuid4().hex[:10]}"
    url = await db.create_database(admin_url, database, migrate=False)
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        server = embedded.DevServer(Path(tmp), port=embedded.free_port())
        server.start()
        settings = base.model_copy(
            update={
                "temporal_address": server.address,
                "database_url": url,
                "task_queue": f"bench-{uuid.uuid4().hex[:8]}",
            }
        )
        await db.migrate_url(url)
        pool = await db.create_pool(url, max_size=pool_size)
        client = await connect(settings)
        s = Stack(settings, client, pool, server, admin_url, database)
        try:
            yield s
        finally:
            for p in s.workers:
                p.terminate()
            for p in s.workers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=30)
            await pool.close()
            server.stop()
            await db.drop_database(admin_url, database)


async def wait_for_worker(client: Client, task_queue: str, within: float = 60) -> None:
    """Block until a worker polls the task queue (so start-up is not billed to the pipeline)."""
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
        if resp.pollers:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("no worker polled the task queue in time")
