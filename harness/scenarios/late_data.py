"""Scenario 11: late data. Provider rows and ledger edits arrive during a night's run and after it;
re-checks reconcile them to exactly what an independent oracle says, in balanced revisions.

Per round (one business date, a real worker process; two in the full profile):

1. The night run starts while the harness holds a row lock in the middle of shard 0, so the run
   provably cannot settle while the first burst of late data lands (some of it behind the shards'
   cursors, some ahead). A feed keeps writing late data concurrently until the night has settled.
2. More late data after the night, then a re-check (`recheck=True`, its own workflow ID) with the
   feed still writing while it runs; then a second re-check with nothing arriving, which must bring
   the date to what the oracle says; then a third, which must find nothing new (no revision, the
   ledger tables byte-identical).

Late data (the "feed"): new payments the ledger records late (never settled, settled, refunded by
the provider, settled with another amount), provider rows for payments the ledger does not know,
copies of a provider row (exact or conflicting), and hand edits of ledger payments (amount within
or beyond tolerance, currency, captured <-> refunded). Each edit touches a new key, or a key with
no discrepancy, once; so what a key must end as does not depend on when a run judged it. Every
ledger edit is also written to `harness_ledger_truth` in the same transaction: the ledger as the
business wrote it, which the reconciliation's corrections never touch.

Must hold: the corrections and review rows (key, kind, new values) and the final ledger equal what
`late_data_oracle` (harness/queries.sql) computes from the raw ledger and provider rows alone; the
latest revision's totals equal the oracle's; every revision balances and follows the one before;
every run completed; duplicates 0, lost 0 (harness.checks.ledger_effects, with the oracle's counts).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import date
from typing import Any

import asyncpg
from temporalio.client import Client, WorkflowExecutionStatus

import harness
from core import db
from core.queries import load
from harness.checks import ledger_digest, ledger_effects
from harness.common import Ctx, Row, seed_day, wait_for
from ledger.models import LedgerReconciliationResult
from ledger.operations import ReconcileRequest, ledger_status, start_reconciliation
from workflows.ledger_reconciliation import LedgerReconciliationWorkflow

SQL = load(harness.__file__)
HEARTBEAT_TIMEOUT = 2.0
SHARDS = 4
PAYMENTS = 1000  # per round, times the profile's scale
BATCH_SIZE = 25
TOLERANCE_CENTS = 50  # the seed's and the workflow's default
BURST = 10  # late edits while shard 0 is held, and again after the night (times the scale)
GAMES = [f"game-{i}" for i in range(1, 9)]  # the seed's games
NEW_KEY_KINDS = ("unknown_payment", "never_settled", "late_settled", "late_refund", "late_amount")
COUNTED_BY_ORACLE = {"lost_corrections", "lost_review_rows"}
EDIT_KINDS = ("amount_small", "amount_large", "currency", "status", "provider_copy", "provider_conflict")


@dataclass
class Feed:
    """Late data for one date: each call writes one random late change (or skips a locked row)."""

    pool: asyncpg.Pool
    business_date: date
    rng: random.Random
    tag: str
    untouched: list[tuple[str, str]]  # ledger keys with no discrepancy, not edited yet
    applied: Counter[str] = field(default_factory=Counter)  # by kind
    phases: Counter[str] = field(default_factory=Counter)  # by phase
    skipped_on_lock: int = 0
    _n: int = 0

    def _new_key(self) -> tuple[str, str]:
        self._n += 1
        # '0' sorts before the seeded IDs of a game (behind a cursor that passed them), 'z' after.
        return self.rng.choice(GAMES), f"pay-{self.rng.choice('0z')}late-{self.tag}-{self._n:05d}"

    def _money(self) -> tuple[int, str]:
        return self.rng.randint(99, 19_999), self.rng.choice(["EUR", "USD", "GBP"])

    async def one(self, phase: str) -> None:
        kinds = NEW_KEY_KINDS + (EDIT_KINDS if self.untouched else ())
        kind = self.rng.choice(kinds)
        key = self.untouched.pop() if kind in EDIT_KINDS else self._new_key()
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                # A key may be locked by a batch (or by the harness's hold): skip it, never wait long.
                await conn.execute("SET LOCAL lock_timeout = '300ms'")
                written = await self._write(conn, kind, key)
        except asyncpg.LockNotAvailableError:
            self.skipped_on_lock += 1
            if kind in EDIT_KINDS:
                self.untouched.insert(0, key)  # rolled back: still untouched, try it again later
            return
        if not written:
            raise AssertionError(f"late {kind} of {key} wrote nothing")
        self.applied[kind] += 1
        self.phases[phase] += 1

    async def _write(self, conn: asyncpg.Connection, kind: str, key: tuple[str, str]) -> bool:
        d, (game, payment) = self.business_date, key
        amount, currency = self._money()
        new_payment = SQL.late_data_new_payment
        report_row = SQL.late_data_new_report_row
        if kind == "unknown_payment":
            return await conn.fetchval(report_row, d, SHARDS, game, payment, amount, currency, "settled") is not None
        if kind == "never_settled":
            return await conn.fetchval(new_payment, d, SHARDS, game, payment, amount, currency, "captured") is not None
        if kind in ("late_settled", "late_refund", "late_amount"):
            provider_amount = amount
            if kind == "late_amount":
                provider_amount += self.rng.choice([-1, 1]) * self.rng.randint(1, 2 * TOLERANCE_CENTS)
            provider_status = "refunded" if kind == "late_refund" else "settled"
            await conn.fetchval(new_payment, d, SHARDS, game, payment, amount, currency, "captured")
            return (
                await conn.fetchval(report_row, d, SHARDS, game, payment, provider_amount, currency, provider_status)
                is not None
            )
        if kind in ("provider_copy", "provider_conflict"):
            delta = 0 if kind == "provider_copy" else self.rng.randint(1, 100)
            return await conn.fetchval(SQL.late_data_copy_report_row, d, game, payment, delta) is not None
        delta, currency_swap, status_flip = 0, False, False
        if kind == "amount_small":
            delta = self.rng.choice([-1, 1]) * self.rng.randint(1, TOLERANCE_CENTS)
        elif kind == "amount_large":
            delta = TOLERANCE_CENTS + self.rng.randint(1, 5_000)
        elif kind == "currency":
            currency_swap = True
        else:
            status_flip = True
        edited = await conn.fetchval(SQL.late_data_edit_payment, game, payment, delta, currency_swap, status_flip)
        return edited is not None

    async def burst(self, count: int, phase: str) -> None:
        for _ in range(count):
            await self.one(phase)

    async def until(self, stop: asyncio.Event, phase: str) -> None:
        """Late data at random short intervals until `stop` is set (the run it races has finished)."""
        while not stop.is_set():
            await self.one(phase)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.rng.uniform(0.02, 0.12))


async def _reconcile(
    client: Client, pool: asyncpg.Pool, tq: str, business_date: date, recheck: bool
) -> tuple[str, Any]:
    started = await start_reconciliation(
        client,
        pool,
        tq,
        ReconcileRequest(
            business_date=business_date,
            max_parallel=2,
            batch_size=BATCH_SIZE,
            tolerance_cents=TOLERANCE_CENTS,
            heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT,
            recheck=recheck,
        ),
    )
    if not started.started:
        raise AssertionError(f"{started.workflow_id} was not started (it already existed)")
    return started.workflow_id, client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, started.workflow_id)


async def _racing(feed: Feed, phase: str, handle: Any) -> LedgerReconciliationResult:
    """The run's result, with the feed writing late data until the run has finished."""
    stop = asyncio.Event()
    writer = asyncio.create_task(feed.until(stop, phase))
    try:
        result: LedgerReconciliationResult = await asyncio.wait_for(handle.result(), 180)
    finally:
        stop.set()
        await writer
    return result


