"""A workflow for the key-rotation test: its input and result are payloads the codec encrypts.
Only temporalio here: the sandbox re-imports this module."""

from __future__ import annotations

from temporalio import workflow


@workflow.defn(name="KeyRotationProbe")
class KeyRotationProbe:
    def __init__(self) -> None:
        self._go = False

    @workflow.run
    async def run(self, text: str, wait: bool) -> str:
        if wait:
            await workflow.wait_condition(lambda: self._go)
        return f"echo {text}"

    @workflow.signal
    def go(self) -> None:
        self._go = True
