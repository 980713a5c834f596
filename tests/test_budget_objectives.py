"""The load budget's objectives against real Postgres: who counts as a player (sessions at work, not
sessions that exist), the players' objective as an absolute bound on added commit latency, and the
deadline objective (every cohort within the lateness objective, up to its hard share)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import asyncpg

from budget import controller
from budget.controller import (
    SQL,
    BudgetChange,
    BudgetSettings,
    Demand,
    LoadBudget,
    Observed,
    StressLimits,
    budget_status,
    in_flight_for,
    set_budget,
    slot_ms_per_1000_rows,
    stress_reasons,
    throttle_in_force,
    with_deadline,
)
from core import db
from tests.helpers import wait_until
from tests.test_budget import LEARNED_BASELINE_OF_THIS_SERVER_RUN, SLOW_WHILE_BATCHES_RUN, a_session_at_work, starter

# Presence judged over an hour: every sample a test takes is in the window, however slow the machine.
WINDOW = 3600.0


async def sample(pool: asyncpg.Pool, n: int) -> None:
    """`n` presence samples, as a worker's probes take them (one look at the sessions each)."""
    async with pool.acquire() as conn:
        for _ in range(n):
            players = await conn.fetchval(
                SQL.sample_players, *SQL.bind("sample_players", service_name_prefix=db.APPLICATION_NAME)
            )
            probe = {
                "holder": "sampler",
                "previous_ms": None,
                "previous_quiet": None,
                "presence_window_seconds": WINDOW,
            }
            await conn.fetchval(SQL.probe, *SQL.bind("probe", **probe, players=players))


async def presence(pool: asyncpg.Pool) -> tuple[bool, float | None]:
    """The adjustment's verdict on the samples taken: (players present, busy share)."""
    budget = LoadBudget(pool, BudgetSettings(adjust_seconds=0.001, presence_window_seconds=WINDOW))
    assert await budget.maybe_adjust() is not None
    status = await budget_status(pool, budget.settings)
    assert status.observed.players_present is not None
    return status.observed.players_present, status.observed.busy_fraction


async def test_an_idle_pool_and_a_monitor_poll_are_not_players_and_a_busy_session_is(pool, db_url):
    """Ten idle connections of the game's pool are never at work, nor is a monitoring poll however
    long it runs (it reads: the players' objective protects commits); a game session writing in one
    sample of forty (2.5% of the window) is under the 5% that makes players; a game session writing
    in every sample is a player."""
    idle_pool = [await asyncpg.connect(db_url, server_settings={"application_name": "game pool"}) for _ in range(10)]
    monitor = await asyncpg.connect(db_url, server_settings={"application_name": "monitoring"})
    game = await asyncpg.connect(db_url, server_settings={"application_name": "game"})
    busy: asyncpg.Connection | None = None
    try:
        await sample(pool, 20)
        assert await presence(pool) == (False, 0.0), "an idle pool is no player"

        polling = asyncio.ensure_future(monitor.execute("SELECT pg_sleep(3600) FROM pg_stat_activity LIMIT 1"))
        await _until_state(pool, "monitoring", "active")
        await sample(pool, 20)
        assert await presence(pool) == (False, 0.0), "a monitoring poll reads: no player, even while it runs"
        await pool.execute("SELECT pg_cancel_backend($1)", monitor.get_server_pid())
        await asyncio.gather(polling, return_exceptions=True)

        writing = asyncio.ensure_future(game.execute("SELECT txid_current(), pg_sleep(3600)"))
        await _until_writing(pool, "game")
        await sample(pool, 1)  # the one sample that catches the game's write
        await pool.execute("SELECT pg_cancel_backend($1)", game.get_server_pid())
        await asyncio.gather(writing, return_exceptions=True)
        await _until_state(pool, "game", "idle")
        await sample(pool, 19)
        present, share = await presence(pool)
        assert not present and share is not None and 0 < share < 0.05, "a write now and then is no player"

        busy = await a_session_at_work(db_url, "game at work")
        await sample(pool, 40)
        present, share = await presence(pool)
        assert present and share is not None and share >= 0.05, "a session writing all along is a player"
    finally:
        for conn in [*idle_pool, monitor, game, *([busy] if busy else [])]:
            await pool.execute("SELECT pg_terminate_backend($1)", conn.get_server_pid())
            conn.terminate()


async def _until_writing(pool: asyncpg.Pool, application_name: str) -> None:
    """Until the session runs a statement holding a transaction ID: 'active' alone comes before
    the statement's txid_current() has assigned one (what a sample counts as writing)."""
    query = (
        "SELECT EXISTS (SELECT 1 FROM pg_stat_activity"
        " WHERE application_name = $1 AND state = 'active' AND backend_xid IS NOT NULL)"
    )
    await wait_until(lambda: pool.fetchval(query, application_name), interval=0.01)


async def _until_state(pool: asyncpg.Pool, application_name: str, state: str) -> None:
    query = "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE application_name = $1 AND state = $2)"
    await wait_until(lambda: pool.fetchval(query, application_name, state), interval=0.01)