async def _completed(client: Client, workflow_ids: list[str]) -> list[str]:
    bad = []
    for wf in workflow_ids:
        status = (await client.get_workflow_handle(wf).describe()).status
        if status != WorkflowExecutionStatus.COMPLETED:
            bad.append(f"{wf}: {status.name if status else None}")
    return bad


def _against_oracle(
    oracle: list[asyncpg.Record], effects: list[asyncpg.Record], ledger: list[asyncpg.Record]
) -> dict[str, int]:
    """Differences between what the runs left and what the oracle demands (each must be 0)."""
    want = {(r["game"], r["payment_id"]): r for r in oracle if r["effect"] is not None}
    got: dict[tuple[str, str], list[asyncpg.Record]] = {}
    for e in effects:
        got.setdefault((e["game"], e["payment_id"]), []).append(e)
    final = {(r["game"], r["payment_id"]): (r["status"], r["amount_cents"]) for r in ledger}
    d = Counter[str]()
    for key, w in want.items():
        rows = got.get(key, [])
        if not rows:
            d[f"lost_oracle_{w['effect']}"] += 1
        elif rows[0]["effect"] != w["effect"] or rows[0]["kind"] != w["kind"]:
            d["oracle_wrong_kind"] += 1
        elif w["effect"] == "correction" and (rows[0]["new_status"], rows[0]["new_amount_cents"]) != (
            w["final_status"],
            w["final_amount"],
        ):
            d["oracle_wrong_correction_values"] += 1
    for key, rows in got.items():
        if key not in want:
            d[f"oracle_unexpected_{rows[0]['effect']}"] += len(rows)
        elif len(rows) > 1:
            d["dup_oracle_effects"] += len(rows) - 1
    for r in oracle:
        key = (r["game"], r["payment_id"])
        if r["in_ledger"] and final.get(key) != (r["final_status"], r["final_amount"]):
            d["oracle_wrong_final_ledger"] += 1
    return dict(d)


