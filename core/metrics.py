"""The project's own Prometheus counters, on the same endpoint as Temporal's runtime metrics.

Workers started with `METRICS_PORT` (or `worker.py --metrics-port`) build a `temporalio.runtime.Runtime`
with a Prometheus exporter (`runtime()` below); the client and the worker use it, so the SDK's
`temporal_*` metrics and these counters are scraped from one `http://<host>:<port>/metrics`.

Inside an activity the counters go through `activity.metric_meter()`, which labels them with
`namespace`, `task_queue` and `activity_type`; elsewhere through the meter installed with
`install()`; with neither (metrics off, a CLI) they are no-ops. Recording never raises: a metric
must not fail a business step.

Counters (names as scraped; docs/observability.md):
  cleanup_accounts_cleaned            accounts whose cleanup was applied (per committed batch)
  cleanup_duplicates_absorbed         accounts a batch found already applied (a redelivery absorbed)
  cleanup_accounts_skipped{reason}    renewed / stale, counted once when the cleanup settles
  cleanup_settlements                 cleanups settled (counted by the delivery that wrote the row)
  cleanup_accounts_failed             accounts isolated by a deterministic error into cleanup_failed
                                      (per batch; `cleanup retry` counts the ones that fail again)
  ledger_corrections                  ledger corrections written            record_corrections(n)
  ledger_review_rows                  rows sent to manual review            record_review_rows(n)
  outbox_delivered, outbox_dead_lettered   outbox outcomes                  record_outbox(d, x)
  cleanup_lateness_seconds            histogram of cleaned_at - renewal_deadline (the planner reads it)
  planner_overdue_accounts            gauge: active accounts past deadline + grace at the last sweep
  planner_overdue_swept               overdue accounts handed to a sweep cleanup
  cleanup_database_clock_behind_seconds  gauge: the database clock behind a claim's timer (0: in step)
  planner_stranded_recovered          claims of closed cleanups released for re-claiming
  planner_restarts{reason}            the planner started again by a worker's watchdog (closed / stuck)
  load_budget_in_flight_limit         gauge: batches allowed in flight now (budget/controller.py; -1: no limit)
  load_budget_rows_per_second_limit   gauge: rows per second allowed now (-1: no limit)
  load_budget_throttled               gauge: 1 while stress has the budget throttle the work, else 0
  load_budget_stress{signal}          gauge, at each adjustment: 1 for each signal showing stress
                                      (commit_probe, commit_probe_ms, batch_latency, lock_waits, replication_lag)
  load_budget_commit_probe_ms         gauge, at each adjustment: the busy commit probe's mean (the objective's measure)
  load_budget_commit_probe_objective_ms  gauge, at each adjustment: the most it may be (ratio x baseline, or the bound)
  load_budget_players_present         gauge, at each adjustment: 1 when a session not this service's was active
                                      (the commit probe's objective applies), 0 when none was
  load_budget_binding{objective}      gauge, at each adjustment: 1 for the objective that sets the limits
  load_budget_deadline_rows_per_second  gauge, at each adjustment: the rate the deadline objective asks for
  load_budget_projected_lateness_seconds  gauge: how late the last cohort known would finish at the rate granted
  load_budget_rows                    rows done by budgeted batches (rate(): accounts cleaned, payment keys per s)
  load_budget_wait_seconds            histogram: time a batch waited for the budget
  held_accounts, cleanups_in_flight   gauges (core/fleet.py): accounts in 'cleaning', the claims holding them
  cleanup_lateness_max_seconds        gauge: the largest lateness of the cleanups of the last 15 minutes
  outbox_backlog, outbox_dead_letters gauges: outbox events pending / dead-lettered now
  ledger_last_settled_date_seconds    gauge: the last settled ledger business date (Unix time of its 00:00 UTC)
  worker_ready                        gauge: 1 when the worker's readiness checks pass (core/health.py)
  cleanup_targets_missing_index       gauge, at the worker's start-up check: targets whose match column
                                      has no usable index on a table that is not tiny (docs/targets.md)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta

from temporalio import activity
from temporalio.common import MetricMeter
from temporalio.runtime import OpenTelemetryConfig, PrometheusConfig, Runtime, TelemetryConfig

log = logging.getLogger(__name__)

_installed: MetricMeter | None = None

DESCRIPTIONS: dict[str, str] = {
    "cleanup_accounts_cleaned": "accounts whose cleanup was applied",
    "cleanup_duplicates_absorbed": "accounts found already applied by a repeated batch (no second effect)",
    "cleanup_accounts_skipped": "accounts not cleaned because they were renewed or their job was stale",
    "cleanup_settlements": "cleanup settlements written",
    "cleanup_accounts_failed": "accounts isolated by a deterministic error and recorded in cleanup_failed",
    "ledger_corrections": "ledger corrections written",
    "ledger_review_rows": "ledger rows sent to manual review",
    "outbox_delivered": "outbox events delivered",
    "outbox_dead_lettered": "outbox events dead-lettered after their last attempt",
    "cleanup_lateness_seconds": "seconds from an account's renewal deadline to its cleanup commit",
    "planner_overdue_accounts": "active accounts past their deadline (and the sweep grace) at the last sweep",
    "cleanup_database_clock_behind_seconds": "how far the database clock was behind the timer of the last claim "
    "that found it more than 30 s behind (0: in step)",
    "planner_overdue_swept": "overdue accounts handed to a sweep cleanup by the planner",
    "planner_stranded_recovered": "claims of closed cleanups released by the planner for re-claiming",
    "planner_restarts": "times a worker's watchdog started the deadline planner again (it was closed or stuck)",
    "load_budget_in_flight_limit": "batches the load budget allows in flight now (-1: no limit)",
    "load_budget_rows_per_second_limit": "rows per second the load budget allows now (-1: no limit)",
    "load_budget_throttled": "1 while stress has the load budget throttle the work, else 0",
    "load_budget_stress": "1 for each signal that showed stress at the load budget's last adjustment",
    "load_budget_commit_probe_ms": "the busy commit probe's mean at the load budget's last adjustment",
    "load_budget_commit_probe_objective_ms": "the most the commit probe's mean may be (the players' objective)",
    "load_budget_players_present": "1 when a session not this service's was active at the load budget's last "
    "adjustment (the commit probe's objective applies), else 0",
    "load_budget_binding": "1 for the objective that set the load budget's limits at its last adjustment",
    "load_budget_deadline_rows_per_second": "the rate the deadline objective asked for at the last adjustment",
    "load_budget_projected_lateness_seconds": "how late the last cohort would finish at the rate granted",
    "load_budget_rows": "rows done by batches under the load budget",
    "load_budget_wait_seconds": "seconds a batch waited for the load budget",
    "held_accounts": "accounts in 'cleaning' now: claimed by a cleanup that has not settled them yet",
    "cleanups_in_flight": "cleanups holding claimed accounts now",
    "cleanup_lateness_max_seconds": "largest cleaned_at - renewal_deadline of the cleanups of the last 15 minutes",
    "outbox_backlog": "outbox events waiting to be delivered",
    "outbox_dead_letters": "outbox events dead-lettered (need an operator)",
    "ledger_last_settled_date_seconds": "the last settled ledger business date, as Unix time of its 00:00 UTC",
    "cleanup_targets_missing_index": "targets whose match column has no usable index on a table that is not tiny "
    "(at the worker's start-up check)",
    "worker_ready": "1 when the worker's readiness checks pass (database, task queue polls, planner), else 0",
}
LATENESS_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0]


HISTOGRAM_BUCKETS = {"cleanup_lateness_seconds": LATENESS_BUCKETS, "load_budget_wait_seconds": LATENESS_BUCKETS}


def runtime(bind_address: str) -> Runtime:
    """A Temporal runtime exporting Prometheus metrics on `bind_address` (`host:port`)."""
    return Runtime(
        telemetry=TelemetryConfig(
            metrics=PrometheusConfig(bind_address=bind_address, histogram_bucket_overrides=HISTOGRAM_BUCKETS)
        )
    )


def otlp_runtime(url: str) -> Runtime:
    """A Temporal runtime pushing the same metrics over OTLP (gRPC; an `http://` or `https://` collector
    URL) every 10 s, with the same names and units as the Prometheus endpoint's."""
    return Runtime(
        telemetry=TelemetryConfig(
            metrics=OpenTelemetryConfig(
                url=url,
                metric_periodicity=timedelta(seconds=10),
                histogram_bucket_overrides=HISTOGRAM_BUCKETS,
            )
        )
    )


