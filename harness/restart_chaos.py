"""A night of work, calm and under database restarts, in one run: `python -m harness.restart_chaos`.

On a Postgres of the benchmark's own (harness.private_pg: never the shared one, which this crashes),
two worker processes (supervised by the harness's supervisor, which restarts one that dies, and
counts it) run with the planner on and the shipped settings. Two reminder relays (shipped settings)
deliver to the harness's local mail provider. The same night runs twice, calm first, then under
chaos:

- a cohort of `--accounts` accounts with the shipped game data, registered through the game's
  `set_deadline` at one instant (bench.planner_cohort), cleaned by the planner's bucket;
- at that instant, a ledger date of `--payments` payments (the shipped shards and batch size)
  started with `start_reconciliation`;
- the cohort's renewal reminders delivered by the relays.

Under chaos, from the deadline, the server is crashed (`pg_ctl stop -m immediate`) and started again
`--restarts` times, every `--every` seconds (uniform between the two bounds), the server down up to
`--down-max` seconds each time (uniform), every draw from `--seed`; the restarts stop once the night
is over (how many hit it is printed).

Printed for each night, in seconds: the cohort closed (the last of its cleanups closed, Temporal's
clock) and its last account cleaned (the database's) after the deadline, the ledger closed after its
start, the last reminder of the cohort delivered after the deadline. Then the ratios chaos / calm
(goal <= 2.0) and how many restarts came before each job closed (a job shorter than the first
interval met none), duplicates and lost work (the harness's database checks, 0), the worker processes
that died and the tracebacks and outage lines in their logs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from typing import Any

import asyncpg

import bench
import harness
from bench.common import load_average, machine, trace_budget
from bench.planner_cohort import FAR, lead_for, register_cohort
from core.queries import load
from demo.fixture import seed_accounts
from harness.checks import Effects, cleanup_effects, ledger_effects, outbox_effects
from harness.common import seed_day
from harness.private_pg import PrivatePostgres
from harness.scenarios.db_restart import log_counts, read_from, retrying
from harness.stack import Harness, Lane
from harness.stack import harness as harness_stack
from ledger.models import DEFAULT_SHARDS, ledger_workflow_id
from ledger.operations import ReconcileRequest, start_reconciliation
from outbox.models import RELAY_STOP_SIGNAL
from outbox.operations import start_relays
from workflows.ledger_reconciliation import LedgerReconciliationWorkflow
from workflows.outbox_relay import OutboxRelayWorkflow

SQL = load(bench.__file__, "planner_cohort.sql")
CHAOS = load(harness.__file__, "restart_chaos.sql")
GOAL = "<= 2.0"
POLL_SECONDS = 0.5
# `pg_ctl start -w` after a crash (crash recovery, then accepting connections) takes about this long
# here: the server is started that much before the drawn downtime ends.
START_SECONDS = 0.3
MATCHES = 5  # the shipped game data's match rows per account (demo.fixture.seed_accounts)


@dataclass(frozen=True)
class Chaos:
    """How the server is crashed: `restarts` times, `every` seconds apart (uniform in the range),
    down up to `down_max` seconds (uniform from 1 s: crash to accepting connections again; the
    downtimes measured are printed), the draws from `seed`."""

    restarts: int = 20
    every: tuple[float, float] = (5.0, 20.0)
    down_max: float = 5.5
    seed: int = 7


@dataclass
class Crashes:
    done: int = 0
    downtime: list[float] = field(default_factory=list)
    at: list[float] = field(default_factory=list)  # seconds after the chaos began, each crash

    def during(self, seconds: float | None) -> int:
        """The crashes in the first `seconds` of the night (a job that closed then met these)."""
        return sum(1 for t in self.at if seconds is not None and t < seconds)


async def crash_repeatedly(pg: PrivatePostgres, chaos: Chaos, crashes: Crashes) -> None:
    """Crash and restart `pg` as `chaos` says; cancelled between two crashes once the night is over
    (a crash in progress always ends with the server started again)."""
    rng = random.Random(chaos.seed)
    began = time.monotonic()
    for _ in range(chaos.restarts):
        await asyncio.sleep(rng.uniform(*chaos.every))
        down = rng.uniform(min(1.0, chaos.down_max), chaos.down_max)
        t = time.monotonic()
        crashes.at.append(round(t - began, 2))
        crash = asyncio.ensure_future(_crash_once(pg, t + down - START_SECONDS))
        try:
            await asyncio.shield(crash)
        finally:
            await crash  # cancelled or not: the server is up again before the night's figures are read
            crashes.downtime.append(round(time.monotonic() - t, 2))
            crashes.done += 1


async def _crash_once(pg: PrivatePostgres, start_at: float) -> None:
    """Crash now, start again at the monotonic instant `start_at` (at once if it has passed)."""
    await asyncio.to_thread(pg.crash)
    try:
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    finally:
        await asyncio.to_thread(pg.restart)


async def _fetchrow(pool: asyncpg.Pool, sql: str, *args: Any) -> asyncpg.Record:
    row = await retrying(lambda: pool.fetchrow(sql, *args), within=120)
    assert row is not None
    return row


async def night(
    h: Harness, lane: Lane, name: str, sizes: tuple[int, int], business_date: date, lead: float
) -> dict[str, Any]:
    """Seed the night (untimed; accounts `acct_<name>_*` at a deadline out of the planner's sight),
    register the cohort at an instant ahead, start the ledger at it; returns the deadline and the
    ledger's expected outcome."""
    pool, (accounts, payments) = lane.pool, sizes
    seeded_at = FAR + timedelta(days=business_date.toordinal() % 1000)
    await seed_accounts(pool, prefix=name, deadline=seeded_at, count=accounts)
    seeded = await seed_day(pool, business_date, payments, DEFAULT_SHARDS)
    await pool.execute("VACUUM ANALYZE")
    deadline = await register_cohort(pool, seeded_at, accounts, lead)
    ahead = (deadline - await pool.fetchval(SQL.database_clock)).total_seconds()
    await asyncio.sleep(max(0.0, ahead))
    started = await start_reconciliation(h.client, pool, lane.task_queue, ReconcileRequest(business_date=business_date))
    return {"deadline": deadline, "seeded": seeded, "ledger_workflow_id": started.workflow_id}


async def wait_night(h: Harness, lane: Lane, deadline: datetime, business_date: date, within: float) -> None:
    """Until the cohort is cleaned and its cleanups closed, the ledger date closed, and every
    reminder of the cohort delivered (or `within` seconds passed: the figures then show the rest)."""
    pool = lane.pool
    give_up = time.monotonic() + within
    ledger = h.client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, ledger_workflow_id(business_date))
    await asyncio.wait_for(ledger.result(), within)
    while time.monotonic() < give_up:
        row = await _fetchrow(pool, CHAOS.night_pending, deadline)
        if not row["accounts"] and not row["reminders"]:
            break
        await asyncio.sleep(POLL_SECONDS)
    for r in await retrying(lambda: pool.fetch(SQL.cohort_cleanups, deadline), within=120):
        left = max(1.0, give_up - time.monotonic())
        await asyncio.wait_for(h.client.get_workflow_handle(r["cleanup_id"]).result(), left)


