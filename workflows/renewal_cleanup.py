"""RenewalCleanupWorkflow: sleep to the renewal deadline, claim, clean in partitions, join, settle.

Deterministic by construction: time comes from `workflow.now()`, all I/O is in activities, and
activities are called by name so this module never imports asyncpg (see DEVELOPERS.md).
"""

from __future__ import annotations

import asyncio
import functools
import operator
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from cleanup.errors import CLEANUP_RETRY, FailedToleranceExceeded
    from cleanup.models import (
        CHECK_ACCOUNT_RENEWED,
        CLAIM_CLEANUP,
        CLAIM_CLEANUP_IN_CHUNKS,
        CLEAN_SMALL_COHORT,
        CLEANUP_PARTITION,
        CLEANUP_WORKFLOW,
        RENEWED_SIGNAL,
        SETTLE_CLEANUP,
        STATUS_QUERY,
        AccountRenewalCheck,
        ClaimChunkedInput,
        ClaimCleanupInput,
        ClaimResult,
        CleanupOutcome,
        CleanupPartitionInput,
        CleanupPhase,
        CleanupResult,
        CleanupSettlement,
        CleanupStatus,
        PartitionCounts,
        PartitionReport,
        RenewalCleanupInput,
        RenewalSignal,
        SettleCleanupInput,
        SmallCohortInput,
        SmallCohortResult,
        following_partitions,
    )
    from core import search_attributes as sa
    from core.heartbeat import LONG_STEP_TIMEOUT

T = TypeVar("T")

_RETRY = CLEANUP_RETRY
# A range cohort of one partition claims, cleans and settles in one activity (`clean_small_cohort`)
# instead of a claim, a partition and a settlement (1.0's path, kept for its open runs).
SMALL_COHORT_PATCH = "small-cohort-one-activity"


