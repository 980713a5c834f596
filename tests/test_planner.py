"""Every account is cleaned at its deadline with nobody running a command.

Real Temporal, real Postgres. The planner alone (no `cleanup` command) cleans accounts whose
deadlines are spread over ~20 s, including a renewal to a new deadline, a stranded claim of a
terminated cleanup, a row edited by hand and a worker outage longer than L; effects are counted in
the database. The renewal rule is checked at the deadline +- a few ms by the database clock, and
the claim is shown to run as bounded statements.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import asyncpg
import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

import cleanup
from activities.cleanup import claim_in_chunks
from cleanup import planner as planner_module
from cleanup.cli import _planner_human_status as _human_status
from cleanup.inputs import StartCleanup
from cleanup.models import (
    ClaimChunkedInput,
    CleanupPartitionInput,
    PartitionReport,
    bucket_cleanup_id,
    planner_workflow_id,
)
from cleanup.operations import renew, start_cleanup
from cleanup.planner import (
    STUCK_TASK_ATTEMPTS,
    ensure_planner,
    plan_buckets,
    planner_status,
    recover_stranded,
    watch_planner,
)
from cleanup.planner_models import PlannerSettings, PlanTickInput, PlanTickResult
from core.config import PROJECT_ROOT, CleanupDefaults
from core.queries import load
from core.temporal import describe_or_none
from tests.broken_planner import BrokenPlanner
from tests.helpers import deadline_in, seed, wait_until
from worker import build_activities, build_worker
from workflows.deadline_planner import DeadlinePlannerWorkflow

SQL = load(cleanup.__file__)
FAST = PlannerSettings(
    bucket_seconds=1.0,
    horizon_seconds=60,
    tick_seconds=1.0,
    max_idle_seconds=1.0,  # deadlines seeded seconds ahead are planned, and missed ones swept, at once
    lateness_objective_seconds=2.0,  # cohorts of one 1 s bucket: the buckets these tests name
    sweep_grace_seconds=3.0,
    iterations_per_run=20,  # several continue-as-new during the test
)
# The planner's cleanups in these tests (the same defaults an operator's cleanup takes).
FAST_CLEANUPS = CleanupDefaults(partitions=2, max_parallel_partitions=2, batch_size=100)


@asynccontextmanager
async def planner_worker(
    client: Client, pool: asyncpg.Pool, task_queue: str, settings: PlannerSettings = FAST
) -> AsyncIterator[Worker]:
    """A worker on the task queue that (like worker.py) ensures the planner when it starts."""
    w = build_worker(client, task_queue, await build_activities(pool))
    async with w:
        await ensure_planner(client, task_queue, settings, cleanups=FAST_CLEANUPS)
        yield w


async def db_clock_past(pool: asyncpg.Pool, instant: Any) -> bool:
    return bool(await pool.fetchval("SELECT clock_timestamp() > $1", instant))


async def all_settled(pool: asyncpg.Pool, accounts: list[str]) -> bool:
    """Every account is in a terminal state: cleaned, renewed for good, or active before its deadline."""
    pending = await pool.fetchval(
        "SELECT count(*) FROM accounts WHERE account_id = ANY($1::text[])"
        " AND (status = 'cleaning' OR (status = 'active' AND renewal_deadline <= clock_timestamp()))",
        accounts,
    )
    return pending == 0 and not await pool.fetchval(
        "SELECT count(*) FROM accounts WHERE account_id = ANY($1::text[]) AND status = 'active'", accounts
    )


@activity.defn(name="cleanup_partition")
async def stuck_cleanup_partition(input: CleanupPartitionInput) -> PartitionReport:
    """A partition that never finishes: its cleanup is terminated mid-run, after its claim."""
    while True:
        await asyncio.sleep(0.5)
        activity.heartbeat()


async def strand_a_claim(client: Client, pool: asyncpg.Pool, accounts: list[str], deadline: Any) -> str:
    """A cohort cleanup that claims its accounts, then is terminated mid-run: they stay in 'cleaning'."""
    queue = f"stuck-{uuid.uuid4().hex[:8]}"
    real = await build_activities(pool)
    activities = [a for a in real if getattr(a, "__name__", "") != "cleanup_partition"] + [stuck_cleanup_partition]
    async with build_worker(client, queue, activities):
        started = await start_cleanup(client, pool, queue, StartCleanup(deadline=deadline, partitions=1))

        async def claimed() -> bool:
            n = await pool.fetchval(
                "SELECT count(*) FROM accounts WHERE status = 'cleaning' AND claimed_by = $1", started.workflow_id
            )
            return bool(n == len(accounts))

        await wait_until(claimed, within=60)
        await client.get_workflow_handle(started.workflow_id).terminate(reason="test: terminated after its claim")
    return started.workflow_id


async def test_the_planner_alone_cleans_every_account_once_through_renewals_strands_and_an_outage(
    client, pool, task_queue
):
    # Deadlines spread over ~20 s, 6 cohorts of 8 accounts (each cohort at its own random instant).
    groups = [await seed(pool, deadline_in(8 + 3 * i), 8, prefix=f"g{i}{uuid.uuid4().hex[:6]}") for i in range(6)]
    deadlines = {
        i: await pool.fetchval("SELECT renewal_deadline FROM accounts WHERE account_id = $1", g[0])
        for i, g in enumerate(groups)
    }
    # A stranded claim: a cohort whose cleanup was terminated after claiming (before the planner runs).
    stranded_deadline = deadline_in(-30)
    stranded = await seed(pool, stranded_deadline, 6, prefix=f"st{uuid.uuid4().hex[:6]}")
    stranded_by = await strand_a_claim(client, pool, stranded, stranded_deadline)
    # A row edited by hand into the past: no bucket will ever cover it, only the sweep.
    [edited] = await seed(pool, deadline_in(3600), 1, prefix=f"ed{uuid.uuid4().hex[:6]}")
    await pool.execute(
        "UPDATE accounts SET renewal_deadline = clock_timestamp() - interval '40 seconds' WHERE account_id = $1",
        edited,
    )
    # Renewed for good before their deadline: never cleaned.
    renewed_for_good = groups[3][:2]
    for account in renewed_for_good:
        assert (await renew(client, pool, task_queue, account)).in_time
    # Renewed to a new deadline (inside the outage below): version 2 is cleaned, once, with its own reminder.
    moved = groups[0][0]
    moved_outcome = await renew(client, pool, task_queue, moved, deadlines[2] + timedelta(seconds=2))
    assert moved_outcome.in_time and moved_outcome.version_after == 2

    everyone = [a for g in groups for a in g] + stranded + [edited]
    async with planner_worker(client, pool, task_queue):
        # The first cohort is cleaned by the planner's bucket cleanup, nobody ran a command.
        await wait_until(lambda: db_clock_past(pool, deadlines[0] + timedelta(seconds=1)), within=60)

        async def first_cleaned() -> bool:
            n = await pool.fetchval(
                "SELECT count(*) FROM accounts WHERE account_id = ANY($1::text[]) AND status = 'cleaned'",
                groups[0][1:],
            )
            return bool(n == len(groups[0]) - 1)

        await wait_until(first_cleaned, within=60)
    # Worker outage longer than L (5 s): later cohorts' deadlines (and the moved account's) pass meanwhile.
    [late_account] = await seed(pool, deadline_in(3600), 1, prefix=f"la{uuid.uuid4().hex[:6]}")
    late_deadline = await pool.fetchval(
        "UPDATE accounts SET renewal_deadline = cleanup_clock() + interval '1 second' WHERE account_id = $1"
        " RETURNING renewal_deadline",
        late_account,
    )
    everyone.append(late_account)
    await wait_until(lambda: db_clock_past(pool, late_deadline + timedelta(seconds=6)), within=60)
    await wait_until(lambda: db_clock_past(pool, deadlines[4] + timedelta(seconds=1)), within=60)
    # A renewal after the deadline is too late even though no worker has claimed the account yet.
    assert await pool.fetchval("SELECT status FROM accounts WHERE account_id = $1", late_account) == "active"
    late = await renew(client, pool, task_queue, late_account)
    assert not late.in_time and late.status_seen == "active"

    async with planner_worker(client, pool, task_queue):
        await wait_until(lambda: db_clock_past(pool, deadlines[5] + timedelta(seconds=1)), within=60)
        await wait_until(lambda: all_settled(pool, everyone), within=120, interval=0.5)
        status = await planner_status(client, pool, task_queue)
        await client.get_workflow_handle(planner_workflow_id(task_queue)).terminate(reason="test over")

    # Exactly once, counted in the database: duplicates 0, lost 0.
    applied = await pool.fetch(
        "SELECT account_id, cleanup_version, count(*) AS n FROM cleanup_applied GROUP BY 1, 2 ORDER BY 1"
    )
    reminders = await pool.fetch(
        "SELECT account_id, event_key, count(*) AS n FROM outbox WHERE kind = 'renewal_reminder' GROUP BY 1, 2"
    )
    expected = set(everyone) - set(renewed_for_good)
    assert [r for r in applied if r["n"] != 1] == [], "duplicates"
    assert {r["account_id"] for r in applied} == expected, "lost (or extra) cleanups"
    assert len(applied) == len(expected), "one effect per account"
    assert {r["account_id"]: r["cleanup_version"] for r in applied}[moved] == 2
    assert {r["account_id"] for r in reminders} == expected and len(reminders) == len(expected)
    assert {r["event_key"] for r in reminders if r["account_id"] == moved} == {f"renewal-reminder:{moved}:v2"}
    statuses = dict(await pool.fetch("SELECT status, count(*) FROM accounts GROUP BY 1"))
    assert statuses == {"cleaned": len(expected), "renewed": len(renewed_for_good)}
    # No command started any cleanup but the stranded one: buckets and sweeps came from the planner.
    started_by_hand = await pool.fetchval(
        "SELECT count(DISTINCT cleanup_id) FROM cleanup_applied WHERE cleanup_id NOT LIKE 'cleanup-bucket-%'"
        " AND cleanup_id NOT LIKE 'cleanup-sweep-%'"
    )
    assert started_by_hand == 0
    # The safety net is visible: the stranded claims recovered, the edited row swept as overdue.
    assert status.stranded_claims_recovered == len(stranded), status
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM planner_sweeps WHERE kind = 'stranded' AND cleanup_id = $1", stranded_by
        )
        == 1
    )
    swept = await pool.fetchval("SELECT cleanup_id FROM cleanup_applied WHERE account_id = $1", edited)
    assert swept.startswith("cleanup-sweep-"), swept
    assert (status.overdue_swept or 0) >= 1 and status.overdue == 0
    assert status.lateness_seconds is not None and status.lateness_seconds.cleanups == len(expected)
    shown = _human_status(status.given())
    assert f"stranded claims recovered  {len(stranded)} in 1" in shown, shown
    late_row = await pool.fetchrow(
        "SELECT outcome, judged_at >= deadline_seen AS after_deadline FROM renewals WHERE account_id = $1", late_account
    )
    assert dict(late_row) == {"outcome": "too_late", "after_deadline": True}


@pytest.mark.whole_machine  # it bounds the lateness it measures
async def test_lateness_of_bucketed_cleanups_is_bounded(client, pool, task_queue):
    """Accounts whose bucket cleanup is planned ahead are cleaned within L of their deadline. Each
    bucket holds two deadlines, so each is a range's cleanup that wakes early."""
    groups = []
    for i in range(5):
        d = deadline_in(5 + 2.5 * i)
        for k, deadline in enumerate((d, other_instant_of_its_bucket(d))):
            groups.append(await seed(pool, deadline, 10, prefix=f"l{i}{k}{uuid.uuid4().hex[:6]}"))
    everyone = [a for g in groups for a in g]
    # A long sweep grace: whatever the load, these are cleaned by their buckets, not by the sweep.
    async with planner_worker(client, pool, task_queue, FAST.model_copy(update={"sweep_grace_seconds": 60.0})):
        await wait_until(lambda: all_settled(pool, everyone), within=120, interval=0.5)
        status = await planner_status(client, pool, task_queue)
        await client.get_workflow_handle(planner_workflow_id(task_queue)).terminate(reason="test over")
    lateness = status.lateness_seconds
    print("lateness:", lateness)
    assert lateness is not None and lateness.cleanups == len(everyone)
    # L: a bucket of 1 s plus claim + clean; generous for a loaded 2-core CI machine.
    assert lateness.p50 is not None and lateness.max is not None
    assert 0 <= lateness.p50 and lateness.max <= 15.0, lateness
    assert await pool.fetchval("SELECT count(*) FROM planner_sweeps WHERE kind = 'overdue'") == 0
    # Each bucket fits in one batch, so it is one partition; its run wakes before the bucket ends,
    # yet no account is claimed (nor cleaned) before its deadline by the database clock.
    early = await pool.fetchval(
        "SELECT count(*) FROM accounts WHERE account_id = ANY($1::text[])"
        " AND (claimed_at < renewal_deadline OR cleaned_at < renewal_deadline)",
        everyone,
    )
    assert early == 0
    buckets = [r[0] for r in await pool.fetch("SELECT DISTINCT cleanup_id FROM cleanup_applied")]
    assert buckets and all(b.startswith("cleanup-bucket-") for b in buckets), buckets
    for workflow_id in buckets:
        history = await client.get_workflow_handle(workflow_id).fetch_history()
        started = history.events[0].workflow_execution_started_event_attributes
        payload = json.loads(started.input.payloads[0].data)
        assert (payload["partitions"], payload["wake_early_seconds"]) == (1, FAST.wake_early_seconds), payload