async def night_times(h: Harness, lane: Lane, deadline: datetime, business_date: date) -> dict[str, Any]:
    """The night's figures, in seconds: cohort closed (its cleanups' last close, Temporal) and last
    account cleaned (database) after the deadline, ledger closed after its start (Temporal), last
    reminder of the cohort delivered after the deadline (database)."""
    pool = lane.pool
    times = await _fetchrow(pool, SQL.cohort_times, deadline)
    reminders = await _fetchrow(pool, CHAOS.cohort_reminders, deadline)
    closes = []
    for r in await retrying(lambda: pool.fetch(SQL.cohort_cleanups, deadline), within=120):
        d = await h.client.get_workflow_handle(r["cleanup_id"]).describe()
        if d.close_time is not None:
            closes.append((d.close_time - deadline).total_seconds())
    ledger = await h.client.get_workflow_handle(ledger_workflow_id(business_date)).describe()
    ledger_close = (ledger.close_time - ledger.start_time).total_seconds() if ledger.close_time else None
    return {
        "cleaned": times["cleaned"],
        "cohort_closed_s": round(max(closes), 2) if closes else None,
        "cohort_last_cleaned_s": round(times["last_cleaned"], 2) if times["last_cleaned"] is not None else None,
        "ledger_closed_s": round(ledger_close, 2) if ledger_close is not None else None,
        "last_reminder_s": round(reminders["last_delivered"], 2) if reminders["last_delivered"] is not None else None,
        "reminders": reminders["reminders"],
        "reminders_pending": reminders["pending"],
    }


