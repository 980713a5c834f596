"""Run a worker: `deadline-cleanup worker` (or `python worker.py` in a checkout).

Start as many as you like, on as many nodes as you like."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import random
import signal
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import NamedTuple

import asyncpg
from temporalio.client import Client
from temporalio.runtime import Runtime
from temporalio.service import RPCError
from temporalio.worker import Worker

from activities.cleanup import CleanupActivities
from activities.ledger import LedgerActivities
from activities.outbox import OutboxRelayActivities
from activities.planner import PlannerActivities
from budget.controller import LoadBudget
from cleanup.planner import ensure_planner, keep_nudging_planner, watch_planner
from cleanup.retention import keep_pruning
from cleanup.targets import load_targets
from core import addresses, db, fleet, health, logs, metrics, outage
from core.cli import CliParser, add_connection_flags, bounded_int
from core.config import DEFAULT_SETTINGS, Settings
from core.errors import InputError, Unavailable
from core.heartbeat import MAX_HEARTBEAT_THROTTLE
from core.process import exit_now
from core.sessions import StalledSessions
from core.temporal import connect, data_converter, ensure_search_attributes
from workflows import ALL_WORKFLOWS

log = logging.getLogger("worker")


async def build_activities(
    pool: asyncpg.Pool,
    claim_pool: asyncpg.Pool | None = None,
    settings: Settings | None = None,
    budget: LoadBudget | None = None,
) -> list[object]:
    """The activities of every job. `settings`: the worker's (None: the defaults, as a test's worker
    takes); `budget`: the process's load budget (None: one of their own for the cleanup and for the
    ledger)."""
    settings = settings or Settings()
    targets = load_targets(settings.cleanup.targets_file)
    cleanup = await CleanupActivities.create(pool, targets, claim_pool, budget, settings.cleanup)
    # The relay's short statements use the connections kept apart: reminders must not queue behind
    # batches that wait on players' row locks and hold every connection of the main pool.
    relay = OutboxRelayActivities.from_settings(claim_pool or pool, settings.outbox)
    return [
        cleanup.claim_cleanup,
        cleanup.check_account_renewed,
        cleanup.cleanup_partition,
        cleanup.settle_cleanup,
        cleanup.claim_cleanup_in_chunks,
        cleanup.clean_small_cohort,
        relay.relay_outbox_batch,
        *planner_activities(pool),
        *ledger_activities(pool, budget),
    ]


def planner_activities(pool: asyncpg.Pool) -> list[object]:
    planner = PlannerActivities(pool)
    return [planner.plan_deadline_buckets, planner.sweep_overdue_accounts]


async def ensure_planner_running(client: Client, settings: Settings, pool: asyncpg.Pool | None = None) -> bool:
    """Running workers is enough: each one ensures the planner (a running one is kept). True: it runs.
    A planner it starts runs as `settings` say (its own section, and the cleanups' defaults)."""
    try:
        s = settings
        workflow_id, started = await ensure_planner(client, s.task_queue, s.planner, pool, s.cleanup.defaults)
    except RPCError as err:
        log.warning("could not ensure the deadline planner: %s", err.message)
        return False
    log.info("deadline planner %s %s", workflow_id, "started" if started else "already running")
    return True


async def keep_planner_running(
    client: Client,
    settings: Settings,
    seen: Callable[[], None] | None = None,
    pool: asyncpg.Pool | None = None,
) -> None:
    """The planner's watchdog, in every worker that ensures it: a closed or stuck planner is started
    again within `settings.planner_watchdog_seconds` (cleanup.planner.watch_planner), so no failure of the planner's own
    run (a step that failed for good, a termination, a task failing over and over) stops it for long."""
    stuck = 0
    while True:
        await asyncio.sleep(
            settings.planner_watchdog_seconds * random.uniform(0.8, 1.2)
        )  # workers look at different moments
        try:
            outcome, stuck = await watch_planner(
                client, settings.task_queue, stuck, pool, settings.planner, settings.cleanup.defaults
            )
            if seen is not None and outcome != "stuck":  # running, or started again just now
                seen()
        except RPCError as err:  # the server is away: look again next time
            log.warning("could not look at the deadline planner: %s", err.message)


def ledger_activities(pool: asyncpg.Pool, budget: LoadBudget | None = None) -> list[object]:
    ledger = LedgerActivities(pool, budget)
    return [ledger.check_ledger_day, ledger.reconcile_shard, ledger.settle_ledger_date]


class WorkerOptions(NamedTuple):
    """The options of the one `Worker` that `build_worker` builds; `from_settings` takes the
    worker's settings (WORKER_*), the defaults are theirs."""

    max_concurrent_activities: int = 16
    graceful_shutdown_seconds: float = 20.0
    sticky_queue_timeout_seconds: float = 3.0
    workflow_task_polls: int | None = None
    activity_task_polls: int | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> WorkerOptions:
        return cls(
            max_concurrent_activities=settings.max_concurrent_activities,
            graceful_shutdown_seconds=settings.worker_graceful_shutdown_seconds,
            sticky_queue_timeout_seconds=settings.worker_sticky_queue_timeout_seconds,
            workflow_task_polls=settings.worker_workflow_task_polls,
            activity_task_polls=settings.worker_activity_task_polls,
        )


DEFAULT_WORKER_OPTIONS = WorkerOptions()


def build_worker(
    client: Client,
    task_queue: str,
    activities: Sequence[object],
    *,
    extra_workflows: Sequence[type] = (),
    pool: asyncpg.Pool | None = None,
    options: WorkerOptions = DEFAULT_WORKER_OPTIONS,
) -> Worker:
    """With the activities' `pool`, an attempt that lost its database connection waits for the
    database and runs again at once (core.outage) instead of waiting out Temporal's back-off.

    Recovery after a worker dies: its activities are retried elsewhere after their heartbeat
    timeout (core.heartbeat), whose heartbeats reach the server at least every second here; a
    workflow task it held times out after WORKFLOW_TASK_TIMEOUT (core.temporal); a workflow task
    for a workflow it had cached waits `options.sticky_queue_timeout_seconds` on its sticky queue
    first. On SIGTERM it stops polling and hands its sticky queue back to the server at once, so the
    next step of an activity that completes meanwhile starts elsewhere (tests/test_worker_shutdown.py)."""
    probe = functools.partial(db.ping, pool) if pool is not None else None
    return Worker(
        client,
        task_queue=task_queue,
        workflows=[*ALL_WORKFLOWS, *extra_workflows],
        activities=list(activities),  # type: ignore[arg-type]
        max_concurrent_activities=options.max_concurrent_activities,
        graceful_shutdown_timeout=timedelta(seconds=options.graceful_shutdown_seconds),
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=options.sticky_queue_timeout_seconds),
        max_heartbeat_throttle_interval=MAX_HEARTBEAT_THROTTLE,
        max_concurrent_workflow_task_polls=options.workflow_task_polls,
        max_concurrent_activity_task_polls=options.activity_task_polls,
        interceptors=[outage.OutageInterceptor(probe)],
    )


