"""Workflow definitions. Nothing here may import asyncpg (it segfaults when re-imported by the sandbox)."""

from workflows.renewal_cleanup import RenewalCleanupWorkflow

ALL_WORKFLOWS: list[type] = [RenewalCleanupWorkflow]
