"""Scenario 11: zombie attempts. A worker that Temporal gave up on comes back and goes on working.

Two forms, all run side by side (each in a lane of its own: database, task queue, workers):

**Frozen** (one lane per job, two workers each, both armed with a `stop` failpoint that only the
first worker to reach it fires, CLEANUP_FAILPOINTS_ONCE_DIR): the worker freezes itself (SIGSTOP)
in the middle of a batch, deterministically:

- cleanup partition: inside the k-th keyset batch's transaction, before its statement;
- ledger shard: inside the k-th batch's transaction, before it asks for the shard lock;
- outbox relay: after the k-th batch sent its events, before their outcomes are recorded.

It stays frozen past the heartbeat timeout, Temporal retries the work on the other worker, and the
job completes there (the relay's events go to the other relay once the frozen one's lease ends).
Then the harness wakes the frozen worker (SIGCONT): the zombie sends its open batch's statement
(or records its outcomes) late. Must hold: the workflows completed (none failed), duplicates 0,
lost 0; the frozen worker's open transaction is ended by Postgres (2 s here:
DB_IDLE_IN_TRANSACTION_TIMEOUT_SECONDS), so its locks never hold the retry back; the zombie's late
work is seen in its log (its late batch found everything already applied, its late record was
fenced, or it was cancelled when its heartbeat was refused) and changed nothing: the digest of
every table the job writes is the same after the zombie woke, did its late work and was stopped,
as when the retry had finished.

**Cut off** (network namespace; needs root): a worker runs on a test host of its own
(harness/netns.py) that reaches Temporal, Postgres and the mail provider only through forwarders
(loopback addresses only). It alone runs a cohort cleanup, a ledger night and a relay; a row lock
held by the harness keeps one partition batch and one shard batch open (waiting inside their
statements) and the mail forwarder is slow, so a relay batch is open too. Then its link to
Temporal is blackholed, not its link to Postgres: it goes on working, unseen by Temporal. A second
worker starts on the host; once the partition and the shard are retried there, the row locks are
released: zombie and retry now run the same partition and the same shard at once, and the relay's
retry takes over after the relay's heartbeat timeout. When everything has completed the link is
restored; the zombie's late completions are refused. Must hold: as above, and the zombie sent
bytes to Postgres while it was cut off (it really worked as a zombie). Without root the form is
skipped, with a note in the row.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client, WorkflowFailureError

from cleanup.inputs import StartCleanup
from cleanup.models import cohort_cleanup_id
from cleanup.operations import cleanup_status, start_cleanup
from core import db
from core.failpoints import ONCE_DIR_ENV
from harness import netns
from harness.checks import (
    CLEANUP_TABLES,
    LEDGER_TABLES,
    OUTBOX_TABLES,
    Effects,
    cleanup_effects,
    ledger_digest,
    ledger_effects,
    outbox_effects,
)
from harness.common import MATCHES, RELAY, Ctx, Row, seed_cohort, seed_day, seed_events, wait_for
from harness.stack import Lane, Slot
from harness.visibility import pending_evidence, temporal_evidence
from ledger.models import ledger_workflow_id
from ledger.operations import ReconcileRequest, ledger_status, start_reconciliation
from outbox.operations import outbox_status, start_relays
from workflows.ledger_reconciliation import LedgerReconciliationWorkflow
from workflows.outbox_relay import OutboxRelayWorkflow
from workflows.renewal_cleanup import RenewalCleanupWorkflow

HEARTBEAT_TIMEOUT = 2.0  # cleanup partitions and ledger shards (the relay batch: RELAY_Z)
# A frozen worker's open transaction is ended by the server after this long (the product's
# DB_IDLE_IN_TRANSACTION_TIMEOUT_SECONDS, 10 s by default): its locks go to the retry.
# Few long polls and a short sticky wait: a frozen worker's open polls take tasks it cannot run
# (each retried after its timeout), so fewer of them means a faster recovery (WORKER_* settings).
IDLE_TX = {
    "DB_IDLE_IN_TRANSACTION_TIMEOUT_SECONDS": str(HEARTBEAT_TIMEOUT),
    "WORKER_WORKFLOW_TASK_POLLS": "2",
    "WORKER_ACTIVITY_TASK_POLLS": "1",
    "WORKER_STICKY_QUEUE_TIMEOUT_SECONDS": str(HEARTBEAT_TIMEOUT),
}
RELAY_Z = RELAY.model_copy(update={"heartbeat_timeout_seconds": 3.0})
CANCELLED = "Completing activity as failed"  # the SDK's line when a refused heartbeat cancelled the attempt
ZOMBIE_LINES = {
    "cleanup": re.compile(r"partition \d+ of \S+ attempt \d+ batch \d+: \d+ account\(s\) already applied.*"),
    "ledger": re.compile(r"shard \d+ of \S+ attempt \d+ batch \d+: \d+ keys, .* already applied"),
    "relay": re.compile(r"relay \S+ batch: claimed \d+, delivered \d+, retry \d+, dead \d+, fenced \d+"),
    # Back online: its late completions reach Temporal and are refused (the SDK's words).
    "reconnected": re.compile(r"Activity not found on completion|Task not found when completing"),
}
EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception|Cancelled)\b.*: ")
STARTED = PendingActivityState.PENDING_ACTIVITY_STATE_STARTED


@dataclass
class Part:
    """One job under one form; merged into the scenario's row."""

    name: str
    runs: int = 0
    effects: Effects = field(default_factory=Effects)
    recovery: float | None = None
    visible: bool = False
    evidence: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    timeline: list[str] = field(default_factory=list)

    def violation(self, text: str) -> None:
        self.violations.append(f"{self.name}: {text}")

    def mark(self, what: str) -> None:
        self.timeline.append(f"{what} {time.monotonic() - self.started:.1f}")


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat: 'T' when stopped by a signal."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    return stat.rsplit(")", 1)[1].split()[0]


