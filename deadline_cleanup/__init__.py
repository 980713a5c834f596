"""The Python front door: one `CleanupClient`, built once from the settings, for every job.

    from deadline_cleanup import CleanupClient, StartCleanup

    async with CleanupClient.connect() as cleanup:  # Settings.from_env(), or connect(settings)
        started = await cleanup.start_cleanup(StartCleanup(account_id="6f1c2a9e-..."))
        print((await cleanup.status(started.workflow_id)).phase)

It holds the Temporal client, the database pool and the settings, so no call carries them; each
method is one operation of the jobs' `operations` modules (what the CLI runs too), with the
settings' defaults (`settings.cleanup.defaults`, `settings.ledger`, ...) filled in. Requests with
options are one model each: `StartCleanup`, `ReconcileRequest`, `RelayBatchSettings`.
"""

from __future__ import annotations

from collections.abc import Generator
from datetime import date, datetime
from types import TracebackType
from typing import Any

import asyncpg
from temporalio.client import Client

from cleanup import operations as cleanup_ops
from cleanup.history import AccountHistory, account_history
from cleanup.inputs import StartCleanup
from cleanup.operations import AccountChange, CleanupListing, CleanupReport, RenewalOutcome, StartedCleanup
from cleanup.planner import PlannerReport, planner_status
from core import addresses, db
from core.config import Settings
from core.temporal import connect
from ledger.models import LedgerReport, StartedReconciliation
from ledger.operations import ReconcileRequest, ledger_status, start_reconciliation
from outbox import operations as outbox_ops
from outbox.models import OutboxStatus, RedeliveredEvent, RelayBatchSettings, StartedRelay

__all__ = ["CleanupClient", "ReconcileRequest", "RelayBatchSettings", "Settings", "StartCleanup"]


class CleanupClient:
    """The jobs' operations on one Temporal client and one pool, with the settings' defaults.
    `close()` (or leaving `async with`) closes the pool; the Temporal client needs no closing."""

    def __init__(self, settings: Settings, client: Client, pool: asyncpg.Pool) -> None:
        self.settings = settings
        self.client = client
        self.pool = pool

    @classmethod
    def connect(cls, settings: Settings | None = None) -> _Connecting:
        """`await CleanupClient.connect()` or `async with CleanupClient.connect() as cleanup`.
        `settings` None: `Settings.from_env()` (the variables of docs/configuration.md)."""
        return _Connecting(settings)

    from_settings = connect

    async def close(self) -> None:
        await self.pool.close()

    # --- accounts -------------------------------------------------------------------------------------

    async def renew(
        self, account_id: str, until: datetime | None = None, *, allow_earlier: bool = False
    ) -> RenewalOutcome:
        """Renew (until `until`, or for good); the database judges it in time or too late."""
        return await cleanup_ops.renew(
            self.client, self.pool, self.settings.task_queue, account_id, until, allow_earlier=allow_earlier
        )

    async def set_deadline(self, account_id: str, deadline: datetime) -> AccountChange:
        return await cleanup_ops.set_deadline(self.pool, account_id, deadline)

    async def hold(self, account_id: str, reason: str) -> AccountChange:
        return await cleanup_ops.hold_account(self.pool, account_id, reason)

    async def release(self, account_id: str) -> AccountChange:
        return await cleanup_ops.release_account(self.pool, account_id)

    async def history(self, account_id: str) -> AccountHistory:
        """The erasure receipt: registrations, renewals, holds, the claim, rows removed per target."""
        return await account_history(self.pool, account_id)

    # --- cleanups -------------------------------------------------------------------------------------

    async def start_cleanup(self, request: StartCleanup) -> StartedCleanup:
        """Start (or find) the cleanup of a cohort or of one account; options left None are the
        settings' defaults, the same as the planner's cleanups take."""
        return await cleanup_ops.start_cleanup(
            self.client, self.pool, self.settings.task_queue, request, self.settings.cleanup.defaults
        )

    async def status(self, workflow_id: str) -> CleanupReport:
        return await cleanup_ops.cleanup_status(self.client, self.pool, workflow_id)

    async def list_cleanups(self, limit: int = 50) -> list[CleanupListing]:
        return await cleanup_ops.list_cleanups(self.client, limit)

    async def planner_status(self) -> PlannerReport:
        return await planner_status(self.client, self.pool, self.settings.task_queue, self.settings.planner)

    # --- the ledger -----------------------------------------------------------------------------------

    async def reconcile(self, request: ReconcileRequest) -> StartedReconciliation:
        """Start (or find) the reconciliation of one business date."""
        return await start_reconciliation(
            self.client, self.pool, self.settings.task_queue, request, self.settings.ledger
        )

    async def ledger_status(self, business_date: date) -> LedgerReport:
        return await ledger_status(self.client, self.pool, business_date)

    # --- the outbox -----------------------------------------------------------------------------------

    async def outbox_status(self, dead_limit: int = 10) -> OutboxStatus:
        return await outbox_ops.outbox_status(self.pool, self.client, dead_limit)

    async def redeliver(self, event_key: str) -> RedeliveredEvent:
        return await outbox_ops.redeliver_event(self.pool, event_key, self.client, self.settings.task_queue)

    async def start_relays(self, relays: int = 1, batch: RelayBatchSettings | None = None) -> list[StartedRelay]:
        """Start (or find) the relays; `batch` None: the defaults, with the outbox settings' heartbeat."""
        batch = batch or RelayBatchSettings(heartbeat_timeout_seconds=self.settings.outbox.heartbeat_timeout_seconds)
        return await outbox_ops.start_relays(self.client, self.settings.task_queue, relays=relays, settings=batch)

    async def stop_relays(self) -> list[str]:
        return await outbox_ops.stop_relays(self.client, self.settings.task_queue)


class _Connecting:
    """What `CleanupClient.connect` returns: awaited, the client; as a context, the client closed after."""

    def __init__(self, settings: Settings | None) -> None:
        self.settings = settings
        self.opened: CleanupClient | None = None

    async def open(self) -> CleanupClient:
        settings = addresses.require(self.settings or Settings.from_env())
        assert settings.database_url is not None  # require refuses a missing address (exit 2)
        client = await connect(settings)
        pool = await db.create_pool(
            settings.database_url, connect_timeout=settings.connect_timeout_seconds, settings=settings
        )
        return CleanupClient(settings, client, pool)

    def __await__(self) -> Generator[Any, None, CleanupClient]:
        return self.open().__await__()

    async def __aenter__(self) -> CleanupClient:
        self.opened = await self.open()
        return self.opened

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self.opened is not None:
            await self.opened.close()