async def test_renewal_rule_is_judged_by_the_database_clock_at_the_deadline(client, pool, task_queue):
    """In time iff the database judges the renewal before the deadline, a few ms either side.

    The rule is checked on what the database recorded (judged_at against the deadline it saw), so
    a slow machine moves renewals across the boundary without failing the test; the +2 s offsets
    make sure some renewals are judged before it however loaded the machine is."""
    accounts = await seed(pool, deadline_in(3600), 44)
    outcomes = []
    for i, account in enumerate(accounts):
        offset_ms = [-5, -2, 2, 5][i % 4] if i < 20 else [-1, 1][i % 2] if i < 40 else 2000
        async with pool.acquire() as conn:
            # The deadline is set relative to the database clock, then the renewal runs at once.
            await conn.execute(
                "UPDATE accounts SET renewal_deadline = clock_timestamp() + make_interval(secs => $2 / 1000.0)"
                " WHERE account_id = $1",
                account,
                offset_ms,
            )
            row = await conn.fetchrow(
                SQL.renew_account, *SQL.bind("renew_account", account_id=account, until=None, allow_earlier=False)
            )
        outcomes.append((offset_ms, row["outcome"]))
    judged = await pool.fetch(
        "SELECT r.outcome, r.judged_at < r.deadline_seen AS before, a.status"
        " FROM renewals r JOIN accounts a USING (account_id) WHERE a.account_id = ANY($1::text[])",
        accounts,
    )
    assert len(judged) == len(accounts)
    for r in judged:  # the rule, for every renewal: in time exactly when judged before the deadline
        assert (r["outcome"] == "in_time") == r["before"], dict(r)
        assert r["status"] == ("renewed" if r["before"] else "active")
    # After the deadline it is always too late (no worker has claimed these accounts).
    assert all(o == "too_late" for ms, o in outcomes if ms < 0)
    assert all(o == "in_time" for ms, o in outcomes if ms >= 2000), outcomes

    # The same rule through the CLI's operation, and the claim agrees with it.
    [early, late] = await seed(pool, deadline_in(3600), 2)
    await pool.execute(
        "UPDATE accounts SET renewal_deadline = clock_timestamp() + interval '10 seconds' WHERE account_id = $1", early
    )
    await pool.execute(
        "UPDATE accounts SET renewal_deadline = clock_timestamp() - interval '3 milliseconds' WHERE account_id = $1",
        late,
    )
    assert (await renew(client, pool, task_queue, early)).in_time
    assert not (await renew(client, pool, task_queue, late)).in_time
    lo = await pool.fetchval("SELECT clock_timestamp() - interval '10 seconds'")
    result = await claim_in_chunks(
        pool,
        ClaimChunkedInput(
            cleanup_id="rule-claim", deadline_from=lo, deadline_until=lo + timedelta(seconds=12), partitions=1
        ),
    )
    claimed = await pool.fetch("SELECT account_id FROM cleanup_claims WHERE cleanup_id = 'rule-claim'")
    assert late in {r[0] for r in claimed} and early not in {r[0] for r in claimed}
    assert await pool.fetchval("SELECT status FROM accounts WHERE account_id = $1", early) == "renewed"
    assert result.claimed == len(claimed)


