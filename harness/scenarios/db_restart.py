"""Opt-in scenario "database restarts": the application's Postgres crashes and restarts, repeatedly.

On a Postgres of the scenario's own (harness.private_pg; never the shared one), while a cohort
cleanup, a ledger night and two reminder relays run, the server is crashed with `pg_ctl stop -m
immediate` and started again several times. Counted: duplicates and lost work (database checks of
every job), recovery (last restart to every run finished), the time from the last restart to the
last reminder delivered (both on the database's clock; reminders written just before the last
crash are pending across it), and what the workers' logs said: tracebacks, one "database
unavailable" line per outage and process, one "database back" line, no rollback error hiding the
real one. `status` is asked while the database is down: it must answer from Temporal.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from temporalio.client import WorkflowExecutionStatus

from cleanup.inputs import StartCleanup
from cleanup.operations import CleanupReport, cleanup_status, start_cleanup
from harness.checks import cleanup_effects, ledger_effects, outbox_effects
from harness.common import (
    MATCHES,
    RELAY,
    Ctx,
    Row,
    seed_cohort,
    seed_day,
    seed_events,
    wait_for,
    wait_while_progressing,
)
from harness.private_pg import PrivatePostgres
from harness.visibility import temporal_evidence
from ledger.models import LedgerReport, ledger_workflow_id
from ledger.operations import ReconcileRequest, ledger_status, start_reconciliation
from outbox.models import RELAY_STOP_SIGNAL
from outbox.operations import start_relays
from workflows.ledger_reconciliation import LedgerReconciliationWorkflow
from workflows.outbox_relay import OutboxRelayWorkflow
from workflows.renewal_cleanup import RenewalCleanupWorkflow

T = TypeVar("T")
REMINDER_GOAL_SECONDS = 10.0
RELAYS = RELAY.model_copy(update={"batch_size": 40, "concurrency": 16})


async def retrying(step: Callable[[], Awaitable[T]], within: float = 60) -> T:
    """The harness's own reads right after a restart may meet a pooled connection that died."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await step()
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