def configure_logs(fmt: str = "text", secrets: Sequence[str] = (), level: int = logging.INFO) -> logging.Handler:
    """The worker's log handler: Temporal IDs on each line, and lost-connection errors kept out of
    WARNING (one line when the database goes away, one when it is back: core.outage)."""
    handler = logs.configure(fmt, level=level, secrets=secrets)
    handler.addFilter(outage.RetriedErrorFilter())
    return handler


async def open_pool(
    url: str, max_size: int, idle_in_transaction_timeout: float | None = None, settings: Settings = DEFAULT_SETTINGS
) -> asyncpg.Pool:
    """The worker's pool; each new connection tells core.outage the database is back. A transaction
    left idle longer than `idle_in_transaction_timeout` (its worker frozen mid-batch) is ended by the
    server, releasing its locks for the retry."""
    return await db.create_pool(
        url,
        max_size=max_size,
        on_connect=outage.OUTAGE.back,
        idle_in_transaction_timeout=idle_in_transaction_timeout,
        settings=settings,
    )


def metrics_runtime(settings: Settings) -> Runtime | None:
    """A runtime exporting metrics (Temporal's and the project's): served for Prometheus when
    `metrics_port` is set, pushed over OTLP when `metrics_otlp_endpoint` is (one or the other)."""
    if settings.metrics_otlp_endpoint is not None:
        if settings.metrics_port is not None:
            raise InputError("set METRICS_PORT (Prometheus) or METRICS_OTLP_ENDPOINT (OTLP), not both")
        runtime = metrics.otlp_runtime(settings.metrics_otlp_endpoint)
        metrics.install(runtime.metric_meter)
        return runtime
    if settings.metrics_port is None:
        return None
    runtime = metrics.runtime(f"{settings.metrics_host}:{settings.metrics_port}")
    metrics.install(runtime.metric_meter)
    return runtime


