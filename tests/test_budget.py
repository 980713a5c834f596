"""The load budget holds across worker processes, and an operator's change reaches running work.

Nothing here asserts a duration: concurrency is observed by the database itself (a trigger on the
batch statement counts the batch statements running at that moment), progress by counts.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from datetime import date
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from temporalio.api.enums.v1 import PendingActivityState

from activities.cleanup import CleanupActivities, PartitionRun, clean_partition_batches
from budget.controller import (
    SQL,
    BudgetChange,
    BudgetLimit,
    BudgetSettings,
    LoadBudget,
    Observed,
    StressLimits,
    budget_status,
    in_flight_for,
    judge,
    set_budget,
    stress_reasons,
)
from cleanup.batches import CompiledCleanup
from cleanup.inputs import StartCleanup
from cleanup.models import CleanupPartitionInput, CleanupResult, PartitionCheckpoint
from cleanup.operations import start_cleanup
from cleanup.planner import planner_status
from cleanup.targets import load_targets
from core import db
from core.config import PROJECT_ROOT, read
from ledger.operations import ReconcileRequest, start_reconciliation
from tests.helpers import claim_one_partition, deadline_in, effect_counts, seed, wait_until
from tests.ledger_helpers import double_postings, id_prefix, seed_day
from worker import build_worker
from workflows.ledger_reconciliation import LedgerReconciliationWorkflow
from workflows.renewal_cleanup import RenewalCleanupWorkflow

# Each batch statement, when it inserts its idempotency records, lingers 0.2 s and records that
# window (by the database's clock): windows that overlap are batches that ran at the same time.
OBSERVE_CONCURRENCY = """
CREATE TABLE observed_batches (started timestamptz NOT NULL, ended timestamptz NOT NULL);
CREATE FUNCTION observe_batches() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    t0 timestamptz := clock_timestamp();
BEGIN
    PERFORM pg_sleep(0.2);
    INSERT INTO observed_batches VALUES (t0, clock_timestamp());
    RETURN NULL;
END $$;
CREATE TRIGGER observe_batches AFTER INSERT ON cleanup_applied
    FOR EACH STATEMENT EXECUTE FUNCTION observe_batches();
"""
MAX_OVERLAP = """
SELECT max((SELECT count(*) FROM observed_batches o WHERE o.started <= w.started AND o.ended > w.started)),
       count(*)
FROM observed_batches w
"""


async def starter(db_url: str, *args: str) -> str:
    """Run `python starter.py ARGS` against the test's database (only the database is needed)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(PROJECT_ROOT / "starter.py"),
        "--database-url",
        db_url,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd=PROJECT_ROOT,
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0, out.decode()
    return out.decode()


async def started_activities(client, workflow_id: str) -> int:
    desc = await client.get_workflow_handle(workflow_id).describe()
    return sum(
        1
        for a in desc.raw_description.pending_activities
        if a.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
    )


async def test_the_budget_holds_across_two_worker_processes_and_set_reaches_running_partitions(
    client, pool, db_url, task_queue, worker_processes
):
    """Two worker processes: a paused budget holds the cohort's claim (it is budgeted too);
    `budget set --max-in-flight 2` lets it run; pausing again while the 8 partitions run stops
    them at their next batch; set again, they finish: never more than 2 batches at once, each
    account cleaned once."""
    await pool.execute(OBSERVE_CONCURRENCY)
    await starter(db_url, "budget", "set", "--max-in-flight", "0", "--rows-per-second", "200")
    deadline = deadline_in(3)
    await seed(pool, deadline, 800)
    for _ in range(2):  # each takes at most 4 partitions: all 8 started means both are in
        worker_processes.start(
            WORKER_MAX_CONCURRENT_ACTIVITIES="4", LOAD_BUDGET_LATENCY_MS="1000000", LOAD_BUDGET_MAX_CLAIM_ROWS="200"
        )
    started = await start_cleanup(
        client,
        pool,
        task_queue,
        StartCleanup(
            deadline=deadline, partitions=8, max_parallel_partitions=8, batch_size=50, heartbeat_timeout_seconds=5
        ),
    )

    async def claim_waiting() -> bool:
        # The partitions start with the claim and wait for its chunks without asking the budget.
        return await _denied_at_least(pool, 1) and await started_activities(client, started.workflow_id) >= 1

    await wait_until(claim_waiting, within=120)
    assert await pool.fetchval("SELECT count(*) FROM cleanup_claims") == 0, "a paused budget claims nothing"
    assert await pool.fetchval("SELECT count(*) FROM load_budget_slots") == 0

    out = await starter(db_url, "budget", "set", "--max-in-flight", "2", "--json")
    assert '"effective_in_flight": 2' in out

    async def partitions_running() -> bool:
        applied = await pool.fetchval("SELECT count(*) FROM cleanup_applied")
        return applied >= 100 and await started_activities(client, started.workflow_id) == 8

    await wait_until(partitions_running, within=120)
    await set_budget(pool, BudgetChange(max_in_flight=0))  # at 200 rows/s the 800 accounts take 4 s: mid-way here
    paused = await pool.fetchval("SELECT denied FROM load_budget")

    async def all_stopped() -> bool:
        return await pool.fetchval("SELECT count(*) FROM load_budget_slots") == 0 and await _denied_at_least(
            pool, paused + 8
        )

    await wait_until(all_stopped, within=60)
    applied = await pool.fetchval("SELECT count(*) FROM cleanup_applied")
    await wait_until(lambda: _denied_at_least(pool, paused + 24), within=60)
    assert await pool.fetchval("SELECT count(*) FROM cleanup_applied") == applied < 800, "paused mid-way"

    await starter(db_url, "budget", "set", "--max-in-flight", "2")
    handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
    result: CleanupResult = await asyncio.wait_for(handle.result(), timeout=180)

    assert result.settlement is not None and result.settlement.cleaned == 800
    counts = await effect_counts(pool)
    assert counts["applied"] == counts["reminders"] == counts["cleaned_accounts"] == 800
    assert counts["duplicate_reminders"] == counts["duplicate_archives"] == 0
    observed, batches = await pool.fetchrow(MAX_OVERLAP)
    assert batches >= 16 and 1 <= observed <= 2, (observed, batches)
    status = await budget_status(pool)
    assert 1 <= status.peak_in_flight <= 2 and status.in_flight == 0
    assert status.rows_done == 800 and status.denied > 0, "an account counts once: cleaned, not also claimed"
    claim = await pool.fetchrow(
        "SELECT count(*) AS streams, sum(chunks) AS chunks, max(max_chunk_rows) AS max_chunk_rows"
        " FROM cleanup_claim_progress"
    )
    # Two streams of about 400 accounts each, chunks of 200 (the last of each stream short or empty).
    assert claim["streams"] == 2 and claim["max_chunk_rows"] == 200, dict(claim)
    assert 4 <= claim["chunks"] <= 6, "the claim ran in the budget's chunk size"
    identities = {
        e.activity_task_started_event_attributes.identity
        for e in (await handle.fetch_history()).events
        if e.HasField("activity_task_started_event_attributes")
    }
    assert len(identities) >= 2, "partitions ran on both worker processes"