def identity(slot: Slot) -> str:
    assert slot.proc is not None
    return f"{slot.proc.pid}@"  # the SDK's worker identity is PID@host


async def wait_frozen(slots: list[Slot], within: float) -> Slot | None:
    def frozen() -> Slot | None:
        return next((s for s in slots if s.proc is not None and process_state(s.proc.pid) == "T"), None)

    async def any_frozen() -> bool:
        return frozen() is not None

    return frozen() if await wait_for(any_frozen, within, 0.05) else None


def log_since(slot: Slot, offset: int) -> str:
    with contextlib.suppress(OSError), open(slot.log_path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")
    return ""


def log_size(slot: Slot) -> int:
    return slot.log_path.stat().st_size if slot.log_path.exists() else 0


def plain(line: str) -> str:
    """A log line without its timestamp and its Temporal IDs."""
    line = line.split(" [workflow_id=", 1)[0]
    return re.sub(r"^\S+ \S+ (INFO|WARNING) \S+ ", "", line).strip()


async def zombie_fate(slot: Slot, offset: int, job: str, within: float = 30) -> list[str]:
    """The lines showing what the woken (or reconnected) zombie did late: its late batch or record,
    or the cancellation of its attempt when Temporal refused its heartbeat."""
    pattern = ZOMBIE_LINES[job]

    def lines() -> list[str]:
        out, text = [], log_since(slot, offset).splitlines()
        for i, ln in enumerate(text):
            if found := pattern.search(ln):
                out.append(plain(ln) if job != "reconnected" else f"refused by Temporal: {found.group(0)}")
            elif CANCELLED in ln:
                # The traceback's last line says why: refused heartbeat, connection ended by the server...
                why = next((t for t in text[i + 1 : i + 80] if EXCEPTION_LINE.match(t)), "")
                out.append(f"attempt ended: {why.strip() or plain(ln)}")
        return out

    async def seen() -> bool:
        return bool(lines())

    await wait_for(seen, within, 0.1)
    return lines()


async def pending_on(client: Client, workflow_id: str, activity: str) -> list[tuple[str, int, int, str]]:
    """(activity ID, attempt, state, last worker identity) of the workflow's pending activities."""
    desc = await client.get_workflow_handle(workflow_id).describe()
    return [
        (p.activity_id, p.attempt, int(p.state), p.last_worker_identity)
        for p in desc.raw_description.pending_activities
        if p.activity_type.name == activity
    ]


async def completed(
    part: Part,
    what: str,
    result: Any,
    within: float = 120,
    pool: asyncpg.Pool | None = None,
    hung: tuple[Client, str, Lane] | None = None,
) -> bool:
    """Await a workflow's result; a failed (or never finished) workflow is a violation (with the
    lane's sessions and who waits on whom, what Temporal shows, and the workers' last lines, when
    it hangs)."""
    try:
        await asyncio.wait_for(result, within)
        return True
    except WorkflowFailureError as err:
        part.violation(f"{what} failed: {err.cause or err}")
    except TimeoutError:
        part.violation(f"{what} did not complete within {within:.0f} s")
        if pool is not None:
            rows = await pool.fetch(
                "SELECT pid, state, wait_event_type, wait_event, pg_blocking_pids(pid) AS blocked_by, "
                "left(query, 60) AS query FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid()"
            )
            part.notes.append(f"{part.name}: sessions when it hung: {[dict(r) for r in rows]}")
        if hung is not None:
            client, workflow_id, lane = hung
            shown = await pending_evidence(client, workflow_id) + await temporal_evidence(client, workflow_id)
            part.notes.append(f"{part.name}: Temporal when it hung: {shown}")
            for slot in lane.slots:
                tail = [plain(ln)[:200] for ln in log_since(slot, 0).splitlines() if ln[:1].isdigit()][-8:]
                part.notes.append(f"{part.name}: {slot.name} last lines: {tail}")
    return False


def digest_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return [f"{t}: {before[t][0]} rows -> {after[t][0]} rows (digest changed)" for t in before if before[t] != after[t]]


def once_dir(ctx: Ctx, name: str) -> str:
    path = ctx.h.log_dir / f"once-{name}"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


async def idle_transactions_ended(part: Part, pool: asyncpg.Pool, frozen_at: float) -> None:
    """The frozen worker's open transactions are ended by Postgres (its locks released for the retry)."""

    async def none_left() -> bool:
        return not await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'idle in transaction'"
        )

    if await wait_for(none_left, 30, 0.1):
        part.evidence.append(
            f"{part.name}: Postgres ended the frozen worker's open transaction(s) {time.monotonic() - frozen_at:.1f} s "
            f"after the freeze (idle_in_transaction_session_timeout {HEARTBEAT_TIMEOUT:g} s): its locks are free"
        )
    else:
        part.violation("the frozen worker's open transaction was never ended: its locks block the retry")