COUNTERS = (
    "cleanup_accounts_cleaned",
    "cleanup_duplicates_absorbed",
    "cleanup_accounts_skipped",
    "cleanup_settlements",
    "cleanup_accounts_failed",
    "ledger_corrections",
    "ledger_review_rows",
    "outbox_delivered",
    "outbox_dead_lettered",
    "planner_overdue_swept",
    "planner_stranded_recovered",
    "planner_restarts",
)


def install(meter: MetricMeter | None) -> None:
    """The meter used outside activities (e.g. `runtime.metric_meter`); `None` turns that off.

    Every counter is declared at 0 here, so `increase()` and the alert rules see a 0 from the
    worker's start instead of no series until the first event."""
    global _installed
    _installed = meter
    if meter is not None:
        for name in COUNTERS:
            meter.create_counter(name, DESCRIPTIONS[name]).add(0)


def _meter() -> MetricMeter | None:
    if activity.in_activity():
        try:
            return activity.metric_meter()
        except RuntimeError:  # a non-threaded sync activity has no meter
            return None
    return _installed


def _record(name: str, record: Callable[[MetricMeter], None]) -> None:
    """Call `record` with the current meter: nothing without one, and a failure is logged, never
    raised (a metric must never fail a business step)."""
    try:
        meter = _meter()
        if meter is not None:
            record(meter)
    except Exception:
        log.debug("could not record metric %s", name, exc_info=True)