def test_the_players_objective_is_an_absolute_bound_on_added_commit_latency() -> None:
    """A sub-millisecond commit may not double, but may take 5 ms more: the ratio alone made 1.2 ms
    the whole allowance on a fast database. The ratio stays available, as a second bound."""
    limits = StressLimits(latency_ms=1e6, max_lock_waits=4, max_lag=10)
    assert limits.probe_added_ms == BudgetSettings().probe_added_ms and BudgetSettings().probe_ratio is None

    def seen(probe_ms: float) -> Observed:
        return Observed(latency_ms=None, lock_waits=0, replication_lag=None, probe_ms=probe_ms, probe_baseline_ms=0.6)

    added = limits.probe_added_ms
    assert added is not None
    assert stress_reasons(seen(0.6 + added * 0.9), limits) == {}, "within the bound: no stress, at 5x the baseline"
    assert "+ 5 ms" in stress_reasons(seen(0.6 + added * 1.1), limits)["commit_probe"]
    ratio = StressLimits(latency_ms=1e6, max_lock_waits=4, max_lag=10, probe_ratio=2.0)
    assert "2 x baseline" in stress_reasons(seen(2.5), ratio)["commit_probe"], "the ratio, when set, binds first"
    assert limits.probe_bound_ms(0.6) == 0.6 + added and ratio.probe_bound_ms(0.6) == 1.6


async def test_the_added_latency_bound_holds_the_work_back_and_the_operator_sets_it(pool, db_url):
    """Against real probes: each commit slowed by 500 ms while a batch runs is past the default bound
    (the work is throttled, and `budget show` says by how much over the baseline); with the bound
    set to a second, the same probes are within it."""
    await pool.execute(SLOW_WHILE_BATCHES_RUN)
    player = await a_session_at_work(db_url, "game")
    try:
        for bound_ms, stressed in ((None, True), (1000.0, False)):
            await pool.execute(LEARNED_BASELINE_OF_THIS_SERVER_RUN)
            await set_budget(pool, BudgetChange(probe_added_ms=bound_ms, reset_scale=True))
            settings = BudgetSettings(
                latency_ms=1e6, adjust_seconds=0.001, probe_interval_seconds=0.05, quiet_seconds=0
            )
            budget = LoadBudget(pool, settings)
            async with budget.batch("test", 10) as grant:
                await _until(pool, "SELECT coalesce(sum(busy_n), 0) >= 2 FROM load_budget_probes")
                grant.rows_done = 10
            verdict = await budget.maybe_adjust()
            assert verdict is not None
            status = await budget_status(pool, settings)
            assert status.observed.players_present is True
            assert (verdict["stress"] is not None) is stressed, verdict
            if stressed:
                assert "ms > baseline" in verdict["stress"] and "+ 5 ms" in verdict["stress"]
            else:
                assert status.probe_added_ms.value == bound_ms and status.probe_added_ms.source == "set"
            await budget.close()
    finally:
        player.terminate()


async def _until(pool: asyncpg.Pool, query: str) -> None:
    await wait_until(lambda: pool.fetchval(query), interval=0.02)


def demand(rows_per_second: float, hard_share: int = 2) -> Demand:
    return Demand(
        cohorts=1,
        accounts_left=100_000,
        rows_per_second=rows_per_second,
        target=None,
        lateness_objective_seconds=60.0,
        hard_share=hard_share,
    )


def test_the_deadline_objective_is_granted_up_to_its_hard_share() -> None:
    """The players' objective throttles to 2,000 rows/s; the deadline asks for more: granted, with
    the batches that deliver it at the batches' latency, up to the hard share; past it, the share is
    all it gets and it says it is late. No hard share: the players' objective alone."""
    throttled = {"rate_limit": 2000.0, "in_flight_limit": 1, "stress": "x", "limited_by": "x", "binding": "players"}
    ms_per_1000 = 200.0  # one batch in flight does 5,000 rows/s
    met = with_deadline(throttled, demand(3000.0), ms_per_1000, 2000.0)
    assert (met["rate_limit"], met["in_flight_limit"], met["binding"]) == (3000.0, 1, "deadline")
    short = with_deadline(throttled, demand(50_000.0), ms_per_1000, 2000.0)
    # past its share, the share's slots bind, not a rate below what the deadline asks
    assert (short["rate_limit"], short["in_flight_limit"]) == (50_000.0, 2)
    assert short["binding"] == "deadline, at its hard share" and "late" in short["limited_by"]
    none = with_deadline(throttled, demand(50_000.0, hard_share=0), ms_per_1000, 2000.0)
    assert (none["rate_limit"], none["binding"]) == (2000.0, "players")
    enough = with_deadline(throttled, demand(1000.0), ms_per_1000, 2000.0)
    assert (enough["rate_limit"], enough["binding"]) == (2000.0, "players"), "the players' rate finishes in time"
    free = {"rate_limit": None, "in_flight_limit": None, "stress": None, "limited_by": None, "binding": "players"}
    assert with_deadline(free, demand(50_000.0), ms_per_1000, 30_000.0)["binding"] == "none", "full speed"