async def wake_and_watch(ctx: Ctx, part: Part, lane: Lane, zombie: Slot, job: str, tables: dict[str, str]) -> None:
    """SIGCONT the frozen zombie, wait for its late work, stop it; the tables must not have changed."""
    before = await ledger_digest(lane.pool, tables)
    offset = log_size(zombie)
    assert zombie.proc is not None
    os.kill(zombie.proc.pid, signal.SIGCONT)
    fate = await zombie_fate(zombie, offset, job)
    part.mark("late work seen")
    await ctx.h.supervisor.stop(zombie)  # whatever it still does late is done (or handed back) by now
    after = await ledger_digest(lane.pool, tables)
    if fate:
        part.evidence.append(f"{part.name}: woken zombie (SIGCONT), late: {'; '.join(fate[:2])}")
    else:
        part.violation("the woken zombie showed no late work in its log (neither a late batch nor a cancellation)")
    changes = digest_changes(before, after)
    if changes:
        part.violation(f"the zombie's late work changed the database: {changes}")
    else:
        rows = sum(n for n, _ in after.values())
        part.evidence.append(
            f"{part.name}: zombie woke, worked late and was stopped: {len(after)} tables ({rows} rows) unchanged"
        )


# -- frozen: cleanup partition ----------------------------------------------------------------------