def count(name: str, value: int, attributes: Mapping[str, str] | None = None) -> None:
    """Add `value` to counter `name` (declared in DESCRIPTIONS); zero and negative values are ignored."""
    if value > 0:
        _record(name, lambda m: m.create_counter(name, DESCRIPTIONS.get(name)).add(value, _attrs(attributes)))


def set_count_gauge(name: str, value: int, attributes: Mapping[str, str] | None = None) -> None:
    """Set the integer gauge `name` (declared in DESCRIPTIONS): counts, flags (1/0), limits (-1: none)."""
    _record(name, lambda m: m.create_gauge(name, DESCRIPTIONS[name]).set(value, _attrs(attributes)))


def set_gauge(name: str, value: float) -> None:
    """Set the gauge `name` (declared in DESCRIPTIONS) to a float."""
    _record(name, lambda m: m.create_gauge_float(name, DESCRIPTIONS[name]).set(float(value)))


def observe(name: str, seconds: Iterable[float]) -> None:
    """One observation per value in the histogram `name` (declared in DESCRIPTIONS); negative
    durations (clocks a little apart) count as 0."""

    def record(meter: MetricMeter) -> None:
        histogram = meter.create_histogram_float(name, DESCRIPTIONS[name])
        for value in seconds:
            histogram.record(max(0.0, value))

    _record(name, record)


def _attrs(attributes: Mapping[str, str] | None) -> dict[str, str] | None:
    return dict(attributes) if attributes else None


# --- cleanup (activities/cleanup.py) ---------------------------------------------------------------


def record_cleanup_batch(*, cleaned: int, already_applied: int, failed: int = 0) -> None:
    count("cleanup_accounts_cleaned", cleaned)
    count("cleanup_duplicates_absorbed", already_applied)
    count("cleanup_accounts_failed", failed)


def record_cleanup_settled(*, skipped_renewed: int, skipped_stale: int) -> None:
    count("cleanup_settlements", 1)
    count("cleanup_accounts_skipped", skipped_renewed, {"reason": "renewed"})
    count("cleanup_accounts_skipped", skipped_stale, {"reason": "stale"})


