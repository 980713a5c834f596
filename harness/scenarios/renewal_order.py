"""Scenario 10: accounts renewed twice in quick succession while their cleanups run, under kills.

A cohort's deadline D1 is seconds away; a single-account cleanup is running for a quarter of its
accounts and the cohort cleanup for all of them. Some accounts are renewed to D2 and at once again
(to D3, or for good), some only to D2, some not at all; a few renewals are timed around the claim
at D1, so they may come too late. The cohort cleanups of D2 and D3 run too, and so do the
single-account cleanups the renewals restart. One worker is armed to die right after a batch
COMMIT, and another is killed with SIGKILL after D3. Every account must end in the state its
latest version implies, and the ordering column (counted when the lane closes) must stay 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from datetime import UTC, datetime, timedelta

from temporalio.client import Client, WorkflowExecutionStatus

from cleanup.inputs import StartCleanup
from cleanup.operations import RenewalOutcome, cleanup_status, renew, start_cleanup
from harness.checks import cleanup_effects, outbox_effects
from harness.common import MATCHES, RELAY, Ctx, Row, account_ids, seed_cohort, wait_while_progressing
from harness.stack import Lane
from harness.visibility import pending_evidence, temporal_evidence
from outbox.operations import start_relays
from workflows.outbox_relay import OutboxRelayWorkflow

KILL_AT_BATCH = "cleanup_partition.after_commit=exit@{n}"


def _passed(until: datetime | None) -> bool:
    """A loaded machine may come to a renewal after its new deadline: renewing to a past deadline
    is refused as bad input (nothing is judged), so the harness does not try it."""
    return until is not None and until <= datetime.now(UTC) + timedelta(seconds=0.2)


async def _renew_twice(
    ctx: Ctx, lane: Lane, account: str, delay: float, second: datetime | None, d2: datetime
) -> list[RenewalOutcome]:
    """Renew to D2 after `delay` seconds and, if `second` is given or None-for-good, at once again."""
    await asyncio.sleep(delay)
    if _passed(d2):
        return []
    first = await renew(ctx.client, lane.pool, lane.task_queue, account, d2)
    if _passed(second):
        return [first]
    return [first, await renew(ctx.client, lane.pool, lane.task_queue, account, second)]


async def _renew_once(ctx: Ctx, lane: Lane, account: str, delay: float, d2: datetime) -> list[RenewalOutcome]:
    await asyncio.sleep(delay)
    return [] if _passed(d2) else [await renew(ctx.client, lane.pool, lane.task_queue, account, d2)]


async def _sigkill_at(ctx: Ctx, lane: Lane, at: datetime, rng_pick: int) -> float | None:
    """SIGKILL one live worker of the lane at `at` (the supervisor restarts it); when it died."""
    await asyncio.sleep(max(0.0, (at - datetime.now(UTC)).total_seconds()))
    live = [s for s in lane.slots if s.alive() and s.proc is not None]
    if not live:
        return None
    slot = live[rng_pick % len(live)]
    assert slot.proc is not None
    with contextlib.suppress(ProcessLookupError):
        os.kill(slot.proc.pid, signal.SIGKILL)
    return time.monotonic()


async def unfinished(client: Client, workflow_ids: list[str]) -> list[str]:
    """The workflows still running, each with its pending activities (what the UI would show)."""
    out = []
    for w in workflow_ids:
        desc = await client.get_workflow_handle(w).describe()
        if desc.status == WorkflowExecutionStatus.RUNNING:
            out.append(f"{w}: {'; '.join(await pending_evidence(client, w)) or 'no pending activity'}")
    return out


async def one_round(ctx: Ctx, lane: Lane, row: Row, rnd: int) -> None:
    rng = ctx.rng(f"renewal-order:{rnd}")
    client, pool, tq = ctx.client, lane.pool, lane.task_queue
    n = rng.randint(40, 60) * ctx.profile.scale
    prefix = ctx.ids.prefix("ro")
    # One worker dies right after a batch COMMIT of whatever partition it runs first. It is started
    # before the deadlines are drawn: on a loaded machine its start-up alone took longer than the
    # gap between D1 and D2, and a renewal to D2 was then refused as in the past.
    await ctx.h.supervisor.start(lane.slots[0], KILL_AT_BATCH.format(n=rng.randint(1, 3)))
    deaths_before = len(lane.slots[0].deaths)
    d1, d2, d3 = ctx.ids.future_deadline(5), ctx.ids.future_deadline(10), ctx.ids.future_deadline(13)
    await seed_cohort(pool, prefix, d1, n)
    ids = await account_ids(pool, prefix)
    rng.shuffle(ids)
    q = n // 4
    twice, once = ids[:q], ids[q : q + q // 2]
    singles = ids[q // 2 : q // 2 + q]  # half of the twice-renewed, every once-renewed, some never
    started = [
        await start_cleanup(client, pool, tq, StartCleanup(account_id=a, heartbeat_timeout_seconds=2)) for a in singles
    ]
    cohort1 = await start_cleanup(
        client, pool, tq, StartCleanup(deadline=d1, partitions=3, batch_size=4, heartbeat_timeout_seconds=2)
    )
    # Renewals spread until shortly after the claim at D1 (the last ones may come too late).
    left = (d1 - datetime.now(UTC)).total_seconds()
    for_good = set(rng.sample(twice, len(twice) // 3))
    tasks = [
        _renew_twice(ctx, lane, a, rng.uniform(0, left + 0.8), None if a in for_good else d3, d2) for a in twice
    ] + [_renew_once(ctx, lane, a, rng.uniform(0, left + 0.8), d2) for a in once]
    killer = asyncio.create_task(_sigkill_at(ctx, lane, d3, rng.randint(0, 9)))
    outcomes = [o for batch in await asyncio.gather(*tasks) for o in batch]
    cohort2 = await start_cleanup(
        client,
        pool,
        tq,
        StartCleanup(deadline=d2, partitions=2, batch_size=4, heartbeat_timeout_seconds=2, allow_empty=True),
    )
    cohort3 = await start_cleanup(
        client,
        pool,
        tq,
        StartCleanup(deadline=d3, partitions=2, batch_size=4, heartbeat_timeout_seconds=2, allow_empty=True),
    )
    cohorts = [cohort1.workflow_id, cohort2.workflow_id, cohort3.workflow_id]
    workflows = (
        cohorts + [s.workflow_id for s in started] + [o.restarted_cleanup for o in outcomes if o.restarted_cleanup]
    )
    # Liveness, not speed: a loaded machine completes them late; a stuck one completes none for long.
    waits = [asyncio.ensure_future(client.get_workflow_handle(w).result()) for w in workflows]

    async def all_done() -> bool:
        return all(wait.done() for wait in waits)

    async def completed() -> int:
        return sum(wait.done() for wait in waits)

    if not await wait_while_progressing(all_done, completed, 180, 0.5):
        for wait in waits:
            wait.cancel()
        raise TimeoutError(f"no cleanup completed for 180 s, still running: {await unfinished(client, workflows)}")
    results = await asyncio.gather(*waits, return_exceptions=True)
    done = time.monotonic()
    failed = [f"{w}: {r}" for w, r in zip(workflows, results, strict=True) if isinstance(r, BaseException)]
    row.violations += [f"cleanup did not complete: {f}" for f in failed[:3]]
    killed_at = await killer
    deaths = lane.slots[0].deaths[deaths_before:]
    for t in [*(d.at for d in deaths[:1]), *([killed_at] if killed_at is not None else [])]:
        row.recovered(done - t)
    row.runs += len(deaths[:1]) + (killed_at is not None)

    # Deliver the reminders, then count.
    relay_prefix = f"harness-relay-{prefix}-"
    await start_relays(
        client, tq, relays=2, settings=RELAY, idle_sleep_seconds=0.3, stop_when_drained=True, id_prefix=relay_prefix
    )
    for i in (1, 2):
        await asyncio.wait_for(
            client.get_workflow_handle_for(OutboxRelayWorkflow.run, f"{relay_prefix}{i}").result(), 120
        )

    expected = expected_states(outcomes)
    renewed = sum(1 for state, _ in expected.values() if state == "renewed")
    effects = await cleanup_effects(
        pool, prefix, matches_per_account=MATCHES, expect_cleaned=n - renewed, cleanup_ids=cohorts
    )
    effects = effects + await outbox_effects(pool, ctx.h.provider.provider)
    rows = await pool.fetch(
        "SELECT account_id, status, cleanup_version FROM accounts WHERE account_id = ANY($1::text[])", list(expected)
    )
    wrong = [r["account_id"] for r in rows if (r["status"], r["cleanup_version"]) != expected[r["account_id"]]]
    if wrong:
        row.violations.append(f"{len(wrong)} accounts not in the state their latest renewal implies, e.g. {wrong[:3]}")
    row.duplicates += effects.duplicates
    row.lost += effects.lost
    row.dead_letters += effects.dead_letters
    row.violations += effects.problems()

    evidence: list[str] = []
    for w in workflows:
        evidence += [f"{w}: {e}" for e in await temporal_evidence(client, w)]
    statuses = [await cleanup_status(client, pool, w) for w in cohorts]
    versions = sorted({v for _, v in expected.values()})
    row.operator_visibility = bool(all(s.settled for s in statuses) and (evidence or not deaths))
    row.evidence += evidence[:4]
    row.evidence.append(
        f"{len(twice)} accounts renewed twice ({len(for_good)} of them for good), {len(once)} once, "
        f"{sum(1 for o in outcomes if not o.in_time)} renewals too late, "
        f"{2 * len(twice) + len(once) - len(outcomes)} not tried (new deadline passed); versions reached {versions}; "
        f"{len(started)} single-account cleanups, {len(workflows) - 3 - len(started)} restarted by renewals; "
        f"cohorts settled: {[s.settlement.cleaned if s.settlement else None for s in statuses]} cleaned"
    )


def expected_states(outcomes: list[RenewalOutcome]) -> dict[str, tuple[str, int]]:
    """Per renewed account: the state and version its latest in-time renewal implies."""
    out: dict[str, tuple[str, int]] = {}
    for o in outcomes:
        if not o.in_time:
            continue
        out[o.account_id] = ("renewed" if o.new_deadline is None else "cleaned", o.version_after)
    return out


async def run(ctx: Ctx) -> Row:
    row = Row("10 renewal order")
    lane = await ctx.h.lane("order", 2)
    try:
        for rnd in range(ctx.profile.rounds):
            await one_round(ctx, lane, row, rnd)
    finally:
        await ctx.h.close_lane(lane)
    return row