def _revision_problems(revisions: list[dict[str, Any]]) -> list[str]:
    problems = []
    previous: dict[str, Any] | None = None
    for n, v in enumerate(revisions, 1):
        if v["revision"] != n:
            problems.append(f"revision {v['revision']} where {n} was due")
        if v["corrected"] + v["sent_to_review"] != v["discrepancies_found"]:
            problems.append(f"revision {v['revision']} does not balance: {v}")
        before = previous or {"discrepancies_found": 0, "corrected": 0, "sent_to_review": 0}
        deltas = (v["new_discrepancies"], v["new_corrections"], v["new_review_rows"])
        if deltas != (
            v["discrepancies_found"] - before["discrepancies_found"],
            v["corrected"] - before["corrected"],
            v["sent_to_review"] - before["sent_to_review"],
        ):
            problems.append(f"revision {v['revision']}: deltas {deltas} do not follow revision {n - 1}")
        previous = v
    return problems


async def _round(ctx: Ctx, row: Row, lane: Any, rng: random.Random, n_round: int) -> bool:
    """One date; True if `ledger status` shows the oracle's totals in a re-check's latest revision."""
    client, pool, tq = ctx.client, lane.pool, lane.task_queue
    scale = ctx.profile.scale
    business_date = ctx.ids.business_date()
    seeded = await seed_day(pool, business_date, PAYMENTS * scale, SHARDS)
    await pool.execute(SQL.late_data_truth_copy, business_date)
    oracle_before = await pool.fetch(SQL.late_data_oracle, business_date, TOLERANCE_CENTS)
    untouched = [(r["game"], r["payment_id"]) for r in oracle_before if r["in_ledger"] and r["effect"] is None]
    rng.shuffle(untouched)
    feed = Feed(pool, business_date, rng, ctx.ids.prefix("ld"), untouched)
    runs: list[str] = []
    label = f"round {n_round} ({business_date})"
    took: dict[str, float] = {}
    t0 = time.monotonic()

    def lap(name: str) -> None:
        nonlocal t0
        took[name] = round(time.monotonic() - t0, 1)
        t0 = time.monotonic()

    lap("seed")

    # 1. The night, held in shard 0 while the first burst lands, the feed racing it to the end.
    stop = asyncio.Event()
    writer: asyncio.Task[None] | None = None
    blocker = await asyncpg.connect(lane.database_url, server_settings=db.service_settings())
    tx = blocker.transaction()
    await tx.start()
    held = True
    try:
        key = await blocker.fetchrow(SQL.late_data_hold_payment, business_date, 0)
        assert key is not None
        with contextlib.suppress(ValueError):
            untouched.remove((key["game"], key["payment_id"]))
        night_id, night = await _reconcile(client, pool, tq, business_date, recheck=False)
        runs.append(night_id)

        async def shard_0_waits() -> bool:
            return bool(await pool.fetchval(SQL.late_data_lock_waiters) >= 1)

        if not await wait_for(shard_0_waits, 60, 0.05):
            raise TimeoutError("shard 0's batch never reached the held row")
        await feed.burst(BURST * scale, "night, shard 0 held")
        if await pool.fetchval("SELECT count(*) FROM ledger_settlements WHERE business_date = $1", business_date):
            row.violations.append(f"{label}: the night settled while shard 0 was held")
        writer = asyncio.create_task(feed.until(stop, "night, racing it"))
        await tx.rollback()
        held = False
        night_result: LedgerReconciliationResult = await asyncio.wait_for(night.result(), 180)
    finally:
        stop.set()
        if writer is not None:
            await writer
        if held:
            await tx.rollback()
        await blocker.close()
    row.runs += 1
    lap("night")

    # 2. Late data after the night; a re-check racing the feed; a quiet re-check; an idle one.
    await feed.burst(BURST * scale, "after the night")
    first_id, first = await _reconcile(client, pool, tq, business_date, recheck=True)
    runs.append(first_id)
    first_result = await _racing(feed, "re-check 1, racing it", first)
    row.runs += 1
    lap("re-check 1")
    second_id, second = await _reconcile(client, pool, tq, business_date, recheck=True)
    runs.append(second_id)
    second_result: LedgerReconciliationResult = await asyncio.wait_for(second.result(), 180)
    row.runs += 1
    lap("re-check 2")

    oracle = await pool.fetch(SQL.late_data_oracle, business_date, TOLERANCE_CENTS)
    want_corrections = sum(1 for r in oracle if r["effect"] == "correction")
    want_review = sum(1 for r in oracle if r["effect"] == "review")
    differences = _against_oracle(
        oracle,
        await pool.fetch(SQL.late_data_effects, business_date),
        await pool.fetch(SQL.late_data_ledger, business_date),
    )
    row.violations += [f"{label}: {k}={v}" for k, v in differences.items() if v]
    row.lost += sum(v for k, v in differences.items() if k.startswith("lost_"))
    row.duplicates += sum(v for k, v in differences.items() if k.startswith("dup_"))
    effects = await ledger_effects(
        pool, business_date, shards=SHARDS, expected_corrections=want_corrections, expected_review=want_review
    )
    row.duplicates += effects.duplicates
    # Missing corrections and review rows are counted per key by the oracle above, not twice.
    row.lost += sum(v for k, v in effects.details.items() if k.startswith("lost_") and k not in COUNTED_BY_ORACLE)
    row.violations += [f"{label}: {p}" for p in effects.problems()]

    want_totals = {
        "keys_examined": len(oracle),
        "discrepancies_found": want_corrections + want_review,
        "corrected": want_corrections,
        "sent_to_review": want_review,
        "duplicate_report_rows": sum(r["duplicate_report_rows"] for r in oracle),
    }
    settled = second_result.settlement
    got_totals = {k: getattr(settled, k) for k in want_totals}
    if got_totals != want_totals:
        row.violations.append(f"{label}: settled {got_totals}, the oracle says {want_totals}")

    lap("oracle")
    before = await ledger_digest(pool)
    idle_id, idle = await _reconcile(client, pool, tq, business_date, recheck=True)
    runs.append(idle_id)
    idle_result: LedgerReconciliationResult = await asyncio.wait_for(idle.result(), 180)
    row.runs += 1
    lap("idle re-check")
    if await ledger_digest(pool) != before:
        row.violations.append(f"{label}: a re-check with nothing new changed the ledger tables")
    if idle_result.settlement.revision != settled.revision or not all(
        s.unchanged_since_report for s in idle_result.shards
    ):
        again = idle_result.settlement.revision
        row.violations.append(f"{label}: the idle re-check judged a shard again or recorded revision {again}")

    row.violations += [f"{label}: run not completed: {b}" for b in await _completed(client, runs)]
    status = await ledger_status(client, pool, business_date)
    revisions = [v.model_dump() for v in status.revisions or []]
    row.violations += [f"{label}: {p}" for p in _revision_problems(revisions)]
    numbers = [v["revision"] for v in revisions]
    if len(numbers) < 2 or status.revision != numbers[-1]:
        row.violations.append(f"{label}: revisions {numbers}, settlement at revision {status.revision}")
    latest = revisions[-1] if revisions else {}
    visible = (
        bool(status.settled)
        and {k: latest.get(k) for k in want_totals} == want_totals
        and "re-check" in str(latest.get("reason", ""))
        and (status.corrections, status.review_rows) == (want_corrections, want_review)
    )
    attempts = max(s.attempt for r in (night_result, first_result, second_result) for s in r.shards)
    row.evidence.append(
        f"{label}: {seeded.payments} payments; late changes {sum(feed.applied.values())} "
        f"({', '.join(f'{p}: {n}' for p, n in feed.phases.items())}), {feed.skipped_on_lock} skipped on a lock"
    )
    sums = "; ".join(
        f"r{v['revision']} {v['discrepancies_found']} = {v['corrected']} + {v['sent_to_review']}" for v in revisions
    )
    verdict = "equal" if not differences and got_totals == want_totals else f"differs: {differences}"
    row.evidence.append(
        f"{label}: revisions {sums}; oracle {want_totals['discrepancies_found']} = {want_corrections} + "
        f"{want_review}, corrections, review rows and ledger {verdict}"
    )
    if latest:
        row.evidence.append(f"{label}: latest revision's reason: {latest['reason']}")
    row.notes.append(f"{label}: late changes by kind {dict(sorted(feed.applied.items()))}")
    row.notes.append(
        f"{label}: night revision {night_result.settlement.revision}, re-check 1 revision "
        f"{first_result.settlement.revision}, re-check 2 revision {settled.revision} "
        f"({sum(not s.unchanged_since_report for s in second_result.shards)} shard(s) judged again), "
        f"idle re-check: all {SHARDS} shards unchanged; highest shard attempt {attempts}"
    )
    row.notes.append(f"{label}: seconds {took}")
    return visible


async def run(ctx: Ctx) -> Row:
    row = Row("12 late data")
    rng = ctx.rng("late-data")
    t0 = time.monotonic()
    # One worker process in the quick profile (starting a second costs seconds on a loaded CI
    # machine), two in the full one, so shards of a run also spread over processes.
    workers = 1 if ctx.profile.scale == 1 else 2
    lane = await ctx.h.lane("late-data", workers)
    row.notes.append(f"lane with {workers} worker(s) up in {time.monotonic() - t0:.1f} s")
    try:
        await lane.pool.execute(SQL.late_data_truth_table)
        visible = [await _round(ctx, row, lane, rng, n) for n in range(1, ctx.profile.rounds + 1)]
        row.operator_visibility = all(visible)
    finally:
        await ctx.h.close_lane(lane)
    return row
