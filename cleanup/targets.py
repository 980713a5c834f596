"""Declarative cleanup targets, and the one set-based statement they compile into."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.queries import load

DEFAULT_TARGETS_FILE = Path(__file__).resolve().parent / "targets.toml"
IDENTIFIER = r"^[a-z_][a-z0-9_]{0,62}$"
# A table, optionally schema-qualified (`game.users`); unqualified names resolve in the service's
# schema, so a game's table is named with its schema.
TABLE_NAME = r"^([a-z_][a-z0-9_]{0,62}\.)?[a-z_][a-z0-9_]{0,62}$"


class CleanupTarget(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    table: str = Field(pattern=TABLE_NAME)
    match_column: str = Field(default="account_id", pattern=IDENTIFIER)
    action: Literal["delete", "archive"]
    archive_table: str | None = Field(default=None, pattern=TABLE_NAME)

    @model_validator(mode="after")
    def _archive_needs_table(self) -> CleanupTarget:
        if self.action == "archive" and not self.archive_table:
            raise ValueError(f"target {self.table!r}: action 'archive' needs archive_table")
        if self.action == "delete" and self.archive_table:
            raise ValueError(f"target {self.table!r}: archive_table is only for action 'archive'")
        return self


class CleanupTargets(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    target: list[CleanupTarget] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_tables(self) -> CleanupTargets:
        names = [t.table for t in self.target]
        if len(names) != len(set(names)):
            raise ValueError("each table may appear in only one target")
        return self


def load_targets(path: Path | None = None) -> CleanupTargets:
    path = path or Path(os.environ.get("CLEANUP_TARGETS_FILE") or DEFAULT_TARGETS_FILE)
    with open(path, "rb") as f:
        return CleanupTargets.model_validate(tomllib.load(f))


def _q(name: str) -> str:
    """Quote an identifier, or each part of a schema-qualified table name."""
    return ".".join('"' + part.replace('"', '""') + '"' for part in name.split("."))


def compile_partition_batch(targets: CleanupTargets, columns: dict[str, list[str]]) -> str:
    """Build the partition batch statement: claim check, idempotency record, every target, outbox.

    `columns` maps each table to its column names (from the live schema); archive moves copy the
    source columns by name.
    """
    ctes: list[str] = []
    counts: list[str] = []
    for i, t in enumerate(targets.target):
        table, match = _q(t.table), _q(t.match_column)
        # By the applied accounts' keys (`= ANY`), never a join the planner may hash over the table.
        applied = f"t.{match} = ANY (ARRAY(SELECT account_id FROM applied))"
        # Each target's CTE t{i} returns one row per row it removed, with its account (for the receipt).
        if t.action == "delete":
            ctes.append(f"t{i} AS (DELETE FROM {table} t WHERE {applied} RETURNING t.{match}::text AS account_id)")
        else:
            assert t.archive_table is not None
            cols = ", ".join(_q(c) for c in columns[t.table])
            ctes.append(f"t{i}_moved AS (DELETE FROM {table} t WHERE {applied} RETURNING t.*)")
            ctes.append(
                f"t{i} AS (INSERT INTO {_q(t.archive_table)} ({cols}) SELECT {cols} FROM t{i}_moved"
                f" RETURNING {match}::text AS account_id)"
            )
        counts.append(f"(SELECT count(*) FROM t{i}) AS rows_t{i}")
    ctes.append(_receipt_cte(targets))
    template = load(__file__).cleanup_partition_batch
    return template.replace("/*target_ctes*/", ",\n".join(ctes) + ",").replace(
        "/*target_counts*/", ", " + ", ".join(counts)
    )


def _receipt_cte(targets: CleanupTargets) -> str:
    """The erasure receipt of each account applied in this batch, in the batch's transaction: rows
    per declared target (in declared order), counted by account once per target (a grouped count
    joined by key, never a scan of a target's rows per account). Names and counts only."""
    grouped = " ".join(
        f"LEFT JOIN (SELECT account_id, count(*) AS n FROM t{i} GROUP BY account_id) c{i}"
        f" ON c{i}.account_id = a.account_id"
        for i in range(len(targets.target))
    )
    entries = ", ".join(
        f"jsonb_build_object('target', '{t.table}', 'action', '{t.action}', 'rows', coalesce(c{i}.n, 0))"
        for i, t in enumerate(targets.target)
    )
    return (
        "receipts AS (INSERT INTO erasure_receipts (account_id, cleanup_version, cleanup_id, targets)"
        f" SELECT a.account_id, a.cleanup_version, $1, jsonb_build_array({entries}) FROM applied a {grouped}"
        " ON CONFLICT DO NOTHING RETURNING 1)"
    )


_KEYSET_FILTER = "/*batch_filter*/c.account_id > $3"


def subset_statement(batch_sql: str) -> str:
    """The batch statement over an explicit set of accounts ($3 text[], $4 its length) instead of a
    keyset page: what bisection runs on each half of a batch that failed deterministically."""
    if _KEYSET_FILTER not in batch_sql:
        raise ValueError("not a compiled partition batch statement")
    return batch_sql.replace(_KEYSET_FILTER, "c.account_id = ANY($3::text[])")


def compile_target_probes(targets: CleanupTargets, columns: dict[str, list[str]]) -> list[tuple[str, str]]:
    """Per target, its action for one account ($1): run (and rolled back) only for an account
    already isolated as failing, to tell which declared target its error comes from."""
    probes: list[tuple[str, str]] = []
    for t in targets.target:
        table, match = _q(t.table), _q(t.match_column)
        if t.action == "delete":
            probes.append((t.table, f"DELETE FROM {table} t WHERE t.{match} = $1"))
        else:
            assert t.archive_table is not None
            cols = ", ".join(_q(c) for c in columns[t.table])
            probes.append(
                (
                    t.table,
                    f"WITH moved AS (DELETE FROM {table} t WHERE t.{match} = $1 RETURNING t.*) "
                    f"INSERT INTO {_q(t.archive_table)} ({cols}) SELECT {cols} FROM moved",
                )
            )
    return probes


PreviewScope = Literal["cohort", "account"]


def compile_preview(targets: CleanupTargets, scope: PreviewScope) -> str:
    """The dry-run statement: accounts in scope, already renewed, reminders to write and one row
    count per declared target (`rows_t{i}`, in declaration order); $1 is the deadline or the account."""
    counts = [
        f"(SELECT count(*) FROM {_q(t.table)} t JOIN scope s ON t.{_q(t.match_column)} = s.account_id)::int"
        f" AS rows_t{i}"
        for i, t in enumerate(targets.target)
    ]
    where = "a.renewal_deadline = $1" if scope == "cohort" else "a.account_id = $1"
    template = load(__file__).preview_cleanup
    return template.replace("/*scope*/", where).replace("/*target_counts*/", ", " + ", ".join(counts))


# Each declared name (as written: schema-qualified or resolved on the search path) with its columns.
SCHEMA_CHECK = """
SELECT n.name AS table_name, array_agg(a.attname::text ORDER BY a.attnum) AS columns
FROM unnest($1::text[]) AS n (name)
JOIN pg_attribute a ON a.attrelid = to_regclass(n.name) AND a.attnum > 0 AND NOT a.attisdropped
GROUP BY n.name
"""


def check_against_schema(targets: CleanupTargets, columns: dict[str, list[str]]) -> None:
    """Fail at worker start-up, with the entry's name, instead of at the deadline."""
    problems: list[str] = []
    for t in targets.target:
        if t.table not in columns:
            problems.append(f"table {t.table!r} does not exist")
            continue
        if t.match_column not in columns[t.table]:
            problems.append(f"table {t.table!r} has no column {t.match_column!r}")
        if t.archive_table:
            if t.archive_table not in columns:
                problems.append(f"archive table {t.archive_table!r} does not exist")
            else:
                missing = set(columns[t.table]) - set(columns[t.archive_table])
                if missing:
                    problems.append(f"archive table {t.archive_table!r} lacks columns {sorted(missing)} of {t.table!r}")
    if problems:
        raise ValueError("cleanup targets do not match the database: " + "; ".join(problems))