async def test_a_paused_budget_holds_a_reconciliation_until_it_is_set(client, pool, db_url, task_queue, worker):
    """A shard waits (heartbeating) on a paused budget instead of failing; a change reaches it."""
    d = date(2026, 10, 26)
    await seed_day(pool, d, payments=600, shards=2)
    await set_budget(pool, BudgetChange(max_in_flight=0))
    started = await start_reconciliation(
        client,
        pool,
        task_queue,
        ReconcileRequest(
            business_date=d, batch_size=100, heartbeat_timeout_seconds=2.0, id_prefix=id_prefix(task_queue)
        ),
    )
    await wait_until(lambda: _denied_at_least(pool, 10), within=60)
    assert await pool.fetchval("SELECT count(*) FROM ledger_corrections") == 0
    assert await pool.fetchval("SELECT count(*) FROM ledger_shard_reports") == 0

    await set_budget(pool, BudgetChange(max_in_flight=1))
    handle = client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, started.workflow_id)
    result = await asyncio.wait_for(handle.result(), timeout=120)
    assert result.settlement.balanced and result.settlement.corrected > 0
    assert await double_postings(pool) == 0
    status = await budget_status(pool)
    assert status.peak_in_flight == 1 and status.in_flight == 0
    attempts = [
        e.activity_task_started_event_attributes.attempt
        for e in (await handle.fetch_history()).events
        if e.HasField("activity_task_started_event_attributes")
    ]
    assert max(attempts) == 1, "waiting for the budget is not a failure (heartbeats kept it alive)"


async def _denied_at_least(pool: asyncpg.Pool, n: int) -> bool:
    return bool(await pool.fetchval("SELECT denied >= $1 FROM load_budget", n))


async def test_slots_hold_across_separate_pools_and_a_dead_holder_s_slot_expires(db_url):
    """Two pools (as two processes would have) with many batches each: never more than N at once;
    a holder that never releases (a killed worker) stops renewing and its slot comes back."""
    pools = [
        await db.create_pool(db_url, min_size=1, max_size=6)  # two worker processes of the service
        for _ in range(2)
    ]
    try:
        settings = BudgetSettings(
            max_in_flight=3, rows_per_second=1e6, latency_ms=1e6, lease_seconds=1.0, quiet_seconds=0
        )  # no back-off: this is about the slots
        budgets = [LoadBudget(p, settings) for p in pools]
        running = peak = 0

        async def batch(b: LoadBudget) -> None:
            nonlocal running, peak
            async with b.batch("test", 10) as grant:
                running += 1
                peak = max(peak, running)
                await asyncio.sleep(0.02)
                grant.rows_done = 10
                running -= 1

        await asyncio.gather(*(batch(budgets[i % 2]) for i in range(60)))
        status = await budget_status(pools[0], settings)
        assert peak <= 3 and status.peak_in_flight <= 3 and status.granted == 60
        assert status.rows_done == 600 and status.in_flight == 0

        # Three slots taken and never released or renewed (their holder died): a fourth acquire
        # waits until the leases expire, then runs.
        held = [await budgets[0].acquire("dead", 1) for _ in range(3)]
        assert sorted(g.slot for g in held if g.slot is not None) == [0, 1, 2]
        waits: list[dict[str, Any]] = []
        grant = await budgets[1].acquire("alive", 1, waits.append)
        assert grant.slot is not None and waits, "it waited for an expired lease, then got a slot"
    finally:
        for b in budgets:
            await b.close()
        for p in pools:
            await p.close()


