"""Reminder delivery through the relay against the provider's own ingest rate:
`python -m bench.outbox_delivery --events 50000`.

The local mail provider (`demo.mail_provider`) runs as a process of its own. In one run:

1. **floor**: the relay's own sending code (`OutboxRelayActivities._send_all`, the same batches of
   `--batch-max` events to `/v1/messages/batch`, the same requests in flight) fed from memory by as
   many loops as there are relays, with no database in between: what the provider ingests from this
   client. Measured before and after the relay; the higher of the two is the floor.
2. **relay**: `--events` reminders in the outbox (seeded set-based), drained by `--relays` relay
   workflows on worker processes with `MAIL_PROVIDER_BATCH_MAX=--batch-max`: claim under a lease,
   send, record each outcome, `--claims-per-batch` claims of `--claim` events per activity, from the
   first relay's start to the last outcome recorded.

Ratio = relay events/s / floor events/s (goal >= 0.6), and relay events/s itself (goal >= 5,000).
The provider's counters are read after the relay: every seeded key reached it, each once in the
customer's mailbox, and the duplicates it absorbed (0 unless a batch was sent twice).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Coroutine
from typing import Any

import httpx
from temporalio.testing import ActivityEnvironment

from activities.outbox import OutboxRelayActivities
from bench.common import (
    Stack,
    cpu_seconds,
    cpu_used,
    database_cpu_seconds,
    load_average,
    machine,
    run_benchmark,
    stack,
    wait_for_worker,
)
from outbox.models import RelayBatchSettings
from outbox.operations import start_relays
from workflows.outbox_relay import OutboxRelayWorkflow

SEED = """
INSERT INTO outbox (event_key, kind, account_id, source_id, payload)
SELECT 'renewal-reminder:acct_' || $2 || g || ':v1', 'renewal_reminder', 'acct_' || $2 || g, 'bench-relay',
       jsonb_build_object('account_id', 'acct_' || $2 || g, 'cleanup_version', 1, 'cleanup_id', 'bench-relay')
FROM generate_series(1, $1::int) g
"""

TIMELINE = """
SELECT extract(epoch FROM min(last_attempt_at) - $1) AS start_to_first_claim,
       extract(epoch FROM max(delivered_at) - min(last_attempt_at)) AS first_claim_to_last_delivery,
       extract(epoch FROM clock_timestamp() - max(delivered_at)) AS last_delivery_to_relays_done
FROM outbox
WHERE event_key LIKE 'renewal-reminder:acct\\_' || $2 || '%'
"""


BY_STATUS = """
SELECT status, count(*)
FROM outbox
WHERE source_id = 'bench-relay' AND event_key LIKE 'renewal-reminder:acct\\_' || $1 || '%'
GROUP BY status
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def provider_process(s: Stack, token: str) -> Any:
    """The local provider in a process of its own (its own interpreter lock), at a free port."""
    port = free_port()
    env = {**os.environ, "MAIL_PROVIDER_TOKEN": token, "PYTHONPATH": str(s.code)}
    log = open(s.server.state_dir / "mail-provider.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "demo.mail_provider", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=s.code,
    )
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


async def provider_stats(url: str, within: float = 30) -> dict[str, Any]:
    """GET /stats (waiting for the provider to listen)."""
    deadline = time.monotonic() + within
    async with httpx.AsyncClient(base_url=url, trust_env=False) as http:
        while True:
            try:
                return dict((await http.get("/stats")).json())
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)


def floor_rows(events: int, tag: str) -> list[dict[str, Any]]:
    """Rows as the relay's claim returns them (the same fields, the payload as the database's JSON text)."""
    return [
        {
            "event_id": i,
            "event_key": f"renewal-reminder:floor_{tag}_{i}:v1",
            "kind": "renewal_reminder",
            "account_id": f"floor_{tag}_{i}",
            "source_id": "bench-floor",
            "payload": json.dumps(
                {"account_id": f"floor_{tag}_{i}", "cleanup_id": "bench-floor", "cleanup_version": 1}
            ),
            "attempts": 1,
            "failures": 0,
            "failure_counts": "{}",
        }
        for i in range(1, events + 1)
    ]


async def floor(
    url: str, token: str, events: int, batch_max: int, settings: RelayBatchSettings, loops: int, tag: str
) -> dict[str, Any]:
    """The relay's sending code fed from memory: `loops` loops each taking claims of `batch_size` rows."""
    relay = OutboxRelayActivities(None, url, token, batch_max=batch_max)  # no database: only its sending code runs
    rows = floor_rows(events, tag)
    claims = [rows[i : i + settings.batch_size] for i in range(0, len(rows), settings.batch_size)]
    env = ActivityEnvironment()
    delivered = 0

    async def loop() -> None:
        nonlocal delivered
        while claims:
            claim = claims.pop(0)
            outcomes = await env.run(relay._send_all, claim, settings, time.monotonic() + 3600, {})
            delivered += sum(o.kind == "delivered" for o in outcomes.values())

    started, cpu_started = time.perf_counter(), time.process_time()
    await asyncio.gather(*(loop() for _ in range(loops)))
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    await relay.aclose()
    return {
        "client_cpu_s": round(cpu, 2),
        "events": events,
        "delivered": delivered,
        "seconds": round(seconds, 3),
        "events_per_s": round(events / seconds, 1),
    }