async def test_the_claim_runs_as_bounded_chunks_and_a_redelivery_claims_nothing_new(pool):
    deadline = deadline_in(-5)
    accounts = await seed(pool, deadline, 2500)
    for account in accounts[:100]:  # renewed before the deadline: skipped and counted
        await pool.execute("UPDATE accounts SET status = 'renewed', cleanup_version = 2 WHERE account_id = $1", account)
    claim = ClaimChunkedInput(
        cleanup_id="chunked",
        deadline_from=deadline,
        deadline_until=deadline + timedelta(microseconds=1),
        partitions=4,
        chunk_size=1000,
    )
    chunks: list[int] = []
    first = await claim_in_chunks(pool, claim, chunks.append)
    again = await claim_in_chunks(pool, claim, chunks.append)

    progress = await pool.fetchrow("SELECT chunks, max_chunk_rows, done FROM cleanup_claim_progress")
    assert dict(progress) == {"chunks": 3, "max_chunk_rows": 1000, "done": True}, "3 statements of <= 1000 rows"
    assert chunks == [900, 1000, 500], chunks
    assert first == again, "a second delivery reports the same claim and claims nothing"
    assert first.claimed == 2400 and first.skipped_renewed == 100
    # dealt round-robin in runs of CLAIM_RUN_ACCOUNTS (64): 37 whole runs and one of 32
    assert first.claimed_per_partition == [640, 608, 576, 576]
    assert await pool.fetchval("SELECT count(*) FROM cleanup_claims") == 2400
    assert await pool.fetchval("SELECT count(*) FROM accounts WHERE status = 'cleaning'") == 2400


