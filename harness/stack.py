"""The harness's stack: bench.common's private dev server + fresh database, lanes, and a supervisor.

A *lane* is a task queue, a database of its own (so one lane's faults and counts never touch
another's) and one or more supervised worker slots. The *supervisor* is a loop that notices a
worker process that died (killed at a failpoint, crashed on a lost server) and starts it again,
recording when and how it died.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
from temporalio.client import Client

from bench.common import Stack, stack
from core import db
from core.config import PROJECT_ROOT
from core.failpoints import SHARED_FILE_ENV
from core.temporal import connect
from demo.fixture import create_game_schema
from demo.mail_provider import FaultShares, MailProvider, ProviderThread
from devstack import embedded
from harness.checks import Ordering, ordering_effects
from harness.worker import READY

WORKER_MODULE = "harness.worker"
# application_name of the harness's own connections: never terminated by faults, and with the service's
# prefix, so that the budget does not take the harness's observing queries for players' sessions.
HARNESS_APP = f"{db.APPLICATION_NAME} harness"


@dataclass
class Death:
    slot: str
    pid: int
    returncode: int
    at: float  # time.monotonic()


@dataclass
class Slot:
    """One supervised worker process; restarted by the supervisor whenever it dies."""

    name: str
    env: dict[str, str]
    log_path: Path
    failpoints: str = ""
    proc: subprocess.Popen[bytes] | None = None
    log_offset: int = 0
    starts: int = 0
    deaths: list[Death] = field(default_factory=list)
    supervised: bool = True
    prefix: list[str] = field(default_factory=list)  # e.g. `ip netns exec NS`: the worker runs on a test host

    def pids(self) -> list[int]:
        """Every process this slot ran that died (the current one is `proc`)."""
        return [d.pid for d in self.deaths]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self, failpoints: str = "") -> None:
        self.failpoints = failpoints
        env = dict(self.env)
        if failpoints:
            env["CLEANUP_FAILPOINTS"] = failpoints
        else:
            env.pop("CLEANUP_FAILPOINTS", None)
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", WORKER_MODULE],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=PROJECT_ROOT,
            )
        self.starts += 1

    def ready(self) -> bool:
        if not self.log_path.exists():
            return False
        with open(self.log_path, "rb") as f:
            f.seek(self.log_offset)
            return READY.encode() in f.read()

    def log_tail(self, chars: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""


class Supervisor:
    """Starts worker slots and restarts any that die (a real supervisor loop, 10 checks a second)."""

    def __init__(self) -> None:
        self.slots: list[Slot] = []
        self._task: asyncio.Task[None] | None = None
        self.restart_delay = 0.2

    def add(self, slot: Slot) -> Slot:
        self.slots.append(slot)
        return slot

    async def __aenter__(self) -> Supervisor:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.to_thread(self.stop_all)

    async def _loop(self) -> None:
        while True:
            for slot in self.slots:
                proc = slot.proc
                if slot.supervised and proc is not None and proc.poll() is not None:
                    slot.deaths.append(Death(slot.name, proc.pid, int(proc.returncode), time.monotonic()))
                    await asyncio.sleep(self.restart_delay)
                    slot.spawn("")  # a restarted worker comes back without failpoints
            await asyncio.sleep(0.1)

    async def start(self, slot: Slot, failpoints: str = "", within: float = 60) -> None:
        """(Re)start a slot's process with these failpoints and wait until it polls."""
        await self.stop(slot)
        slot.spawn(failpoints)
        await self.wait_ready(slot, within)

    async def wait_ready(self, slot: Slot, within: float = 60) -> None:
        """Until the slot's current process polls (a dead one about to be restarted does not)."""
        deadline = time.monotonic() + within
        while not (slot.alive() and slot.ready()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {slot.name} did not start in time:\n{slot.log_tail()}")
            await asyncio.sleep(0.05)

    async def stop(self, slot: Slot) -> None:
        """Stop a slot's process on purpose (not a death: the supervisor does not restart it)."""
        proc = slot.proc
        slot.proc = None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)  # a frozen (SIGSTOPped) worker only sees SIGTERM once continued
            try:
                await asyncio.to_thread(proc.wait, 20)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait, 10)

    async def wait_death(self, slot: Slot, after: int, within: float) -> Death | None:
        """The first death of `slot` beyond the first `after` recorded ones, or None on timeout."""
        deadline = time.monotonic() + within
        while len(slot.deaths) <= after:
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.02)
        return slot.deaths[after]

    def stop_all(self) -> None:
        procs = [s.proc for s in self.slots if s.proc is not None]
        for s in self.slots:
            s.supervised = False
            s.proc = None
        for p in procs:
            if p.poll() is None:
                p.terminate()
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGCONT)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()

    def deaths(self) -> list[Death]:
        return [d for s in self.slots for d in s.deaths]


@dataclass
class Lane:
    name: str
    task_queue: str
    database_url: str
    pool: asyncpg.Pool
    slots: list[Slot]
    env: dict[str, str] = field(default_factory=dict)  # every slot's environment (before its own overrides)
    # The failpoint file the lane's workers share (core.failpoints), if it has one.
    failpoints_file: Path | None = None


