"""Shared plumbing: configuration, models, database access, the Temporal connection, the CLI helpers."""