async def test_running_a_worker_is_enough_and_the_planner_is_steered_from_the_cli(
    client, pool, task_queue, worker_processes, settings
):
    accounts = await seed(pool, deadline_in(6), 30)
    worker_processes.start(
        CLEANUP_PLANNER="on",
        PLANNER_TICK_SECONDS="1",
        PLANNER_MAX_IDLE_SECONDS="1",
        PLANNER_LATENESS_OBJECTIVE="2",
        PLANNER_SWEEP_GRACE_SECONDS="3",
        CLEANUP_PARTITIONS="2",
    )
    await wait_until(lambda: all_settled(pool, accounts), within=120, interval=0.5)
    assert await pool.fetchval("SELECT count(*) FROM cleanup_applied") == 30

    def cli(*args: str) -> dict[str, Any]:
        out = subprocess.run(
            [sys.executable, str(PROJECT_ROOT / "starter.py"), "planner", *args, "--json"],
            env={
                **__import__("os").environ,
                "TEMPORAL_ADDRESS": settings.temporal_address,
                "DATABASE_URL": settings.database_url,
                "TEMPORAL_TASK_QUEUE": task_queue,
            },
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return dict(json.loads(out.stdout))

    status = cli("status")
    assert status["workflow_id"] == planner_workflow_id(task_queue) and status["temporal_status"] == "RUNNING"
    assert status["lateness_seconds"]["cleanups"] == 30 and status["overdue"] == 0
    assert {"next_deadlines", "due_next_hour", "stranded_claims_recovered"} <= set(status)
    cli("pause", "--reason", "maintenance")
    handle = client.get_workflow_handle_for(DeadlinePlannerWorkflow.run, planner_workflow_id(task_queue))

    async def phase(expected: str) -> bool:
        return bool((await handle.query(DeadlinePlannerWorkflow.status)).phase == expected)

    await wait_until(lambda: phase("paused"), within=60)
    cli("resume")
    await wait_until(lambda: phase("sleeping"), within=60)
    await handle.terminate(reason="test over")


async def test_planner_metrics_lateness_histogram_and_overdue_gauge() -> None:
    from core import metrics
    from devstack.embedded import free_port
    from tests.test_observability import samples, scrape, total

    port = free_port()
    runtime = metrics.runtime(f"127.0.0.1:{port}")
    metrics.install(runtime.metric_meter)
    try:
        metrics.record_lateness([0.3, 0.8, 1.5, 7.0])
        metrics.set_overdue(12)
        metrics.set_overdue(4)  # a gauge: the last sweep's value
        metrics.record_overdue_swept(4)
        metrics.record_stranded(6)
        text = await asyncio.to_thread(scrape, port)
    finally:
        metrics.install(None)
    assert total(text, "cleanup_lateness_seconds_count") == 4
    buckets = {labels["le"]: v for labels, v in samples(text, "cleanup_lateness_seconds_bucket")}
    assert buckets["1"] == 2 and buckets["2"] == 3 and buckets["10"] == 4, buckets
    assert total(text, "planner_overdue_accounts") == 4
    assert total(text, "planner_overdue_swept") == 4 and total(text, "planner_stranded_recovered") == 6


def test_bucket_and_sweep_ids_name_a_task_queue_other_than_the_default() -> None:
    """Planners of two deployments on one namespace (the demo's, a test's) never share a cleanup."""
    from datetime import UTC, datetime

    from cleanup.models import DEFAULT_TASK_QUEUE, bucket_cleanup_id, sweep_cleanup_id

    at = datetime(2026, 11, 1, 9, 0, 1, tzinfo=UTC)
    assert bucket_cleanup_id(at, 1000, DEFAULT_TASK_QUEUE) == "cleanup-bucket-20261101T090001Z-1000ms"
    assert sweep_cleanup_id(at, DEFAULT_TASK_QUEUE) == "cleanup-sweep-20261101T090001Z"
    assert bucket_cleanup_id(at, 1000, "demo-1a2b") == "cleanup-bucket-20261101T090001Z-1000ms-demo-1a2b"
    assert sweep_cleanup_id(at, "demo-1a2b") == "cleanup-sweep-20261101T090001Z-demo-1a2b"
    assert planner_workflow_id("demo-1a2b") == "deadline-planner-demo-1a2b"


async def test_a_retried_sweep_step_neither_starts_nor_records_a_second_sweep(client, pool, task_queue):
    """A worker killed after the sweep step started and recorded its cleanup, before replying: the
    retry (which does not know that cleanup's ID) finds it running and leaves it be, so the accounts
    are neither swept twice nor counted twice in `planner status`."""
    from cleanup.planner import sweep_overdue
    from cleanup.planner_models import SweepInput

    await seed(pool, deadline_in(-60), 5)
    # The planner's input names the sweep of an earlier iteration (long finished); no worker polls
    # the queue, so the sweep the step starts stays running.
    earlier = f"cleanup-sweep-earlier-{task_queue}"
    sweep = SweepInput(
        settings=FAST, cleanups=FAST_CLEANUPS, task_queue=task_queue, previous_sweep_id=earlier, as_of=datetime.now(UTC)
    )
    first = await sweep_overdue(pool, client, sweep)
    retried = await sweep_overdue(pool, client, sweep)  # the same input: the first reply was lost
    try:
        assert first.sweep_cleanup_id is not None and first.overdue == 5
        assert retried.sweep_cleanup_id is None and retried.overdue == 5
        recorded = await pool.fetch("SELECT cleanup_id, accounts FROM planner_sweeps WHERE kind = 'overdue'")
        assert [tuple(r) for r in recorded] == [(first.sweep_cleanup_id, 5)]
    finally:
        await client.get_workflow_handle(first.sweep_cleanup_id or "").terminate(reason="test over")


async def test_two_attempts_of_one_sweep_step_at_once_start_one_sweep_counted_once(client, pool, task_queue):
    """A zombie attempt and its retry run the same sweep step at once: one sweep cleanup (its ID
    comes from the iteration, not the attempt's clock), and `planner status` counts it once."""
    from cleanup.planner import sweep_overdue
    from cleanup.planner_models import SweepInput

    await seed(pool, deadline_in(-60), 4)
    as_of = await pool.fetchval("SELECT clock_timestamp()")
    step = SweepInput(
        settings=FAST, cleanups=FAST_CLEANUPS, task_queue=task_queue, as_of=as_of
    )  # no worker: the sweep stays running
    attempts = await asyncio.gather(sweep_overdue(pool, client, step), sweep_overdue(pool, client, step))
    started = {a.sweep_cleanup_id for a in attempts} - {None}
    try:
        assert len(started) == 1, attempts
        recorded = await pool.fetch("SELECT DISTINCT cleanup_id FROM planner_sweeps WHERE kind = 'overdue'")
        assert [r[0] for r in recorded] == list(started)
        status = await planner_status(client, pool, task_queue)
        assert status.overdue_swept == 4 and status.overdue_sweeps == 1, status
    finally:
        for workflow_id in started:
            await client.get_workflow_handle(workflow_id or "").terminate(reason="test over")


async def test_a_worker_ensures_each_bucket_once_not_every_tick(pool):
    """Ensuring a bucket again changes nothing, so a worker asks the server once per bucket; a
    process that has not seen it (another worker, a restart) asks once more. A bucket that fits in
    one batch is one partition. A bucket of one instant is a cleanup of that instant (it wakes at
    it); a bucket of several deadlines is the range's, which wakes early."""
    small = FAST_CLEANUPS.model_copy(update={"batch_size": 3})
    instant = deadline_in(20)
    await seed(pool, instant, 3)
    mixed = deadline_in(30)
    await seed(pool, mixed, 2)  # more than one batch, two deadlines in one bucket: the settings' partitions
    await seed(pool, other_instant_of_its_bucket(mixed), 2)
    starts: list[tuple[str, int, float, datetime | None]] = []

    class RecordingClient:
        async def start_workflow(self, workflow: str, input: Any, *, id: str, **_: Any) -> Any:
            starts.append((id, input.partitions, input.wake_early_seconds, input.deadline_until))
            return SimpleNamespace(result_run_id=f"run-{len(starts)}")

    tick = PlanTickInput(settings=FAST, cleanups=small, task_queue="q")
    ensured: dict[str, Any] = {}
    for _ in range(3):
        result = await plan_buckets(pool, RecordingClient(), tick, ensured)  # type: ignore[arg-type]
        assert result.buckets == 2
    assert [(i, p, w, u is None) for i, p, w, u in starts] == [
        (bucket_cleanup_id(instant, 0, "q"), 1, 0.0, True),
        (bucket_cleanup_id(mixed.replace(microsecond=0), 1000, "q"), small.partitions, FAST.wake_early_seconds, False),
    ]
    assert set(ensured) == {i for i, *_ in starts}
    await plan_buckets(pool, RecordingClient(), tick, {})  # type: ignore[arg-type]
    assert len(starts) == 4


def other_instant_of_its_bucket(deadline: datetime) -> datetime:
    """Another deadline in the same 1 s bucket."""
    return deadline.replace(microsecond=(deadline.microsecond + 500_000) % 1_000_000 or 1)


async def test_a_bucket_of_one_instant_cleans_while_it_claims_and_a_later_deadline_in_it_is_not_missed(
    client, pool, task_queue
):
    """A bucket that only ever holds one instant is cleaned by that instant's cleanup alone, whose
    partitions follow its claim. A bucket that gets another deadline after its instant's cleanup was
    ensured gets the range's cleanup too; the claim gives each account to one of them. Every account
    is cleaned once, never before its deadline, none by the sweep."""
    alone_at = deadline_in(12)
    alone = await seed(pool, alone_at, 150)
    shared_at = deadline_in(24)
    shared = await seed(pool, shared_at, 20)
    alone_id, shared_id = bucket_cleanup_id(alone_at, 0, task_queue), bucket_cleanup_id(shared_at, 0, task_queue)
    range_id = bucket_cleanup_id(shared_at.replace(microsecond=0), 1000, task_queue)
    async with planner_worker(client, pool, task_queue, FAST.model_copy(update={"sweep_grace_seconds": 60.0})):
        await wait_until(lambda: _started(client, shared_id), within=60)
        later_at = other_instant_of_its_bucket(shared_at)
        later = await seed(pool, later_at, 5)  # the bucket now holds two deadlines
        await wait_until(lambda: _started(client, range_id), within=60)
        await wait_until(lambda: all_settled(pool, alone + shared + later), within=120, interval=0.5)
        await client.get_workflow_handle(planner_workflow_id(task_queue)).terminate(reason="test over")
    by_cleanup = {
        r["cleanup_id"]: r["n"]
        for r in await pool.fetch(
            "SELECT cleanup_id, count(*) AS n FROM cleanup_applied WHERE account_id = ANY($1::text[]) GROUP BY 1",
            alone + shared + later,
        )
    }
    assert sum(by_cleanup.values()) == len(alone) + len(shared) + len(later), by_cleanup  # once each
    assert by_cleanup[alone_id] == len(alone), by_cleanup
    assert set(by_cleanup) - {alone_id} <= {shared_id, range_id, bucket_cleanup_id(later_at, 0, task_queue)}
    payload = json.loads(
        (await client.get_workflow_handle(alone_id).fetch_history())
        .events[0]
        .workflow_execution_started_event_attributes.input.payloads[0]
        .data
    )
    assert payload["deadline_until"] is None and payload["partitions"] == FAST_CLEANUPS.partitions, payload
    early = await pool.fetchval(
        "SELECT count(*) FROM accounts WHERE account_id = ANY($1::text[]) AND claimed_at < renewal_deadline",
        alone + shared + later,
    )
    assert early == 0


async def _started(client: Client, workflow_id: str) -> bool:
    return await describe_or_none(client, workflow_id) is not None


async def test_a_planner_step_that_fails_for_good_is_reported_and_the_loop_goes_on(client, pool, task_queue):
    """A non-retryable error in one plan step (a bad row, a bug) used to fail the planner's run,
    which then planned and swept nothing until a worker restarted. Now the step is reported (status,
    a log line) and the next tick plans again: every account is still cleaned, once."""
    real = await build_activities(pool)
    real_plan: Any = next(a for a in real if getattr(a, "__name__", "") == "plan_deadline_buckets")
    calls = 0

    @activity.defn(name="plan_deadline_buckets")
    async def plan_failing_once(input: PlanTickInput) -> PlanTickResult:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ApplicationError("a row the planner cannot read", type="BadRow", non_retryable=True)
        return PlanTickResult.model_validate(await real_plan(input))

    accounts = await seed(pool, deadline_in(4), 20)
    async with build_worker(client, task_queue, [a for a in real if a is not real_plan] + [plan_failing_once]):
        await ensure_planner(client, task_queue, FAST, cleanups=FAST_CLEANUPS)
        await wait_until(lambda: all_settled(pool, accounts), within=90, interval=0.5)
        handle = client.get_workflow_handle_for(DeadlinePlannerWorkflow.run, planner_workflow_id(task_queue))
        status = await handle.query(DeadlinePlannerWorkflow.status)
        assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
        assert status.totals.step_failures == 1 and calls >= 2
        assert status.last_step_error is not None and "a row the planner cannot read" in status.last_step_error
        assert status.totals.iterations >= 2
        await handle.terminate(reason="test over")
    assert (
        await pool.fetchval("SELECT count(*) FROM cleanup_applied WHERE account_id = ANY($1::text[])", accounts) == 20
    )


async def test_a_workers_watchdog_starts_a_closed_planner_again(client, pool, task_queue, worker_processes):
    """Terminated (by hand, or failed, or timed out), the planner is started again by the next look
    of any worker's watchdog, and accounts due after that are cleaned by it."""
    worker_processes.start(
        CLEANUP_PLANNER="on",
        PLANNER_WATCHDOG_SECONDS="1",
        PLANNER_TICK_SECONDS="1",
        PLANNER_MAX_IDLE_SECONDS="1",
        PLANNER_LATENESS_OBJECTIVE="2",
        PLANNER_SWEEP_GRACE_SECONDS="3",
        CLEANUP_PARTITIONS="2",
    )
    handle = client.get_workflow_handle(planner_workflow_id(task_queue))

    async def running() -> bool:
        desc = await describe_or_none(client, planner_workflow_id(task_queue))
        return desc is not None and desc.status == WorkflowExecutionStatus.RUNNING

    await wait_until(running, within=60)
    first_run = (await handle.describe()).run_id
    await handle.terminate(reason="test: an operator's mistake")

    async def another_run() -> bool:
        desc = await describe_or_none(client, planner_workflow_id(task_queue))
        return desc is not None and desc.status == WorkflowExecutionStatus.RUNNING and desc.run_id != first_run

    await wait_until(another_run, within=60)
    assert "was TERMINATED: started again" in worker_processes.logs()
    accounts = await seed(pool, deadline_in(4), 10)
    await wait_until(lambda: all_settled(pool, accounts), within=90, interval=0.5)
    assert (
        await pool.fetchval("SELECT count(*) FROM cleanup_applied WHERE account_id = ANY($1::text[])", accounts) == 10
    )


async def test_a_planner_stuck_on_a_failing_workflow_task_is_started_again(client, pool, task_queue):
    """RUNNING but stuck: its task fails over and over, so it plans nothing. The watchdog's second
    look at it terminates it and starts a new run, which a healthy worker then runs."""
    async with Worker(client, task_queue=task_queue, workflows=[BrokenPlanner]):
        await ensure_planner(client, task_queue, FAST, cleanups=FAST_CLEANUPS)

        async def failing() -> bool:
            desc = await describe_or_none(client, planner_workflow_id(task_queue))
            assert desc is not None
            task = desc.raw_description.pending_workflow_task
            return desc.raw_description.HasField("pending_workflow_task") and task.attempt >= STUCK_TASK_ATTEMPTS

        await wait_until(failing, within=120, interval=0.5)
        first_run = (await client.get_workflow_handle(planner_workflow_id(task_queue)).describe()).run_id
        assert await watch_planner(client, task_queue, 0) == ("stuck", 1)
        assert await watch_planner(client, task_queue, 1) == ("restarted", 0)
    handle = client.get_workflow_handle_for(DeadlinePlannerWorkflow.run, planner_workflow_id(task_queue))
    assert (await handle.describe()).run_id != first_run
    async with build_worker(client, task_queue, await build_activities(pool)):
        await wait_until(
            lambda: _iterated(handle),
            within=60,
        )
        assert await watch_planner(client, task_queue, 0) == ("running", 0)
        await handle.terminate(reason="test over")


async def applied(pool: asyncpg.Pool, accounts: list[str]) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM cleanup_applied WHERE account_id = ANY($1::text[])", accounts))


async def _iterated(handle: Any) -> bool:
    return bool((await handle.query(DeadlinePlannerWorkflow.status)).totals.iterations >= 1)


async def test_a_sweep_step_releases_a_big_stranded_claim_in_bounded_steps(client, pool, task_queue, monkeypatch):
    """A closed cohort of millions is released over several sweep steps, each bounded in time (at
    least one chunk each), so the planner's loop never waits long behind one step."""
    deadline = deadline_in(1)
    accounts = await seed(pool, deadline, 30)
    workflow_id = await strand_a_claim(client, pool, accounts, deadline)
    monkeypatch.setattr(planner_module, "RELEASE_CHUNK", 10)
    steps = [(await recover_stranded(pool, client, time_limit=0.0))[:2] for _ in range(4)]
    assert steps == [([workflow_id], 10), ([workflow_id], 10), ([workflow_id], 10), ([], 0)]
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM accounts WHERE account_id = ANY($1::text[]) AND status = 'active'", accounts
        )
        == 30
    )