# One slot, leased for an hour: only its session's end can free it within a test.
ONE_SLOT_FOR_AN_HOUR = BudgetSettings(
    max_in_flight=1, rows_per_second=1e6, latency_ms=1e6, lease_seconds=3600, quiet_seconds=0, adjust_seconds=0.001
)


async def test_a_slot_is_free_at_once_when_its_holder_s_session_ends(db_url):
    """The database session of the worker holding the only slot ends (the worker died, its
    connection broke): a batch waiting in another worker gets the slot, though its lease has an
    hour to run; the holder, asking again, ties its next slot to a new session."""
    pools = [await db.create_pool(db_url, min_size=1, max_size=4) for _ in range(2)]
    holder, other = (LoadBudget(p, ONE_SLOT_FOR_AN_HOUR) for p in pools)
    try:
        assert (await holder.acquire("holder", 1)).slot == 0
        pid, _ = await holder.session_identity()
        waits: list[dict[str, Any]] = []
        waiting = asyncio.ensure_future(other.acquire("other", 1, waits.append))

        async def denied_twice() -> bool:
            return len(waits) >= 2

        await wait_until(denied_twice, within=60)  # denied: the slot is held
        assert not waiting.done()
        assert await pools[1].fetchval("SELECT pg_terminate_backend($1, 60000)", pid)
        grant = await asyncio.wait_for(waiting, 60)
        assert grant.slot == 0
        status = await budget_status(pools[1], ONE_SLOT_FOR_AN_HOUR)
        assert [s.holder.split()[-1] for s in status.slots] == ["other"]

        release = SQL.bind(
            "release",
            slot=grant.slot,
            lease=grant.lease,
            rows_done=1,
            ms_per_1000_rows=None,
            cohort=None,
            held_seconds=0.0,
        )
        await other._bookkeeping(SQL.release, *release)
        again = await asyncio.wait_for(holder.acquire("holder", 1), 60)
        assert again.slot == 0 and (await holder.session_identity())[0] != pid, "a new session holds it"
    finally:
        for b in (holder, other):
            await b.close()
        for p in pools:
            await p.close()


@pytest.mark.server  # a Postgres of its own (harness.private_pg), crashed and restarted
async def test_a_restart_frees_every_slot_and_its_slow_first_probes_are_not_stress() -> None:
    """A real crash and restart of the database: the slot held before it is free at once, and the
    slow commit probes of the restarted server make a new baseline instead of shrinking the budget
    (against a baseline measured on the same run of the server, the same probes do shrink it)."""
    from harness.private_pg import PrivatePostgres

    pg = PrivatePostgres()
    await asyncio.to_thread(pg.init)
    await db.migrate_url(pg.admin_url)
    pools = [await db.create_pool(pg.admin_url, max_size=4)]
    budgets = [LoadBudget(pools[0], ONE_SLOT_FOR_AN_HOUR)]
    player: asyncpg.Connection | None = None
    try:
        assert (await budgets[0].acquire("before the crash", 1)).slot == 0
        await pools[0].execute(LEARNED_BASELINE_OF_THIS_SERVER_RUN)
        await asyncio.to_thread(pg.crash)
        await asyncio.to_thread(pg.restart)
        pools.append(await db.create_pool(pg.admin_url, max_size=4))
        budgets.append(LoadBudget(pools[1], ONE_SLOT_FOR_AN_HOUR))
        after = budgets[1]
        grant = await asyncio.wait_for(after.acquire("after the restart", 1), 60)
        assert grant.slot == 0, "the slot held before the crash is free"

        player = await a_session_at_work(pg.admin_url, "game")  # the players are on it
        await pools[1].execute(SLOW_BUSY_PROBES)
        await probe_once(pools[1])
        verdict = await after.maybe_adjust()
        assert verdict is not None and verdict["stress"] is None, "not stress: the baseline is learned again"
        assert await pools[1].fetchval("SELECT probe_baseline_ms FROM load_budget") is None, "learned again"

        await pools[1].execute(LEARNED_BASELINE_OF_THIS_SERVER_RUN)  # the same probes, no restart between
        await pools[1].execute(SLOW_BUSY_PROBES)
        await probe_once(pools[1])
        verdict = await after.maybe_adjust()
        assert verdict is not None and "commit probe" in verdict["stress"] and verdict["rate_limit"] is not None
    finally:
        if player is not None:
            player.terminate()
        for b in budgets:
            await b.close()
        for p in pools:
            p.terminate()
        await asyncio.to_thread(pg.close)


LEARNED_BASELINE_OF_THIS_SERVER_RUN = """
UPDATE load_budget SET probe_baseline_ms = 1, probe_baseline_at = clock_timestamp(),
       probe_baseline_server_start = pg_postmaster_start_time(), scale = 1
"""
# Five busy probes of 200 ms each: 200 times the baseline.
SLOW_BUSY_PROBES = """
INSERT INTO load_budget_probes (holder, probed_at, busy_ms_sum, busy_n) VALUES ('slow', clock_timestamp(), 1000, 5)
ON CONFLICT (holder) DO UPDATE SET busy_ms_sum = 1000, busy_n = 5
"""