def test_a_slot_counts_the_claim_and_a_throttle_the_players_set_ends_when_they_leave() -> None:
    """A claim's chunks hold slots too, and a partition following its claim does fewer rows than it
    is charged: a slot delivers what the window's rows over its slot-seconds say, not what the
    batches' latency alone says, so the rate takes more batches. A deadline whose delivery is
    unknown (only the claim held slots) gets its hard share. A throttle the players' objective set
    is lifted once they are absent; one the database's own signals set grows back."""
    assert slot_ms_per_1000_rows(250.0, slot_seconds=3.0, rows=4000) == 750.0, "3 slot-seconds for 4,000 rows"
    assert slot_ms_per_1000_rows(250.0, slot_seconds=0.5, rows=4000) == 250.0, "never below the batches' latency"
    assert slot_ms_per_1000_rows(None, slot_seconds=3.0, rows=0) is None
    assert (in_flight_for(2000.0, 250.0), in_flight_for(2000.0, 750.0)) == (1, 2)
    throttled = {"rate_limit": 2000.0, "in_flight_limit": 1, "stress": None, "limited_by": "x", "binding": "players"}
    unknown = with_deadline(throttled, demand(3000.0), None, None)
    assert (unknown["rate_limit"], unknown["in_flight_limit"]) == (3000.0, 2)
    assert throttle_in_force(2000.0, "players", players_present=False) is None, "they left: it protects nobody"
    assert throttle_in_force(2000.0, "deadline", players_present=False) is None
    assert throttle_in_force(2000.0, "players", players_present=True) == 2000.0
    assert throttle_in_force(2000.0, "database", players_present=False) == 2000.0, "the database's own: grows back"

    def seen(samples: int, before: bool) -> tuple[float | None, bool]:
        probes = {"presence_samples": samples, "presence_busy": 0}
        return controller.players_presence(probes, {"observed_players_present": before}, 0.05)

    assert seen(3, before=True) == (0.0, True), "3 samples cannot say they left"
    assert seen(10, before=True) == (0.0, False)
    assert seen(3, before=False) == (0.0, False)


async def test_a_cohort_s_deadline_raises_the_rate_the_players_objective_leaves(pool, db_url):
    """A cohort of 100,000 accounts, 50 s past its deadline with a 60-s objective, needs all it has
    left within 10 s: players at work and the commit probe past its bound throttle the work to the
    floor, but the deadline objective raises the rate to what it needs (at most its hard share), and
    `budget show` says the deadline binds, the projected finish and whether it is on time. Its
    batches count its accounts done; a cohort done is forgotten."""
    await pool.execute(SLOW_WHILE_BATCHES_RUN)
    await pool.execute(LEARNED_BASELINE_OF_THIS_SERVER_RUN)
    player = await a_session_at_work(db_url, "game")
    settings = BudgetSettings(
        latency_ms=1e6, adjust_seconds=0.001, probe_interval_seconds=0.05, quiet_seconds=0, min_rows_per_second=100
    )
    budget = LoadBudget(pool, settings)
    try:
        deadline = await pool.fetchval("SELECT clock_timestamp()") - timedelta(seconds=50)
        await budget.register_cohort("cohort-1", deadline, 100_000)
        # Charged a batch's worth, 10 done: its latency per 1,000 rows is the time over 10,000 rows.
        async with budget.batch("cleanup", 10_000, cohort="cohort-1") as grant:
            await _until(pool, "SELECT coalesce(sum(busy_n), 0) >= 2 FROM load_budget_probes")
            grant.rows_done = 10
        verdict = await budget.maybe_adjust()
        assert verdict is not None and verdict["stress"] is not None, "the players' objective is past its bound"
        status = await budget_status(pool, settings)
        assert status.deadline.accounts_left == 100_000 - 10, "a batch's accounts count as done for its cohort"
        assert status.deadline.rows_per_second is not None and status.deadline.rows_per_second > 5000
        assert status.deadline.binding in ("deadline", "deadline, at its hard share")
        assert status.effective_rows_per_second is not None and status.effective_rows_per_second > 100
        assert status.deadline.projected_finish is not None and status.deadline.on_time is not None
        assert "deadline objective" in status.limited_by and "deadline:" in status.objective
        out = await starter(db_url, "budget", "show")
        assert "binding" in out and "projected_finish" in out and "deadline objective" in out

        await set_budget(pool, BudgetChange(deadline_max_in_flight=0, reset_scale=True))
        verdict = await budget.maybe_adjust()
        assert verdict is not None and verdict["binding"] == "players", "no hard share: the players' objective"

        await pool.execute("UPDATE load_budget_cohorts SET done = accounts")
        await budget.maybe_adjust()
        assert await pool.fetchval("SELECT count(*) FROM load_budget_cohorts") == 0, "a cohort done is forgotten"
    finally:
        await budget.close()
        player.terminate()
