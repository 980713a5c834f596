"""The load budget: how much cleanup and reconciliation work may run on the players' database at once.

One budget for every job together, across all worker processes and nodes, kept in Postgres
(migration 012, statements in budget/budget.sql):

- **in flight**: a batch holds a row of `load_budget_slots` while it runs; at most the effective
  in-flight limit of such rows exist. Acquires are serialised by a transaction-scoped advisory
  lock, so two workers can never both take the last slot. A slot belongs to the database session
  its worker process keeps open while it has budgeted work: it is free at once when that session
  ends (the worker died, the server restarted); a holder whose session lives on but who stopped
  renewing its lease (a frozen process) loses it after `lease_seconds`.
- **rows per second**: a token bucket of rows on the same row (refilled by the database clock,
  charged the batch size up front, the unused part refunded at release), when a rate limit applies.
- **adaptive in both directions**: at most once per `adjust_seconds`, one worker samples the
  database's stress (the commit probe against its quiet baseline, and against `probe_max_ms` when
  set: the players' objective; the mean latency of the batches per 1,000 rows; lock waits in this
  database; replication lag when a standby streams from the server). With no stress and no cap the
  work runs unthrottled; stressed, it is throttled to half of what it did (or of its limit, never
  below `min_rows_per_second`); healthy again, the limit grows by `grow_factor` per adjustment and
  is lifted once the work no longer uses half of it. The operator's caps (`max_in_flight`,
  `rows_per_second`) are optional and apply on top. A server restart forgets the probe's baseline.
- **the commit probe**: while a process has budgeted work waiting or in flight, it times a one-row
  write that commits, as a player's commit would, every `probe_interval_seconds`; probes taken
  while no slot is held anywhere make the baseline (and when there were none for
  `baseline_seconds`, nothing is granted for `quiet_seconds` so that there are).
- **players present**: with each probe (outside its timing), the process samples whether a session
  of the database other than this service's (by application_name) is writing (a statement in a
  transaction that holds an ID). The commit probe's objective holds the work back only while
  players are present (at least `presence_busy_fraction` of the samples of the last
  `presence_window_seconds`): on a database nobody else writes to, the work's own load on the
  probe is not stress. The other signals apply either way.
- **the deadline objective**: a cohort's claim registers its deadline and accounts
  (`register_cohort`), its batches count them done; each adjustment grants at least the rate that
  finishes every cohort within `lateness_objective_seconds` of its deadline, up to
  `deadline_max_in_flight` batches in flight (`with_deadline`).
- **a batch blocked on a lock** (a session of this role waiting on a row lock for
  `blocked_after_seconds`) does not count against `max_in_flight`: it uses neither CPU nor WAL.
- The budget's own writes commit without waiting for the WAL flush (budget/budget.sql).
- **operator control**: `starter.py budget show|set` changes the row; every acquire reads it, so a
  change reaches running partitions at their next batch (and waiting ones at their next try).

A batch that cannot have a slot or rows waits, calling `while_waiting` (the activities heartbeat
with it, so waiting is neither a failure nor a dead worker). Platform code: no job is imported.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import os
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import asyncpg

from core import db, metrics
from core.config import BudgetSettings as BudgetSettings  # declared with every other setting
from core.model import Model
from core.queries import load

SQL = load(__file__, "budget.sql")
log = logging.getLogger("budget")

Waiting = Callable[[dict[str, Any]], None]
# How far one idle probe moves the baseline toward its own latency (about the last five count).
IDLE_BASELINE_WEIGHT = 0.2


@dataclass
class Grant:
    """A batch's permission to run: `slot` is None when the budget is off. Set `rows_done` to what
    the batch really did (unused rows are refunded)."""

    lease: str
    slot: int | None
    rows: int
    waited_seconds: float
    in_flight_limit: int | None = None
    rows_per_second: float | None = None
    rows_done: int | None = None
    # Seconds of the batch spent waiting for a lock of the service's own (another batch's follow-ups,
    # cleanup.batches), not on the database's work: left out of the latency the budget reads as stress.
    idle_seconds: float = 0.0


@contextlib.asynccontextmanager
async def under_budget(
    budget: LoadBudget | None, job: str, rows: int, while_waiting: Waiting | None = None, cohort: str | None = None
) -> AsyncIterator[Grant]:
    """`budget.batch(...)`, or no limit at all when `budget` is None (the benchmarks' direct runs)."""
    if budget is None:
        yield Grant(lease="", slot=None, rows=rows, waited_seconds=0.0)
        return
    async with budget.batch(job, rows, while_waiting, cohort) as grant:
        yield grant


def _usable(conn: Any) -> bool:
    """An open connection (asyncpg gives a pooled connection back to its pool when it closes)."""
    try:
        return conn is not None and not conn.is_closed()
    except asyncpg.InterfaceError:
        return False


def _holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class LoadBudget:
    """The client side of the budget; one per worker process (cheap: it holds no connection)."""

    def __init__(self, pool: asyncpg.Pool, settings: BudgetSettings | None = None) -> None:
        self.pool = pool
        self.settings = settings or BudgetSettings()  # the worker passes its own (Settings.budget)
        self.holder = _holder()
        self._active = 0  # batches of this process waiting for the budget or in flight
        self._prober: asyncio.Future[None] | None = None
        self._probe_key = f"{self.holder} {uuid.uuid4().hex[:8]}"
        # This process's batches waiting for the budget, in order: only the first asks the database
        # (a crowd of them asking at once, each refused but one, would load the players' database
        # with refusals); it is woken when a slot of this process frees, and the next when it leaves.
        self._queue: collections.deque[asyncio.Event] = collections.deque()
        # The session this process's slots are tied to: a pool connection held while it has budgeted
        # work (the probes run on it), with its backend pid and start time. The database ends it with
        # the process (or the server), and every slot recorded with it is free at once.
        self._session: Any = None
        self._session_id: tuple[int, Any] | None = None
        self._session_lock = asyncio.Lock()
        self._grants = 0  # slots granted to this process and not yet released
        self.throttled = False  # the last acquire found a rate limit (claims and batches then take fewer rows)
        # Until then (time.monotonic()), the operator's row said "off": no statements per batch. Two per
        # batch on one hot row otherwise, serialized by the budget's lock, for a budget that limits nothing.
        self._off_until = 0.0
        self._adjusted_at = time.monotonic()  # this process's last try to adjust (maybe_adjust)

    def _busy(self) -> bool:
        return self._active > 0 or self._grants > 0

    async def _probe_loop(self) -> None:
        """Time the commit probe every `probe_interval_seconds` while this process has work; each
        probe statement also records the previous one's latency (quiet or busy) for the adjustment.
        The probes run on the budget session, which also keeps it in use; it is given back when the
        work is done."""
        try:
            await self._probe_while_busy()
        except asyncio.CancelledError:  # the process is stopping: end the session (its slots go with it)
            self._prober = None
            conn, self._session, self._session_id = self._session, None, None
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.terminate()  # synchronous, and hands the connection back to its pool
            raise
        async with self._session_lock:
            if not self._busy():
                await self._discard_session(give_back=True)

    async def _probe_while_busy(self) -> None:
        previous: tuple[float, bool] | None = None
        warm: Any = None  # the session whose probes count: the first on a session only warms it up
        while True:
            if not self._busy():
                self._prober = None  # before any await: a batch starting now starts a new loop
                break
            try:
                async with self._session_lock:
                    conn = await self._open_session()
                    try:
                        # Whether players are present, sampled outside the probe's timing: the probe
                        # times a player's commit, not this look at pg_stat_activity.
                        players = await conn.fetchval(
                            SQL.sample_players, *SQL.bind("sample_players", service_name_prefix=db.APPLICATION_NAME)
                        )
                        started = time.perf_counter()
                        quiet = await conn.fetchval(
                            SQL.probe,
                            *SQL.bind(
                                "probe",
                                holder=self._probe_key,
                                previous_ms=previous[0] if previous else None,
                                previous_quiet=previous[1] if previous else None,
                                players=players,
                                presence_window_seconds=self.settings.presence_window_seconds,
                            ),
                        )
                    except Exception:
                        if not _usable(conn):
                            await self._discard_session()
                        raise
                # A session's first probe plans the statement and fills its caches: not a commit's time.
                previous = ((time.perf_counter() - started) * 1000, bool(quiet)) if conn is warm else None
                warm = conn
            except Exception:  # a probe is an observation; the batches report the database's errors
                log.debug("load budget probe failed", exc_info=True)
            if time.monotonic() - self._adjusted_at >= max(LOOP_ADJUST_SECONDS, 2 * self.settings.adjust_seconds):
                # Batches that hold every slot for long (a claim's first chunk, a slow batch) ask for
                # no slot, so no acquire adjusts: the probe loop does, so the limits do not freeze.
                try:
                    await self.maybe_adjust()
                except Exception:
                    log.debug("load budget adjustment failed", exc_info=True)
            await asyncio.sleep(self.settings.probe_interval_seconds)

    async def watch(self) -> None:
        """While this process has no budgeted work, a commit probe every `idle_probe_seconds` (the
        worker runs this beside its polling): the players alone, measured when none of the work
        runs, is the baseline the work starts from. Probes taken at a batch's start would carry
        whatever else the work's start does (its plans, its first statements)."""
        while True:
            await asyncio.sleep(self.settings.idle_probe_seconds * random.uniform(0.8, 1.2))
            if self._busy() or not self.settings.enabled or time.monotonic() < self._off_until:
                continue
            try:
                await self._idle_probe()
            except Exception:  # an observation: the next one may succeed
                log.debug("load budget idle probe failed", exc_info=True)

    async def _idle_probe(self) -> None:
        """One commit probe on a pooled connection (the first run of the statement on it only plans
        it); quiet (no slot held anywhere), it moves the baseline."""
        async with self.pool.acquire() as conn:
            players = await conn.fetchval(
                SQL.sample_players, *SQL.bind("sample_players", service_name_prefix=db.APPLICATION_NAME)
            )
            window = self.settings.presence_window_seconds
            probe = {"holder": self._probe_key, "previous_ms": None, "previous_quiet": None}
            # The first run plans it: no sample.
            await conn.fetchval(SQL.probe, *SQL.bind("probe", **probe, players=None, presence_window_seconds=window))
            started = time.perf_counter()
            quiet = await conn.fetchval(
                SQL.probe, *SQL.bind("probe", **probe, players=players, presence_window_seconds=window)
            )
            ms = (time.perf_counter() - started) * 1000
        if quiet:
            await self._bookkeeping(
                SQL.learn_idle_baseline, *SQL.bind("learn_idle_baseline", latency_ms=ms, weight=IDLE_BASELINE_WEIGHT)
            )

    async def _open_session(self) -> Any:
        """The budget session (caller holds `_session_lock`): the one open, or a new one."""
        if _usable(self._session):
            return self._session
        await self._discard_session()
        conn = await self.pool.acquire()
        try:
            row = await conn.fetchrow(SQL.session_identity)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.pool.release(conn)
            raise
        assert row is not None
        self._session, self._session_id = conn, (row["pid"], row["backend_start"])
        return conn

    async def _discard_session(self, give_back: bool = False) -> None:
        """Forget the budget session (caller holds `_session_lock`). `give_back`: it is healthy and
        this process holds no slot, so the pool may reuse it; otherwise it is closed, which ends it in
        the database too."""
        conn, self._session, self._session_id = self._session, None, None
        if conn is None:
            return
        if not give_back:
            with contextlib.suppress(Exception):
                conn.terminate()
        with contextlib.suppress(Exception):
            await self.pool.release(conn)

    async def session_identity(self) -> tuple[int, Any]:
        """(backend pid, backend start) of the session this process's slots are tied to."""
        if self._session_id is None or not _usable(self._session):
            async with self._session_lock:
                await self._open_session()
        assert self._session_id is not None
        return self._session_id

    async def close(self) -> None:
        """End the budget session now (its slots become free); the next batch opens another."""
        async with self._session_lock:
            await self._discard_session()

    def claim_rows(self, chunk_size: int) -> int:
        """Accounts per statement of a cohort's claim: the cohort's own chunk while the work runs
        unthrottled, at most `max_claim_rows` while a rate limit applies (smaller bursts of WAL)."""
        return min(chunk_size, self.settings.max_claim_rows) if self.throttled else chunk_size

    def batch_rows(self, batch_size: int) -> int:
        """Accounts per cleanup batch: the partition's own batch size while the work runs
        unthrottled, at most `throttled_batch_rows` while a rate limit applies: paced work in short
        statements and small commits, as the players' objective is met at the least cost to them."""
        return min(batch_size, self.settings.throttled_batch_rows) if self.throttled else batch_size

    @contextlib.asynccontextmanager
    async def batch(
        self, job: str, rows: int, while_waiting: Waiting | None = None, cohort: str | None = None
    ) -> AsyncIterator[Grant]:
        """Hold a slot and `rows` rows of the budget for the body (one batch); release after it.
        `rows` is what the batch is charged: accounts it cleans (a claim's chunk charges none: an
        account is one unit of the rate, claimed and cleaned). `cohort`: the cohort registered with
        `register_cohort` whose accounts the batch cleans; its `rows_done` count as done there."""
        if not self.settings.enabled or time.monotonic() < self._off_until:
            yield Grant(lease="", slot=None, rows=rows, waited_seconds=0.0)
            return
        async with self._probing():
            async with self._held(job, rows, while_waiting, cohort) as grant:
                yield grant

    async def register_cohort(self, cohort: str, deadline: datetime, accounts: int) -> None:
        """Tell the deadline objective of a cohort: its deadline and how many accounts it has. Its
        batches (`batch(..., cohort=...)`) count its accounts done; a cohort done is forgotten."""
        if not self.settings.enabled or accounts <= 0:
            return
        await self._bookkeeping(
            SQL.register_cohort, *SQL.bind("register_cohort", cohort=cohort, deadline=deadline, accounts=accounts)
        )

    @contextlib.asynccontextmanager
    async def _probing(self) -> AsyncIterator[None]:
        """The commit probe runs while this process has budgeted work waiting or in flight."""
        self._active += 1
        if self._prober is None:
            self._prober = asyncio.ensure_future(self._probe_loop())
        try:
            yield
        finally:
            self._active -= 1

    @contextlib.asynccontextmanager
    async def _held(
        self, job: str, rows: int, while_waiting: Waiting | None, cohort: str | None
    ) -> AsyncIterator[Grant]:
        grant = await self.acquire(job, rows, while_waiting)
        renewing = asyncio.ensure_future(self._renew(grant)) if grant.slot is not None else None
        started = time.perf_counter()
        ok = False
        try:
            yield grant
            ok = True
        finally:
            if renewing is not None:
                renewing.cancel()
                with contextlib.suppress(BaseException):
                    await renewing
            seconds = max(time.perf_counter() - started - grant.idle_seconds, 0.0)
            done = grant.rows_done if ok and grant.rows_done is not None else rows
            # Latency per 1,000 rows of a batch charged rows; a claim's chunk (no rows) says nothing of it.
            ms_per_1000 = seconds * 1_000_000 / rows if ok and rows > 0 else None
            try:
                release = SQL.bind(
                    "release",
                    slot=grant.slot,
                    lease=grant.lease,
                    rows_done=done,
                    ms_per_1000_rows=ms_per_1000,
                    cohort=cohort,
                    held_seconds=seconds,
                )
                await self._bookkeeping(SQL.release, *release)
            except Exception:  # never mask the batch's own outcome
                log.warning(
                    "could not release load budget slot %s; it is free once its session ends (or its lease runs out)",
                    grant.slot,
                    exc_info=True,
                )
            finally:
                if grant.slot is not None:
                    self._grants -= 1
            metrics.record_budget_rows(done)
            # The slot is free now: this process's first waiter tries at once instead of at its next
            # poll (waiters in other processes still poll, within max_poll_seconds).
            self._wake_first()

    async def acquire(self, job: str, rows: int, while_waiting: Waiting | None = None) -> Grant:
        """Wait until a slot and `rows` rows are free (`while_waiting` is called on each wait). A
        batch asks at once while no batch of this process waits; once one is refused, they ask in
        turn: the first in the queue asks the database, the others wait for their turn (still
        calling `while_waiting`, so their activities heartbeat)."""
        lease = uuid.uuid4().hex
        started = time.perf_counter()
        turn = self._join_queue() if self._queue else None
        try:
            while True:
                if turn is not None and self._queue[0] is not turn:
                    await self._wait_for_turn(turn, started, while_waiting)
                    continue
                await self.maybe_adjust()
                waited = time.perf_counter() - started
                row = await self._try_acquire(lease, job, rows, waited)
                if row is None:
                    continue
                if row["granted"]:
                    metrics.record_budget_wait(waited)
                    if row["slot"] is not None:
                        self._grants += 1
                    return Grant(
                        lease=lease,
                        slot=row["slot"],
                        rows=rows,
                        waited_seconds=waited,
                        in_flight_limit=row["in_flight_limit"],
                        rows_per_second=row["rows_per_second"],
                    )
                turn = turn or self._join_queue()
                if while_waiting is not None:
                    while_waiting(_waiting_details(row, waited))
                if self._queue[0] is turn:
                    await self._wait_to_retry(row, turn)
        finally:
            if turn is not None:
                self._queue.remove(turn)
                self._wake_first()

    def _join_queue(self) -> asyncio.Event:
        turn = asyncio.Event()
        self._queue.append(turn)
        return turn

    def _wake_first(self) -> None:
        if self._queue:
            self._queue[0].set()

    async def _wait_for_turn(self, turn: asyncio.Event, started: float, while_waiting: Waiting | None) -> None:
        """Behind another batch of this process: until woken, at most twice `max_poll_seconds`."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(turn.wait(), 2 * self.settings.max_poll_seconds)
        turn.clear()
        if while_waiting is not None:
            ahead = next(i for i, t in enumerate(self._queue) if t is turn)
            waited = round(time.perf_counter() - started, 1)
            while_waiting({"waiting_for_load_budget_s": waited, "behind_batches_of_this_worker": ahead})

    async def _try_acquire(self, lease: str, job: str, rows: int, waited: float) -> asyncpg.Record | None:
        """One try for a slot and `rows` rows under the budget's lock: the budget row's verdict (granted
        or not, and the limits in force), or None when the session the slot was to be tied to had
        ended (a restart, a broken connection): the next try ties it to a new one."""
        s = self.settings
        session_pid, session_start = await self.session_identity()
        async with self.pool.acquire() as conn, db.transaction(conn):
            await conn.execute(SQL.lock_budget)
            row = await conn.fetchrow(
                SQL.acquire,
                *SQL.bind(
                    "acquire",
                    lease=lease,
                    job=job,
                    holder=f"{self.holder} {job}",
                    rows=rows,
                    lease_seconds=s.lease_seconds,
                    default_max_in_flight=s.max_in_flight,
                    default_rows_per_second=s.rows_per_second,
                    waited_seconds=waited,
                    burst_seconds=s.burst_seconds,
                    blocked_after_seconds=s.blocked_after_seconds,
                    session_pid=session_pid,
                    session_start=session_start,
                ),
            )
        assert row is not None
        if not row["session_alive"]:
            async with self._session_lock:
                if self._session_id == (session_pid, session_start):
                    await self._discard_session()
            return None
        if not row["enabled"]:
            self._off_until = time.monotonic() + s.off_recheck_seconds
        metrics.set_budget(row["in_flight_limit"], row["rows_per_second"])
        self.throttled = row["rows_per_second"] is not None
        return row

    async def _wait_to_retry(self, row: asyncpg.Record, turn: asyncio.Event) -> None:
        """Until the next try after a refusal: until the rows refill (or the quiet moment ends), at
        most `max_poll_seconds` (jittered), or at once when a slot of this process is released."""
        s = self.settings
        pause = row["refill_seconds"] if row["refill_seconds"] is not None else s.max_poll_seconds / 2
        if row["quiet_seconds"] is not None:
            pause = max(pause, row["quiet_seconds"])
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(turn.wait(), min(s.max_poll_seconds, pause) * random.uniform(0.8, 1.2))
        turn.clear()

    async def _bookkeeping(self, statement: str, *args: object) -> asyncpg.Record | None:
        """One of the budget's own writes, committed without waiting for the WAL flush (budget.sql)."""
        async with self.pool.acquire() as conn, db.transaction(conn):
            await conn.execute(SQL.no_commit_wait)
            return await conn.fetchrow(statement, *args)

    async def _renew(self, grant: Grant) -> None:
        while True:
            await asyncio.sleep(self.settings.lease_seconds / 3)
            try:
                renewal = SQL.bind(
                    "renew_slot", slot=grant.slot, lease=grant.lease, lease_seconds=self.settings.lease_seconds
                )
                await self._bookkeeping(SQL.renew_slot, *renewal)
            except Exception:
                log.warning("could not renew load budget slot %s", grant.slot, exc_info=True)

    async def maybe_adjust(self) -> dict[str, Any] | None:
        """The adaptive step, by whichever worker claims it first in each interval: observe the
        window, judge it against the players' objective and the other limits (the operator's, else
        this worker's), give the deadline objective its share, record the verdict."""
        s = self.settings
        self._adjusted_at = time.monotonic()
        claimed = await self.pool.fetchrow(
            SQL.claim_adjustment, *SQL.bind("claim_adjustment", adjust_seconds=s.adjust_seconds)
        )
        if claimed is None:
            return None
        window = await self._observe(claimed)
        limits = StressLimits.of(claimed, s)
        reasons = stress_reasons(window.seen, limits)
        players_present = window.seen.players_present
        verdict = judge(
            reasons,
            rate_limit=throttle_in_force(claimed["rate_limit"], claimed["binding"], players_present),
            observed_rows_per_second=window.rows_per_second,
            observed_latency_ms=window.slot_ms_per_1000_rows,
            settings=s,
            players_present=players_present,
            near_objective=limits.near(window.seen),
            observed_peak_in_flight=claimed["window_peak_in_flight"],
        )
        verdict["binding"] = "players" if players_present else "database"
        demand = await self._deadline_demand(claimed)
        verdict = with_deadline(verdict, demand, window.slot_ms_per_1000_rows, window.rows_per_second)
        await self._record(window, verdict, demand)
        metrics.set_budget_verdict(
            verdict["rate_limit"] is not None,
            holding_back(reasons, players_present),
            window.seen.probe_ms,
            limits.probe_bound_ms(window.seen.probe_baseline_ms),
            players_present,
        )
        metrics.set_budget_objectives(verdict["binding"], demand.rows_per_second, verdict["projected_lateness"])
        if verdict["stress"]:
            log.info("load budget throttles to %s: %s", _rate_text(verdict["rate_limit"]), verdict["stress"])
        return verdict

    async def _deadline_demand(self, claimed: asyncpg.Record) -> Demand:
        """What the deadline objective asks of this window: the cohorts' accounts left and the rate
        that finishes them within the lateness objective (the operator's, else this worker's)."""
        s = self.settings
        lateness = claimed["lateness_objective_seconds"] or s.lateness_objective_seconds
        share = claimed["deadline_max_in_flight"]
        asked = SQL.bind(
            "deadline_demand",
            lateness_objective_seconds=lateness,
            plan_seconds=lateness * DEADLINE_PLAN_SHARE,
            forgotten_after_seconds=COHORT_FORGOTTEN_SECONDS,
        )
        row = await self.pool.fetchrow(SQL.deadline_demand, *asked)
        assert row is not None
        return Demand(
            cohorts=row["cohorts"],
            accounts_left=row["accounts_left"],
            rows_per_second=row["rows_per_second"],
            target=row["target"],
            lateness_objective_seconds=lateness,
            hard_share=share if share is not None else s.deadline_max_in_flight,
        )

    async def _record(self, window: _Window, verdict: dict[str, Any], demand: Demand) -> None:
        """The verdict and what it was judged on, on the budget row (budget show, planner status)."""
        await self._bookkeeping(
            SQL.apply_adjustment,
            *SQL.bind(
                "apply_adjustment",
                rate_limit=verdict["rate_limit"],
                stress=verdict["stress"],
                latency_ms=window.seen.latency_ms,
                lock_waits=window.seen.lock_waits,
                replication_lag=window.seen.replication_lag,
                probe_ms=window.seen.probe_ms,
                probes=window.probes,
                new_baseline_ms=window.new_baseline,
                quiet_seconds=window.quiet_seconds,
                forget_baseline=window.restarted,
                in_flight_limit=verdict["in_flight_limit"],
                limited_by=verdict["limited_by"],
                window_rows_per_second=window.rows_per_second,
                players_present=window.seen.players_present,
                busy_fraction=window.busy_fraction,
                binding=verdict["binding"],
                deadline_rows_per_second=demand.rows_per_second if demand.cohorts else None,
                deadline_accounts_left=demand.accounts_left if demand.cohorts else None,
                deadline_target=demand.target,
                projected_finish=verdict["projected_finish"],
            ),
        )

    async def _observe(self, claimed: asyncpg.Record) -> _Window:
        """What the window that `claimed` closed saw: the batches' latency and rows per second, the
        database's lock waits and replication lag, the commit probes and their quiet baseline, and
        whether players were present (at least `presence_busy_fraction` of the samples of the last
        `presence_window_seconds` saw a session not the service's writing)."""
        stress = await self.pool.fetchrow(SQL.sample_stress)
        presence = SQL.bind("collect_probes", presence_window_seconds=self.settings.presence_window_seconds)
        collected = await self.pool.fetchrow(SQL.collect_probes, *presence)
        assert stress is not None and collected is not None
        probes = dict(collected)
        latency_ms = claimed["window_ms_sum"] / claimed["window_batches"] if claimed["window_batches"] else None
        # What the players saw while the work ran: every probe of the window, between batches too, as
        # a player's commits are spread over time (the probes while a batch held a slot alone would
        # judge paced work by its worst moments). None: no batch ran in the window.
        taken = probes["busy_n"] + probes["quiet_n"]
        busy_ms = (probes["busy_ms_sum"] + probes["quiet_ms_sum"]) / taken if probes["busy_n"] else None
        baseline = claimed["probe_baseline_ms"]
        # A baseline of an earlier run of the server says nothing of this one (cold caches, a
        # recovery's checkpoint), and neither do this window's observations, taken across the
        # restart: forget them all and learn the baseline again. A restart is not load.
        restarted = bool(claimed["server_restarted"]) and baseline is not None
        if restarted:
            log.info("load budget: the database restarted; the commit probe's baseline is measured again")
            baseline = latency_ms = busy_ms = None
            probes.update(busy_n=0, quiet_n=0)
        new_baseline = None
        if probes["quiet_n"]:
            quiet_ms = probes["quiet_ms_sum"] / probes["quiet_n"]
            # A few quiet probes replace a higher baseline; a lower one rises slowly. Probes between
            # batches still carry the work's after-effects (WAL flushes, checkpoints, the vacuum of
            # what it deleted): the work must not loosen its own objective by raising the baseline.
            weight = min(1.0, probes["quiet_n"] / 5) * (1.0 if baseline is None or quiet_ms < baseline else 0.1)
            new_baseline = quiet_ms if baseline is None else baseline + weight * (quiet_ms - baseline)
            baseline = new_baseline
        busy_fraction, players_present = players_presence(probes, claimed, self.settings.presence_busy_fraction)
        # The baseline serves only the players' objective: with nobody else on the database a quiet
        # moment would stall the work for nothing.
        wants_quiet = players_present and busy_ms is not None and new_baseline is None
        return _Window(
            seen=Observed(
                latency_ms=latency_ms,
                lock_waits=stress["lock_waits"],
                replication_lag=stress["replication_lag"],
                probe_ms=busy_ms,
                probe_baseline_ms=baseline,
                players_present=players_present,
            ),
            busy_fraction=busy_fraction,
            probes=taken if busy_ms is not None else 0,
            new_baseline=new_baseline,
            quiet_seconds=self._quiet_seconds(claimed, wants_quiet),
            restarted=restarted,
            rows_per_second=claimed["window_rows"] / claimed["window_seconds"]
            if (claimed["window_seconds"] or 0) > 0
            else None,
            slot_ms_per_1000_rows=slot_ms_per_1000_rows(
                latency_ms, claimed["window_slot_seconds"], claimed["window_rows"]
            ),
        )

    def _quiet_seconds(self, claimed: asyncpg.Record, busy_without_quiet_probe: bool) -> float | None:
        """How long nothing is granted so that quiet probes measure the baseline again (None: no
        such moment): when work is running with players present and no quiet probe was seen for a
        while, at most once per `baseline_seconds`, even when that moment found no quiet probe."""
        s = self.settings
        stale = [claimed["baseline_age_seconds"], claimed["since_quiet_seconds"]]
        if (
            s.quiet_seconds > 0
            and busy_without_quiet_probe
            and all(age is None or age > s.baseline_seconds for age in stale)
        ):
            return s.quiet_seconds
        return None


def players_presence(probes: dict[str, Any], claimed: Any, busy_fraction: float) -> tuple[float | None, bool]:
    """(the share of the window's presence samples that saw a player at work, players present):
    present at `busy_fraction` of the samples or more. With fewer than MIN_PRESENCE_SAMPLES samples
    (work starting after an idle spell: an idle worker samples once every few seconds) the last
    verdict (`claimed`), present, stands: work that starts while players are on starts paced, not at
    full speed for a window."""
    samples, busy = probes["presence_samples"], probes["presence_busy"]
    share = busy / samples if samples else None
    present = share is not None and share >= busy_fraction
    return share, present or (samples < MIN_PRESENCE_SAMPLES and bool(claimed["observed_players_present"]))


def _waiting_details(row: asyncpg.Record, waited: float) -> dict[str, Any]:
    """Why a batch waits for the budget, as its heartbeat shows it."""
    return {
        "waiting_for_load_budget_s": round(waited, 1),
        "in_flight": row["in_flight"],
        "in_flight_limit": row["in_flight_limit"],
        "rows_per_second_limit": None if row["rows_per_second"] is None else round(row["rows_per_second"], 1),
        **({"measuring_baseline": True} if row["quiet_seconds"] is not None else {}),
    }


@dataclass(frozen=True)
class Observed:
    """What an adjustment window saw of the database's stress (None: not observed in the window)."""

    latency_ms: float | None  # the batches' mean latency per 1,000 rows
    lock_waits: int  # sessions of this database waiting on a lock now
    replication_lag: float | None  # seconds, when a standby streams from the server
    probe_ms: float | None = None  # the commit probe's mean while work ran
    probe_baseline_ms: float | None = None  # ... and while none ran (its quiet baseline)
    players_present: bool = True  # a session not this service's was active (the objective applies)


# Where the controller stops growing: this share of the way from the commit probe's baseline to its bound.
SET_POINT_SHARE = 1 / 3


@dataclass(frozen=True)
class StressLimits:
    """Above these the database is stressed; the commit probe's are the players' objective: its mean
    at most `probe_added_ms` above its quiet baseline, and, each when set, at most `probe_ratio` x the
    baseline (and by more than `probe_min_ms`) and at most `probe_max_ms`."""

    latency_ms: float
    max_lock_waits: int
    max_lag: float
    probe_added_ms: float | None = 5.0
    probe_ratio: float | None = None
    probe_min_ms: float = 1.0
    probe_max_ms: float | None = None

    @classmethod
    def of(cls, row: Any, s: BudgetSettings) -> StressLimits:
        """The limits in force: the operator's values in the budget row, else the worker's settings."""
        return cls(
            latency_ms=row["latency_ms"] or s.latency_ms,
            max_lock_waits=row["max_lock_waits"] if row["max_lock_waits"] is not None else s.max_lock_waits,
            max_lag=row["max_replication_lag_seconds"] or s.max_replication_lag_seconds,
            probe_added_ms=row["probe_added_ms"] or s.probe_added_ms,
            probe_ratio=row["probe_ratio"] or s.probe_ratio,
            probe_min_ms=s.probe_min_ms,
            probe_max_ms=row["probe_max_ms"] or s.probe_max_ms,
        )

    def relative_bound_ms(self, baseline_ms: float) -> float | None:
        """The least of the bounds set relative to the baseline (None: none set)."""
        bounds = [baseline_ms + self.probe_added_ms] if self.probe_added_ms is not None else []
        if self.probe_ratio is not None:
            bounds.append(max(baseline_ms * self.probe_ratio, baseline_ms + self.probe_min_ms))
        return min(bounds) if bounds else None

    def probe_bound_ms(self, baseline_ms: float | None) -> float | None:
        """The commit probe's mean above which it shows stress (None: no bound known yet)."""
        bounds = [self.probe_max_ms] if self.probe_max_ms is not None else []
        relative = self.relative_bound_ms(baseline_ms) if baseline_ms is not None else None
        bounds += [relative] if relative is not None else []
        return min(bounds) if bounds else None

    def near(self, seen: Observed) -> str | None:
        """Whether the commit probe is past its set point (a third of the way from its baseline to
        the bound where it means stress, or 3/4 of `probe_max_ms` without a baseline), as the
        operator reads it: the controller stops growing there (None: below it, or nothing to judge).
        A third, not half: the objective is judged on every player's commit in a 10-s window, and
        the few probes of a 2-s adjustment miss the outliers (a checkpoint, a vacuum) that lift a
        window's mean."""
        probe, baseline = seen.probe_ms, seen.probe_baseline_ms
        bound = self.probe_bound_ms(baseline)
        if probe is None or bound is None:
            return None
        set_point = baseline + (bound - baseline) * SET_POINT_SHARE if baseline is not None else bound * 3 / 4
        if probe <= set_point:
            return None
        return f"commit probe {probe:.1f} ms past its set point {set_point:.1f} ms (stress above {bound:.1f} ms)"


@dataclass(frozen=True)
class _Window:
    """One adjustment window's observations, as the adjustment records them with its verdict."""

    seen: Observed
    busy_fraction: float | None  # the share of the presence window's samples that saw a player at work
    probes: int  # commit probes taken while work ran
    new_baseline: float | None  # the quiet baseline learnt in this window (None: no quiet probe)
    quiet_seconds: float | None  # nothing granted this long so that quiet probes are taken
    restarted: bool  # the server restarted since the baseline was learnt: it is learnt again
    rows_per_second: float | None  # what the work did in the window
    slot_ms_per_1000_rows: float | None = None  # slot time per 1,000 rows done (slot_ms_per_1000_rows)


def slot_ms_per_1000_rows(latency_ms: float | None, slot_seconds: float, rows: int) -> float | None:
    """Milliseconds of slot time per 1,000 rows done in a window: every slot's seconds (a claim's
    chunks too, which charge no rows but hold a slot for each account before it is cleaned) over the
    rows the batches did (a partition following its claim does a few of the rows it was charged
    for each chunk it follows). One slot then delivers 1,000,000 / this rows/s. Never below the
    batches' own latency (a slot still held at the window's end is not counted yet); the batches'
    latency when the window did no rows."""
    if rows <= 0 or slot_seconds <= 0:
        return latency_ms
    held = slot_seconds * 1_000_000 / rows
    return held if latency_ms is None else max(held, latency_ms)


def _rate_text(rate: float | None) -> str:
    return "no rate limit" if rate is None else f"{rate:.0f} rows/s"


def stress_reasons(seen: Observed, limits: StressLimits) -> dict[str, str]:
    """The signals that show stress, each as the operator reads it (empty: healthy). Keyed by
    signal (metrics.STRESS_SIGNALS)."""
    reasons: dict[str, str] = {}
    probe_ms, baseline_ms = seen.probe_ms, seen.probe_baseline_ms
    relative = limits.relative_bound_ms(baseline_ms) if baseline_ms is not None else None
    if probe_ms is not None and baseline_ms is not None and relative is not None and probe_ms > relative:
        reasons["commit_probe"] = _probe_text(probe_ms, baseline_ms, limits)
    if probe_ms is not None and limits.probe_max_ms is not None and probe_ms > limits.probe_max_ms:
        reasons["commit_probe_ms"] = f"commit probe {probe_ms:.1f} ms > {limits.probe_max_ms:g} ms"
    if seen.latency_ms is not None and seen.latency_ms > limits.latency_ms:
        reasons["batch_latency"] = f"batch latency {seen.latency_ms:.0f} ms per 1000 rows > {limits.latency_ms:.0f}"
    if seen.lock_waits > limits.max_lock_waits:
        reasons["lock_waits"] = f"{seen.lock_waits} lock waits > {limits.max_lock_waits}"
    if seen.replication_lag is not None and seen.replication_lag > limits.max_lag:
        reasons["replication_lag"] = f"replication lag {seen.replication_lag:.1f} s > {limits.max_lag:.1f}"
    return reasons


def _probe_text(probe_ms: float, baseline_ms: float, limits: StressLimits) -> str:
    """The relative bound the commit probe passed, as the operator set it."""
    added = limits.probe_added_ms
    if added is not None and probe_ms > baseline_ms + added:
        return f"commit probe {probe_ms:.1f} ms > baseline {baseline_ms:.1f} ms + {added:g} ms"
    return f"commit probe {probe_ms:.1f} ms > {limits.probe_ratio:g} x baseline {baseline_ms:.1f} ms"


# The players' objective: it holds the work back only while players are present.
PLAYER_SIGNALS = ("commit_probe", "commit_probe_ms")
# The verdicts (`binding`) of a throttle set with players present: lifted once they are absent.
PLAYER_BINDINGS = ("players", "deadline", "deadline, at its hard share")
# Presence judged on fewer samples than this keeps the last verdict (a start after an idle spell).
MIN_PRESENCE_SAMPLES = 10
# A process whose batches held their slots this long without an acquire (which adjusts) adjusts
# from its probe loop: long batches (a claim's first chunk) must not freeze the limits.
LOOP_ADJUST_SECONDS = 4.0
# The deadline objective plans to finish this share of the way into the lateness objective: the
# rate asked is flat from the start, with room left for a slow window, instead of rising into a
# crunch of batches at the end (when the players' objective would be overridden the most).
DEADLINE_PLAN_SHARE = 0.75
PLAYERS_ABSENT = "no player at work (players absent): the commit probe does not hold the work back"


def holding_back(reasons: dict[str, str], players_present: bool) -> dict[str, str]:
    """The stress that holds the work back: every signal's while players are present; without them
    the commit probe's objective protects nobody, and only the database's own signals count."""
    return {k: v for k, v in reasons.items() if players_present or k not in PLAYER_SIGNALS}


def judge(
    reasons: dict[str, str],
    *,
    rate_limit: float | None,
    observed_rows_per_second: float | None,
    observed_latency_ms: float | None,
    settings: BudgetSettings,
    players_present: bool = True,
    near_objective: str | None = None,
    observed_peak_in_flight: int = 0,
) -> dict[str, Any]:
    """The next adaptive limits (None: unthrottled). Stressed: half of the rate limit, or of what the
    work did in the window when it was unthrottled (never below `min_rows_per_second`).

    Healthy, with players absent: a rate limit (one the database's own signals set:
    `throttle_in_force`) grows by `settings.grow_factor` while the work uses it, and is lifted once
    the work does not use half of it. With players present the work is
    never unthrottled: the limit follows it, at most `grow_factor` x what it did (a start begins at
    `min_rows_per_second`, not at full speed), and holds while the commit probe is past its set
    point (`near_objective`, StressLimits.near): an objective to hold in every window is approached,
    not overshot and halved.

    Under a rate limit the in-flight limit is what delivers that rate at the slot time per row
    (`observed_latency_ms`: slot_ms_per_1000_rows; `in_flight_for`): one short batch after another,
    not a crowd of them competing with the players for the cores; never more than half of the most
    that ran at once in the window when stressed, nor more than one beyond it when not. With players
    absent the commit probe's reasons are not stress (`holding_back`)."""
    reasons = holding_back(reasons, players_present)
    peak, min_rows_per_second, grow_factor = observed_peak_in_flight, settings.min_rows_per_second, settings.grow_factor
    if reasons:
        seen = [x for x in (rate_limit, observed_rows_per_second) if x]
        rate = max(min_rows_per_second, min(seen) / 2) if seen else min_rows_per_second
        why = "; ".join(reasons.values())
        return _limits(rate, observed_latency_ms, max(1, peak // 2), stress=why, limited_by=why)
    did = observed_rows_per_second or 0.0
    if not players_present:
        if rate_limit is None or did < rate_limit / 2:
            return {"rate_limit": None, "in_flight_limit": None, "stress": None, "limited_by": None}
        grown = rate_limit * grow_factor
        growing = f"growing back after stress ({_rate_text(grown)})"
        return _limits(grown, observed_latency_ms, peak + 1, stress=None, limited_by=growing)
    if near_objective is not None:
        held = rate_limit if rate_limit is not None else max(min_rows_per_second, did)
        return _limits(
            held, observed_latency_ms, peak + 1, stress=None, limited_by=f"holding its rate: {near_objective}"
        )
    rate = max(min_rows_per_second, grow_factor * (did if rate_limit is None else min(rate_limit, did)))
    following = f"players present: at most {grow_factor:g} x what the work did while the objective holds"
    return _limits(rate, observed_latency_ms, peak + 1, stress=None, limited_by=f"{following} ({_rate_text(rate)})")


def throttle_in_force(rate_limit: float | None, binding: str | None, players_present: bool) -> float | None:
    """The rate limit an adjustment starts from: none once the players whose objective set it (the
    last verdict's `binding`: the players', or the deadline's over theirs) are absent, as it
    protects nobody then; the limit as it is otherwise."""
    return None if not players_present and binding in PLAYER_BINDINGS else rate_limit


def in_flight_for(rate: float, latency_ms_per_1000_rows: float | None) -> int:
    """Batches at once that deliver `rate` rows/s at the batches' latency (Little's law), at least
    one; 1 when the latency is unknown (no batch finished in the window)."""
    if latency_ms_per_1000_rows is None:
        return 1
    return max(1, math.ceil(rate * latency_ms_per_1000_rows / 1_000_000))


# A cohort none of whose batches (claim chunks included) released for this long is forgotten: its
# cleanup ended without counting it done (the budget was switched off under it, it was cancelled).
# A throttled cohort releases a batch every few seconds at least; a paused one asks for nothing.
COHORT_FORGOTTEN_SECONDS = 120.0


@dataclass(frozen=True)
class Demand:
    """What the deadline objective asks: the cohorts with accounts left, and the rate (rows/s) that
    finishes each within the lateness objective of its deadline; the latest of their targets."""

    cohorts: int
    accounts_left: int
    rows_per_second: float
    target: datetime | None
    lateness_objective_seconds: float
    hard_share: int  # batches in flight the deadline objective may hold whatever the players' objective says


def with_deadline(
    verdict: dict[str, Any], demand: Demand, latency_ms: float | None, observed_rows_per_second: float | None
) -> dict[str, Any]:
    """The verdict with the deadline objective's share: while a throttle applies, at least the rate
    that finishes every cohort by its plan (`DEADLINE_PLAN_SHARE` of the way into the lateness
    objective: `demand.rows_per_second`), and the batches in flight that deliver it at the slot
    time per row (`latency_ms`: slot_ms_per_1000_rows), up to `demand.hard_share` batches (the
    players' objective may hold the work back below what the deadline asks only past that share).
    Says which objective binds and when the cohorts would finish at the rate granted
    (`projected_finish`, None: no cohort, or no rate known).

    The priority: the operator's caps first (applied at each acquire), then the deadline objective
    up to its hard share, then the players' objective and the database's own signals."""
    out = dict(verdict)
    rate, n = verdict["rate_limit"], verdict["in_flight_limit"]
    binding = verdict.get("binding", "players") if rate is not None else "none"
    if rate is not None and demand.cohorts and demand.hard_share > 0:
        share_rate = demand.hard_share * 1_000_000 / latency_ms if latency_ms else None
        if demand.rows_per_second > rate:
            rate = demand.rows_per_second
            # Delivery unknown (no rows done in the window: the claim alone held the slots), or the
            # share cannot deliver the rate asked: its whole share, the slots limiting, not the rate.
            needed = in_flight_for(rate, latency_ms) if latency_ms else demand.hard_share
            n = max(n or 1, min(demand.hard_share, needed))
            short = share_rate is not None and demand.rows_per_second > share_rate
            binding = "deadline, at its hard share" if short else "deadline"
            why = f"the deadline objective: {_rate_text(rate)} for {demand.accounts_left} accounts"
            out["limited_by"] = (
                f"{why}{' (its hard share: later than planned)' if short else ''}, over: {verdict['limited_by']}"
            )
    out.update(rate_limit=rate, in_flight_limit=n, binding=binding)
    speed = rate if rate is not None else observed_rows_per_second
    finish = None
    if demand.cohorts and speed:
        finish = datetime.now(UTC) + timedelta(seconds=demand.accounts_left / speed)
    out["projected_finish"] = finish
    late = None
    if finish is not None and demand.target is not None:
        late = (finish - demand.target).total_seconds() + demand.lateness_objective_seconds
    out["projected_lateness"] = late
    return out


def _limits(rate: float, latency_ms: float | None, most: int, *, stress: str | None, limited_by: str) -> dict[str, Any]:
    return {
        "rate_limit": rate,
        "in_flight_limit": min(most, in_flight_for(rate, latency_ms)),
        "stress": stress,
        "limited_by": limited_by,
    }


class BudgetLimit(Model):
    """One limit: the operator's value ('set') or the workers' LOAD_BUDGET_* setting ('default');
    None: no limit."""

    value: int | float | None
    source: Literal["set", "default"]


class BudgetObservation(Model):
    """The last window the controller judged (None before the first)."""

    rows_per_second: float | None
    latency_ms_per_1000_rows: float | None
    lock_waits: int | None
    replication_lag_seconds: float | None
    commit_probe_ms: float | None
    commit_probes: int | None
    players_present: bool | None  # players were at work: the commit probe's objective applied
    busy_fraction: float | None  # the share of the presence window's samples that saw a player at work
    at: datetime | None


class BudgetDeadline(Model):
    """The deadline objective at the last adjustment: which objective bound the limits, and for the
    cohorts with accounts left, the rate that finishes them within the lateness objective, their
    latest target (deadline + objective) and when they would finish at the rate granted."""

    binding: str | None  # none | players | database | deadline | deadline, at its hard share
    accounts_left: int | None
    rows_per_second: float | None
    target: datetime | None
    projected_finish: datetime | None
    on_time: bool | None  # the projected finish is by the target


class BudgetSlot(Model):
    """A batch in flight: the slot it holds, whose it is, until when its lease runs."""

    slot: int
    job: str
    holder: str
    rows: int
    acquired_at: datetime
    expires_at: datetime
    backend_pid: int | None
    expired: bool


class BudgetStatus(Model):
    """What the budget does now and why, the operator's caps, what is in flight, the counters."""

    enabled: bool
    doing: str
    limited_by: str
    objective: str
    max_in_flight: BudgetLimit
    rows_per_second: BudgetLimit
    latency_ms: BudgetLimit
    probe_ratio: BudgetLimit
    probe_max_ms: BudgetLimit
    probe_added_ms: BudgetLimit
    lateness_objective_seconds: BudgetLimit
    deadline_max_in_flight: BudgetLimit
    max_lock_waits: BudgetLimit
    max_replication_lag_seconds: BudgetLimit
    throttled: bool
    adaptive_rows_per_second: float | None
    adaptive_in_flight: int | None
    effective_in_flight: int | None
    effective_rows_per_second: float | None
    stress: str | None
    last_stress: str | None
    stressed_at: datetime | None
    observed: BudgetObservation
    deadline: BudgetDeadline
    commit_probe_baseline_ms: float | None
    commit_probe_baseline_at: datetime | None
    in_flight: int
    slots: list[BudgetSlot]
    peak_in_flight: int
    granted: int
    denied: int
    rows_done: int
    wait_seconds: float
    changed_by: str | None
    changed_at: datetime | None


async def budget_status(pool: asyncpg.Pool, settings: BudgetSettings | None = None) -> BudgetStatus:
    """What `budget show` and `planner status` print: what the budget does now and why (the rate and
    in-flight limits in force, what sets them, the objective and the last observation against it),
    the operator's caps (and where they come from), what is in flight now, and the counters."""
    s = settings or BudgetSettings()
    row = await pool.fetchrow(SQL.budget_row)
    assert row is not None
    slots = [BudgetSlot(**r) for r in await pool.fetch(SQL.budget_slots) if not r["expired"]]

    def limit(name: str) -> BudgetLimit:
        value = row[name]
        return BudgetLimit(
            value=value if value is not None else getattr(s, name),
            source="set" if value is not None else "default",
        )

    cap_n = row["max_in_flight"] if row["max_in_flight"] is not None else s.max_in_flight
    cap_r = row["rows_per_second"] if row["rows_per_second"] is not None else s.rows_per_second
    effective_n = 0 if cap_n == 0 else _least(cap_n, row["in_flight_limit"])
    effective_r = _least(cap_r, row["rate_limit"])
    enabled = row["enabled"] and s.enabled
    return BudgetStatus(
        enabled=enabled,
        doing=_doing(enabled, effective_n, effective_r, row["rate_limit"], cap_n, cap_r, len(slots)),
        limited_by=_limited_by(enabled, row, cap_n, cap_r),
        objective=_objective(StressLimits.of(row, s), row["probe_baseline_ms"], row, s),
        max_in_flight=limit("max_in_flight"),
        rows_per_second=limit("rows_per_second"),
        latency_ms=limit("latency_ms"),
        probe_ratio=limit("probe_ratio"),
        probe_max_ms=limit("probe_max_ms"),
        probe_added_ms=limit("probe_added_ms"),
        lateness_objective_seconds=limit("lateness_objective_seconds"),
        deadline_max_in_flight=limit("deadline_max_in_flight"),
        max_lock_waits=limit("max_lock_waits"),
        max_replication_lag_seconds=limit("max_replication_lag_seconds"),
        throttled=row["rate_limit"] is not None or row["in_flight_limit"] is not None,
        adaptive_rows_per_second=row["rate_limit"],
        adaptive_in_flight=row["in_flight_limit"],
        effective_in_flight=effective_n,
        effective_rows_per_second=None if effective_r is None else round(effective_r, 1),
        stress=row["stress"],
        last_stress=row["last_stress"],
        stressed_at=row["stressed_at"],
        observed=_observation(row),
        deadline=_deadline(row),
        commit_probe_baseline_ms=row["probe_baseline_ms"],
        commit_probe_baseline_at=row["probe_baseline_at"],
        in_flight=len(slots),
        slots=slots,
        peak_in_flight=row["peak_in_flight"],
        granted=row["granted"],
        denied=row["denied"],
        rows_done=row["rows_done"],
        wait_seconds=round(row["wait_seconds"], 3),
        changed_by=row["changed_by"],
        changed_at=row["changed_at"],
    )


def _observation(row: asyncpg.Record) -> BudgetObservation:
    """The last observation the budget adjusted on, from the budget row."""
    return BudgetObservation(
        rows_per_second=row["observed_rows_per_second"],
        latency_ms_per_1000_rows=row["observed_latency_ms"],
        lock_waits=row["observed_lock_waits"],
        replication_lag_seconds=row["observed_replication_lag"],
        commit_probe_ms=row["observed_probe_ms"],
        commit_probes=row["observed_probes"],
        players_present=row["observed_players_present"],
        busy_fraction=row["observed_busy_fraction"],
        at=row["adjusted_at"],
    )


def _deadline(row: asyncpg.Record) -> BudgetDeadline:
    """The deadline objective as the last adjustment saw it, from the budget row."""
    target, finish = row["deadline_target"], row["projected_finish"]
    return BudgetDeadline(
        binding=row["binding"],
        accounts_left=row["deadline_accounts_left"],
        rows_per_second=None if row["deadline_rows_per_second"] is None else round(row["deadline_rows_per_second"], 1),
        target=target,
        projected_finish=finish,
        on_time=None if target is None or finish is None else finish <= target,
    )


def _least(*values: Any) -> Any:
    """The smallest of the limits given (None: no limit)."""
    given = [v for v in values if v is not None]
    return min(given) if given else None


def _doing(
    enabled: bool, n: int | None, r: float | None, rate_limit: float | None, cap_n: Any, cap_r: Any, in_flight: int
) -> str:
    """The limits in force; a throttle kept while no batch runs is the one the next work starts under."""
    if not enabled:
        return "off: batches run without any limit"
    if n == 0:
        return "paused: no batch may start (max_in_flight 0)"
    rate = "any rate" if r is None else f"at most {r:.0f} rows/s"
    batches = "any number of batches" if n is None else f"at most {n} batch{'es' if n != 1 else ''} in flight"
    capped = cap_n is not None or cap_r is not None
    how = "throttled" if rate_limit is not None else ("capped" if capped else "full speed")
    idle = " (idle: the next work starts under this limit)" if rate_limit is not None and not in_flight else ""
    return f"{how}: {batches}, {rate}{idle}"


def _limited_by(enabled: bool, row: Any, cap_n: Any, cap_r: Any) -> str:
    """The signal (or cap) that sets the limits now, and that the commit probe does not when the last
    adjustment found players absent."""
    if not enabled:
        return "nothing (the budget is off)"
    absent = row["observed_players_present"] is False
    also = f"; {PLAYERS_ABSENT}" if absent else ""
    if row["rate_limit"] is not None or row["in_flight_limit"] is not None:
        if row["stress"] is None and row["last_stress"]:
            return f"{row['limited_by'] or 'growing back'}, after: {row['last_stress']}{also}"
        return (row["limited_by"] or row["stress"] or "stress") + also
    caps = [f"max_in_flight {cap_n}" if cap_n is not None else "", f"rows_per_second {cap_r:g}" if cap_r else ""]
    caps = [c for c in caps if c]
    if caps:
        return "the operator's cap: " + ", ".join(caps) + also
    return f"nothing: {PLAYERS_ABSENT}" if absent else "nothing: no stress signal, no cap"


def _objective(limits: StressLimits, baseline_ms: float | None, row: Any, s: BudgetSettings) -> str:
    """Both objectives and their priority, as the operator reads them."""
    bounds = [f"at most {limits.probe_added_ms:g} ms above its quiet baseline"] if limits.probe_added_ms else []
    if limits.probe_ratio is not None:
        bounds.append(f"at most {limits.probe_ratio:g} x its quiet baseline")
    if limits.probe_max_ms is not None:
        bounds.append(f"at most {limits.probe_max_ms:g} ms")
    text = "players: while players are at work, a player's commit (the commit probe, mean per window) " + " and ".join(
        bounds
    )
    if baseline_ms is not None:
        text += f" (baseline {baseline_ms:.1f} ms)"
    lateness = row["lateness_objective_seconds"] or s.lateness_objective_seconds
    share = row["deadline_max_in_flight"] if row["deadline_max_in_flight"] is not None else s.deadline_max_in_flight
    deadline = (
        f"deadline: every cohort's accounts cleaned within {lateness:g} s of its deadline, granted up to"
        f" {share} batch{'es' if share != 1 else ''} in flight before the players' objective"
    )
    database = f"at most {limits.max_lock_waits} lock waits; replication lag at most {limits.max_lag:g} s"
    return f"{deadline}; {text}; {database}"


class BudgetChange(Model):
    """What `set_budget` changes for every worker. A field left out is left as it is; a limit given
    as None goes back to the workers' LOAD_BUDGET_* default (`model_fields_set` tells the two apart).
    `reset_scale` forgets the adaptive throttle (the work runs unthrottled until the next stress)."""

    enabled: bool | None = None
    max_in_flight: int | None = None
    rows_per_second: float | None = None
    latency_ms: float | None = None
    max_lock_waits: int | None = None
    max_replication_lag_seconds: float | None = None
    probe_ratio: float | None = None
    probe_max_ms: float | None = None
    probe_added_ms: float | None = None
    lateness_objective_seconds: float | None = None
    deadline_max_in_flight: int | None = None
    reset_scale: bool = False

    def pair(self, name: str) -> tuple[bool, Any]:
        """(whether the limit changes, its new value: None is the workers' default)."""
        return name in self.model_fields_set, getattr(self, name)


# The limits `budget set` changes: set_budget takes each as :change_<limit> and :<limit>.
CHANGEABLE = (
    "max_in_flight",
    "rows_per_second",
    "latency_ms",
    "max_lock_waits",
    "max_replication_lag_seconds",
    "probe_ratio",
    "probe_max_ms",
    "probe_added_ms",
    "lateness_objective_seconds",
    "deadline_max_in_flight",
)


async def set_budget(pool: asyncpg.Pool, change: BudgetChange, *, changed_by: str | None = None) -> None:
    """Change the budget for every worker (`change` says what; docs/budget.md, Operator control)."""
    limits: dict[str, Any] = {}
    for name in CHANGEABLE:
        limits[f"change_{name}"], limits[name] = change.pair(name)
    values = SQL.bind(
        "set_budget",
        enabled=change.enabled,
        reset_scale=change.reset_scale,
        changed_by=changed_by or _holder(),
        **limits,
    )
    await pool.execute(SQL.set_budget, *values)
