"""Where the players' time goes during a phase of `bench.player_load` (diagnostics, not a figure).

For each phase it records:

- **CPU per process group** from /proc/PID/schedstat: the CPU time used and the time spent
  *runnable but waiting for a core* (the run-queue delay), for the players' Postgres backends, the
  cleanup worker's backends, the worker process, the benchmark process (the players' client), the
  Temporal server and Postgres' own processes (WAL writer, checkpointer, background writer). The
  players' run-queue delay per query is the direct measure of CPU contention.
- **wait events**: pg_stat_activity sampled every `interval` seconds; for each group, how many
  samples found a backend active on the CPU (no wait event) or waiting on what (IO:WALSync,
  LWLock:WALWrite, Lock:transactionid, ...). Sampling is weighted by duration, so slow queries
  dominate it, as they dominate a p99.
- **WAL and checkpoints**: pg_stat_wal and pg_stat_bgwriter deltas (cluster-wide: on a shared
  server they include other databases' work).
- **the machine**: /proc/stat busy and iowait fractions of all cores.
- **a timeline** (when `timeline=True`): per sample, the seconds since the start, the busy fraction
  of the cores since the sample before, and the database's client backends active: how many, how
  many on a CPU, and what the others waited on. It shows *when* cores idle (a tail, a burst of
  commits) where the totals only say how much.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg

from core import db

ACTIVITY = """
SELECT pid, coalesce(nullif(application_name, ''), backend_type) AS who, backend_type, state,
       wait_event_type, wait_event
FROM pg_stat_activity
WHERE pid <> pg_backend_pid()
  AND (datname = current_database() OR backend_type IN ('walwriter', 'checkpointer', 'background writer'))
"""
WAL = "SELECT wal_records, wal_fpi, wal_bytes::bigint AS wal_bytes, wal_buffers_full FROM pg_stat_wal"
BGWRITER = """
SELECT checkpoints_timed, checkpoints_req, buffers_checkpoint, buffers_clean, buffers_backend,
       buffers_backend_fsync
FROM pg_stat_bgwriter
"""
# PostgreSQL 17 moved the checkpointer's and the backends' counters elsewhere; read what exists.
CHECKPOINTER_17 = "SELECT num_timed AS checkpoints_timed, num_requested AS checkpoints_req FROM pg_stat_checkpointer"


def schedstat(pid: int) -> tuple[int, int] | None:
    """(ns on a CPU, ns runnable but waiting for a CPU) of a live process."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        on_cpu, waiting, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
        return int(on_cpu), int(waiting)
    return None


