"""At-least-once delivery on purpose: the tests use the harness's redelivery workflow."""

from harness.redelivery import HarnessRedeliverWorkflow as RedeliverActivityWorkflow
from harness.redelivery import Redelivery

__all__ = ["RedeliverActivityWorkflow", "Redelivery"]