@workflow.defn(name=CLEANUP_WORKFLOW)
class RenewalCleanupWorkflow:
    @workflow.init
    def __init__(self, input: RenewalCleanupInput) -> None:
        self._input = input
        self._phase: CleanupPhase = "sleeping"
        self._renewal_signals: list[RenewalSignal] = []
        self._signals_checked = 0
        self._claim: ClaimResult | None = None
        self._reports: dict[int, PartitionReport] = {}
        self._settlement: CleanupSettlement | None = None
        self._step_timeout = timedelta(seconds=input.step_timeout_seconds)
        self._overlapped = False
        self._streams = 1
        self._partitions = input.partitions

    @workflow.run
    async def run(self, input: RenewalCleanupInput) -> CleanupResult:
        if await self._sleep_until_deadline():
            await self._settle(ClaimResult(claimed_per_partition=[], skipped_renewed=1, skipped_stale=0))
            return self._result("renewed")

        if self._is_small_cohort(input):
            return await self._clean_small_cohort(input)

        self._set_phase("claiming")
        limit = asyncio.Semaphore(input.max_parallel_partitions)
        if self._overlaps_claim(input):
            # Partitions start with the claim and clean each chunk as it commits; the join waits
            # for the claim and for every partition.
            await asyncio.gather(
                self._claim_then_clean(input),
                *(self._clean_partition(p, limit, follow_claim=True) for p in range(self._partitions)),
            )
            assert self._claim is not None
            claim = self._claim
        else:
            claim = await self._claim_accounts(input)
            self._claim = claim
            self._set_phase("cleaning")
            busy = [p for p, n in enumerate(claim.claimed_per_partition) if n > 0]
            # The join: settlement starts only after every partition with claimed accounts has reported.
            await asyncio.gather(*(self._clean_partition(p, limit) for p in busy))

        await self._settle(claim)
        self._check_failed_tolerance()
        if claim.claimed > 0:
            return self._result("cleaned")
        if input.account_id is not None:
            return self._result("renewed" if claim.skipped_renewed else "stale")
        return self._result("nothing_to_clean")

    def _is_small_cohort(self, input: RenewalCleanupInput) -> bool:
        """A range of one partition, or an instant of one partition started as one (the planner's
        cohorts that fit one batch): one activity."""
        one = input.deadline_until is not None or input.one_activity
        small = input.account_id is None and input.partitions == 1 and one
        return small and workflow.patched(SMALL_COHORT_PATCH)

    async def _clean_small_cohort(self, input: RenewalCleanupInput) -> CleanupResult:
        """Claim, clean and settle in one activity: the same statements, each as safe to run twice,
        so the same exactly-once proofs; one activity and one workflow task instead of three steps."""
        self._set_phase("cleaning")
        done: SmallCohortResult = await workflow.execute_activity(
            CLEAN_SMALL_COHORT,
            SmallCohortInput(
                claim=ClaimChunkedInput(
                    cleanup_id=input.cleanup_id,
                    deadline_from=input.deadline_from,
                    # One instant is the range [deadline, deadline + 1 µs): timestamptz has µs precision.
                    deadline_until=input.deadline_until or input.deadline_from + timedelta(microseconds=1),
                    partitions=1,
                    chunk_size=input.claim_chunk_size,
                ),
                partition=CleanupPartitionInput(
                    cleanup_id=input.cleanup_id,
                    partition_no=0,
                    batch_size=input.batch_size,
                    heartbeat_interval_seconds=input.heartbeat_interval_seconds,
                ),
                deadline=input.deadline_from,
            ),
            result_type=SmallCohortResult,
            start_to_close_timeout=LONG_STEP_TIMEOUT,
            heartbeat_timeout=timedelta(seconds=input.heartbeat_timeout_seconds),
            retry_policy=_RETRY,
            summary="claim, clean and settle",
        )
        self._claim = done.claim
        self._reports[0] = done.report
        self._settlement = done.settlement
        workflow.upsert_memo({"partitions_done": 1})
        self._set_phase("settled")
        self._check_failed_tolerance()
        return self._result("cleaned" if done.claim.claimed > 0 else "nothing_to_clean")

    def _overlaps_claim(self, input: RenewalCleanupInput) -> bool:
        """A cohort of one instant cleans while it claims: its chunks arrive in account order, the
        order of the partitions' keysets, and all its following partitions run at once (none waits
        for the claim to end). Ranges (the planner's buckets and sweeps) and single accounts claim
        first."""
        if input.account_id is not None or input.deadline_until is not None:
            return False
        self._overlapped = True
        self._partitions = following_partitions(input.partitions, input.max_parallel_partitions)
        self._streams = min(input.claim_streams, self._partitions)
        return True

    async def _claim_then_clean(self, input: RenewalCleanupInput) -> None:
        self._claim = await self._claim_accounts(input)
        self._set_phase("cleaning")

    async def _claim_accounts(self, input: RenewalCleanupInput) -> ClaimResult:
        """Cohorts claim in bounded chunks, as a regular heartbeating activity (a 10M-account cohort
        never becomes one statement); a single account is one short statement."""
        if input.account_id is not None:
            return await self._bookkeeping(
                CLAIM_CLEANUP,
                ClaimCleanupInput(
                    cleanup_id=input.cleanup_id,
                    deadline=input.deadline_from,
                    account_id=input.account_id,
                    expected_version=input.expected_version,
                    partitions=input.partitions,
                ),
                ClaimResult,
            )
        # Several streams (partitions following the claim) claim at once, each for its own
        # partitions; their counts add up to the cohort's. One stream is awaited directly, so its
        # command comes before the partitions' (a gather of one would schedule it after them).
        if self._streams == 1:
            return await self._claim_stream(input, 0)
        streams = await asyncio.gather(*(self._claim_stream(input, k) for k in range(self._streams)))
        return functools.reduce(operator.add, streams)

    async def _claim_stream(self, input: RenewalCleanupInput, stream: int) -> ClaimResult:
        return await workflow.execute_activity(  # type: ignore[no-any-return]
            CLAIM_CLEANUP_IN_CHUNKS,
            ClaimChunkedInput(
                cleanup_id=input.cleanup_id,
                deadline_from=input.deadline_from,
                # One instant is the range [deadline, deadline + 1 µs): timestamptz has µs precision.
                deadline_until=input.deadline_until or input.deadline_from + timedelta(microseconds=1),
                partitions=self._partitions,
                chunk_size=input.claim_chunk_size,
                stream=stream,
                streams=self._streams,
            ),
            result_type=ClaimResult,
            start_to_close_timeout=LONG_STEP_TIMEOUT,
            heartbeat_timeout=timedelta(seconds=input.heartbeat_timeout_seconds),
            retry_policy=_RETRY,
            summary="claim" if self._streams == 1 else f"claim stream {stream}",
        )

    async def _sleep_until_deadline(self) -> bool:
        """Sleep durably; for one account, wake on a renewal signal and let the database confirm it."""
        single = self._input.account_id is not None
        while True:
            remaining = self._input.wake_at - workflow.now()
            if remaining <= timedelta(0):
                return False
            try:
                await workflow.wait_condition(
                    lambda: single and len(self._renewal_signals) > self._signals_checked,
                    timeout=remaining,
                    timeout_summary="renewal deadline",
                )
            except TimeoutError:
                return False
            self._signals_checked = len(self._renewal_signals)
            assert self._input.account_id is not None and self._input.expected_version is not None
            renewed = await workflow.execute_activity(
                CHECK_ACCOUNT_RENEWED,
                AccountRenewalCheck(account_id=self._input.account_id, expected_version=self._input.expected_version),
                result_type=bool,
                # One read: a worker that dies in it is noticed as soon as one that dies mid-batch
                # (the heartbeat timeout), not after the step timeout. A slow read is retried, harmlessly.
                start_to_close_timeout=timedelta(seconds=self._input.heartbeat_timeout_seconds),
                retry_policy=_RETRY,
            )
            if renewed:
                self._set_phase("renewed")
                return True

    async def _clean_partition(self, partition_no: int, limit: asyncio.Semaphore, follow_claim: bool = False) -> None:
        async with limit:
            report = await workflow.execute_activity(
                CLEANUP_PARTITION,
                CleanupPartitionInput(
                    cleanup_id=self._input.cleanup_id,
                    partition_no=partition_no,
                    batch_size=self._input.batch_size,
                    heartbeat_interval_seconds=self._input.heartbeat_interval_seconds,
                    follow_claim=follow_claim,
                    claim_streams=self._streams,
                ),
                result_type=PartitionReport,
                start_to_close_timeout=LONG_STEP_TIMEOUT,
                heartbeat_timeout=timedelta(seconds=self._input.heartbeat_timeout_seconds),
                retry_policy=_RETRY,
                summary=f"partition {partition_no}",
            )
        self._reports[partition_no] = report
        workflow.upsert_memo({"partitions_done": len(self._reports)})

    async def _settle(self, claim: ClaimResult) -> None:
        """A single-account cleanup ended by a renewal keeps the phase `renewed` (so
        `CleanupPhase = 'renewed'` finds it)."""
        if self._phase == "renewed":
            self._settlement = await self._settle_activity(claim)
            return
        self._set_phase("settling")
        self._settlement = await self._settle_activity(claim)
        self._set_phase("settled")

    async def _settle_activity(self, claim: ClaimResult) -> CleanupSettlement:
        return await self._bookkeeping(
            SETTLE_CLEANUP,
            SettleCleanupInput(
                cleanup_id=self._input.cleanup_id,
                deadline=self._input.deadline_from,
                account_id=self._input.account_id,
                partitions=self._partitions,
                claim=claim,
                reports=[self._reports[p] for p in sorted(self._reports)],
            ),
            CleanupSettlement,
        )

    def _check_failed_tolerance(self) -> None:
        """Accounts that failed deterministically (cleanup_failed) never block the cohort: it settles
        with them counted. With a tolerance (`--max-failed`) exceeded, the run then fails loudly,
        naming the count and the first reasons."""
        settlement, tolerance = self._settlement, self._input.failed_tolerance()
        if (
            tolerance is not None
            and settlement is not None
            and self._input.failed_exceeds_tolerance(settlement.failed, settlement.claimed)
        ):
            raise FailedToleranceExceeded(settlement.failed, tolerance, settlement.failed_reasons)

    async def _bookkeeping(self, activity: str, arg: Any, result_type: type[T]) -> T:
        """Claim of one account and settlement: short, idempotent statements, run as local
        activities (no task-queue round trip; retried the same way)."""
        return await workflow.execute_local_activity(  # type: ignore[no-any-return]
            activity,
            arg,
            result_type=result_type,
            start_to_close_timeout=self._step_timeout,
            retry_policy=_RETRY,
        )

    def _set_phase(self, phase: CleanupPhase) -> None:
        self._phase = phase
        workflow.upsert_search_attributes([sa.CLEANUP_PHASE.value_set(phase)])

    def _result(self, outcome: CleanupOutcome) -> CleanupResult:
        return CleanupResult(cleanup_id=self._input.cleanup_id, outcome=outcome, settlement=self._settlement)

    @workflow.signal(name=RENEWED_SIGNAL)
    def renewed(self, signal: RenewalSignal) -> None:
        self._renewal_signals.append(signal)

    @workflow.query(name=STATUS_QUERY)
    def status(self) -> CleanupStatus:
        counts = PartitionCounts()
        for report in self._reports.values():
            counts = counts + report.counts
        claim = self._claim
        return CleanupStatus(
            cleanup_id=self._input.cleanup_id,
            phase=self._phase,
            deadline=self._input.deadline_from,
            account_id=self._input.account_id,
            partitions_total=(
                sum(1 for n in claim.claimed_per_partition if n) if claim and not self._overlapped else self._partitions
            ),
            partitions_done=len(self._reports),
            settled=self._settlement is not None,
            renewal_signals=len(self._renewal_signals),
            counts=counts,
            claimed=claim.claimed if claim else None,
            applied=sum(report.applied for report in self._reports.values()),
        )