async def frozen_cleanup(ctx: Ctx, round_no: int = 0) -> Part:
    part = Part("frozen cleanup partition")
    k = ctx.rng(f"zombie-cleanup-{round_no}").randint(2, 4)
    lane = await ctx.h.lane(
        "zombie-cleanup",
        2,
        failpoints=f"cleanup_partition.in_batch=stop@{k}",
        env={ONCE_DIR_ENV: once_dir(ctx, f"zombie-cleanup-{round_no}"), **IDLE_TX},
    )
    client, pool = ctx.client, lane.pool
    try:
        n = 120 * ctx.profile.scale
        prefix, deadline = ctx.ids.prefix("zc"), ctx.ids.past_deadline()
        await seed_cohort(pool, prefix, deadline, n)
        wf = cohort_cleanup_id(deadline)
        await start_cleanup(
            client,
            pool,
            lane.task_queue,
            StartCleanup(
                deadline=deadline,
                partitions=2,
                max_parallel_partitions=2,
                batch_size=10,
                heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT,
                step_timeout_seconds=5,
            ),
        )
        zombie = await wait_frozen(lane.slots, 60)
        if zombie is None:
            part.violation(f"no worker froze at cleanup_partition.in_batch=stop@{k}")
            return part
        frozen_at = time.monotonic()
        part.mark("frozen")
        held = [a for a in await pending_on(client, wf, "cleanup_partition") if a[3].startswith(identity(zombie))]
        open_tx = await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'idle in transaction'"
        )
        part.evidence.append(
            f"{part.name}: worker {identity(zombie)} froze (SIGSTOP) in its batch {k}, transaction open "
            f"({open_tx} idle in transaction), holding {[f'activity {h[0]} attempt {h[1]}' for h in held]}"
        )
        await idle_transactions_ended(part, pool, frozen_at)
        handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, wf)
        if not await completed(part, f"cleanup {wf}", handle.result(), pool=pool, hung=(client, wf, lane)):
            return part
        part.recovery = time.monotonic() - frozen_at
        part.mark("completed")
        part.runs += 1
        retried = await temporal_evidence(client, wf)
        part.visible = any("cleanup_partition attempt" in r for r in retried)
        part.evidence += [f"{part.name}: {r}" for r in retried[:2]]
        await wake_and_watch(ctx, part, lane, zombie, "cleanup", CLEANUP_TABLES)
        part.effects = await cleanup_effects(
            pool, prefix, matches_per_account=MATCHES, expect_cleaned=n, cleanup_ids=[wf]
        )
        status = await cleanup_status(client, pool, wf)
        part.visible = part.visible and bool(status.settled)
    finally:
        await ctx.h.close_lane(lane)
    return part


# -- frozen: ledger shard ---------------------------------------------------------------------------


async def frozen_ledger(ctx: Ctx, round_no: int = 0) -> Part:
    part = Part("frozen ledger shard")
    k = ctx.rng(f"zombie-ledger-{round_no}").randint(2, 3)
    lane = await ctx.h.lane(
        "zombie-ledger",
        2,
        failpoints=f"reconcile_shard.in_batch=stop@{k}",
        env={ONCE_DIR_ENV: once_dir(ctx, f"zombie-ledger-{round_no}"), **IDLE_TX},
    )
    client, pool = ctx.client, lane.pool
    try:
        d = ctx.ids.business_date()
        seeded = await seed_day(pool, d, 300 * ctx.profile.scale, 2)
        wf = ledger_workflow_id(d)
        await start_reconciliation(
            client,
            pool,
            lane.task_queue,
            ReconcileRequest(business_date=d, batch_size=40, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT),
        )
        zombie = await wait_frozen(lane.slots, 60)
        if zombie is None:
            part.violation(f"no worker froze at reconcile_shard.in_batch=stop@{k}")
            return part
        frozen_at = time.monotonic()
        part.mark("frozen")
        held = [a for a in await pending_on(client, wf, "reconcile_shard") if a[3].startswith(identity(zombie))]
        part.evidence.append(
            f"{part.name}: worker {identity(zombie)} froze (SIGSTOP) in its batch {k}, before the shard lock, "
            f"holding {[f'activity {h[0]} attempt {h[1]}' for h in held]}"
        )
        await idle_transactions_ended(part, pool, frozen_at)
        handle = client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, wf)
        if not await completed(part, f"ledger {wf}", handle.result(), pool=pool, hung=(client, wf, lane)):
            return part
        part.recovery = time.monotonic() - frozen_at
        part.mark("completed")
        part.runs += 1
        retried = await temporal_evidence(client, wf)
        part.visible = any("reconcile_shard attempt" in r for r in retried)
        part.evidence += [f"{part.name}: {r}" for r in retried[:2]]
        await wake_and_watch(ctx, part, lane, zombie, "ledger", LEDGER_TABLES)
        part.effects = await ledger_effects(
            pool,
            d,
            shards=2,
            expected_corrections=seeded.expected_corrections,
            expected_review=seeded.expected_review,
        )
        status = await ledger_status(client, pool, d)
        part.visible = part.visible and bool(status.settled)
    finally:
        await ctx.h.close_lane(lane)
    return part