def read_from(path: Path, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def log_counts(text: str) -> dict[str, int]:
    return {
        "tracebacks": text.count("Traceback (most recent call last)"),
        "warnings": len(re.findall(r"^\S+ \S+ WARNING ", text, re.M)),
        "unavailable_lines": text.count("database unavailable at "),
        "back_lines": text.count("database back after "),
        "rollback_hid_cause": text.count("cannot call Transaction.__aexit__()"),
    }


async def run(ctx: Ctx) -> Row:
    row = Row("database restarts")
    rng = ctx.rng("db-restart")
    pg = PrivatePostgres()
    await asyncio.to_thread(pg.init)
    lane = None
    # The harness's own pool reconnects too; its asyncpg warnings are not what this scenario measures.
    harness_pool_log = logging.getLogger("asyncpg.pool")
    old_level = harness_pool_log.level
    harness_pool_log.setLevel(logging.ERROR)
    try:
        lane = await ctx.h.lane("dbrestart", 2, admin_url=pg.admin_url)
        client, pool, tq = ctx.client, lane.pool, lane.task_queue
        offsets = {s.name: s.log_path.stat().st_size if s.log_path.exists() else 0 for s in lane.slots}
        n = rng.randint(1200, 1500) * ctx.profile.scale
        prefix, deadline = ctx.ids.prefix("dr"), ctx.ids.past_deadline()
        await seed_cohort(pool, prefix, deadline, n)
        d = ctx.ids.business_date()
        seeded = await seed_day(pool, d, rng.randint(6000, 8000) * ctx.profile.scale, 4)
        await seed_events(pool, ctx.ids.prefix("dre"), 100)
        cleanup = await start_cleanup(
            client, pool, tq, StartCleanup(deadline=deadline, partitions=4, batch_size=5, heartbeat_timeout_seconds=5)
        )
        await start_reconciliation(
            client, pool, tq, ReconcileRequest(business_date=d, batch_size=10, heartbeat_timeout_seconds=5)
        )
        relay_prefix = f"harness-relay-{prefix}-"
        relays = await start_relays(
            client, tq, relays=3, settings=RELAYS, idle_sleep_seconds=0.5, id_prefix=relay_prefix
        )
        relay_ids = [r.workflow_id for r in relays]

        async def busy() -> bool:
            applied = await pool.fetchval(
                "SELECT count(*) FROM cleanup_applied WHERE cleanup_id = $1", cleanup.workflow_id
            )
            corrected = await pool.fetchval("SELECT count(*) FROM ledger_corrections WHERE business_date = $1", d)
            return bool(applied and corrected)

        await wait_for(busy, 60, 0.05)
        crashes = 3 + ctx.profile.rounds
        downtime: list[float] = []
        status_while_down: list[CleanupReport | LedgerReport] = []
        late_events = 0
        running_at_crash = {"cleanup": 0, "ledger": 0}
        for i in range(crashes):
            last = i == crashes - 1
            for job, wf in (("cleanup", cleanup.workflow_id), ("ledger", ledger_workflow_id(d))):
                desc = await client.get_workflow_handle(wf).describe()
                running_at_crash[job] += desc.status == WorkflowExecutionStatus.RUNNING
            if last:  # reminders written just before the last outage: pending across it
                late_events, late_prefix = 60, ctx.ids.prefix("drl")
                await retrying(functools.partial(seed_events, pool, late_prefix, late_events))
            await asyncio.to_thread(pg.crash)
            t_down = time.monotonic()
            if i == 0:  # an operator asks while the database is down: Temporal answers
                try:
                    status_while_down.append(await cleanup_status(client, None, cleanup.workflow_id))
                    status_while_down.append(await ledger_status(client, pool, d))
                except Exception as err:
                    row.violations.append(f"status while the database was down failed: {type(err).__name__}: {err}")
            await asyncio.sleep(rng.uniform(1.0, 3.0))
            await asyncio.to_thread(pg.restart)
            downtime.append(time.monotonic() - t_down)
            if not last:
                await asyncio.sleep(rng.uniform(1.0, 2.0))
        t_restart = time.monotonic()
        restart_at = await retrying(lambda: pool.fetchval("SELECT pg_postmaster_start_time()"))
        pending_at_restart = await retrying(
            lambda: pool.fetchval("SELECT count(*) FROM outbox WHERE status = 'pending'")
        )

        await asyncio.wait_for(
            asyncio.gather(
                client.get_workflow_handle_for(RenewalCleanupWorkflow.run, cleanup.workflow_id).result(),
                client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, ledger_workflow_id(d)).result(),
            ),
            300,
        )

        async def pending() -> int:
            return int(await retrying(lambda: pool.fetchval("SELECT count(*) FROM outbox WHERE status = 'pending'")))

        async def drained() -> bool:
            return not await pending()

        if not await wait_while_progressing(drained, pending, 180, 0.2):
            row.violations.append("reminders still pending after the last restart, none delivered for 180 s")
        row.recovered(time.monotonic() - t_restart)
        for relay_id in relay_ids:
            await client.get_workflow_handle(relay_id).signal(RELAY_STOP_SIGNAL)
        await asyncio.wait_for(
            asyncio.gather(*(client.get_workflow_handle_for(OutboxRelayWorkflow.run, r).result() for r in relay_ids)),
            120,
        )
        # Reminders written before the last restart (waiting across it) measure the recovery; those
        # the cohort writes afterwards measure how much work was left, reported apart.
        after = await pool.fetchrow(
            "SELECT min(delivered_at) AS first,"
            " max(delivered_at) FILTER (WHERE created_at < $1) AS last_waiting,"
            " max(delivered_at) AS last FROM outbox WHERE delivered_at > $1",
            restart_at,
        )

        def since_restart(at: Any) -> float | None:
            return (at - restart_at).total_seconds() if at is not None else None

        tail = await pool.fetchrow(
            "SELECT attempts, last_error FROM outbox WHERE created_at < $1 AND delivered_at > $1"
            " ORDER BY delivered_at DESC LIMIT 1",
            restart_at,
        )
        first_seconds = since_restart(after["first"])
        reminder_seconds = since_restart(after["last_waiting"])
        overall_seconds = since_restart(after["last"])

        effects = await cleanup_effects(
            pool, prefix, matches_per_account=MATCHES, expect_cleaned=n, cleanup_ids=[cleanup.workflow_id]
        )
        effects = effects + await ledger_effects(
            pool, d, shards=4, expected_corrections=seeded.expected_corrections, expected_review=seeded.expected_review
        )
        effects = effects + await outbox_effects(pool, ctx.h.provider.provider)
        row.runs = 1
        row.duplicates += effects.duplicates
        row.lost += effects.lost
        row.dead_letters += effects.dead_letters
        row.violations += effects.problems()

        text = "".join(read_from(s.log_path, offsets.get(s.name, 0)) for s in lane.slots)
        counts = log_counts(text)
        processes = len(lane.slots) + sum(len(s.deaths) for s in lane.slots)
        if counts["rollback_hid_cause"]:
            row.violations.append(f"{counts['rollback_hid_cause']} rollback errors hid the real error")
        if counts["unavailable_lines"] == 0 or counts["back_lines"] == 0:
            row.violations.append(f"no plain outage/recovery line in the worker logs: {counts}")
        if counts["unavailable_lines"] > crashes * processes:
            row.violations.append(f"more than one 'database unavailable' line per outage and process: {counts}")

        cs = await cleanup_status(client, pool, cleanup.workflow_id)
        ls = await ledger_status(client, pool, d)
        answered = len(status_while_down) == 2 and all(s.database is not None for s in status_while_down)
        row.operator_visibility = bool(cs.settled and ls.settled and answered)
        if not answered:
            row.violations.append(
                f"status while the database was down did not say what is missing: {status_while_down}"
            )
        evidence: list[str] = []
        for wf in (cleanup.workflow_id, ledger_workflow_id(d)):
            evidence += await temporal_evidence(client, wf)
        row.evidence += evidence[:3]
        if reminder_seconds is None or first_seconds is None or overall_seconds is None:
            row.violations.append("no reminder delivered after the last restart")
        elif reminder_seconds >= REMINDER_GOAL_SECONDS:
            row.violations.append(
                f"the last reminder waiting at the last restart was delivered {reminder_seconds:.1f} s after it"
                f" (goal < {REMINDER_GOAL_SECONDS:.0f} s)"
            )
        row.notes.append(
            f"{crashes} crashes (pg_ctl stop -m immediate), down {min(downtime):.1f}-{max(downtime):.1f} s each; "
            f"cohort running at {running_at_crash['cleanup']}, ledger night at {running_at_crash['ledger']} of them; "
            f"{n} accounts, {seeded.expected_corrections + seeded.expected_review} ledger discrepancies, "
            f"{effects.details.get('events', '?')} reminders"
        )
        row.notes.append(
            f"last restart -> last of the {pending_at_restart} reminders waiting at it delivered: "
            + (f"{reminder_seconds:.1f} s" if reminder_seconds is not None else "-")
            + f" (goal < {REMINDER_GOAL_SECONDS:.0f} s; {late_events} written just before the last crash);"
            + (f" first delivery {first_seconds:.1f} s" if first_seconds is not None else "")
            + (f", last reminder of the run {overall_seconds:.1f} s" if overall_seconds is not None else "")
            + " (the cohort writes reminders until it ends)"
            + (
                f"; that last one took {tail['attempts']} attempt(s) at the provider"
                + (f", last error: {tail['last_error']}" if tail["last_error"] else "")
                if tail is not None
                else ""
            )
        )
        row.notes.append(
            f"worker logs ({processes} processes): {counts['unavailable_lines']} 'database unavailable' lines, "
            f"{counts['back_lines']} 'database back' lines, {counts['warnings']} WARNING lines, "
            f"{counts['tracebacks']} tracebacks, {counts['rollback_hid_cause']} rollback errors hiding the cause"
        )
        row.notes.append(f"status while down: database = {status_while_down[0].database if status_while_down else '-'}")
    finally:
        harness_pool_log.setLevel(old_level)
        if lane is not None:
            await ctx.h.close_lane(lane)
        await asyncio.to_thread(pg.close)
    return row
