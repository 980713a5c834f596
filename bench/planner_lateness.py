"""Lateness of the deadline planner: `python -m bench.planner_lateness --accounts 100000 --spread 600`.

N accounts with the shipped game data (cleanup/seed.sql: 2 saves, 5 items, 5 matches each) get
deadlines spread uniformly over a window (`--spread` seconds, starting `--lead` seconds after the
workers are up). Worker processes (`python -m worker`, the planner on, default planner settings
unless `--planner KEY=VALUE` overrides one) are the only thing running: no cleanup command. When
every account is cleaned (or the window plus `--drain` seconds have passed), the lateness
`cleaned_at - renewal_deadline` of every account is read from the database: p50/p90/p99/p99.9/max,
the same per minute of deadlines (if throughput were the limit, it would grow minute after minute),
`claimed_at - renewal_deadline` (the part before the claim), which cleanup cleaned each account
(bucket or overdue sweep) and how many idempotency records each account has (exactly one).

Also printed: load average (sampled every 10 s), CPU seconds of the Temporal server and of each
worker over the window, and their peak RSS. Goal: p99 <= 2 s, max <= 5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import statistics
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

import bench
from bench.common import LoadSampler, Stack, machine, run_benchmark, stack, wait_for_worker
from budget.controller import budget_status
from cleanup.models import CLAIM_CLEANUP_IN_CHUNKS, CLEANUP_PARTITION, STATUS_QUERY, planner_workflow_id
from core.queries import load
from demo.fixture import seed_accounts

SQL = load(bench.__file__, "scale.sql")
FAR = datetime(2100, 1, 1, tzinfo=UTC)
SEED_CHUNK = 10_000


async def seed_cohort(pool: asyncpg.Pool, accounts: int, prefix: str) -> float:
    """N accounts with game data, deadline far ahead (spread later); seconds taken."""
    t = time.perf_counter()
    for i, start in enumerate(range(0, accounts, SEED_CHUNK)):
        await seed_accounts(pool, prefix=f"{prefix}{i:04d}", deadline=FAR, count=min(SEED_CHUNK, accounts - start))
    await pool.execute("VACUUM ANALYZE")
    return time.perf_counter() - t


async def spread_deadlines(pool: asyncpg.Pool, first: datetime, spread_seconds: float) -> None:
    await pool.execute(SQL.spread_deadlines, *SQL.bind("spread_deadlines", first=first, spread_seconds=spread_seconds))
    await pool.execute("VACUUM ANALYZE accounts")


async def database_now(pool: asyncpg.Pool) -> datetime:
    now: datetime = await pool.fetchval(SQL.database_clock)
    return now


async def wait_all_cleaned(pool: asyncpg.Pool, accounts: int, until: float, every: float = 2.0) -> bool:
    """Poll until every account is cleaned or the monotonic instant `until` passes."""
    while True:
        if await pool.fetchval(SQL.cleaned_count) >= accounts:
            return True
        if time.monotonic() > until:
            return False
        await asyncio.sleep(every)


async def keep_evidence(s: Stack) -> str:
    """A run that did not clean every account: keep the worker and server logs and the planner's
    status beside the project (the stack's directory is deleted with it) so the stall can be read."""
    target = s.settings.state_dir / "bench-evidence" / f"planner-lateness-{datetime.now(UTC):%Y%m%dT%H%M%SZ}"
    target.mkdir(parents=True, exist_ok=True)
    for log in s.server.state_dir.glob("*.log"):
        shutil.copy(log, target / log.name)
    try:
        status = await s.client.get_workflow_handle(planner_workflow_id(s.settings.task_queue)).query(STATUS_QUERY)
        (target / "planner-status.json").write_text(json.dumps(status, default=str, indent=2))
    except Exception as err:  # the evidence of a broken run: whatever can be read is worth keeping
        (target / "planner-status.json").write_text(json.dumps({"error": repr(err)}))
    database = {
        "account_states": [dict(r) for r in await s.pool.fetch(SQL.account_states)],
        "backends": [dict(r) for r in await s.pool.fetch(SQL.backends)],
        "budget": (await budget_status(s.pool)).model_dump(),
    }
    (target / "database.json").write_text(json.dumps(database, default=str, indent=2))
    (target / "running-cleanups.json").write_text(json.dumps(await running_cleanups(s.client), default=str, indent=2))
    return str(target)


async def running_cleanups(client: Client, limit: int = 200) -> list[dict[str, Any]]:
    """Every running workflow's pending workflow task attempt (a task failing over and over) and
    pending activities: type, attempt, state, last heartbeat, last failure."""
    out: list[dict[str, Any]] = []
    async for w in client.list_workflows("ExecutionStatus = 'Running'", limit=limit):
        try:
            raw = (await client.get_workflow_handle(w.id).describe()).raw_description
        except Exception as err:
            out.append({"workflow_id": w.id, "error": repr(err)})
            continue
        out.append(
            {
                "workflow_id": w.id,
                "type": w.workflow_type,
                "workflow_task_attempt": (
                    raw.pending_workflow_task.attempt if raw.HasField("pending_workflow_task") else None
                ),
                "pending_activities": [
                    {
                        "type": a.activity_type.name,
                        "activity_id": a.activity_id,
                        "state": a.state,
                        "attempt": a.attempt,
                        "last_heartbeat": (
                            a.last_heartbeat_time.ToDatetime() if a.HasField("last_heartbeat_time") else None
                        ),
                        "last_worker": a.last_worker_identity,
                        "last_failure": a.last_failure.message if a.HasField("last_failure") else None,
                    }
                    for a in raw.pending_activities
                ],
            }
        )
    return out


def _r(x: float | None, n: int = 3) -> float | None:
    return None if x is None else round(x, n)


async def lateness_report(pool: asyncpg.Pool, first: datetime) -> dict[str, Any]:
    """Everything read back from the database once the run is over."""
    s = await pool.fetchrow(SQL.lateness_summary)
    claim = await pool.fetchrow(SQL.claim_lateness)
    applied = await pool.fetchrow(SQL.applied_per_account)
    sweeps = await pool.fetchrow(SQL.overdue_sweeps)
    assert s is not None and claim is not None and applied is not None and sweeps is not None
    latest = await pool.fetch(SQL.latest_accounts, 5)
    budget = (await budget_status(pool)).model_dump()
    return {
        "cleaned": s["cleaned"],
        "not_cleaned": s["not_cleaned"],
        "lateness_seconds": {k: _r(s[k]) for k in ("min", "p50", "p90", "p99", "p999", "max")},
        "claim_lateness_seconds": {k: _r(claim[k]) for k in ("p50", "p99", "max")},
        "lateness_by_minute_of_deadlines": [
            {
                "minute": r["minute"],
                "accounts": r["accounts"],
                "p50": _r(r["p50"]),
                "p99": _r(r["p99"]),
                "max": _r(r["max"]),
            }
            for r in await pool.fetch(SQL.lateness_by_minute, first)
        ],
        "idempotency_records_per_account": {"min": applied["min"], "max": applied["max"], "total": applied["records"]},
        "cleaned_by": {
            r["kind"]: {"accounts": r["accounts"], "cleanups": r["cleanups"]}
            for r in await pool.fetch(SQL.applied_by_kind)
        },
        "overdue_sweeps": {"sweeps": sweeps["sweeps"], "accounts": sweeps["accounts"]},
        "load_budget": {
            k: budget[k]
            for k in (
                "effective_in_flight",
                "throttled",
                "limited_by",
                "granted",
                "denied",
                "wait_seconds",
                "stress",
            )
        },
        "latest_accounts": [
            {
                "cleanup_id": r["cleanup_id"],
                "deadline": r["renewal_deadline"].isoformat(),
                "claim_lateness": _r(r["claim_lateness"]),
                "lateness": _r(r["lateness"]),
            }
            for r in latest
        ],
    }


_BUCKET_ID = re.compile(r"cleanup-bucket-(\d{8}T\d{6}(?:\.\d+)?)Z-(\d+)ms(?:-.+)?")


def _bucket_end(workflow_id: str) -> datetime | None:
    m = _BUCKET_ID.fullmatch(workflow_id)
    if m is None:
        return None
    fmt = "%Y%m%dT%H%M%S.%f" if "." in m[1] else "%Y%m%dT%H%M%S"
    return datetime.strptime(m[1], fmt).replace(tzinfo=UTC) + timedelta(milliseconds=int(m[2]))


async def bucket_phases(client: Client, workflow_ids: list[str], sample: int = 60) -> dict[str, Any]:
    """Where a bucket cleanup's time goes, from the event times of its history (a sample of the
    buckets, evenly spread): the timer firing after the bucket's end, the workflow task that
    schedules the claim, the claim activity waiting in the queue and running, the partitions
    (first scheduled to last completed) and the settlement up to the close."""
    ids = sorted(workflow_ids)
    step = max(1, len(ids) // sample)
    phases: dict[str, list[float]] = {}

    def add(name: str, a: datetime | None, b: datetime | None) -> None:
        if a is not None and b is not None:
            phases.setdefault(name, []).append((b - a).total_seconds())

    for workflow_id in ids[::step]:
        end = _bucket_end(workflow_id)
        history = await client.get_workflow_handle(workflow_id).fetch_history()
        kinds: dict[int, str] = {}
        t: dict[str, datetime] = {}
        for e in history.events:
            at = e.event_time.ToDatetime(tzinfo=UTC)
            if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED and "timer_due" not in t:
                due = (
                    e.event_time.ToDatetime(tzinfo=UTC)
                    + e.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta()
                )
                t["timer_due"] = due
            elif e.event_type == EventType.EVENT_TYPE_TIMER_FIRED:
                t.setdefault("fired", at)
            elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                kind = e.activity_task_scheduled_event_attributes.activity_type.name
                kinds[e.event_id] = kind
                t.setdefault(f"{kind}.scheduled", at)
            elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                kind = kinds[e.activity_task_started_event_attributes.scheduled_event_id]
                t.setdefault(f"{kind}.started", at)
            elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
                kind = kinds[e.activity_task_completed_event_attributes.scheduled_event_id]
                t[f"{kind}.completed"] = at  # the last one of its kind
            elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED:
                t["closed"] = at
        claim, part = CLAIM_CLEANUP_IN_CHUNKS, CLEANUP_PARTITION
        add("0_timer_due_after_bucket_end", end, t.get("timer_due"))
        add("1_timer_fired_after_bucket_end", end, t.get("fired"))
        add("2_claim_scheduled_after_timer", t.get("fired"), t.get(f"{claim}.scheduled"))
        add("3_claim_queued", t.get(f"{claim}.scheduled"), t.get(f"{claim}.started"))
        add("4_claim_ran", t.get(f"{claim}.started"), t.get(f"{claim}.completed"))
        add("5_partitions_scheduled_after_claim", t.get(f"{claim}.completed"), t.get(f"{part}.scheduled"))
        add("6_partitions_first_scheduled_to_last_completed", t.get(f"{part}.scheduled"), t.get(f"{part}.completed"))
        add("7_settled_and_closed_after_partitions", t.get(f"{part}.completed"), t.get("closed"))
        add("bucket_end_to_closed", end, t.get("closed"))
    return {
        "buckets_sampled": len(ids[::step]),
        **{k: {"p50": round(statistics.median(v), 3), "max": round(max(v), 3)} for k, v in sorted(phases.items())},
    }


def planner_worker_env(overrides: dict[str, str]) -> dict[str, str]:
    return {"CLEANUP_PLANNER": "on", **{f"PLANNER_{k.upper()}": v for k, v in overrides.items()}}


async def start_planner_workers(s: Stack, workers: int, planner: dict[str, str]) -> None:
    for _ in range(workers):
        s.start_worker("worker", **planner_worker_env(planner))
    await wait_for_worker(s.client, s.settings.task_queue)


async def run(
    accounts: int,
    spread_seconds: float = 600.0,
    lead_seconds: float = 30.0,
    workers: int = 2,
    planner: dict[str, str] | None = None,
    drain_seconds: float = 180.0,
) -> dict[str, Any]:
    planner = planner or {}
    async with stack() as s:
        seed_seconds = await seed_cohort(s.pool, accounts, "l")
        await start_planner_workers(s, workers, planner)
        cpu_before = s.cpu()
        with LoadSampler() as load:
            first = await database_now(s.pool) + timedelta(seconds=lead_seconds)
            await spread_deadlines(s.pool, first, spread_seconds)
            t0 = time.monotonic()
            done = await wait_all_cleaned(
                s.pool, accounts, t0 + lead_seconds + spread_seconds + drain_seconds, every=min(2.0, spread_seconds / 5)
            )
            wall = time.monotonic() - t0
        cpu_after = s.cpu()
        report = await lateness_report(s.pool, first)
        buckets = [r["cleanup_id"] for r in await s.pool.fetch(SQL.cleanup_ids)]
        phases = await bucket_phases(s.client, [b for b in buckets if _bucket_end(b) is not None])
        memory = s.memory()
        alive = [w.poll() is None for w in s.workers]
        evidence = None if done else await keep_evidence(s)
    late = report["lateness_seconds"]
    return {
        "scenario": "planner_lateness",
        "accounts": accounts,
        "spread_seconds": spread_seconds,
        "lead_seconds": lead_seconds,
        "workers": workers,
        "planner_overrides": planner,
        "database": "the $DATABASE_URL server (else the embedded Postgres), a fresh database",
        "seed_seconds": round(seed_seconds, 1),
        "all_cleaned": done,
        "seconds_from_spread_to_last_cleaned": round(wall, 1),
        **report,
        "bucket_cleanup_phases_seconds": phases,
        "goal": "p99 <= 2 s, max <= 5 s",
        "goal_met": bool(done and late["p99"] is not None and late["p99"] <= 2.0 and late["max"] <= 5.0),
        "cpu_seconds_during_run": {k: round(cpu_after[k] - cpu_before[k], 1) for k in cpu_after},
        **memory,
        "workers_alive_at_end": alive,
        "evidence_kept_in": evidence,
        "load_average_1m": load.summary(),
        "machine": machine(),
    }


def parse_overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key.strip()] = value.strip()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accounts", type=int, default=100_000)
    parser.add_argument("--spread", type=float, default=600.0, help="deadlines spread over this many seconds")
    parser.add_argument("--lead", type=float, default=30.0, help="first deadline this long after the workers are up")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--drain", type=float, default=180.0, help="give up this long after the last deadline")
    parser.add_argument(
        "--planner",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a PlannerSettings field, e.g. tick_seconds=2",
    )
    args = parser.parse_args()
    result = run_benchmark(
        run(args.accounts, args.spread, args.lead, args.workers, parse_overrides(args.planner), args.drain)
    )
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