# -- frozen: relay batch ----------------------------------------------------------------------------


async def frozen_relay(ctx: Ctx, round_no: int = 0) -> Part:
    part = Part("frozen relay batch")
    k = ctx.rng(f"zombie-relay-{round_no}").randint(1, 2)
    lane = await ctx.h.lane(
        "zombie-relay",
        2,
        failpoints=f"relay_outbox_batch.after_send=stop@{k}",
        env={ONCE_DIR_ENV: once_dir(ctx, f"zombie-relay-{round_no}"), **IDLE_TX},
    )
    client, pool = ctx.client, lane.pool
    try:
        prefix = ctx.ids.prefix("zr")
        await seed_events(pool, prefix, 30 * ctx.profile.scale)
        relay_prefix = f"harness-relay-{prefix}-"
        relays = [f"{relay_prefix}1", f"{relay_prefix}2"]
        await start_relays(
            client,
            lane.task_queue,
            relays=2,
            settings=RELAY_Z,
            idle_sleep_seconds=0.5,
            stop_when_drained=True,
            id_prefix=relay_prefix,
        )
        zombie = await wait_frozen(lane.slots, 60)
        if zombie is None:
            part.violation(f"no worker froze at relay_outbox_batch.after_send=stop@{k}")
            return part
        frozen_at = time.monotonic()
        part.mark("frozen")
        owners = []
        for relay in relays:
            for activity_id, attempt, _, who in await pending_on(client, relay, "relay_outbox_batch"):
                if who.startswith(identity(zombie)):
                    owners.append(f"{relay}/{activity_id}#{attempt}/")
        leased = [
            dict(r)
            for r in await pool.fetch(
                "SELECT event_id, lease_owner FROM outbox "
                "WHERE status = 'pending' AND lease_owner LIKE ANY($1::text[])",
                [o + "%" for o in owners],
            )
        ]
        part.evidence.append(
            f"{part.name}: worker {identity(zombie)} froze (SIGSTOP) after its batch {k} sent "
            f"{len(leased)} event(s), before recording them (lease {RELAY.lease_seconds:g} s)"
        )
        if not leased:
            part.notes.append(f"{part.name}: the frozen batch held no lease when seen (owners {owners})")
        for relay in relays:
            handle = client.get_workflow_handle_for(OutboxRelayWorkflow.run, relay)
            if not await completed(part, f"relay {relay}", handle.result(), pool=pool, hung=(client, relay, lane)):
                return part
        part.recovery = time.monotonic() - frozen_at
        part.mark("completed")
        part.runs += 1
        ids = [r["event_id"] for r in leased]
        taken_over = await pool.fetch("SELECT status, recorded_by FROM outbox WHERE event_id = ANY($1::bigint[])", ids)
        by_zombie = [r for r in taken_over if any((r["recorded_by"] or "").startswith(o) for o in owners)]
        if by_zombie:
            part.violation(f"{len(by_zombie)} of the frozen batch's events were recorded by the zombie before it woke")
        part.evidence.append(
            f"{part.name}: its {len(ids)} leased event(s) re-leased and recorded by "
            f"{sorted({(r['recorded_by'] or '?').split('/')[0] for r in taken_over})}"
        )
        retried: list[str] = []
        for relay in relays:
            retried += await temporal_evidence(client, relay)
        part.visible = any("relay_outbox_batch attempt" in r for r in retried)
        part.evidence += [f"{part.name}: {r}" for r in retried[:2]]
        await wake_and_watch(ctx, part, lane, zombie, "relay", OUTBOX_TABLES)
        part.effects = await outbox_effects(pool, ctx.h.provider.provider)
        absorbed = part.effects.details.get("resends_absorbed_by_key", 0)
        part.evidence.append(f"{part.name}: provider absorbed {absorbed} re-send(s) by Idempotency-Key")
        status = await outbox_status(pool, client)
        part.visible = part.visible and status.pending == 0
    finally:
        await ctx.h.close_lane(lane)
    return part


# -- cut off: a worker on its own test host ---------------------------------------------------------


