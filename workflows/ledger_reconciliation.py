"""Nightly payment-ledger reconciliation: one business date, shards fanned out, joined, settled once.

`LedgerReconciliationWorkflow` reconciles one date under the ID `ledger-reconciliation-{date}`.
`ScheduledLedgerReconciliationWorkflow` is the Temporal Schedule's action: a schedule's arguments
are fixed and it appends the scheduled time to the workflow ID, so this thin parent derives the
business date from its scheduled time and starts the date-keyed child; if a run of that date
already exists (a manual run, an earlier backfill), the date is already taken care of.

Deterministic by construction: time comes from the scheduled-time search attribute or
`workflow.info()`, all I/O is in activities, and activities are called by name so this module
never imports asyncpg (see DEVELOPERS.md).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import (
    SearchAttributeKey,
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import WorkflowAlreadyStartedError

with workflow.unsafe.imports_passed_through():
    from core import search_attributes as sa
    from core.heartbeat import LONG_STEP_TIMEOUT
    from ledger.errors import LEDGER_RETRY
    from ledger.models import (
        CHECK_LEDGER_DAY,
        LEDGER_WORKFLOW,
        RECONCILE_SHARD,
        SCHEDULED_LEDGER_WORKFLOW,
        SETTLE_LEDGER_DATE,
        STATUS_QUERY,
        LedgerDay,
        LedgerDayCheck,
        LedgerPhase,
        LedgerReconciliationInput,
        LedgerReconciliationResult,
        LedgerSettlement,
        LedgerStatus,
        ReconcileShardInput,
        ScheduledLedgerInput,
        ScheduledLedgerResult,
        SettleLedgerInput,
        ShardReport,
        business_date_at,
        ledger_workflow_id,
    )

_RETRY = LEDGER_RETRY

# Set by the Temporal server on every workflow a schedule starts (backfills included).
SCHEDULED_START_TIME = SearchAttributeKey.for_datetime("TemporalScheduledStartTime")


@workflow.defn(name=LEDGER_WORKFLOW)
class LedgerReconciliationWorkflow:
    @workflow.init
    def __init__(self, input: LedgerReconciliationInput) -> None:
        self._input = input
        self._phase: LedgerPhase = "checking"
        self._reports: dict[int, ShardReport] = {}
        self._settlement: LedgerSettlement | None = None

    @workflow.run
    async def run(self, input: LedgerReconciliationInput) -> LedgerReconciliationResult:
        workflow.upsert_search_attributes([sa.BUSINESS_DATE.value_set(input.business_date.isoformat())])
        await workflow.execute_activity(
            CHECK_LEDGER_DAY,
            LedgerDayCheck(business_date=input.business_date, shards=input.shards),
            result_type=LedgerDay,
            start_to_close_timeout=timedelta(minutes=1),
            retry_policy=_RETRY,
        )

        self._phase = "reconciling"
        limit = asyncio.Semaphore(min(input.max_parallel, input.shards))
        # The join: settlement starts only after every shard has reported.
        await asyncio.gather(*(self._reconcile_shard(shard, limit) for shard in range(input.shards)))

        self._phase = "settling"
        self._settlement = await workflow.execute_activity(
            SETTLE_LEDGER_DATE,
            SettleLedgerInput(
                business_date=input.business_date,
                shards=input.shards,
                workflow_id=workflow.info().workflow_id,
                # Same command either way (no patch needed): only the payload says why a revision.
                reason=(f"re-check {workflow.info().workflow_id}" if input.recheck else None),
            ),
            result_type=LedgerSettlement,
            # A few aggregate statements that heartbeat while they run: a worker killed during them
            # is noticed within the heartbeat timeout (the start-to-close is only a backstop).
            # Timeouts are not part of replay determinism.
            start_to_close_timeout=timedelta(minutes=1),
            heartbeat_timeout=timedelta(seconds=input.heartbeat_timeout_seconds),
            retry_policy=_RETRY,
        )
        self._phase = "settled"
        return LedgerReconciliationResult(
            business_date=input.business_date,
            workflow_id=workflow.info().workflow_id,
            settlement=self._settlement,
            shards=[self._reports[s] for s in sorted(self._reports)],
        )

    async def _reconcile_shard(self, shard: int, limit: asyncio.Semaphore) -> None:
        async with limit:
            report = await workflow.execute_activity(
                RECONCILE_SHARD,
                ReconcileShardInput(
                    business_date=self._input.business_date,
                    shard=shard,
                    shards=self._input.shards,
                    batch_size=self._input.batch_size,
                    tolerance_cents=self._input.tolerance_cents,
                    workflow_id=workflow.info().workflow_id,
                ),
                result_type=ShardReport,
                start_to_close_timeout=LONG_STEP_TIMEOUT,
                heartbeat_timeout=timedelta(seconds=self._input.heartbeat_timeout_seconds),
                retry_policy=_RETRY,
                summary=f"shard {shard}",
            )
        self._reports[shard] = report

    @workflow.query(name=STATUS_QUERY)
    def status(self) -> LedgerStatus:
        reports = self._reports.values()
        return LedgerStatus(
            business_date=self._input.business_date,
            phase=self._phase,
            shards_total=self._input.shards,
            shards_done=len(self._reports),
            discrepancies_found=sum(r.discrepancies_found for r in reports),
            corrected=sum(r.corrected for r in reports),
            sent_to_review=sum(r.sent_to_review for r in reports),
            settled=self._settlement is not None,
        )


@workflow.defn(name=SCHEDULED_LEDGER_WORKFLOW)
class ScheduledLedgerReconciliationWorkflow:
    """The schedule's action: derive the business date, then start (or find) the date's run."""

    @workflow.run
    async def run(self, input: ScheduledLedgerInput) -> ScheduledLedgerResult:
        info = workflow.info()
        if input.business_date is not None:
            business_date = input.business_date
        else:
            # The scheduled time, not the wall clock: a backfill of last week gets last week's dates.
            scheduled = info.typed_search_attributes.get(SCHEDULED_START_TIME) or info.workflow_start_time
            business_date = business_date_at(scheduled, input.time_zone, input.days_before)
        workflow.upsert_search_attributes([sa.BUSINESS_DATE.value_set(business_date.isoformat())])
        child_id = ledger_workflow_id(business_date, input.id_prefix)
        child_input = LedgerReconciliationInput.of(input, business_date)
        try:
            handle = await workflow.start_child_workflow(
                LedgerReconciliationWorkflow.run,
                child_input,
                id=child_id,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                # A terminated parent must not take the date's reconciliation down with it.
                parent_close_policy=workflow.ParentClosePolicy.ABANDON,
                search_attributes=TypedSearchAttributes(
                    [SearchAttributePair(sa.BUSINESS_DATE, business_date.isoformat())]
                ),
                static_summary=f"ledger reconciliation of {business_date.isoformat()}",
            )
        except WorkflowAlreadyStartedError:
            # A manual run or an earlier scheduled run owns this date: it is done or in progress.
            return ScheduledLedgerResult(business_date=business_date, workflow_id=child_id, outcome="already_started")
        result = await handle
        return ScheduledLedgerResult(
            business_date=business_date,
            workflow_id=child_id,
            outcome="reconciled",
            settlement=result.settlement,
        )
