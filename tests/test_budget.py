"""The load budget holds across worker processes, and an operator's change reaches running work.

Nothing here asserts a duration: concurrency is observed by the database itself (a trigger on the
batch statement counts the batch statements running at that moment), progress by counts.
"""

from __future__ import annotations

import asyncio
import sys
from datetime import date
from typing import Any

import asyncpg
from temporalio.api.enums.v1 import PendingActivityState

from cleanup.models import CleanupResult
from cleanup.operations import start_cleanup
from cleanup.planner import planner_status
from core import db
from core.budget import BudgetSettings, LoadBudget, budget_status, judge, set_budget
from core.config import PROJECT_ROOT
from ledger.operations import start_reconciliation
from tests.helpers import deadline_in, effect_counts, seed, wait_until
from tests.ledger_helpers import double_postings, id_prefix, seed_day
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
        deadline=deadline,
        partitions=8,
        max_parallel_partitions=8,
        batch_size=50,
        heartbeat_timeout_seconds=5,
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
    await set_budget(pool, max_in_flight=0)  # at 200 rows/s the 800 accounts take 4 s: mid-way here
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
    assert 1 <= status["peak_in_flight"] <= 2 and status["in_flight"] == 0
    assert status["rows_done"] >= 1600 and status["denied"] > 0, "the claim's 800 rows and the partitions' 800"
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
    await set_budget(pool, max_in_flight=0)
    started = await start_reconciliation(
        client, pool, task_queue, d, batch_size=100, heartbeat_timeout_seconds=2.0, id_prefix=id_prefix(task_queue)
    )
    await wait_until(lambda: _denied_at_least(pool, 10), within=60)
    assert await pool.fetchval("SELECT count(*) FROM ledger_corrections") == 0
    assert await pool.fetchval("SELECT count(*) FROM ledger_shard_reports") == 0

    await set_budget(pool, max_in_flight=1)
    handle = client.get_workflow_handle_for(LedgerReconciliationWorkflow.run, started.workflow_id)
    result = await asyncio.wait_for(handle.result(), timeout=120)
    assert result.settlement.balanced and result.settlement.corrected > 0
    assert await double_postings(pool) == 0
    status = await budget_status(pool)
    assert status["peak_in_flight"] == 1 and status["in_flight"] == 0
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
        await asyncpg.create_pool(db_url, min_size=1, max_size=6, server_settings=db.service_settings())
        for _ in range(2)
    ]
    try:
        settings = BudgetSettings(
            max_in_flight=3, rows_per_second=1e6, latency_ms=1e6, lease_seconds=1.0, quiet_seconds=0, min_scale=1.0
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
        assert peak <= 3 and status["peak_in_flight"] <= 3 and status["granted"] == 60
        assert status["rows_done"] == 600 and status["in_flight"] == 0

        # Three slots taken and never released or renewed (their holder died): a fourth acquire
        # waits until the leases expire, then runs.
        held = [await budgets[0].acquire("dead", 1) for _ in range(3)]
        assert sorted(g.slot for g in held if g.slot is not None) == [0, 1, 2]
        waits: list[dict[str, Any]] = []
        grant = await budgets[1].acquire("alive", 1, waits.append)
        assert grant.slot is not None and waits, "it waited for an expired lease, then got a slot"
    finally:
        for p in pools:
            await p.close()


async def test_a_budget_switched_off_costs_one_statement_per_recheck_not_two_per_batch(pool):
    """Switched off by the operator, the budget limits nothing: a worker that has read so runs its
    batches without the acquire and release statements (each one on the budget's one hot row,
    under its lock) until `off_recheck_seconds` have passed, then reads the row again."""
    await set_budget(pool, enabled=False)
    asked_once = LoadBudget(pool, BudgetSettings(off_recheck_seconds=3600))
    before = (await budget_status(pool, asked_once.settings))["granted"]
    grants = []
    for _ in range(20):
        async with asked_once.batch("test", 10) as grant:
            grants.append(grant)
    assert all(g.slot is None for g in grants), "off: no slot taken"
    assert (await budget_status(pool, asked_once.settings))["granted"] - before == 1, "one acquire, not 20"

    await set_budget(pool, enabled=True)
    asks_each_time = LoadBudget(pool, BudgetSettings(off_recheck_seconds=0, quiet_seconds=0))
    async with asks_each_time.batch("test", 10) as grant:
        assert grant.slot is not None, "switched on again: the next read of the row takes a slot"


def test_back_off_halves_on_stress_and_grows_back_when_healthy() -> None:
    common: dict[str, Any] = {
        "latency_threshold": 1000.0,
        "max_lock_waits": 4,
        "max_lag": 10.0,
        "min_scale": 0.1,
        "grow_step": 0.1,
    }
    slow = judge(scale=1.0, latency_ms=2500.0, lock_waits=0, replication_lag=None, **common)
    assert slow["scale"] == 0.5 and "batch latency" in slow["stress"]
    locked = judge(scale=0.15, latency_ms=None, lock_waits=9, replication_lag=None, **common)
    assert locked["scale"] == 0.1 and "lock waits" in locked["stress"]
    lagging = judge(scale=1.0, latency_ms=10.0, lock_waits=0, replication_lag=30.0, **common)
    assert lagging["scale"] == 0.5 and "replication lag" in lagging["stress"]
    healthy = judge(scale=0.5, latency_ms=200.0, lock_waits=1, replication_lag=0.5, **common)
    assert healthy == {"scale": 0.6, "stress": None}
    probed = judge(
        scale=1.0,
        latency_ms=None,
        lock_waits=0,
        replication_lag=None,
        probe_ms=9.0,
        **common,
        probe_baseline_ms=4.0,
        probe_ratio=1.5,
        probe_min_ms=1.0,
    )
    assert probed["scale"] == 0.5 and "commit probe" in probed["stress"]
    for probe_ms, baseline in ((5.9, 4.0), (1.2, 0.5), (9.0, None)):  # under 1.5 x; under +1 ms; no baseline
        calm = judge(
            scale=1.0,
            latency_ms=None,
            lock_waits=0,
            replication_lag=None,
            probe_ms=probe_ms,
            **common,
            probe_baseline_ms=baseline,
            probe_ratio=1.5,
            probe_min_ms=1.0,
        )
        assert calm["stress"] is None, (probe_ms, baseline)
    assert judge(scale=1.0, latency_ms=None, lock_waits=0, replication_lag=None, **common)["scale"] == 1.0


async def test_stress_shrinks_the_budget_and_budget_show_tells_why(client, pool, db_url, task_queue):
    await set_budget(pool, max_in_flight=8)  # for every reader, not only this process's settings
    budget = LoadBudget(pool, BudgetSettings(latency_ms=1.0, adjust_seconds=0.001))
    async with budget.batch("test", 100) as grant:
        await asyncio.sleep(0.01)  # > 1 ms per 1000 rows: stress by the latency threshold
        grant.rows_done = 100
    await asyncio.sleep(0.01)
    verdict = await budget.maybe_adjust()
    assert verdict is not None and verdict["scale"] == 0.5
    status = await budget_status(pool, budget.settings)
    assert status["effective_in_flight"] == 4 and "batch latency" in status["stress"]

    planner = await planner_status(client, pool, task_queue)
    assert planner["budget"]["effective_in_flight"] == 4 and planner["budget"]["stress"] == status["stress"]
    out = await starter(db_url, "budget", "show")
    assert "batch latency" in out and "scale" in out
    await starter(db_url, "budget", "set", "--reset-scale", "--rows-per-second", "250")
    status = await budget_status(pool)
    assert status["scale"] == 1.0 and status["rows_per_second"] == {"value": 250.0, "source": "set"}


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


async def test_a_slow_commit_probe_against_its_quiet_baseline_shrinks_the_budget(pool, db_url):
    """The players' view: with no baseline yet, the budget grants nothing for a moment so the
    probes measure one; probes that are slow while batches run then mean stress."""
    await pool.execute(SLOW_WHILE_BATCHES_RUN)
    await set_budget(pool, max_in_flight=4)
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

    # Another worker's batch is in flight all along: every probe of this one's batch is busy.
    await pool.execute(
        "INSERT INTO load_budget_slots VALUES (3, 'other', 'other', 'other host', 10, now(), now() + interval '1 hour')"
    )
    async with budget.batch("test", 10) as grant:
        await wait_until(lambda: probes("busy_n", 2), within=60)
        grant.rows_done = 10
    verdict = await budget.maybe_adjust()
    assert verdict is not None and verdict["stress"] is None, "no baseline: no verdict from the probe"
    row = await pool.fetchrow("SELECT quiet_until > clock_timestamp() AS quiet, probe_baseline_ms FROM load_budget")
    assert row["quiet"] and row["probe_baseline_ms"] is None, "a quiet moment is asked for"
    await pool.execute("DELETE FROM load_budget_slots WHERE lease = 'other'")

    waits: list[dict[str, Any]] = []
    async with budget.batch("test", 10, waits.append) as grant:  # waits out the quiet moment, probing
        assert any(w.get("measuring_baseline") for w in waits)
        baseline = await pool.fetchval("SELECT probe_baseline_ms FROM load_budget")
        assert baseline is not None and baseline < 500, "quiet probes (no slot held) made the baseline"
        await wait_until(lambda: probes("busy_n", 2), within=60)
        grant.rows_done = 10
    verdict = await budget.maybe_adjust()
    assert verdict is not None and "commit probe" in verdict["stress"] and verdict["scale"] == 0.5
    status = await budget_status(pool, settings)
    assert status["observed"]["commit_probe_ms"] >= 500 and status["commit_probe_baseline_ms"] < 500
    assert "commit probe" in status["stress"] and status["effective_in_flight"] == 2


async def test_a_batch_blocked_on_a_players_row_lock_does_not_hold_the_only_slot(client, pool, task_queue, worker):
    """One batch in flight (the default on two cores): a player's open transaction holds a row the
    first partition's batch must delete; that batch waits on the lock, and after
    `blocked_after_seconds` its slot no longer counts, so the other partition runs meanwhile."""
    await set_budget(pool, max_in_flight=1, rows_per_second=1e6, latency_ms=1e6)
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
                deadline=deadline,
                partitions=2,
                max_parallel_partitions=2,
                batch_size=50,
                claim_streams=1,  # one stream: partitions take runs of accounts round-robin in key order
            )

            async def other_partition_done() -> bool:
                return bool(
                    await pool.fetchval("SELECT count(*) FROM cleanup_partition_reports WHERE partition_no = 1")
                )

            await wait_until(other_partition_done, within=120)
            # runs of CLAIM_RUN_ACCOUNTS (64): partition 0 has accounts 0-63 and 128-191, partition 1 the rest
            assert await pool.fetchval("SELECT count(*) FROM cleanup_applied WHERE partition_no = 1") == 72
            assert await pool.fetchval("SELECT count(*) FROM cleanup_applied WHERE partition_no = 0") == 0
            assert await pool.fetchval("SELECT count(*) FROM load_budget_slots WHERE expires_at > now()") == 1
        finally:
            await tx.rollback()
    handle = client.get_workflow_handle_for(RenewalCleanupWorkflow.run, started.workflow_id)
    result: CleanupResult = await asyncio.wait_for(handle.result(), timeout=120)
    assert result.settlement is not None and result.settlement.cleaned == 200
    assert (await budget_status(pool))["peak_in_flight"] == 1, "never two batches running at once"