def budget_changes(trace: list[dict[str, Any]], since: float) -> list[dict[str, Any]]:
    """The budget's limits as they changed in the night (seconds after `since`)."""
    changes: list[dict[str, Any]] = []
    keys = ("rate_limit", "in_flight_limit", "stress")
    for t in trace:
        if not changes or any(t[k] != changes[-1][k] for k in keys):
            changes.append({"at": round(t["at"] - since, 1), **{k: t[k] for k in keys}})
    return changes


def _ratio(chaos: float | None, calm: float | None) -> float | None:
    return round(chaos / calm, 3) if chaos is not None and calm else None


async def run(
    accounts: int = 50_000,
    payments: int = 200_000,
    chaos: Chaos | None = None,
    within: float = 900.0,
    lead: float | None = None,
    planner_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """`within`: the longest either night may take before its figures are read as they stand.
    `lead`: seconds from registering a cohort to its deadline (default `lead_for(accounts)`).
    `planner_env`: PLANNER_* settings of the workers (none: as shipped)."""
    chaos = chaos or Chaos()
    night_lead = lead or lead_for(accounts)
    load_before = load_average()
    pg = PrivatePostgres()
    await asyncio.to_thread(pg.init)
    # The benchmark's own pool reconnects after each crash; its asyncpg warnings are not measured.
    logging.getLogger("asyncpg.pool").setLevel(logging.ERROR)
    try:
        async with harness_stack() as h:
            env = {"DB_POOL_MAX_SIZE": "8", **(planner_env or {})}  # the shipped pool, not the harness's 4
            lane = await h.lane("chaos", 2, admin_url=pg.admin_url, planner=True, env=env)
            try:
                return await _nights(h, lane, pg, (accounts, payments), chaos, (within, night_lead)) | {
                    "load_average_1m_before_and_after": [load_before, load_average()],
                    "machine": machine(),
                }
            except BaseException:
                # Printed before the lane's closing checks, which may fail in turn and hide it.
                traceback.print_exc()
                raise
            finally:
                await h.close_lane(lane)
    finally:
        await asyncio.to_thread(pg.close)


async def _nights(
    h: Harness, lane: Lane, pg: PrivatePostgres, sizes: tuple[int, int], chaos: Chaos, waits: tuple[float, float]
) -> dict[str, Any]:
    """The calm night, then the same under chaos; the checks and the logs after both. `sizes`:
    accounts and payments; `waits`: the longest a night may take, and the cohort's lead."""
    (accounts, payments), (within, lead) = sizes, waits
    offsets = {s.name: s.log_path.stat().st_size if s.log_path.exists() else 0 for s in lane.slots}
    relays = await start_relays(h.client, lane.task_queue, relays=2, id_prefix=f"chaos-relay-{lane.task_queue}-")
    dates = {"calm": date(2020, 1, 1), "chaos": date(2020, 1, 2)}
    nights: dict[str, dict[str, Any]] = {}
    crashes = Crashes()
    effects = Effects()
    problems: list[str] = []
    for name, business_date in dates.items():
        planned = await night(h, lane, name, sizes, business_date, lead)
        crashing = asyncio.ensure_future(crash_repeatedly(pg, chaos, crashes)) if name == "chaos" else None
        trace: list[dict[str, Any]] = []
        tracing = asyncio.ensure_future(trace_budget(lane.pool, trace))
        t = time.monotonic()
        try:
            await wait_night(h, lane, planned["deadline"], business_date, within)
        finally:
            tracing.cancel()
            await asyncio.gather(tracing, return_exceptions=True)
            if crashing is not None:
                crashing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await crashing
        nights[name] = {"wall_s": round(time.monotonic() - t, 1)} | await night_times(
            h, lane, planned["deadline"], business_date
        )
        nights[name]["budget_changes"] = budget_changes(trace, planned["deadline"].timestamp())
        print(f"{name}: {json.dumps(nights[name])}", file=sys.stderr, flush=True)
        seeded = planned["seeded"]
        checked = await cleanup_effects(lane.pool, name, matches_per_account=MATCHES, expect_cleaned=accounts)
        checked = checked + await ledger_effects(
            lane.pool,
            business_date,
            shards=DEFAULT_SHARDS,
            expected_corrections=seeded.expected_corrections,
            expected_review=seeded.expected_review,
        )
        problems += [f"{name}: {p}" for p in checked.problems()]
        effects = effects + checked
    for r in relays:
        await h.client.get_workflow_handle(r.workflow_id).signal(RELAY_STOP_SIGNAL)
    stopped = (h.client.get_workflow_handle_for(OutboxRelayWorkflow.run, r.workflow_id) for r in relays)
    await asyncio.gather(*(handle.result() for handle in stopped))
    delivered = await outbox_effects(lane.pool, h.provider.provider)
    problems += [f"reminders: {p}" for p in delivered.problems()]
    effects = effects + delivered
    text = "".join(read_from(s.log_path, offsets.get(s.name, 0)) for s in lane.slots)
    calm, hit = nights["calm"], nights["chaos"]
    return {
        "scenario": "restart_chaos",
        "accounts": accounts,
        "payments": payments,
        "lead_seconds": lead,
        "chaos": {
            "restarts_asked": chaos.restarts,
            "restarts_during_the_night": crashes.done,
            "every_s": list(chaos.every),
            "down_max_s": chaos.down_max,
            "downtime_s": crashes.downtime,
            "crashed_at_s": crashes.at,
            "seed": chaos.seed,
            # a job that closed before the first crash met none: its ratio says nothing of restarts
            "restarts_before_the_cohort_closed": crashes.during(hit["cohort_closed_s"]),
            "restarts_before_the_ledger_closed": crashes.during(hit["ledger_closed_s"]),
        },
        "calm": calm,
        "under_restarts": hit,
        "ratio": _ratio(hit["cohort_closed_s"], calm["cohort_closed_s"]),
        "target": GOAL,
        "ledger_closed_ratio": _ratio(hit["ledger_closed_s"], calm["ledger_closed_s"]),
        "ledger_closed_ratio_target": GOAL,
        "last_reminder_ratio": _ratio(hit["last_reminder_s"], calm["last_reminder_s"]),
        "duplicates": effects.duplicates,
        "lost": effects.lost,
        "dead_letters": effects.dead_letters,
        "problems": problems,
        "worker_deaths": sum(len(s.deaths) for s in lane.slots),
        "worker_logs": log_counts(text),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accounts", type=int, default=50_000, help="the cohort due at one instant")
    parser.add_argument("--payments", type=int, default=200_000, help="the ledger date reconciled at that instant")
    parser.add_argument("--restarts", type=int, default=20)
    parser.add_argument("--every", type=float, nargs=2, default=[5.0, 20.0], metavar=("MIN", "MAX"))
    parser.add_argument("--down-max", type=float, default=5.5)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--within", type=float, default=900.0, help="give up on a night after this long")
    args = parser.parse_args()
    chaos = Chaos(args.restarts, (args.every[0], args.every[1]), args.down_max, args.seed)
    result = asyncio.run(run(args.accounts, args.payments, chaos, args.within))
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
