"""What a day of deadlines costs on Temporal: `python -m bench.planner_events`.

History events (what a self-hosted server stores and works through) and the billable kinds among
them (what Temporal Cloud charges per action) per account cleaned through the planner, at three
spreads of deadlines, and per day of an idle planner; beside each, the lateness of the accounts.

Each spread runs on a stack of its own (a private dev server, so every workflow in its namespace is
the run's): N accounts with the shipped game data get deadlines spread uniformly over a window
starting `--lead` seconds ahead, registered before the workers start (renewal deadlines are
registered long before they fall due); worker processes (`python -m worker`, the planner on, its
settings as shipped unless `--planner KEY=VALUE` overrides one) do the rest. Once every account is
cleaned and every cleanup closed, the history of every run of every workflow is read: events, and
per kind: workflow starts (continue-as-new included), activity attempts, local activities,
timers, signals, search-attribute and memo upserts, other markers (patches), and heartbeats
(estimated: not in a history; an activity that runs longer than its heartbeat interval sends about
one per 0.8 x its heartbeat timeout, the SDK's throttle). Queries are not in a history either; the
benchmark sends none (`planner status` sends one each time it runs).

- dense: 50 accounts a second (`--dense` accounts);
- one per second (`--per-second` accounts);
- one per minute (`--per-minute` accounts);
- idle: a planner with nothing to do for `--idle` seconds; the events from its first sleep to its
  last (whole iterations) per second, times a day, plus its continue-as-new every
  `iterations_per_run` iterations.

`--curve 3,5,10,20` also runs the one-per-second spread under each lateness objective
(PLANNER_LATENESS_OBJECTIVE): events per account against the lateness p99.
Goals (judged by bench.report): one per second <= 6 events per account with p99 within
the objective; dense <= 1; idle <= 30,000 events a day.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from datetime import timedelta
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

import bench
from bench.common import LoadSampler, machine, run_benchmark, stack
from bench.planner_lateness import FAR, database_now, parse_overrides, start_planner_workers
from cleanup.models import planner_workflow_id
from core.config import PlannerSettings
from core.queries import load
from demo.fixture import seed_accounts

SQL = load(bench.__file__, "scale.sql")
DAY = 86_400.0
# The SDK sends at most one heartbeat per this share of the heartbeat timeout.
HEARTBEAT_THROTTLE = 0.8
LOCAL_ACTIVITY_MARKER = "core_local_activity"
E = EventType


async def history_costs(client: Client) -> dict[str, Any]:
    """Every run of every workflow in the client's namespace: runs, history events, billable kinds."""
    kinds: Counter[str] = Counter()
    events = 0
    by_type: Counter[str] = Counter()
    async for w in client.list_workflows(""):
        history = await client.get_workflow_handle(w.id, run_id=w.run_id).fetch_history()
        events += len(history.events)
        by_type[w.workflow_type] += len(history.events)
        kinds.update(event_kinds(history.events))
    return {"history_events": events, "events_by_workflow_type": dict(by_type), "billable": billable(kinds)}


