"""Workflow definitions. Nothing here may import asyncpg (it segfaults when re-imported by the sandbox)."""

from workflows.deadline_planner import DeadlinePlannerWorkflow
from workflows.ledger_reconciliation import LedgerReconciliationWorkflow, ScheduledLedgerReconciliationWorkflow
from workflows.outbox_relay import OutboxRelayWorkflow
from workflows.renewal_cleanup import RenewalCleanupWorkflow

ALL_WORKFLOWS: list[type] = [RenewalCleanupWorkflow]
ALL_WORKFLOWS.append(OutboxRelayWorkflow)
ALL_WORKFLOWS += [LedgerReconciliationWorkflow, ScheduledLedgerReconciliationWorkflow]
ALL_WORKFLOWS.append(DeadlinePlannerWorkflow)