async def probe_once(pool: asyncpg.Pool, holder: str = "one probe") -> None:
    """One commit probe as a worker's prober takes it, with its sample of whether players are present
    (it records nothing else: no previous probe is given)."""
    async with pool.acquire() as conn:
        players = await conn.fetchval(
            SQL.sample_players, *SQL.bind("sample_players", service_name_prefix=db.APPLICATION_NAME)
        )
        probe = SQL.bind(
            "probe", holder=holder, previous_ms=None, previous_quiet=None, players=players, presence_window_seconds=10.0
        )
        await conn.fetchval(SQL.probe, *probe)


async def a_session_at_work(url: str, application_name: str) -> asyncpg.Connection:
    """A session named `application_name` (a player's, unless it has this service's prefix) running a
    statement in a writing transaction (txid_current() assigns it an ID) until it is closed: every
    presence sample sees it at work."""
    # pg_sleep does not notice its client is gone: the statement timeout ends it after the test.
    settings = {"application_name": application_name, "statement_timeout": "120s"}
    conn = await asyncpg.connect(url, server_settings=settings)
    running = asyncio.ensure_future(conn.execute("SELECT txid_current(), pg_sleep(3600)"))
    running.add_done_callback(lambda f: f.cancelled() or f.exception())
    await wait_until(lambda: conn_is_active(url, application_name), within=60)
    return conn


async def conn_is_active(url: str, application_name: str) -> bool:
    probe = await asyncpg.connect(url)
    try:
        return bool(
            await probe.fetchval(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE application_name = $1 AND state = 'active')",
                application_name,
            )
        )
    finally:
        await probe.close()


@pytest_asyncio.fixture
async def other_session(db_url: str) -> AsyncIterator[Callable[[str], Awaitable[asyncpg.Connection]]]:
    """Opens `a_session_at_work` on the test's database; each is closed after the test."""
    opened: list[asyncpg.Connection] = []

    async def open_one(application_name: str) -> asyncpg.Connection:
        opened.append(await a_session_at_work(db_url, application_name))
        return opened[-1]

    yield open_one
    for conn in opened:
        conn.terminate()


async def test_a_budget_switched_off_costs_one_statement_per_recheck_not_two_per_batch(pool):
    """Switched off by the operator, the budget limits nothing: a worker that has read so runs its
    batches without the acquire and release statements (each one on the budget's one hot row,
    under its lock) until `off_recheck_seconds` have passed, then reads the row again."""
    await set_budget(pool, BudgetChange(enabled=False))
    asked_once = LoadBudget(pool, BudgetSettings(off_recheck_seconds=3600))
    before = (await budget_status(pool, asked_once.settings)).granted
    grants = []
    for _ in range(20):
        async with asked_once.batch("test", 10) as grant:
            grants.append(grant)
    assert all(g.slot is None for g in grants), "off: no slot taken"
    assert (await budget_status(pool, asked_once.settings)).granted - before == 1, "one acquire, not 20"

    await set_budget(pool, BudgetChange(enabled=True))
    asks_each_time = LoadBudget(pool, BudgetSettings(off_recheck_seconds=0, quiet_seconds=0))
    async with asks_each_time.batch("test", 10) as grant:
        assert grant.slot is not None, "switched on again: the next read of the row takes a slot"


def test_each_signal_shows_stress_against_its_threshold() -> None:
    limits = StressLimits(latency_ms=1000.0, max_lock_waits=4, max_lag=10.0)
    calm = Observed(latency_ms=None, lock_waits=0, replication_lag=None)
    assert stress_reasons(calm, limits) == {}
    assert list(stress_reasons(replace(calm, latency_ms=2500.0), limits)) == ["batch_latency"]
    assert list(stress_reasons(replace(calm, lock_waits=9), limits)) == ["lock_waits"]
    assert list(stress_reasons(replace(calm, replication_lag=30.0), limits)) == ["replication_lag"]
    probe = replace(limits, probe_ratio=1.5, probe_min_ms=1.0)
    slow = stress_reasons(replace(calm, probe_ms=9.0, probe_baseline_ms=4.0), probe)
    assert list(slow) == ["commit_probe"] and "1.5 x baseline 4.0 ms" in slow["commit_probe"]
    for probe_ms, baseline in ((5.9, 4.0), (1.2, 0.5), (9.0, None)):  # under 1.5 x; under +1 ms; no baseline
        assert stress_reasons(replace(calm, probe_ms=probe_ms, probe_baseline_ms=baseline), probe) == {}
    bounded = replace(limits, probe_max_ms=25.0)
    slow_alone = stress_reasons(replace(calm, probe_ms=30.0), bounded)
    assert list(slow_alone) == ["commit_probe_ms"], "the absolute objective needs no baseline"
    assert stress_reasons(replace(calm, probe_ms=20.0), bounded) == {}


def step(
    reasons: dict[str, str],
    rate: float | None,
    did: float | None,
    latency_ms: float | None,
    players: bool = True,
    near: str | None = None,
    peak: int = 8,
) -> Any:
    """One adjustment's verdict with 2,000 rows/s at least and growth 1.5x."""
    return judge(
        reasons,
        rate_limit=rate,
        observed_rows_per_second=did,
        observed_latency_ms=latency_ms,
        settings=BudgetSettings(min_rows_per_second=2000.0, grow_factor=1.5),
        players_present=players,
        near_objective=near,
        observed_peak_in_flight=peak,
    )