def event_kinds(events: Any) -> Counter[str]:
    """The billable kinds among a history's events (heartbeats estimated from activity run times)."""
    out: Counter[str] = Counter()
    heartbeat_timeouts: dict[int, float] = {}
    started_at: dict[int, Any] = {}
    for e in events:
        t = e.event_type
        if t == E.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
            out["workflow_starts"] += 1
        elif t == E.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            timeout = e.activity_task_scheduled_event_attributes.heartbeat_timeout.ToTimedelta()
            heartbeat_timeouts[e.event_id] = timeout.total_seconds()
        elif t == E.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            a = e.activity_task_started_event_attributes
            out["activities"] += max(1, a.attempt)
            started_at[a.scheduled_event_id] = e.event_time.ToDatetime()
        elif t in (E.EVENT_TYPE_ACTIVITY_TASK_COMPLETED, E.EVENT_TYPE_ACTIVITY_TASK_FAILED):
            attrs = (
                e.activity_task_completed_event_attributes
                if t == E.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
                else e.activity_task_failed_event_attributes
            )
            timeout = heartbeat_timeouts.get(attrs.scheduled_event_id, 0.0)
            began = started_at.get(attrs.scheduled_event_id)
            if timeout and began is not None:
                ran = (e.event_time.ToDatetime() - began).total_seconds()
                if ran >= timeout / 3:  # core.heartbeat beats every third of the timeout
                    out["heartbeats_estimated"] += 1 + int(ran // (HEARTBEAT_THROTTLE * timeout))
        elif t == E.EVENT_TYPE_MARKER_RECORDED:
            name = e.marker_recorded_event_attributes.marker_name
            out["local_activities" if name == LOCAL_ACTIVITY_MARKER else "markers"] += 1
        elif t == E.EVENT_TYPE_TIMER_STARTED:
            out["timers"] += 1
        elif t == E.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            out["signals"] += 1
        elif t == E.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES:
            out["search_attribute_upserts"] += 1
        elif t == E.EVENT_TYPE_WORKFLOW_PROPERTIES_MODIFIED:
            out["memo_upserts"] += 1
    return out


def billable(kinds: Counter[str]) -> dict[str, int]:
    names = (
        "workflow_starts",
        "activities",
        "local_activities",
        "timers",
        "signals",
        "search_attribute_upserts",
        "memo_upserts",
        "markers",
        "heartbeats_estimated",
    )
    return {**{k: kinds.get(k, 0) for k in names}, "queries": 0}


async def spread_run(
    name: str, accounts: int, spread: float, lead: float, workers: int, planner: dict[str, str], drain: float
) -> dict[str, Any]:
    """`accounts` deadlines spread over `spread` seconds from `lead` seconds ahead, cleaned by the
    planner alone; what every workflow of the stack cost, per account, and the lateness."""
    async with stack() as s:
        await seed_accounts(s.pool, prefix=name, deadline=FAR, count=accounts)
        first = await database_now(s.pool) + timedelta(seconds=lead)
        await s.pool.execute(SQL.spread_deadlines, *SQL.bind("spread_deadlines", first=first, spread_seconds=spread))
        t0 = time.monotonic()
        with LoadSampler() as sampler:
            await start_planner_workers(s, workers, planner)
            cleaned = await wait_closed(s.client, s.pool, accounts, t0 + lead + spread + drain)
        wall = time.monotonic() - t0
        costs = await history_costs(s.client)
        late = await s.pool.fetchrow(SQL.lateness_summary)
        assert late is not None
        cleanups = len([w async for w in s.client.list_workflows("WorkflowType = 'RenewalCleanupWorkflow'")])
    per_account = {k: round(v / accounts, 3) for k, v in costs["billable"].items()}
    return {
        "accounts": accounts,
        "spread_seconds": spread,
        "all_cleaned": cleaned,
        "cleanups": cleanups,
        "history_events": costs["history_events"],
        "events_per_account": round(costs["history_events"] / accounts, 3),
        "events_by_workflow_type": costs["events_by_workflow_type"],
        "billable": costs["billable"],
        "billable_per_account": per_account,
        "lateness_seconds": {k: _r(late[k]) for k in ("p50", "p99", "max")},
        "seconds": round(wall, 1),
        "load_average_1m": sampler.summary(),
    }


async def wait_closed(client: Client, pool: Any, accounts: int, until: float) -> bool:
    """Until every account is cleaned and no cleanup runs any more (their last events are counted)."""
    while time.monotonic() < until:
        if await pool.fetchval(SQL.cleaned_count) >= accounts:
            running = [w async for w in client.list_workflows("WorkflowType = 'RenewalCleanupWorkflow'")]
            if all(w.status is not None and w.status.name != "RUNNING" for w in running):
                return True
        await asyncio.sleep(1.0)
    return False


async def idle_run(seconds: float, workers: int, planner: dict[str, str]) -> dict[str, Any]:
    """A planner with no deadline at all for `seconds`: its events per day, from whole iterations."""
    settings = planner_settings(planner)
    async with stack() as s:
        await start_planner_workers(s, workers, planner)
        await asyncio.sleep(seconds)
        planner_id = planner_workflow_id(s.settings.task_queue)
        events = []
        async for w in s.client.list_workflows(f"WorkflowId = '{planner_id}'"):
            events += list((await s.client.get_workflow_handle(w.id, run_id=w.run_id).fetch_history()).events)
    events.sort(key=lambda e: e.event_time.ToDatetime())
    timers = [i for i, e in enumerate(events) if e.event_type == E.EVENT_TYPE_TIMER_STARTED]
    assert len(timers) >= 2, f"{len(timers)} planner sleeps in {seconds} s: measure longer"
    first, last = timers[0], timers[-1]
    elapsed = (events[last].event_time.ToDatetime() - events[first].event_time.ToDatetime()).total_seconds()
    per_iteration = (last - first) / (len(timers) - 1)
    interval = elapsed / (len(timers) - 1)
    # A run's fixed events (started, its first workflow task) and its continue-as-new.
    run_overhead = 1 + next(i for i, e in enumerate(events) if e.event_type == E.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED)
    iterations_a_day = DAY / interval
    per_day = iterations_a_day * (per_iteration + run_overhead / settings.iterations_per_run)
    kinds = event_kinds(events[first + 1 : last + 1])
    return {
        "measured_seconds": seconds,
        "iterations_measured": len(timers) - 1,
        "seconds_per_iteration": round(interval, 2),
        "events_per_iteration": round(per_iteration, 2),
        "events_per_day": round(per_day),
        "billable_per_day": {k: round(v * iterations_a_day / (len(timers) - 1)) for k, v in billable(kinds).items()},
    }


def planner_settings(planner: dict[str, str]) -> PlannerSettings:
    """The settings the workers read from these PLANNER_* overrides (`lateness_objective` is the
    variable PLANNER_LATENESS_OBJECTIVE of the field `lateness_objective_seconds`)."""
    fields = PlannerSettings.model_fields
    return PlannerSettings.model_validate({k if k in fields else f"{k}_seconds": v for k, v in planner.items()})


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


SPREADS = {"dense": 50.0, "one_per_second": 1.0, "one_per_minute": 1 / 60}


async def run(
    dense: int = 500,
    per_second: int = 60,
    per_minute: int = 4,
    idle_seconds: float = 150.0,
    lead: float = 30.0,
    workers: int = 2,
    planner: dict[str, str] | None = None,
    curve: tuple[float, ...] = (),
    drain: float = 120.0,
) -> dict[str, Any]:
    planner = planner or {}
    settings = planner_settings(planner)
    sizes = {"dense": dense, "one_per_second": per_second, "one_per_minute": per_minute}
    out: dict[str, Any] = {"scenario": "planner_events", "accounts": sum(sizes.values())}
    sampler = LoadSampler()
    sampler.__enter__()
    for name, n in sizes.items():
        out[name] = await spread_run(name, n, n / SPREADS[name], lead, workers, planner, drain)
    out["idle"] = await idle_run(idle_seconds, workers, planner)
    if curve:
        out["curve"] = []
        for objective in curve:
            if objective == settings.lateness_objective_seconds:  # the run above
                point = out["one_per_second"]
            else:
                with_objective = {**planner, "lateness_objective": f"{objective:g}"}
                point = await spread_run("c", per_second, float(per_second), lead, workers, with_objective, drain)
            out["curve"].append({"lateness_objective_seconds": objective, **point})
    sampler.__exit__()
    out.update(
        {
            "load_average_1m": sampler.summary(),
            "planner_overrides": planner,
            "lateness_objective_seconds": settings.lateness_objective_seconds,
            "max_idle_seconds": settings.max_idle_seconds,
            "workers": workers,
            "machine": machine(),
        }
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dense", type=int, default=500, help="accounts at 50 a second")
    parser.add_argument("--per-second", type=int, default=60, help="accounts at one a second")
    parser.add_argument("--per-minute", type=int, default=4, help="accounts at one a minute")
    parser.add_argument("--idle", type=float, default=150.0, help="seconds of an idle planner measured")
    parser.add_argument("--lead", type=float, default=30.0, help="first deadline this long after registering")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--curve", default="", help="lateness objectives for the one-per-second curve, e.g. 3,5,10,20")
    parser.add_argument("--planner", action="append", default=[], metavar="KEY=VALUE", help="a PLANNER_* setting")
    args = parser.parse_args()
    curve = tuple(float(x) for x in args.curve.split(",") if x.strip())
    result = run_benchmark(
        run(
            args.dense,
            args.per_second,
            args.per_minute,
            args.idle,
            args.lead,
            args.workers,
            parse_overrides(args.planner),
            curve,
        )
    )
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
