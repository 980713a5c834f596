"""The start-up check of the declared targets: what passes here cannot fail forever at the deadline.

Read from the live catalog under the worker's own role, each target is judged for what would make
every batch fail alike (a wrong type, an identity or generated archive column, a missing privilege,
a NOT NULL column to null, a cascade nobody counts) or silently alter data (a lossy cast into the
archive); the service's own tables are refused. Each problem names the target, the column and the
fix. The compiled statements are then run once in a rolled-back transaction (cleanup.batches), so
whatever the catalog rules miss fails here, not at the deadline.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import asyncpg

from cleanup.targets import CleanupTarget, CleanupTargets, TargetPlan, split_name
from core.errors import InputError
from core.queries import MIGRATIONS_DIR, load

SQL = load(__file__, "targets.sql")
# An archive column may be of another type only if every value converts without loss.
WIDENING = {
    "smallint": {"integer", "bigint", "numeric"},
    "integer": {"bigint", "numeric"},
    "bigint": {"numeric"},
    "real": {"double precision"},
    "character varying": {"text"},
}
HEX_HASH_CHARS = 64
_VARCHAR = re.compile(r"^character varying(?:\((\d+)\))?$")
_CREATE_TABLE = re.compile(r"CREATE TABLE (?:IF NOT EXISTS )?(?:\w+\.)?(\w+)", re.IGNORECASE)


class TargetsRefused(InputError):
    """The declared targets cannot work on this database; the message lists every problem with its fix
    (the worker exits 2 at start-up with it, the CLI too)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("cleanup targets refused: " + "; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    not_null: bool
    has_default: bool
    identity: str  # '' / 'a' (GENERATED ALWAYS) / 'd' (BY DEFAULT)
    generated: str  # '' / 's' (stored)


@dataclass(frozen=True)
class Table:
    schema: str
    name: str
    columns: dict[str, Column]
    privileges: frozenset[str]

    @property
    def full(self) -> str:
        return f"{self.schema}.{self.name}"


@dataclass(frozen=True)
class Cascade:
    parent: tuple[str, str]
    child: tuple[str, str]
    constraint: str
    pairs: tuple[tuple[str, str], ...]  # (child column, parent column)


@dataclass
class Catalog:
    tables: dict[tuple[str, str], Table]
    cascades: list[Cascade] = field(default_factory=list)
    service_schema: str = "public"
    role: str = "?"


def service_tables() -> frozenset[str]:
    """The tables the service's own migrations create: never a target."""
    return frozenset(m.lower() for f in MIGRATIONS_DIR.glob("*.sql") for m in _CREATE_TABLE.findall(f.read_text()))


def _table(row: asyncpg.Record) -> Table:
    columns = {
        name: Column(name, type_, nn, hd, ident, gen)
        for name, type_, nn, hd, ident, gen in zip(
            row["columns"],
            row["types"],
            row["not_null"],
            row["has_default"],
            row["identity"],
            row["generated"],
            strict=True,
        )
    }
    privileges = frozenset(p for p in ("SELECT", "INSERT", "UPDATE", "DELETE") if row[f"can_{p.lower()}"])
    return Table(row["schema_name"], row["table_name"], columns, privileges)


async def read_catalog(conn: asyncpg.Connection | asyncpg.Pool, targets: CleanupTargets) -> Catalog:
    names = [t.schema_table for t in targets.target] + [
        split_name(t.archive_table) for t in targets.target if t.archive_table
    ]
    schemas, tables = [n[0] for n in names], [n[1] for n in names]
    rows = await conn.fetch(SQL.target_tables, schemas, tables)
    service = await conn.fetchrow(SQL.service_schema)
    cascades = [
        Cascade(
            (r["parent_schema"], r["parent_table"]),
            (r["child_schema"], r["child_table"]),
            r["constraint_name"],
            tuple(zip(r["child_columns"], r["parent_columns"], strict=True)),
        )
        for r in await conn.fetch(SQL.cascading_foreign_keys, schemas, tables)
    ]
    return Catalog(
        tables={(r["schema_name"], r["table_name"]): _table(r) for r in rows},
        cascades=cascades,
        service_schema=service["schema_name"] if service else "public",
        role=service["role_name"] if service else "?",
    )


def _lossless(source: str, target: str) -> bool:
    if source == target:
        return True
    base_s = re.sub(r"\(.*\)$", "", source)
    if base_s == "numeric" and target == "numeric":
        return True
    sv, tv = _VARCHAR.match(source), _VARCHAR.match(target)
    if sv and tv:
        return tv.group(1) is None or (sv.group(1) is not None and int(tv.group(1)) >= int(sv.group(1)))
    return target in WIDENING.get(base_s, set()) or (base_s == "character varying" and target == "text")


def _grant(table: Table, privilege: str, role: str) -> str:
    fix = (
        "run `starter.py migrate` as the owner (it grants what the targets need), "
        f"or GRANT {privilege} ON {table.full} TO {role}"
    )
    return f"the worker's role {role!r} lacks {privilege} on {table.full} (fix: {fix})"


def _check_archive(t: CleanupTarget, source: Table, archive: Table, role: str, problems: list[str]) -> TargetPlan:
    copy: list[str] = []
    overriding = False
    where = f"target {t.label}: archive {archive.full}"
    for name, col in source.columns.items():
        dest = archive.columns.get(name)
        if dest is None:
            problems.append(
                f"{where} lacks column {name!r} (fix: ALTER TABLE {archive.full} ADD COLUMN {name} {col.type})"
            )
            continue
        if dest.generated:
            continue  # computed again from the copied columns
        if dest.identity == "a":
            overriding = True  # the archived row keeps the source's value (OVERRIDING SYSTEM VALUE)
        if not _lossless(col.type, dest.type):
            problems.append(
                f"{where} column {name!r} is {dest.type}, the source's is {col.type}: the copy would be altered "
                f"or refused (fix: ALTER TABLE {archive.full} ALTER COLUMN {name} TYPE {col.type})"
            )
        copy.append(name)
    for name, dest in archive.columns.items():
        if name not in source.columns and dest.not_null and not (dest.has_default or dest.identity or dest.generated):
            problems.append(
                f"{where} column {name!r} is NOT NULL with no default and not in the source (fix: give it a DEFAULT)"
            )
    if "INSERT" not in archive.privileges:
        problems.append(f"target {t.label}: " + _grant(archive, "INSERT", role))
    return TargetPlan(key_type=source.columns[t.match_column].type, copy_columns=tuple(copy), overriding=overriding)


def _check_anonymize(t: CleanupTarget, table: Table, problems: list[str]) -> None:
    for name in (*t.null_columns, *t.hash_columns):
        col = table.columns.get(name)
        where = f"target {t.label}: column {name!r}"
        if col is None:
            problems.append(f"{where} does not exist in {table.full} (fix: remove it from the target)")
        elif col.generated or col.identity:
            problems.append(f"{where} is generated or an identity: it cannot be set (fix: remove it from the target)")
        elif name in t.null_columns and col.not_null:
            problems.append(
                f"{where} is NOT NULL (fix: hash it instead, "
                f"or ALTER TABLE {table.full} ALTER COLUMN {name} DROP NOT NULL)"
            )
        elif name in t.hash_columns:
            varchar = _VARCHAR.match(col.type)
            short = varchar is not None and varchar.group(1) is not None and int(varchar.group(1)) < HEX_HASH_CHARS
            if not (col.type == "text" or varchar) or short:
                problems.append(
                    f"{where} is {col.type}: a keyed hash is {HEX_HASH_CHARS} hex characters of text "
                    f"(fix: ALTER TABLE {table.full} ALTER COLUMN {name} TYPE text, or null it instead)"
                )


def _check_target(
    t: CleanupTarget, catalog: Catalog, service: frozenset[str], problems: list[str]
) -> TargetPlan | None:
    for declared in (t.table, t.archive_table):
        if declared is None:
            continue
        schema, name = split_name(declared)
        # Anything in the service's schema, and an unqualified name of a service table (a typo away).
        if schema == catalog.service_schema or ("." not in declared and name in service):
            problems.append(f"target {t.label}: {schema}.{name} is one of the service's own tables, never a target")
            return None
    table = catalog.tables.get(t.schema_table)
    if table is None:
        problems.append(
            f"target {t.label}: table {'.'.join(t.schema_table)} does not exist (or the worker's role cannot see it)"
        )
        return None
    if t.match_column not in table.columns:
        problems.append(f"target {t.label}: {table.full} has no column {t.match_column!r} (fix: match_column)")
        return None
    needed = {"delete": ("SELECT", "DELETE"), "archive": ("SELECT", "DELETE"), "anonymize": ("SELECT", "UPDATE")}[
        t.action
    ]
    problems += [f"target {t.label}: " + _grant(table, p, catalog.role) for p in needed if p not in table.privileges]
    plan = TargetPlan(key_type=table.columns[t.match_column].type)
    if t.action == "anonymize":
        _check_anonymize(t, table, problems)
    elif t.action == "archive":
        assert t.archive_table is not None
        archive = catalog.tables.get(split_name(t.archive_table))
        if archive is None:
            problems.append(f"target {t.label}: archive table {t.archive_table} does not exist")
            return None
        plan = _check_archive(t, table, archive, catalog.role, problems)
    return plan


def _check_cascades(targets: CleanupTargets, catalog: Catalog, problems: list[str]) -> None:
    """Every row a cascade removes from a deleted target's table must be removed (and counted) first
    by a target declared before it, on a column of that foreign key referencing the parent's match column."""
    order = list(targets.target)
    for cascade in catalog.cascades:
        for i, parent in enumerate(order):
            if parent.action == "anonymize" or parent.schema_table != cascade.parent:
                continue
            covering = [
                c
                for c in order[:i]
                if c.schema_table == cascade.child
                and c.action != "anonymize"
                and (c.match_column, parent.match_column) in cascade.pairs
            ]
            if covering:
                continue
            child = ".".join(cascade.child)
            refs = [ch for ch, pa in cascade.pairs if pa == parent.match_column]
            fix = (
                f"declare a target on {child} with match_column = {refs[0]!r} before it"
                if refs
                else f"make {child}'s foreign key include a column referencing "
                f"{'.'.join(cascade.parent)}.{parent.match_column} and declare a target on it before this one"
            )
            problems.append(
                f"target {parent.label}: deleting its rows removes rows of {child} by ON DELETE CASCADE "
                f"({cascade.constraint}) that no target counts (fix: {fix})"
            )


def plan_targets(targets: CleanupTargets, catalog: Catalog) -> list[TargetPlan]:
    """Each target's plan on this catalog, or TargetsRefused listing every problem with its fix."""
    problems: list[str] = []
    service = service_tables()
    plans = [_check_target(t, catalog, service, problems) for t in targets.target]
    if not problems:
        _check_cascades(targets, catalog, problems)
    if problems:
        raise TargetsRefused(problems)
    return [p for p in plans if p is not None]