def test_the_budget_throttles_on_stress_and_grows_back_until_it_is_lifted() -> None:
    stress = {"lock_waits": "9 lock waits > 4"}
    # Unthrottled, the work did 10,000 rows/s at 600 ms per 1,000 rows: stress halves what it did,
    # with the batches at once that deliver that at that latency (5,000 x 0.6 s / 1,000 = 3).
    first = step(stress, None, 10_000.0, 600.0, players=False)
    assert (first["rate_limit"], first["in_flight_limit"]) == (5000.0, 3) and first["stress"] == "9 lock waits > 4"
    again = step(stress, 5000.0, 4900.0, 150.0, players=False)
    assert (again["rate_limit"], again["in_flight_limit"]) == (2450.0, 1), "short batches: one at a time"
    slow = step(stress, None, 100.0, 200_000.0, players=False, peak=3)
    assert slow["in_flight_limit"] == 1, "never more than half of what ran at once"
    floor = step(stress, 2450.0, 2400.0, None, players=False)
    assert (floor["rate_limit"], floor["in_flight_limit"]) == (2000.0, 1), "never below the deadlines' rate"
    # Healthy, nobody else on the database: a limit the work uses grows; one it does not use half of is lifted.
    grows = step({}, 2000.0, 1990.0, 700.0, players=False)
    assert (grows["rate_limit"], grows["in_flight_limit"], grows["stress"]) == (3000.0, 3, None)
    lifted = step({}, 3000.0, 900.0, 100.0, players=False)
    assert (lifted["rate_limit"], lifted["in_flight_limit"]) == (None, None)
    idle = step({}, None, None, None, players=False)
    assert (idle["rate_limit"], idle["in_flight_limit"]) == (None, None), "no stress, no limit"


def test_with_players_present_the_limit_follows_the_work_and_holds_near_the_objective() -> None:
    start = step({}, None, 0.0, 100.0, peak=0)
    assert (start["rate_limit"], start["in_flight_limit"]) == (2000.0, 1), "a start is slow, not at full speed"
    grows = step({}, 2000.0, 1990.0, 100.0)
    assert (grows["rate_limit"], grows["in_flight_limit"]) == (2985.0, 1), "1.5 x what the work did"
    unused = step({}, 12_000.0, 3000.0, 100.0)
    assert unused["rate_limit"] == 4500.0, "a limit the work does not use falls back toward what it does"
    ended = step({}, 12_000.0, 0.0, 100.0)
    assert ended["rate_limit"] == 2000.0, "the next work starts slowly again"
    unthrottled = step({}, None, 9000.0, 300.0)
    assert (unthrottled["rate_limit"], unthrottled["in_flight_limit"]) == (13_500.0, 5), "never unthrottled"
    near = "commit probe 1.6 ms past its set point 1.5 ms (stress above 2.0 ms)"
    held = step({}, 4000.0, 3900.0, 100.0, near=near)
    assert held["rate_limit"] == 4000.0 and near in held["limited_by"] and held["stress"] is None
    absent = step({}, 4000.0, 3900.0, 100.0, players=False, near=near)
    assert absent["rate_limit"] == 6000.0, "the set point is the players' objective's: absent, it grows"


def test_the_commit_probe_s_set_point_is_a_third_of_the_way_to_its_bound() -> None:
    limits = StressLimits(latency_ms=1000.0, max_lock_waits=4, max_lag=10.0, probe_ratio=2.0, probe_min_ms=1.0)
    seen = Observed(latency_ms=None, lock_waits=0, replication_lag=None, probe_baseline_ms=3.0)
    assert limits.near(replace(seen, probe_ms=3.9)) is None  # bound 6 ms, set point 4 ms
    assert "set point 4.0 ms" in str(limits.near(replace(seen, probe_ms=4.5)))
    small = replace(seen, probe_baseline_ms=0.6)  # bound 1.6 ms (baseline + 1 ms), set point 0.93 ms
    assert limits.near(replace(small, probe_ms=0.9)) is None and limits.near(replace(small, probe_ms=1.0))
    absolute = replace(limits, probe_max_ms=20.0)
    assert limits.near(replace(seen, probe_ms=9.0, probe_baseline_ms=None)) is None, "nothing to judge"
    assert absolute.near(replace(seen, probe_ms=16.0, probe_baseline_ms=None)), "3/4 of the absolute bound"


def test_the_in_flight_limit_delivers_the_rate_at_the_batches_latency() -> None:
    assert in_flight_for(4000.0, None) == 1, "no batch finished: one at a time"
    assert in_flight_for(4000.0, 100.0) == 1  # 0.4 batches' worth of work at once
    assert in_flight_for(4000.0, 500.0) == 2
    assert in_flight_for(20_000.0, 400.0) == 8