async def lock_waiters(pool: asyncpg.Pool) -> int:
    return int(
        await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
    )


async def cut_off_host(ctx: Ctx, round_no: int = 0) -> Part:
    part = Part("cut-off host")
    why = netns.available()
    if why is not None:
        part.notes.append(f"{part.name}: network-namespace form SKIPPED: {why}")
        part.evidence.append(f"{part.name}: skipped ({why}); the frozen form ran")
        part.visible = True
        return part
    host = netns.TestHost()
    lane: Lane | None = None
    blockers: list[asyncpg.Connection] = []
    client = ctx.client
    try:
        await host.create()
        lane = await ctx.h.lane("zombie-host", 0, env={"LOAD_BUDGET_MAX_IN_FLIGHT": "8", **IDLE_TX})
        pool = lane.pool
        fwd_pg = await host.forward("postgres", netns.postgres_upstream(lane.database_url))
        fwd_t = await host.forward("temporal", int(ctx.h.address.rsplit(":", 1)[1]))
        mail_port = int(ctx.h.provider.url.rsplit(":", 1)[1].split("/")[0])
        fwd_mail = await host.forward("mail", mail_port)
        zombie = ctx.h.add_slot(
            lane,
            "netns",
            env={
                "DATABASE_URL": netns.via_forwarder(lane.database_url, fwd_pg.port),
                "TEMPORAL_ADDRESS": f"127.0.0.1:{fwd_t.port}",
                "MAIL_PROVIDER_URL": f"http://127.0.0.1:{fwd_mail.port}",
            },
            prefix=host.prefix,
        )
        retrier = ctx.h.add_slot(lane, "host")
        await ctx.h.supervisor.start(zombie)
        part.evidence.append(
            f"{part.name}: worker {identity(zombie)} on test host {host.name} (network namespace), reaching "
            f"Temporal, Postgres and the mail provider only through forwarders"
        )

        # Work for it alone: a cohort, a night, reminders; one partition batch and one shard batch held.
        scale = ctx.profile.scale
        n = 120 * scale
        prefix, deadline = ctx.ids.prefix("zh"), ctx.ids.past_deadline()
        await seed_cohort(pool, prefix, deadline, n)
        d = ctx.ids.business_date()
        seeded = await seed_day(pool, d, 300 * scale, 2)
        events_prefix = ctx.ids.prefix("zhr")
        await seed_events(pool, events_prefix, 40 * scale)
        held_partition, held_shard = (
            ctx.rng(f"zombie-host-{round_no}").randrange(2),
            ctx.rng(f"zombie-shard-{round_no}").randrange(2),
        )
        for sql, args in (
            # Its cloud save (not the account row, so the claim does not wait): in the partition's 3rd batch.
            (
                "SELECT 1 FROM demo_game.cloud_saves WHERE account_id ="
                " (SELECT account_id FROM accounts WHERE account_id LIKE $1"
                " ORDER BY account_id OFFSET $2 LIMIT 1) FOR UPDATE",
                [f"acct_{prefix}_%", held_partition + 2 * 25],
            ),
            (
                "SELECT 1 FROM ledger_payments WHERE business_date = $1 AND shard = $2 "
                "ORDER BY game, payment_id OFFSET 100 LIMIT 1 FOR UPDATE",
                [d, held_shard],
            ),
        ):
            blocker = await asyncpg.connect(lane.database_url, server_settings=db.service_settings())
            blockers.append(blocker)
            await blocker.execute("BEGIN")
            await blocker.execute(sql, *args)
        fwd_mail.latency = 0.4  # a slow provider link: each relay batch stays open a while
        cwf, lwf = cohort_cleanup_id(deadline), ledger_workflow_id(d)
        relay_id = f"harness-relay-{events_prefix}-1"
        await start_cleanup(
            client,
            pool,
            lane.task_queue,
            StartCleanup(
                deadline=deadline,
                partitions=2,
                max_parallel_partitions=2,
                batch_size=10,
                heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT,
                step_timeout_seconds=5,
            ),
        )
        await start_reconciliation(
            client,
            pool,
            lane.task_queue,
            ReconcileRequest(business_date=d, batch_size=40, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT),
        )

        async def relay_until_drained(id_prefix: str) -> None:
            await start_relays(
                client,
                lane.task_queue,
                relays=1,
                settings=RELAY_Z,
                idle_sleep_seconds=0.5,
                stop_when_drained=True,
                id_prefix=id_prefix,
            )

        # The partition's and the shard's batches wait on their held rows for as long as the rows are
        # held; the relay starts only then, so its batch is open at the cut however slowly the
        # machine brought the other two to their locks (a relay started first may have drained).
        # The waiting batches may hold every connection of the worker's main pool: the relay runs
        # on the connections kept apart, so reminders are not starved (checked here).
        async def batches_waiting() -> bool:
            return await lock_waiters(pool) >= 2

        if not await wait_for(batches_waiting, 90, 0.05):
            part.violation("the partition batch and the shard batch never waited on their held rows")
            return part
        await relay_until_drained(f"harness-relay-{events_prefix}-")

        async def relay_batch_open() -> bool:
            leased = await pool.fetchval(
                "SELECT count(*) FROM outbox WHERE status = 'pending' AND lease_owner LIKE $1 AND leased_until > now()",
                f"{relay_id}/%",
            )
            return bool(leased)

        if not await wait_for(relay_batch_open, 60, 0.02):
            outbox = await pool.fetch(
                "SELECT status, lease_owner IS NOT NULL AS leased, count(*) FROM outbox"
                " WHERE lease_owner LIKE $1 OR lease_owner IS NULL GROUP BY 1, 2",
                f"{relay_id}/%",
            )
            part.violation(
                "no relay batch was open while the partition and shard batches waited (reminders starved): "
                f"outbox (status, leased, count) {[tuple(r) for r in outbox]}, lock waiters {await lock_waiters(pool)}"
            )
            return part
        fwd_t.cut()
        cut_at = time.monotonic()
        part.mark("cut")
        cut_db = await pool.fetchval("SELECT clock_timestamp()")
        open_relay = [
            r["event_id"]
            for r in await pool.fetch(
                "SELECT event_id FROM outbox WHERE status = 'pending' AND lease_owner LIKE $1", f"{relay_id}/%"
            )
        ]
        part.evidence.append(
            f"{part.name}: link to Temporal blackholed (Postgres and the provider still reachable) with partition "
            f"{held_partition}'s and shard {held_shard}'s batches waiting on held rows and a relay batch of "
            f"{len(open_relay)} event(s) open"
        )
        await ctx.h.supervisor.start(retrier)

        async def retried_on_host() -> bool:
            me = identity(retrier)
            for wf, activity in ((cwf, "cleanup_partition"), (lwf, "reconcile_shard")):
                if not any(
                    a >= 2 and s == STARTED and who.startswith(me)
                    for _, a, s, who in await pending_on(client, wf, activity)
                ):
                    return False
            return True

        if not await wait_for(retried_on_host, 90, 0.2):
            part.violation("the held partition and shard were not retried on the host worker")
            return part
        for blocker in blockers:
            await blocker.execute("ROLLBACK")
        part.evidence.append(
            f"{part.name}: partition and shard retried on {identity(retrier)}; rows released: zombie and retry run "
            "the same partition and shard at once"
        )
        handles = [
            (cwf, f"cleanup {cwf}", client.get_workflow_handle_for(RenewalCleanupWorkflow.run, cwf).result()),
            (lwf, f"ledger {lwf}", client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, lwf).result()),
            (relay_id, f"relay {relay_id}", client.get_workflow_handle_for(OutboxRelayWorkflow.run, relay_id).result()),
        ]
        for wf_id, what, result in handles:
            if not await completed(part, what, result, pool=pool, hung=(client, wf_id, lane)):
                return part
        part.recovery = time.monotonic() - cut_at
        # The relay stops the first time it finds nothing pending, which can come while a partition
        # still waits on its held row; a production relay never stops. A second one, started once the
        # cleanup has settled, delivers what was written after the first one drained.
        drain_id = f"harness-relay-{events_prefix}-drain-"
        await relay_until_drained(drain_id)
        drain = client.get_workflow_handle_for(OutboxRelayWorkflow.run, f"{drain_id}1").result()
        if not await completed(part, f"relay {drain_id}1", drain, pool=pool):
            return part
        part.mark("completed")
        part.runs += 1
        while_cut = fwd_pg.bytes_up_while_cut_elsewhere
        late_zombie = [ln for ln in log_since(zombie, 0).splitlines() if ZOMBIE_LINES["cleanup"].search(ln)]
        late_retry = [ln for ln in log_since(retrier, 0).splitlines() if ZOMBIE_LINES["cleanup"].search(ln)]
        relay_late = await pool.fetchval(
            "SELECT count(*) FROM outbox WHERE event_id = ANY($1::bigint[]) AND delivered_at >= $2",
            open_relay,
            cut_db,
        )
        part.evidence.append(
            f"{part.name}: while cut off the zombie sent {while_cut} bytes to Postgres; batches that found the "
            f"other's work already applied: zombie {len(late_zombie)}, retry {len(late_retry)}; "
            f"{relay_late} of the open relay batch's events delivered after the cut"
        )
        if while_cut == 0:
            part.violation("the cut-off worker did nothing with Postgres while cut off (not a zombie)")
        retried: list[str] = []
        for wf in (cwf, lwf, relay_id):
            retried += await temporal_evidence(client, wf)
        part.evidence += [f"{part.name}: {r}" for r in retried[:3]]
        part.visible = any("attempt" in r for r in retried)

        # Reconnect: the zombie's late completions and heartbeats reach Temporal and are refused.
        tables = {**CLEANUP_TABLES, **LEDGER_TABLES}
        before = await ledger_digest(pool, tables)
        offset = log_size(zombie)
        sent_before = fwd_t.bytes_up
        fwd_t.reconnect()

        async def talked() -> bool:
            return fwd_t.bytes_up > sent_before

        await wait_for(talked, 30, 0.1)
        fate = await zombie_fate(zombie, offset, "reconnected", within=5)
        await ctx.h.supervisor.stop(zombie)
        after = await ledger_digest(pool, tables)
        changes = digest_changes(before, after)
        if changes:
            part.violation(f"the reconnected zombie changed the database: {changes}")
        part.evidence.append(
            f"{part.name}: link restored; zombie talked to Temporal again ({fwd_t.bytes_up - sent_before} bytes) "
            f"{'and: ' + '; '.join(fate[:2]) if fate else ''}; then stopped: {len(after)} tables unchanged"
        )
        part.effects = (
            await cleanup_effects(pool, prefix, matches_per_account=MATCHES, expect_cleaned=n, cleanup_ids=[cwf])
            + await ledger_effects(
                pool,
                d,
                shards=2,
                expected_corrections=seeded.expected_corrections,
                expected_review=seeded.expected_review,
            )
            + await outbox_effects(pool, ctx.h.provider.provider)
        )
        cs, ls = await cleanup_status(client, pool, cwf), await ledger_status(client, pool, d)
        part.visible = part.visible and bool(cs.settled and ls.settled)
    finally:
        for blocker in blockers:
            with contextlib.suppress(Exception):
                await blocker.close()
        if lane is not None:
            await ctx.h.close_lane(lane)
        await host.close()
    return part