async def cleaning_count(pool: asyncpg.Pool, accounts: list[str]) -> int:
    return int(
        await pool.fetchval(
            "SELECT count(*) FROM accounts WHERE account_id = ANY($1::text[]) AND status = 'cleaning'", accounts
        )
    )


async def test_claims_of_a_workflow_temporal_does_not_know_are_kept_and_reported(client, pool, task_queue):
    """ "Not found" is not "closed": a worker pointed at another namespace or cluster must not take
    every claim in flight for stranded. Only a workflow Temporal reports closed releases its claims."""
    deadline = deadline_in(1)
    accounts = await seed(pool, deadline, 5)
    ghost = f"cleanup-elsewhere-{uuid.uuid4().hex[:8]}"  # a claim made on another cluster
    await pool.execute(
        "UPDATE accounts SET status = 'cleaning', claimed_by = $1, claimed_at = now(), claimed_namespace = $2"
        " WHERE account_id = ANY($3::text[])",
        ghost,
        client.namespace,
        accounts,
    )
    recovery = await recover_stranded(pool, client)
    assert ghost in recovery.not_found and ghost not in recovery.released_workflows
    assert await cleaning_count(pool, accounts) == len(accounts)


async def test_claims_are_judged_only_in_the_namespace_that_claimed_them(client, pool, task_queue):
    deadline = deadline_in(1)
    accounts = await seed(pool, deadline, 4)
    workflow_id = await strand_a_claim(client, pool, accounts, deadline)
    recorded = await pool.fetch("SELECT DISTINCT claimed_namespace FROM accounts WHERE claimed_by = $1", workflow_id)
    assert [r["claimed_namespace"] for r in recorded] == [client.namespace], "the claim records its namespace"
    # The same workflow ID, claimed in another namespace: closed here says nothing about it there.
    await pool.execute("UPDATE accounts SET claimed_namespace = 'elsewhere' WHERE claimed_by = $1", workflow_id)
    recovery = await recover_stranded(pool, client)
    assert workflow_id not in recovery.released_workflows + recovery.not_found
    assert await cleaning_count(pool, accounts) == len(accounts)
    back = "UPDATE accounts SET claimed_namespace = $2 WHERE claimed_by = $1"
    await pool.execute(back, workflow_id, client.namespace)
    recovery = await recover_stranded(pool, client)
    assert recovery.released_workflows == [workflow_id] and recovery.released == len(accounts)
    assert await cleaning_count(pool, accounts) == 0