async def test_stress_throttles_the_budget_and_budget_show_tells_why(client, pool, db_url, task_queue):
    budget = LoadBudget(pool, BudgetSettings(latency_ms=1.0, adjust_seconds=0.001, quiet_seconds=0))
    status = await budget_status(pool, budget.settings)
    assert status.doing.startswith("full speed") and status.limited_by.startswith("nothing")
    async with budget.batch("test", 100) as grant:
        await asyncio.sleep(0.01)  # > 1 ms per 1000 rows: stress by the latency threshold
        grant.rows_done = 100
    await asyncio.sleep(0.01)
    verdict = await budget.maybe_adjust()
    assert verdict is not None and verdict["rate_limit"] == budget.settings.min_rows_per_second
    status = await budget_status(pool, budget.settings)
    assert status.throttled and status.effective_in_flight == 1 and "batch latency" in str(status.stress)
    assert status.doing.startswith("throttled") and "batch latency" in status.limited_by
    assert status.doing.endswith("(idle: the next work starts under this limit)"), "no batch in flight now"
    # Nobody else uses this database: the batches' own latency still holds the work back.
    assert status.observed.players_present is False and "players absent" in status.limited_by
    assert status.effective_rows_per_second == budget.settings.min_rows_per_second

    planner = await planner_status(client, pool, task_queue)
    assert planner.budget is not None
    assert planner.budget.effective_in_flight == 1 and planner.budget.stress == status.stress
    out = await starter(db_url, "budget", "show")
    assert "batch latency" in out and "throttled" in out and "objective" in out
    await starter(db_url, "budget", "set", "--reset-scale", "--rows-per-second", "250")
    status = await budget_status(pool)
    assert not status.throttled and status.rows_per_second == BudgetLimit(value=250.0, source="set")
    assert status.doing.startswith("capped") and "rows_per_second 250" in status.limited_by


async def test_budget_set_rejects_what_is_not_a_finite_number(pool, db_url):
    for value in ("nan", "inf", "-inf"):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(PROJECT_ROOT / "starter.py"),
            "--database-url",
            db_url,
            "budget",
            "set",
            f"--probe-ratio={value}",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await proc.communicate()
        assert proc.returncode == 2 and b"finite" in out and b"Traceback" not in out, out
    for column in ("rows_per_second", "probe_ratio", "probe_max_ms", "latency_ms"):
        for value in ("NaN", "Infinity"):
            with pytest.raises(asyncpg.CheckViolationError):
                await pool.execute(f"UPDATE load_budget SET {column} = $1::text::float8", value)


# While a batch holds a slot, every commit probe is slowed down by half a second: the database as
# the players would see it while the cleanup hurts them.
SLOW_WHILE_BATCHES_RUN = """
CREATE FUNCTION slow_probe() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM load_budget_slots WHERE expires_at > clock_timestamp()) THEN
        PERFORM pg_sleep(0.5);
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER slow_probe BEFORE UPDATE ON load_budget_probes FOR EACH ROW EXECUTE FUNCTION slow_probe();
"""


async def test_a_slow_commit_probe_against_its_quiet_baseline_shrinks_the_budget(pool, other_session):
    """The players' view: with no baseline yet, the budget grants nothing for a moment so the
    probes measure one; probes that are slow while batches run then mean stress (players present).
    With nobody else on the database, no such moment: it would stall the work for nothing."""
    await pool.execute(SLOW_WHILE_BATCHES_RUN)
    await set_budget(pool, BudgetChange(max_in_flight=4))
    settings = BudgetSettings(
        rows_per_second=1e6,
        latency_ms=1e6,
        adjust_seconds=0.001,
        probe_interval_seconds=0.05,
        baseline_seconds=3600,
        quiet_seconds=1.0,
    )
    budget = LoadBudget(pool, settings)

    async def probes(column: str, n: int) -> bool:
        return bool(await pool.fetchval(f"SELECT coalesce(sum({column}), 0) >= $1 FROM load_budget_probes", n))

    async def quiet_moment_asked() -> bool:
        return bool(await pool.fetchval("SELECT coalesce(quiet_until > clock_timestamp(), false) FROM load_budget"))

    # Another worker's probes, all taken while a batch held a slot, and no baseline yet.
    for busy_samples in (0, 10):  # of 10 presence samples: none at work, then all of them
        await pool.execute(
            "INSERT INTO load_budget_probes"
            " (holder, probed_at, busy_ms_sum, busy_n, presence_n, presence_busy, presence_since)"
            " VALUES ('other', clock_timestamp(), 1000, 2, 10, $1, clock_timestamp())"
            " ON CONFLICT (holder) DO UPDATE SET busy_ms_sum = 1000, busy_n = 2, presence_n = 10,"
            " presence_busy = excluded.presence_busy, presence_since = excluded.presence_since",
            busy_samples,
        )
        verdict = await budget.maybe_adjust()
        assert verdict is not None and verdict["stress"] is None, "no baseline: no verdict from the probe"
        assert await quiet_moment_asked() is (busy_samples > 0), "a quiet moment only for players"
    assert await pool.fetchval("SELECT probe_baseline_ms FROM load_budget") is None
    await other_session("game")  # the players are on the database from now on

    waits: list[dict[str, Any]] = []
    async with budget.batch("test", 10, waits.append) as grant:  # waits out the quiet moment, probing
        assert any(w.get("measuring_baseline") for w in waits)
        baseline = await pool.fetchval("SELECT probe_baseline_ms FROM load_budget")
        assert baseline is not None and baseline < 500, "quiet probes (no slot held) made the baseline"
        await wait_until(lambda: probes("busy_n", 2), within=60)
        grant.rows_done = 10
    verdict = await budget.maybe_adjust()
    assert verdict is not None and "commit probe" in verdict["stress"] and verdict["rate_limit"] is not None
    status = await budget_status(pool, settings)
    probe, baseline = status.observed.commit_probe_ms, status.commit_probe_baseline_ms
    # the window's mean of every probe, between the batches too: most of them slowed by 500 ms
    assert probe is not None and baseline is not None and probe > 250 > baseline, "most of them slowed by 500 ms"
    assert "commit probe" in str(status.stress) and status.throttled and "commit probe" in status.limited_by
    assert status.effective_in_flight == 1, "half of the one batch it ran at a time, and at least one"
    assert status.observed.players_present is True and "players absent" not in status.limited_by