def proc_stat() -> tuple[int, int, int]:
    """(total, idle, iowait) jiffies of all cores."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields), fields[3], fields[4]


async def _counters(conn: asyncpg.Connection) -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(asyncpg.PostgresError):
        row = await conn.fetchrow(WAL)
        out.update({k: int(v) for k, v in dict(row or {}).items()})
    try:
        row = await conn.fetchrow(BGWRITER)
    except asyncpg.PostgresError:
        row = await conn.fetchrow(CHECKPOINTER_17)
    out.update({k: int(v) for k, v in dict(row or {}).items()})
    return out


class Observer:
    """Samples one database (and the processes around it) while a phase runs."""

    def __init__(self, url: str, processes: dict[str, int], interval: float = 0.1, timeline: bool = False) -> None:
        self.url = url
        self.processes = processes  # group name -> pid of a client-side process (worker, bench, temporal)
        self.interval = interval
        self.timeline = timeline

    async def observe(self, during: Any) -> tuple[dict[str, Any], Any]:
        # The service's prefix: the load budget must not take the observer's sampling for a player.
        name = f"{db.APPLICATION_NAME} observer"
        conn = await asyncpg.connect(self.url, server_settings={"application_name": name, **db.service_settings()})
        try:
            waits: dict[str, Counter[str]] = {}
            pids: dict[int, str] = {}
            start_sched: dict[int, tuple[int, int]] = {}
            stop = asyncio.Event()
            timeline: list[list[Any]] = []

            def note_pid(pid: int, who: str) -> None:
                if pid not in pids:
                    pids[pid] = who
                    first = schedstat(pid)
                    if first is not None:
                        start_sched[pid] = first

            async def sample() -> None:
                previous = proc_stat()
                while not stop.is_set():
                    client: Counter[str] = Counter()
                    for r in await conn.fetch(ACTIVITY):
                        who = _group(r["who"], r["backend_type"])
                        note_pid(r["pid"], who)
                        if r["state"] == "active" or r["backend_type"] != "client backend":
                            what = f"{r['wait_event_type']}:{r['wait_event']}" if r["wait_event_type"] else "CPU"
                            waits.setdefault(who, Counter())[what] += 1
                            if r["backend_type"] == "client backend":
                                client[what] += 1
                    if self.timeline:
                        now = proc_stat()
                        total, idle, iowait = (e - s for e, s in zip(now, previous, strict=True))
                        previous = now
                        busy = round(1 - (idle + iowait) / total, 2) if total else None
                        on_cpu = client.pop("CPU", 0)
                        timeline.append(
                            [
                                round(time.perf_counter() - started, 2),
                                busy,
                                on_cpu + sum(client.values()),
                                on_cpu,
                                dict(client),
                            ]
                        )
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), self.interval)

            for who, pid in self.processes.items():
                note_pid(pid, who)
            counters = await _counters(conn)
            machine = proc_stat()
            started = time.perf_counter()
            sampler = asyncio.ensure_future(sample())
            try:
                result = await during()
            finally:
                stop.set()
                await sampler
            seconds = time.perf_counter() - started
            machine_end = proc_stat()
            counters_end = await _counters(conn)
            end_sched = {pid: schedstat(pid) for pid in pids}
        finally:
            await conn.close()

        cpu: dict[str, dict[str, float]] = {}
        for pid, who in pids.items():
            a, b = start_sched.get(pid), end_sched.get(pid)
            if a is None or b is None:
                continue
            group = cpu.setdefault(who, {"processes": 0, "cpu_s": 0.0, "runqueue_wait_s": 0.0})
            group["processes"] += 1
            group["cpu_s"] += (b[0] - a[0]) / 1e9
            group["runqueue_wait_s"] += (b[1] - a[1]) / 1e9
        for group in cpu.values():
            group["cpu_s"] = round(group["cpu_s"], 3)
            group["runqueue_wait_s"] = round(group["runqueue_wait_s"], 3)
        total, idle, iowait = (e - s for e, s in zip(machine_end, machine, strict=True))
        out: dict[str, Any] = {
            "seconds": round(seconds, 2),
            "machine_busy": round(1 - (idle + iowait) / total, 3) if total else None,
            "machine_iowait": round(iowait / total, 3) if total else None,
            "load_average_1m": round(os.getloadavg()[0], 2),
            "cpu": dict(sorted(cpu.items())),
            "wait_samples": {who: dict(c.most_common(8)) for who, c in sorted(waits.items())},
            "cluster_counters": {k: counters_end[k] - counters.get(k, 0) for k in counters_end},
        }
        if self.timeline:
            out["idle_core_seconds"] = idle_core_seconds(timeline, os.cpu_count() or 1)
            out["timeline"] = {
                "columns": ["seconds", "cores_busy", "client_backends_active", "on_cpu", "waiting_on"],
                "samples": timeline,
            }
        return out, result


def idle_core_seconds(samples: list[list[Any]], cores: int) -> dict[str, float]:
    """Core-seconds left idle over a timeline, split by whether at least one client backend per core
    was active at the sample (cores idle while backends wait: locks, WAL flushes) or fewer (a tail
    or a start with too little work in flight)."""
    waiting = few = 0.0
    for (t0, *_), (t1, busy, active, *_) in itertools.pairwise(samples):
        if busy is None:
            continue
        idle = (1 - busy) * cores * (t1 - t0)
        if active >= cores:
            waiting += idle
        else:
            few += idle
    return {"with_a_backend_per_core": round(waiting, 3), "fewer_backends_than_cores": round(few, 3)}


def _group(who: str, backend_type: str) -> str:
    if backend_type != "client backend":
        return f"postgres {backend_type}"
    return who
