"""Shared plumbing: configuration, models, database access, embedded services."""