@pytest.mark.parametrize(
    ("application_name", "players"),
    [(None, False), (f"{db.APPLICATION_NAME} another worker", False), ("game", True)],
    ids=["nobody-else", "only-this-service", "a-player"],
)
async def test_the_commit_probe_holds_the_work_back_only_while_players_are_present(
    pool, other_session, application_name, players
):
    """The work's own load slows the commit probe far past its objective (every probe is slowed
    while a slot is held). With nobody but this service on the database, however busy its own
    sessions are, that protects nobody: the budget does not throttle and `budget show` says the
    players are absent. With a player's session at work, the same probes throttle it."""
    await pool.execute(SLOW_WHILE_BATCHES_RUN)
    await pool.execute(LEARNED_BASELINE_OF_THIS_SERVER_RUN)
    settings = BudgetSettings(latency_ms=1e6, adjust_seconds=0.001, probe_interval_seconds=0.05, quiet_seconds=0)
    budget = LoadBudget(pool, settings)
    if application_name is not None:
        await other_session(application_name)

    async with budget.batch("test", 10) as grant:
        await wait_until(
            lambda: pool.fetchval("SELECT coalesce(sum(busy_n), 0) >= 2 FROM load_budget_probes"), within=60
        )
        grant.rows_done = 10
    verdict = await budget.maybe_adjust()
    assert verdict is not None
    status = await budget_status(pool, settings)
    probe, baseline = status.observed.commit_probe_ms, status.commit_probe_baseline_ms
    assert probe is not None and baseline is not None and probe > 10 * baseline, "far past the objective"
    assert status.observed.players_present is players
    if players:
        assert "commit probe" in verdict["stress"] and verdict["rate_limit"] is not None
        assert status.throttled and "commit probe" in status.limited_by
    else:
        assert verdict["stress"] is None and verdict["rate_limit"] is None and verdict["in_flight_limit"] is None
        assert not status.throttled and status.doing.startswith("full speed")
        assert status.limited_by.startswith("nothing") and "players absent" in status.limited_by


async def test_a_session_whose_state_the_worker_role_cannot_see_counts_as_a_player(pool, db_url):
    """PostgreSQL hides the state of another role's sessions: an idle game session counts as a
    player for a worker role without pg_read_all_stats (the objective applies, as it always did),
    and no longer once the role is granted it and sees that the session is idle."""
    game = await asyncpg.connect(db_url, server_settings={"application_name": "game"})  # idle, another role
    role = f"budget_worker_{uuid.uuid4().hex[:8]}"
    await pool.execute(f"CREATE ROLE {role} LOGIN IN ROLE {db.WORKER_ROLE}")
    try:
        for granted in (False, True):
            if granted:
                await pool.execute(f"GRANT pg_read_all_stats TO {role}")
            worker = await asyncpg.connect(
                db_url,
                user=role,
                server_settings={"application_name": db.APPLICATION_NAME, **db.service_settings()},
            )
            try:
                seen = await worker.fetchval(
                    SQL.sample_players, *SQL.bind("sample_players", service_name_prefix=db.APPLICATION_NAME)
                )
            finally:
                await worker.close()
            assert seen is not granted, "hidden: a player; visible: an idle session, not one"
    finally:
        await game.close()
        await pool.execute(f"DROP OWNED BY {role}; DROP ROLE {role}")


def test_without_players_the_commit_probe_does_not_hold_the_work_back() -> None:
    probe = {
        "commit_probe": "commit probe 5.8 ms > 2 x baseline 2.5 ms",
        "commit_probe_ms": "commit probe 5.8 ms > 5 ms",
    }
    present = step(probe, None, 14_000.0, 300.0, players=True)
    assert (present["rate_limit"], present["in_flight_limit"]) == (7000.0, 3) and "5.8 ms" in present["stress"]
    absent = step(probe, None, 14_000.0, 300.0, players=False)
    assert (absent["rate_limit"], absent["in_flight_limit"], absent["stress"]) == (None, None, None)
    grows = step(probe, 2000.0, 1990.0, 100.0, players=False)
    assert (grows["rate_limit"], grows["in_flight_limit"], grows["stress"]) == (3000.0, 1, None), "as when healthy"
    locks = step({**probe, "lock_waits": "9 lock waits > 4"}, None, 10_000.0, 300.0, players=False)
    assert (locks["rate_limit"], locks["in_flight_limit"]) == (5000.0, 2), "the database's own signals still count"
    assert locks["stress"] == "9 lock waits > 4"