# --- ledger and outbox (for their owners to call) --------------------------------------------------


def record_corrections(n: int) -> None:
    """Call once per committed shard/batch with the corrections that commit actually inserted."""
    count("ledger_corrections", n)


def record_review_rows(n: int) -> None:
    """Call once per committed shard/batch with the review rows that commit actually inserted."""
    count("ledger_review_rows", n)


def record_outbox(delivered: int, dead: int) -> None:
    """Call once per relay batch with the events it marked delivered and dead-lettered."""
    count("outbox_delivered", delivered)
    count("outbox_dead_lettered", dead)


# --- planner (cleanup/planner.py) -------------------------------------------------------------------


def record_lateness(seconds: Iterable[float]) -> None:
    """One observation per cleanup: seconds from its renewal deadline to its cleanup commit."""
    observe("cleanup_lateness_seconds", seconds)


def set_overdue(n: int) -> None:
    set_count_gauge("planner_overdue_accounts", n)


def set_database_clock_behind(seconds: float) -> None:
    set_gauge("cleanup_database_clock_behind_seconds", max(0.0, seconds))


def record_overdue_swept(n: int) -> None:
    count("planner_overdue_swept", n)


def record_stranded(n: int) -> None:
    count("planner_stranded_recovered", n)


def record_planner_restart(reason: str) -> None:
    count("planner_restarts", 1, {"reason": reason})


# --- load budget (budget/controller.py) -------------------------------------------------------------------


STRESS_SIGNALS = ("commit_probe", "commit_probe_ms", "batch_latency", "lock_waits", "replication_lag")


def set_budget(in_flight_limit: int | None, rows_per_second: float | None) -> None:
    """The budget as the last acquire saw it (None: no limit, exported as -1)."""
    set_count_gauge("load_budget_in_flight_limit", -1 if in_flight_limit is None else in_flight_limit)
    set_gauge("load_budget_rows_per_second_limit", -1.0 if rows_per_second is None else rows_per_second)


def set_budget_verdict(
    throttled: bool,
    signals: Iterable[str],
    probe_ms: float | None,
    objective_ms: float | None,
    players_present: bool,
) -> None:
    """What the budget's last adjustment decided and why: the signals whose stress held the work
    back, the commit probe against its objective, whether players were present (without them the
    commit probe holds nothing back)."""
    set_count_gauge("load_budget_throttled", int(throttled))
    set_count_gauge("load_budget_players_present", int(players_present))
    stressed = set(signals)
    for signal in STRESS_SIGNALS:
        set_count_gauge("load_budget_stress", int(signal in stressed), {"signal": signal})
    if probe_ms is not None:
        set_gauge("load_budget_commit_probe_ms", probe_ms)
    if objective_ms is not None:
        set_gauge("load_budget_commit_probe_objective_ms", objective_ms)


BINDINGS = ("none", "players", "database", "deadline", "deadline, at its hard share")


def set_budget_objectives(binding: str, deadline_rows_per_second: float, projected_lateness: float | None) -> None:
    """Which objective sets the budget's limits (1 for the one that binds), the rate the deadline
    objective asks for, and how late the last cohort known would finish at the rate granted."""
    for name in BINDINGS:
        set_count_gauge("load_budget_binding", int(name == binding), {"objective": name})
    set_gauge("load_budget_deadline_rows_per_second", deadline_rows_per_second)
    if projected_lateness is not None:
        set_gauge("load_budget_projected_lateness_seconds", projected_lateness)


def record_budget_rows(n: int) -> None:
    count("load_budget_rows", n)


def record_budget_wait(seconds: float) -> None:
    observe("load_budget_wait_seconds", [seconds])


# --- health (core/health.py) ------------------------------------------------------------------------


def set_ready(ready: bool) -> None:
    set_count_gauge("worker_ready", int(ready))


def set_targets_missing_index(n: int) -> None:
    set_count_gauge("cleanup_targets_missing_index", n)
