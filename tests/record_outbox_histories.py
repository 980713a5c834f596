"""Record the OutboxRelayWorkflow history for the replay tests: `python -m tests.record_outbox_histories [PATH]`.

A `nudge` arrives while the first batch is in flight (so a second batch runs before the relay
idles), then the relay idles and is stopped (`outbox_relay.json`). The batch activity is a stand-in
(no database, no provider): only the workflow's commands are recorded. Runs on the time-skipping
test server, which needs nothing else.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

from temporalio import activity
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from devstack import embedded
from outbox.models import RELAY_OUTBOX_BATCH, OutboxRelayInput, RelayBatchInput, RelayBatchResult
from workflows.outbox_relay import OutboxRelayWorkflow

HISTORIES = Path(__file__).resolve().parent / "histories"


class HeldBatches:
    """Batch 1 is held in flight until released; every batch finds an empty outbox."""

    def __init__(self) -> None:
        self.calls = 0
        self.held = asyncio.Event()
        self.release = asyncio.Event()

    @activity.defn(name=RELAY_OUTBOX_BATCH)
    async def relay_outbox_batch(self, input: RelayBatchInput) -> RelayBatchResult:
        self.calls += 1
        if self.calls == 1:
            self.held.set()
            await self.release.wait()
        return RelayBatchResult(claimed=0, pending=0, due=0)


async def record(path: Path) -> int:
    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=pydantic_data_converter, test_server_existing_path=embedded.test_server_path()
    )
    batches = HeldBatches()
    task_queue = f"record-{uuid.uuid4().hex[:8]}"
    try:
        async with Worker(
            env.client, task_queue=task_queue, workflows=[OutboxRelayWorkflow], activities=[batches.relay_outbox_batch]
        ):
            handle = await env.client.start_workflow(
                OutboxRelayWorkflow.run,
                OutboxRelayInput(relay_id="outbox-relay-recorded", idle_sleep_seconds=600),
                id=f"outbox-relay-recorded-{uuid.uuid4().hex[:6]}",
                task_queue=task_queue,
            )
            await asyncio.wait_for(batches.held.wait(), 30)
            await handle.signal(OutboxRelayWorkflow.nudge)
            batches.release.set()
            for _ in range(600):  # until the relay idles after its last batch (a query, not a sleep race)
                status = await handle.query(OutboxRelayWorkflow.status)
                if status.phase == "idle" and status.totals.batches == batches.calls:
                    break
                await asyncio.sleep(0.05)
            else:
                raise RuntimeError("the relay never went idle")
            await handle.signal(OutboxRelayWorkflow.stop)
            await handle.result()
            history = await handle.fetch_history()
    finally:
        await env.shutdown()
    path.write_text(history.to_json())
    return len(history.events)


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else HISTORIES / "outbox_relay.json"
    print(f"recorded {target.name}: {asyncio.run(record(target))} events")