async def test_a_batch_blocked_on_a_players_row_lock_does_not_hold_the_only_slot(client, pool, task_queue):
    """One batch in flight (the default on two cores): a player's open transaction holds a row the
    first partition's batch must delete; that batch waits on the lock, and after
    `blocked_after_seconds` its slot no longer counts, so the other partition runs meanwhile."""
    # An hour's lease: a renewal late on a loaded machine must not make the blocked batch's slot look
    # dead (the next acquire takes a lapsed slot over); here only its session's end may free it.
    cleanup = await CleanupActivities.create(pool, load_targets())
    cleanup.budget = LoadBudget(pool, read(BudgetSettings).model_copy(update={"lease_seconds": 3600.0}))
    activities = [cleanup.claim_cleanup_in_chunks, cleanup.cleanup_partition, cleanup.settle_cleanup]
    async with build_worker(client, task_queue, activities):
        await set_budget(pool, BudgetChange(max_in_flight=1, rows_per_second=1e6, latency_ms=1e6))
        deadline = deadline_in(2)
        accounts = await seed(pool, deadline, 200)
        async with pool.acquire() as player:
            tx = player.transaction()
            await tx.start()
            try:
                # the first account in key order goes to partition 0
                await player.execute(
                    "SELECT 1 FROM demo_game.inventory_items WHERE account_id = $1 FOR UPDATE", accounts[0]
                )
                started = await start_cleanup(
                    client,
                    pool,
                    task_queue,
                    StartCleanup(
                        deadline=deadline, partitions=2, max_parallel_partitions=2, batch_size=50, claim_streams=1
                    ),
                )

                async def other_partition_done() -> bool:
                    return bool(
                        await pool.fetchval("SELECT count(*) FROM cleanup_partition_reports WHERE partition_no = 1")
                    )

                await wait_until(other_partition_done, within=120)
                # runs of CLAIM_RUN_ACCOUNTS (64): partition 0 has accounts 0-63 and 128-191, partition 1 the rest
                assert await pool.fetchval("SELECT count(*) FROM cleanup_applied WHERE partition_no = 1") == 72
                assert await pool.fetchval("SELECT count(*) FROM cleanup_applied WHERE partition_no = 0") == 0
                # The blocked batch still holds its slot, tied to its live session.
                held = await pool.fetchval(
                    "SELECT count(*) FROM load_budget_slots s JOIN pg_stat_activity a"
                    " ON a.pid = s.backend_pid AND a.backend_start = s.backend_start"
                )
                assert held == 1
            finally:
                await tx.rollback()
        handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
        result: CleanupResult = await asyncio.wait_for(handle.result(), timeout=120)
        assert result.settlement is not None and result.settlement.cleaned == 200
        assert (await budget_status(pool)).peak_in_flight == 1, "never two batches running at once"


@pytest.mark.parametrize(("rows_per_second", "batches"), [(None, 2), (1e6, 4)])
async def test_under_a_rate_limit_a_partition_cleans_in_batches_of_the_throttled_size(pool, rows_per_second, batches):
    """While a rate limit applies (here the operator's cap), each batch takes at most
    `throttled_batch_rows` accounts (short statements and small commits, as paced work makes them);
    a batch that short is not the partition's last: every account is cleaned, once. Unthrottled,
    the partition's own batch size."""
    deadline = deadline_in(-60)
    cleanup_id = f"throttled-{uuid.uuid4().hex[:8]}"
    await seed(pool, deadline, 10)
    await claim_one_partition(pool, cleanup_id, deadline)
    settings = BudgetSettings(rows_per_second=rows_per_second, throttled_batch_rows=3, quiet_seconds=0)
    budget = LoadBudget(pool, settings)
    try:
        compiled = await CompiledCleanup.compile(pool, load_targets())
        partition = CleanupPartitionInput(cleanup_id=cleanup_id, partition_no=0, batch_size=5)
        run = PartitionRun(pool, compiled, partition, budget=budget)
        done = await clean_partition_batches(run, PartitionCheckpoint())
    finally:
        await budget.close()
    assert (done.counts.cleaned, done.batches) == (10, batches)
    counts = await effect_counts(pool)
    assert counts["applied"] == counts["reminders"] == counts["cleaned_accounts"] == 10


async def test_a_worker_with_no_work_learns_the_baseline_from_its_idle_probes(pool, other_session):
    """The baseline the work starts from is the players alone: a worker with no budgeted work
    probes every `idle_probe_seconds`, and its quiet probes set the baseline (a stale one of an
    earlier server run is replaced) and say whether players are present."""
    await pool.execute("UPDATE load_budget SET probe_baseline_ms = 500, probe_baseline_server_start = NULL")
    await other_session("game")
    budget = LoadBudget(pool, BudgetSettings(idle_probe_seconds=0.05))
    watching = asyncio.ensure_future(budget.watch())
    try:
        await wait_until(lambda: pool.fetchval("SELECT probe_baseline_ms < 100 FROM load_budget"), within=60)
        players_seen = await pool.fetchval("SELECT coalesce(sum(presence_busy), 0) FROM load_budget_probes")
        assert players_seen >= 1, "an idle probe samples the players too"
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
    row = await pool.fetchrow(
        "SELECT probe_baseline_at > clock_timestamp() - interval '1 minute' AS fresh,"
        " probe_baseline_server_start = pg_postmaster_start_time() AS this_run FROM load_budget"
    )
    assert row["fresh"] and row["this_run"], "the baseline is of this server run, and fresh"

    # With a slot held anywhere, a probe is not quiet: the baseline does not move.
    await pool.execute("UPDATE load_budget SET probe_baseline_ms = 0.001")
    await pool.execute(
        "INSERT INTO load_budget_slots VALUES (3, 'other', 'other', 'other host', 10, now(), now() + interval '1 hour')"
    )
    await budget._idle_probe()
    assert await pool.fetchval("SELECT probe_baseline_ms FROM load_budget") == 0.001