@dataclass
class Harness:
    """Everything a scenario needs: the stack, the mail provider, a supervisor, and lanes."""

    stack: Stack
    provider: ProviderThread
    token: str
    supervisor: Supervisor
    log_dir: Path
    lanes: list[Lane] = field(default_factory=list)
    databases: list[str] = field(default_factory=list)
    # The ordering checks of every closed lane, in closing order (the runner takes each scenario's).
    ordering: list[tuple[str, Ordering]] = field(default_factory=list)

    @property
    def client(self) -> Client:
        return self.stack.client

    @property
    def address(self) -> str:
        assert self.stack.settings.temporal_address is not None
        return self.stack.settings.temporal_address

    async def lane(
        self,
        name: str,
        workers: int,
        *,
        address: str | None = None,
        admin_url: str | None = None,
        planner: bool = False,
        env: dict[str, str] | None = None,
        failpoints: str | Sequence[str] = "",
        shared_failpoints: bool = False,
    ) -> Lane:
        """A fresh migrated database, a task queue and `workers` started slots. `admin_url`: make the
        database on another server (a private one a scenario may crash), which the caller removes.
        `planner`: the workers ensure the lane's deadline planner (CLEANUP_PLANNER=on), as
        `worker.py` does; otherwise the scenario drives its cleanups itself. `env` adds to every
        slot's environment (e.g. PLANNER_TICK_SECONDS). `failpoints`: CLEANUP_FAILPOINTS of every
        slot's first start (a string), or of the first slots, one per slot (a sequence).
        `shared_failpoints`: the workers share one failpoint file (armed by the scenario, per run)."""
        database = f"harness_{name.replace('-', '_')}_{uuid.uuid4().hex[:8]}"
        url = await db.create_database(admin_url or self.stack.admin_url, database)
        await create_game_schema(url)
        if admin_url is None:
            self.databases.append(database)
        pool = await harness_pool(url)
        task_queue = f"harness-{name}-{uuid.uuid4().hex[:6]}"
        worker_env = dict(
            os.environ,
            TEMPORAL_ADDRESS=address or self.address,
            TEMPORAL_NAMESPACE=self.stack.settings.temporal_namespace,
            TEMPORAL_TASK_QUEUE=task_queue,
            DATABASE_URL=url,
            DB_POOL_MAX_SIZE="4",
            MAIL_PROVIDER_URL=self.provider.url,
            MAIL_PROVIDER_TOKEN=self.token,
            PYTHONUNBUFFERED="1",
            CLEANUP_PLANNER="on" if planner else "off",
            CLEANUP_FAILPOINTS_ENABLED="1",  # the harness's workers are the ones failpoints are for
        )
        worker_env.pop("CLEANUP_FAILPOINTS", None)
        worker_env.pop(SHARED_FILE_ENV, None)
        worker_env.update(env or {})
        failpoints_file = self.log_dir / f"{name}-failpoints.json" if shared_failpoints else None
        if failpoints_file is not None:
            failpoints_file.unlink(missing_ok=True)
            worker_env[SHARED_FILE_ENV] = str(failpoints_file)
        slots = [
            self.supervisor.add(Slot(f"{name}-w{i}", worker_env, self.log_dir / f"{name}-w{i}.log"))
            for i in range(workers)
        ]
        armed = [failpoints] * workers if isinstance(failpoints, str) else list(failpoints)
        armed += [""] * (workers - len(armed))
        await asyncio.gather(*(self.supervisor.start(s, f) for s, f in zip(slots, armed, strict=True)))
        lane = Lane(name, task_queue, url, pool, slots, worker_env, failpoints_file)
        self.lanes.append(lane)
        return lane

    def add_slot(
        self, lane: Lane, suffix: str, *, env: dict[str, str] | None = None, prefix: list[str] | None = None
    ) -> Slot:
        """Another (not yet started) worker slot on `lane`: its environment is the lane's plus `env`."""
        name = f"{lane.name}-{suffix}"
        slot = self.supervisor.add(Slot(name, {**lane.env, **(env or {})}, self.log_dir / f"{name}.log"))
        slot.prefix = list(prefix or [])
        lane.slots.append(slot)
        return slot

    async def close_lane(self, lane: Lane) -> None:
        for s in lane.slots:
            s.supervised = False
        await asyncio.gather(*(self.supervisor.stop(s) for s in lane.slots))
        try:
            # After every scenario, over the lane's whole database and its reminders at the provider.
            self.ordering.append((lane.name, await ordering_effects(lane.pool, self.provider.provider)))
        finally:
            await lane.pool.close()


async def harness_pool(url: str, max_size: int = 6) -> asyncpg.Pool:
    pool = await asyncpg.create_pool(
        url,
        min_size=1,
        max_size=max_size,
        command_timeout=120,
        server_settings={"application_name": HARNESS_APP, **db.service_settings()},
    )
    assert pool is not None
    return pool


@contextlib.asynccontextmanager
async def harness(log_dir: Path | None = None) -> AsyncIterator[Harness]:
    token = secrets.token_urlsafe(24)
    async with stack(pool_size=4) as s:
        logs = log_dir or s.server.state_dir
        logs.mkdir(parents=True, exist_ok=True)
        with ProviderThread(MailProvider(token, FaultShares(hang_seconds=2), seed=5)) as provider:
            async with Supervisor() as supervisor:
                h = Harness(s, provider, token, supervisor, logs)
                try:
                    yield h
                finally:
                    supervisor.stop_all()
                    for lane in h.lanes:
                        await lane.pool.close()
                    for database in h.databases:
                        await db.drop_database(s.admin_url, database)


async def new_client(address: str, like: Client) -> Client:
    """A client to another server (the restart scenario's), with the stack's converter."""
    del like
    from core.config import Settings

    return await connect(Settings(temporal_address=address))


__all__ = ["Death", "Harness", "Lane", "Slot", "Supervisor", "embedded", "harness", "harness_pool", "new_client"]
