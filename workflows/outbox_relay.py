"""OutboxRelayWorkflow: a long-running drain loop over the outbox, one activity per batch.

Runs batches back to back while there is work, sleeps when nothing is due (waking early on a
`nudge` signal), and continues as new every `batches_per_run` batches so its history stays bounded.
Each relay is one workflow ID (`outbox-relay-<n>`); several relays, on as many workers and nodes as
you like, share the outbox safely because the activity claims rows under a lease with SKIP LOCKED.

Deterministic by construction: time comes from the workflow, all I/O is in the activity, which is
called by name so this module never imports asyncpg (see DEVELOPERS.md).
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from outbox.errors import OUTBOX_RETRY
    from outbox.models import (
        RELAY_NUDGE_SIGNAL,
        RELAY_OUTBOX_BATCH,
        RELAY_STATUS_QUERY,
        RELAY_STOP_SIGNAL,
        RELAY_WORKFLOW,
        OutboxRelayInput,
        OutboxRelayStatus,
        RelayBatchInput,
        RelayBatchResult,
        RelayPhase,
        RelayTotals,
    )

_RETRY = OUTBOX_RETRY
# Shortest pause when the outbox is not empty but nothing is due yet (leases, retries later).
_MIN_IDLE = timedelta(milliseconds=200)


@workflow.defn(name=RELAY_WORKFLOW)
class OutboxRelayWorkflow:
    @workflow.init
    def __init__(self, input: OutboxRelayInput) -> None:
        self._input = input
        self._totals = input.totals
        self._phase: RelayPhase = "relaying"
        self._last: RelayBatchResult | None = None
        # Nudges received so far (a carried one counts as received before this run's first batch).
        self._nudges = 1 if input.nudged else 0
        self._stop = False

    @workflow.run
    async def run(self, input: OutboxRelayInput) -> RelayTotals:
        s = input.settings
        batches = 0
        while not self._stop:
            self._set_phase("relaying")
            nudges_before_batch = self._nudges
            result = await workflow.execute_activity(
                RELAY_OUTBOX_BATCH,
                RelayBatchInput(relay_id=input.relay_id, settings=s),
                result_type=RelayBatchResult,
                # The activity stops sending before its lease ends, so the lease bounds its duration.
                start_to_close_timeout=timedelta(seconds=s.lease_seconds + 30),
                # The activity heartbeats while its requests are in flight, so the timeout need not cover one.
                heartbeat_timeout=timedelta(seconds=s.heartbeat_timeout),
                retry_policy=_RETRY,
                summary=f"batch {self._totals.batches + 1}",
            )
            batches += 1
            self._last = result
            self._totals = self._totals.add(result)
            workflow.upsert_memo(
                {"delivered": self._totals.delivered, "dead": self._totals.dead, "batches": self._totals.batches}
            )
            # Short: the activity's last claim found fewer than batch_size due events.
            if result.claimed < s.batch_size * result.claims:
                if input.stop_when_drained and result.pending == 0:
                    self._set_phase("drained")
                    return self._totals
                if result.claimed == 0:
                    await self._idle(result, nudges_before_batch)
            if self._stop:  # arrived during the last batch: finish instead of continuing as new
                break
            if batches >= input.batches_per_run or workflow.info().is_continue_as_new_suggested():
                workflow.continue_as_new(
                    input.model_copy(
                        update={
                            "totals": self._totals.model_copy(update={"runs": self._totals.runs + 1}),
                            # A nudge this run received and has not acted on yet goes to the next run
                            # (a stop never gets here: the relay finishes on it).
                            "nudged": self._nudges != nudges_before_batch,
                        }
                    )
                )
        self._set_phase("stopping")
        return self._totals

    async def _idle(self, result: RelayBatchResult, nudges_before_batch: int) -> None:
        """Sleep until the next event is due (or idle_sleep_seconds), or until nudged or stopped.

        A nudge that arrived while the batch ran may announce events the batch's claim did not see
        yet, so it ends the idle at once: only nudges received before the batch started are cleared.
        """
        self._set_phase("idle")
        wait = timedelta(seconds=self._input.idle_sleep_seconds)
        if result.next_due_in_seconds is not None:
            wait = min(wait, max(_MIN_IDLE, timedelta(seconds=result.next_due_in_seconds)))
        if self._nudges != nudges_before_batch or self._stop:
            return
        condition = lambda: self._nudges != nudges_before_batch or self._stop  # noqa: E731
        try:
            await workflow.wait_condition(condition, timeout=wait, timeout_summary="outbox idle")
        except TimeoutError:
            pass

    def _set_phase(self, phase: RelayPhase) -> None:
        if phase != self._phase or phase == "idle":
            self._phase = phase
            t = self._totals
            workflow.set_current_details(
                f"{phase}: {t.delivered} delivered, {t.retried} retried, {t.dead} dead in {t.batches} batches"
            )

    @workflow.signal(name=RELAY_NUDGE_SIGNAL)
    def nudge(self) -> None:
        """New events were written: look now instead of at the end of the idle sleep."""
        self._nudges += 1

    @workflow.signal(name=RELAY_STOP_SIGNAL)
    def stop(self) -> None:
        """Finish after the batch in flight (its outcomes are recorded first)."""
        self._stop = True

    @workflow.query(name=RELAY_STATUS_QUERY)
    def status(self) -> OutboxRelayStatus:
        return OutboxRelayStatus(
            relay_id=self._input.relay_id, phase=self._phase, totals=self._totals, last_batch=self._last
        )