async def timed(part: Any) -> Part:
    p: Part = await part
    p.mark("done")
    return p


async def run(ctx: Ctx) -> Row:
    """The four parts side by side; the full profile repeats them (`rounds`), each round with its own draws."""
    row = Row("11 zombie attempt")
    parts: list[Part | BaseException] = []
    for r in range(ctx.profile.rounds):
        parts += await asyncio.gather(
            timed(frozen_cleanup(ctx, r)),
            timed(frozen_ledger(ctx, r)),
            timed(frozen_relay(ctx, r)),
            timed(cut_off_host(ctx, r)),
            return_exceptions=True,
        )
    visible = True
    for p in parts:
        if isinstance(p, BaseException):
            row.violations.append(f"a part crashed: {type(p).__name__}: {p}")
            visible = False
            continue
        row.runs += p.runs
        row.duplicates += p.effects.duplicates
        row.lost += p.effects.lost
        row.dead_letters += p.effects.dead_letters
        if p.recovery is not None:
            row.recovered(p.recovery)
        row.evidence += p.evidence
        row.violations += p.violations + [f"{p.name}: {v}" for v in p.effects.problems()]
        row.notes += [*p.notes, f"{p.name} timeline (s): {', '.join(p.timeline)}"]
        visible = visible and p.visible
    row.operator_visibility = visible
    return row