class WorkerExtras(NamedTuple):
    """What a caller adds to the one worker: workflows and activities beside the project's, a
    callback once it polls, and whether it ensures the deadline planner."""

    workflows: Sequence[type] = ()
    activities: Sequence[object] = ()
    on_ready: Callable[[], None] | None = None
    planner: bool = True


async def run_worker(
    settings: Settings,
    stop: asyncio.Event | None = None,
    *,
    extra_workflows: Sequence[type] = (),
    extra_activities: Sequence[object] = (),
    on_ready: Callable[[], None] | None = None,
    planner: bool = True,
) -> None:
    """The one worker: `python worker.py`, and the harness's and the benchmarks' workers with their
    extra workflows and activities. `planner=False` (or CLEANUP_PLANNER=off) does not ensure the
    deadline planner, for runs that drive cleanups themselves."""
    extras = WorkerExtras(extra_workflows, extra_activities, on_ready, planner)
    # A mistake in the targets file exits 2 naming its file and line before anything is started.
    load_targets(settings.cleanup.targets_file)
    settings = addresses.require(settings)
    assert settings.database_url is not None
    runtime = metrics_runtime(settings)
    if runtime is not None and settings.metrics_port is not None:
        log.info("metrics on http://%s:%s/metrics", settings.metrics_host, settings.metrics_port)
    elif runtime is not None:
        log.info("metrics pushed over OTLP to %s", settings.metrics_otlp_endpoint)
    readiness = health.Readiness(
        namespace=settings.temporal_namespace,
        task_queue=settings.task_queue,
        planner_stale_seconds=3 * settings.planner_watchdog_seconds + 30,  # three missed looks of the watchdog
    )
    probes = await health.serve(readiness, settings.health_host, settings.health_port) if settings.health_port else None
    try:
        await _run_worker(settings, stop, readiness, runtime, extras)
    finally:
        if probes is not None:
            probes.close()


async def _run_worker(
    settings: Settings,
    stop: asyncio.Event | None,
    readiness: health.Readiness,
    runtime: Runtime | None,
    extras: WorkerExtras,
) -> None:
    """Open the pools, connect, poll until `stop`, then shut down gracefully and close the pools."""
    assert settings.database_url is not None
    await db.check_worker_database(settings.database_url, settings)  # never DDL at start-up: `migrate` does it
    pool = await open_pool(
        settings.database_url, settings.pool_max_size, settings.db_idle_in_transaction_timeout_seconds, settings
    )
    readiness.ping_db = functools.partial(db.ping, pool)
    claim_pool = await open_pool(
        settings.database_url, settings.claim_pool_size, settings.db_idle_in_transaction_timeout_seconds, settings
    )
    try:
        readiness.client = client = await connect(settings, runtime=runtime)
        await _check_search_attributes(client, settings.temporal_namespace)
        budget = LoadBudget(pool, settings.budget)  # one per process: its batches, its probes, its idle baseline
        worker = build_worker(
            client,
            settings.task_queue,
            [*(await build_activities(pool, claim_pool, settings, budget)), *extras.activities],
            extra_workflows=extras.workflows,
            pool=pool,
            options=WorkerOptions.from_settings(settings),
        )
        log.info(
            "worker polling %s on %s (payload encryption %s)",
            settings.task_queue,
            settings.temporal_address,
            "on" if settings.payload_encryption_key else "off",
        )
        async with worker:
            tasks = await _start_companions(
                settings, client, pool, readiness, gauges=runtime is not None, extras=extras, budget=budget
            )
            if extras.on_ready is not None:
                extras.on_ready()
            try:
                await (stop or asyncio.Event()).wait()
            finally:
                readiness.polling = False
                for task in tasks:
                    task.cancel()
            log.info(
                "worker shutting down: running activities get %ss to finish or hand their work back",
                settings.worker_graceful_shutdown_seconds,
            )
            stopping = time.monotonic()
        log.info("worker stopped %.1fs after the shutdown began", time.monotonic() - stopping)
    finally:
        await claim_pool.close()
        await pool.close()


async def _check_search_attributes(client: Client, namespace: str) -> None:
    """Register the project's search attributes if missing; without the permission, only a warning."""
    try:
        added = await ensure_search_attributes(client, namespace)
        if added:
            log.info("registered search attributes %s", added)
    except RPCError as err:  # e.g. no operator permission on a managed cluster
        log.warning("could not check search attributes: %s", err.message)