async def relay_run(s: Stack, events: int, settings: RelayBatchSettings, relays: int, prefix: str) -> dict[str, Any]:
    """Seeded reminders drained by `relays` relay workflows on the stack's worker."""
    await s.pool.execute(SEED, events, prefix)
    await s.pool.execute("VACUUM ANALYZE outbox")
    cpu_before = await database_cpu_seconds(s.pool)
    workers_before = {p.pid: cpu_seconds(p.pid) for p in s.workers}
    temporal_before = cpu_seconds(s.server_pid())
    db_started = await s.pool.fetchval("SELECT clock_timestamp()")
    started = time.perf_counter()
    handles = await start_relays(
        s.client,
        s.settings.task_queue,
        relays=relays,
        settings=settings,
        idle_sleep_seconds=0.5,
        stop_when_drained=True,
        id_prefix=f"bench-relay-{prefix}",
    )
    totals = await asyncio.gather(
        *(s.client.get_workflow_handle_for(OutboxRelayWorkflow.run, h.workflow_id).result() for h in handles)
    )
    closed = time.perf_counter() - started
    by_status = dict(await s.pool.fetch(BY_STATUS, prefix))  # this round's events only
    timeline = dict(await s.pool.fetchrow(TIMELINE, db_started, prefix) or {})
    # Delivered = recorded as delivered in the outbox: until the last outcome committed, as the floor
    # runs until the last answer came back. The relays' drain mode then still waits out the others'
    # leases before its workflows complete (production relays never complete).
    seconds = float(timeline["start_to_first_claim"] + timeline["first_claim_to_last_delivery"])
    return {
        "events": events,
        "delivered": int(by_status.get("delivered", 0)),
        "by_status": by_status,
        "recorded_delivered": sum(t.delivered for t in totals),
        "batches": sum(t.batches for t in totals),
        "seconds": round(seconds, 3),
        "events_per_s": round(events / seconds, 1),
        "seconds_until_relays_closed": round(closed, 3),
        "events_per_s_until_relays_closed": round(events / closed, 1),
        # Where the time went, by the database's clock: start -> first claim, first claim -> last
        # delivery recorded, and the last delivery recorded -> the relays' workflows closed.
        "timeline_s": {k: round(float(v), 3) for k, v in timeline.items()},
        "database_cpu_s": cpu_used(cpu_before, await database_cpu_seconds(s.pool)),
        "temporal_server_cpu_s": round((cpu_seconds(s.server_pid()) or 0.0) - (temporal_before or 0.0), 2),
        "worker_cpu_s": [round((cpu_seconds(p.pid) or 0.0) - (workers_before[p.pid] or 0.0), 2) for p in s.workers],
    }


async def run(
    events: int = 100_000,
    batch_max: int = 500,
    claim: int = 5000,
    concurrency: int = 8,
    relays: int = 2,
    rounds: int = 2,
    claims_per_batch: int = 20,
) -> dict[str, Any]:
    """Floor, then `rounds` times relay and floor again; the best of each (others share the machine)."""
    settings = RelayBatchSettings(
        batch_size=claim,
        claims_per_batch=claims_per_batch,
        concurrency=concurrency,
        lease_seconds=120,
        request_timeout_seconds=30,
    )
    token = secrets.token_urlsafe(24)
    load_before = load_average()
    async with stack() as s:
        with provider_process(s, token) as (proc, url):
            await provider_stats(url)
            env = {"MAIL_PROVIDER_URL": url, "MAIL_PROVIDER_TOKEN": token, "MAIL_PROVIDER_BATCH_MAX": str(batch_max)}
            await wait_for_worker(s.client, s.settings.task_queue, pid=s.start_worker(**env).pid)
            phase = Phase(s, proc.pid)
            floors = [await phase.measure(floor(url, token, events, batch_max, settings, relays, "f0"))]
            runs = []
            for r in range(rounds):
                runs.append(await phase.measure(relay_run(s, events, settings, relays, f"r{r}x")))
                floors.append(await phase.measure(floor(url, token, events, batch_max, settings, relays, f"f{r + 1}")))
            stats = await provider_stats(url)
    best_floor = max(f["events_per_s"] for f in floors)
    best_relay = max(r["events_per_s"] for r in runs)
    return {
        "scenario": "outbox_delivery",
        "machine": machine(),
        "events": events,
        "provider_batch_max": batch_max,
        "claim_batch_size": claim,
        "claims_per_activity": claims_per_batch,
        "requests_in_flight_per_claim": concurrency,
        "relays": relays,
        "floors": floors,
        "relay_runs": runs,
        "floor_events_per_s": best_floor,
        "relay_events_per_s": best_relay,
        "ratio": round(best_relay / best_floor, 3),
        "target": ">= 0.6",
        "relay_events_per_s_target": ">= 5000",
        "provider": {
            k: stats[k]
            for k in ("received", "unique_keys", "delivered", "duplicates", "batch_requests", "batch_messages")
        },
        "load_average_1m_before_and_after": [load_before, load_average()],
    }


class Phase:
    """CPU seconds the provider and the Temporal server used during one measured phase."""

    def __init__(self, s: Stack, provider_pid: int) -> None:
        self.pids = {"provider_cpu_s": provider_pid, "temporal_server_cpu_s": s.server_pid()}

    async def measure(self, measured: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
        before = {k: cpu_seconds(pid) or 0.0 for k, pid in self.pids.items()}
        result = await measured
        after = {k: cpu_seconds(pid) or 0.0 for k, pid in self.pids.items()}
        return {**result, **{k: round(after[k] - before[k], 2) for k in self.pids}, "load_average_1m": load_average()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--batch-max", type=int, default=500, help="events per request (MAIL_PROVIDER_BATCH_MAX)")
    parser.add_argument("--claim", type=int, default=5000, help="events per relay claim (batch_size)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight per claim")
    parser.add_argument("--relays", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="relay runs, each followed by a floor")
    parser.add_argument("--claims-per-batch", type=int, default=20, help="claims per relay activity")
    args = parser.parse_args()
    result = run_benchmark(
        run(args.events, args.batch_max, args.claim, args.concurrency, args.relays, args.rounds, args.claims_per_batch)
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
