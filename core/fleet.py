"""Gauges read from the database for the dashboard and the alerts (deploy/grafana, deploy/prometheus).

Events are counted where they happen (core/metrics.py); what is *pending* (accounts held by a claim,
cleanups in flight, the outbox backlog and its dead letters, the last settled ledger night) is a
state, read here every `interval` seconds by each worker that exports metrics. Every replica reports
the same values; queries take `max()` over them.
"""

from __future__ import annotations

import asyncio
import logging

import asyncpg

from core import metrics
from core.queries import load

log = logging.getLogger(__name__)
SQL = load(__file__, "fleet.sql")
GAUGES = {
    "held_accounts": "held_accounts",
    "cleanups_in_flight": "cleanups_in_flight",
    "outbox_backlog": "outbox_backlog",
    "outbox_dead_letters": "outbox_dead_letters",
    "cleanup_lateness_max_seconds": "lateness_max_15m",
}


async def export_once(pool: asyncpg.Pool) -> None:
    row = await pool.fetchrow(SQL.fleet_state)
    assert row is not None
    for name, column in GAUGES.items():
        metrics.set_gauge(name, row[column])
    if row["ledger_last_settled_date"] is not None:  # no gauge (and no alert) before the first night
        metrics.set_gauge("ledger_last_settled_date_seconds", row["ledger_last_settled_date"])


async def export(pool: asyncpg.Pool, interval: float = 15.0) -> None:
    """Keep the gauges current; a database away for a while leaves the last values (readiness says so)."""
    while True:
        try:
            await export_once(pool)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as err:
            log.debug("could not read the fleet gauges: %s", err)
        await asyncio.sleep(interval)
