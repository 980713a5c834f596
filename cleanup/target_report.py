"""What a cleanup does per account, read from the declared targets and the live catalog: each
target's action, match column, the index that finds its rows, the cascades it covers, and for an
anonymized table the columns it changes and those it leaves as they were (`targets check`).

A match column with no usable index on a table that is not tiny (target_check.TINY_TABLE_ROWS) is
reported, not refused: every batch would read that table whole, so the cleanup is slow (and late)
but correct. The worker logs it at start-up and exports it (`cleanup_targets_missing_index`), and
`planner status` shows it for as long as it lasts, each with the `CREATE INDEX CONCURRENTLY`
statement that fixes it.
"""

from __future__ import annotations

from cleanup.target_check import Catalog, CheckedFollowUp
from cleanup.targets import CleanupTarget, CleanupTargets, sql_constant
from core.model import Model


class MissingIndex(Model):
    """A target whose match column no usable index leads with, on a table that is not tiny."""

    target: str
    table: str
    match_column: str
    row_estimate: int
    fix: str


class TargetReport(Model):
    """One declared target, as a cleanup applies it to each account."""

    table: str
    action: str
    match_column: str
    index: str | None  # the usable index leading with the match column (None: every batch reads the table)
    archive_table: str | None = None
    covers_cascades: list[str] = []  # the ON DELETE CASCADE foreign keys whose rows this target removes first
    changed_columns: dict[str, str] = {}  # anonymize: column -> what it becomes
    unchanged_columns: list[str] = []  # anonymize: the columns the row keeps as they were


class FollowUpReport(Model):
    """A declared follow-up statement as a batch runs it: its phase, its statement as compiled ($1
    the batch's account keys, a typed array) and the tables its plan reads or writes."""

    name: str
    phase: str
    statement: str
    tables: list[str]


def describe_follow_ups(checked: list[CheckedFollowUp]) -> list[FollowUpReport]:
    return [
        FollowUpReport(name=c.follow_up.name, phase=c.follow_up.phase, statement=c.follow_up.sql, tables=list(c.tables))
        for c in checked
    ]


class TargetsCheck(Model):
    """`targets check`: the file, the target set's fingerprint, each target, and the missing indexes."""

    file: str
    fingerprint: str
    targets: list[TargetReport]
    missing_indexes: list[MissingIndex]
    follow_ups: list[FollowUpReport] = []  # in declared order; "before" ones run before the targets


def create_index_statement(table: str, column: str) -> str:
    """The statement that gives a match column its index without blocking the game's writes."""
    name = f"{table.rpartition('.')[2]}_{column}_idx"[:63]
    return f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {table} ({column})"


def missing_indexes(targets: CleanupTargets, catalog: Catalog) -> list[MissingIndex]:
    """Each target whose match column has no usable index on a table that is not tiny."""
    missing = []
    for t in targets.target:
        table = catalog.tables.get(t.schema_table)
        size = table.size if table else None
        if table is None or size is None or size.tiny or t.match_column in size.indexes:
            continue
        missing.append(
            MissingIndex(
                target=t.label,
                table=table.full,
                match_column=t.match_column,
                row_estimate=int(size.rows),
                fix=create_index_statement(table.full, t.match_column),
            )
        )
    return missing


def _covered_cascades(i: int, targets: CleanupTargets, catalog: Catalog) -> list[str]:
    """The cascades from a table deleted later whose rows target `i` removes (and counts) first."""
    t = targets.target[i]
    later = [p for p in targets.target[i + 1 :] if p.action != "anonymize"]
    return [
        f"{'.'.join(c.parent)} ON DELETE CASCADE ({c.constraint})"
        for c in catalog.cascades
        if c.child == t.schema_table
        and t.action != "anonymize"
        and any(p.schema_table == c.parent and (t.match_column, p.match_column) in c.pairs for p in later)
    ]


def _changes(t: CleanupTarget) -> dict[str, str]:
    return (
        {c: "NULL" for c in t.null_columns}
        | {c: "keyed hash (pseudonym)" for c in t.hash_columns}
        | {
            c: f"set to {sql_constant(v) if sql_constant(v) == 'DEFAULT' else repr(v)}"
            for c, v in t.set_columns.items()
        }
        | {c: "random (anonymous)" for c in t.random_columns}
    )


def describe_targets(targets: CleanupTargets, catalog: Catalog) -> list[TargetReport]:
    """Each declared target as the cleanup applies it (the targets passed the start-up check)."""
    reports = []
    for i, t in enumerate(targets.target):
        table = catalog.tables.get(t.schema_table)
        size = table.size if table else None
        report = TargetReport(
            table=t.table,
            action=t.action,
            match_column=t.match_column,
            index=size.indexes.get(t.match_column) if size else None,
            archive_table=t.archive_table,
            covers_cascades=_covered_cascades(i, targets, catalog),
        )
        if t.action == "anonymize" and table is not None:
            changed = _changes(t)
            kept = [c for c in table.columns if c not in changed and c != t.match_column]
            report = report.model_copy(update={"changed_columns": changed, "unchanged_columns": kept})
        reports.append(report)
    return reports