async def _start_companions(
    settings: Settings,
    client: Client,
    pool: asyncpg.Pool,
    readiness: health.Readiness,
    *,
    gauges: bool,
    extras: WorkerExtras,
    budget: LoadBudget,
) -> list[asyncio.Task[None]]:
    """The tasks that run beside a polling worker (cancelled when it stops): the load budget's idle
    probe, the stalled-session watch, the readiness export, the fleet gauges (with metrics on),
    the daily retention run, and the planner's watchdog and its nudges on a registration due soon
    (after ensuring the planner once, unless the planner is off)."""
    tasks: list[asyncio.Task[None]] = [asyncio.create_task(budget.watch())]
    if settings.db_idle_in_transaction_timeout_seconds:
        # A paused client's locks where Postgres' idle-in-transaction timeout does not reach them.
        assert settings.database_url is not None
        stalled = StalledSessions(settings.database_url, settings.db_idle_in_transaction_timeout_seconds)
        tasks.append(asyncio.create_task(stalled.watch()))
    readiness.polling = True
    tasks.append(asyncio.create_task(health.export_readiness(readiness)))
    if gauges:
        tasks.append(asyncio.create_task(fleet.export(pool)))
    # Retention: once a day at a random moment per worker; one prunes at a time (cleanup.retention).
    tasks.append(asyncio.create_task(keep_pruning(pool, settings.cleanup.retention_days, budget)))
    if extras.planner and settings.planner_enabled:
        readiness.planner_expected = True
        if await ensure_planner_running(client, settings, pool):
            readiness.planner_seen()
        watchdog = keep_planner_running(client, settings, readiness.planner_seen, pool)
        tasks.append(asyncio.create_task(watchdog))
        assert settings.database_url is not None
        tasks.append(asyncio.create_task(keep_nudging_planner(client, settings.database_url, settings)))
    return tasks


def build_parser() -> argparse.ArgumentParser:
    """The worker's options; each has an environment variable, named in its help."""
    # A bad value is one line (exit 2), as for every command (core.cli.CliParser).
    parser = CliParser(prog="deadline-cleanup worker", description=__doc__, allow_abbrev=False)
    add_connection_flags(parser)
    parser.add_argument(
        "--metrics-port",
        type=bounded_int(1, 65535),
        help="serve Prometheus /metrics on this port (env: METRICS_PORT; default: off)",
    )
    parser.add_argument(
        "--log-format", choices=["text", "json"], help="log lines as text or JSON (env: LOG_FORMAT; default text)"
    )
    return parser


def main(
    argv: list[str] | None = None,
    *,
    extra_workflows: Sequence[type] = (),
    extra_activities: Sequence[object] = (),
    on_ready: Callable[[], None] | None = None,
    planner: bool = True,
) -> int:
    """`python worker.py`: exit 0 once stopped by SIGINT/SIGTERM, 2 on bad configuration, 75 while
    Temporal or the database is unreachable, 1 on any other error."""
    settings = _settings(build_parser().parse_args(argv))
    if settings is None:
        return 2
    configure_logs(settings.log_format, secrets=sorted(settings.secrets()))
    try:  # a payload key configured but malformed or a placeholder: exit 2 before connecting to anything
        data_converter(settings)
    except InputError as err:
        log.error("bad configuration: %s", err)
        return 2
    extras = WorkerExtras(extra_workflows, extra_activities, on_ready, planner)
    try:
        asyncio.run(_run_until_signalled(settings, extras))
    except InputError as err:  # bad configuration: say what, never echo a secret
        log.error("%s", err)
        return 2
    except Unavailable as err:  # Temporal or the database unreachable: try again later (EX_TEMPFAIL)
        log.error("%s", err)
        return 75
    except Exception:  # logged through the redacting formatter, traceback included
        log.exception("worker stopped on an error")
        return 1
    return 0


def _settings(args: argparse.Namespace) -> Settings | None:
    """The settings from the environment and the flags; None (logged) when they are bad."""
    try:
        return Settings.from_env(
            task_queue=args.task_queue,
            temporal_namespace=args.namespace,
            temporal_address=args.temporal_address,
            database_url=args.database_url,
            metrics_port=args.metrics_port,
            log_format=args.log_format,
        )
    except ValueError as err:  # ConfigError: names the variable, never a secret
        logs.configure("text")
        log.error("bad configuration: %s", err)
        return None


async def _run_until_signalled(settings: Settings, extras: WorkerExtras) -> None:
    """Run the worker until SIGINT or SIGTERM, then let it shut down gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def stop_now() -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_now)
    await run_worker(
        settings,
        stop,
        extra_workflows=extras.workflows,
        extra_activities=extras.activities,
        on_ready=extras.on_ready,
        planner=extras.planner,
    )


if __name__ == "__main__":
    exit_now(main())
