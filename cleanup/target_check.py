"""The start-up check of the declared targets: what passes here cannot fail forever at the deadline.

Read from the live catalog under the worker's own role, each target is judged for what would make
every batch fail alike (a wrong type, an identity or generated archive column, a missing privilege,
a NOT NULL column to null, a cascade nobody counts) or silently alter data (a lossy cast into the
archive); the service's own tables are refused. Each problem names the target, the column and the
fix. The compiled statements are then run once in a rolled-back transaction (cleanup.batches), so
whatever the catalog rules miss fails here, not at the deadline.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import asyncpg

from cleanup.follow_ups import CompiledFollowUp, compile_statement
from cleanup.targets import (
    CleanupTarget,
    CleanupTargets,
    ColumnDefault,
    TargetPlan,
    constant_check_sql,
    constant_text,
    split_name,
)
from core import db
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
RANDOM_TEXT_CHARS = len("anon-") + 36  # a random_columns value in a text column: anon-<uuid>
TINY_TABLE_ROWS = 10_000
"""A table with fewer rows (pg_class.reltuples, summed over partitions) is read whole by each batch
in about a millisecond: its match column needs no index, and the start-up check does not warn."""
TINY_TABLE_PAGES = 64
"""The same bound for a table never analyzed (reltuples unknown): 64 pages of 8 kB, about 512 kB."""
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
class TableSize:
    """How big a table is (the planner's estimate, summed over its partitions) and its usable
    indexes: valid, not partial, by their first key column (what `= ANY(keys)` can search)."""

    rows: float
    analyzed: bool
    pages: int
    indexes: dict[str, str]  # first key column -> an index's name

    @property
    def tiny(self) -> bool:
        if self.analyzed:
            return self.rows < TINY_TABLE_ROWS
        return self.pages < TINY_TABLE_PAGES


@dataclass(frozen=True)
class Table:
    schema: str
    name: str
    columns: dict[str, Column]
    privileges: frozenset[str]
    size: TableSize | None = None

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
    # (schema, table, column) -> why the column's type refuses its set_columns constant
    bad_constants: dict[tuple[str, str, str], str] = field(default_factory=dict)


def service_tables() -> frozenset[str]:
    """The tables the service's own migrations create: never a target."""
    return frozenset(m.lower() for f in MIGRATIONS_DIR.glob("*.sql") for m in _CREATE_TABLE.findall(f.read_text()))


def _table(row: asyncpg.Record, size: TableSize | None = None) -> Table:
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
    return Table(row["schema_name"], row["table_name"], columns, privileges, size)


async def read_catalog(conn: asyncpg.Connection | asyncpg.Pool, targets: CleanupTargets) -> Catalog:
    names = [t.schema_table for t in targets.target] + [
        split_name(t.archive_table) for t in targets.target if t.archive_table
    ]
    schemas, tables = [n[0] for n in names], [n[1] for n in names]
    declared = {"schemas": schemas, "tables": tables}
    rows = await conn.fetch(SQL.target_tables, *SQL.bind("target_tables", **declared))
    service = await conn.fetchrow(SQL.service_schema)
    cascades = [
        Cascade(
            (r["parent_schema"], r["parent_table"]),
            (r["child_schema"], r["child_table"]),
            r["constraint_name"],
            tuple(zip(r["child_columns"], r["parent_columns"], strict=True)),
        )
        for r in await conn.fetch(SQL.cascading_foreign_keys, *SQL.bind("cascading_foreign_keys", **declared))
    ]
    sized = await conn.fetch(SQL.table_sizes, *SQL.bind("table_sizes", **declared))
    sizes = {(r["schema_name"], r["table_name"]): _size(r) for r in sized}
    found = {
        (r["schema_name"], r["table_name"]): _table(r, sizes.get((r["schema_name"], r["table_name"]))) for r in rows
    }
    return Catalog(
        tables=found,
        cascades=cascades,
        service_schema=service["schema_name"] if service else "public",
        role=service["role_name"] if service else "?",
        bad_constants=await _bad_constants(conn, targets, found),
    )


def _size(row: asyncpg.Record) -> TableSize:
    indexes: dict[str, str] = {}
    for name, column in zip(row["index_names"], row["index_columns"], strict=True):
        indexes.setdefault(column, name)
    return TableSize(row["row_estimate"], row["analyzed"], row["pages"], indexes)


async def _bad_constants(
    conn: asyncpg.Connection | asyncpg.Pool, targets: CleanupTargets, tables: dict[tuple[str, str], Table]
) -> dict[tuple[str, str, str], str]:
    """Each set_columns constant its column's type refuses, with the database's reason: cast as the
    cleanup's assignment would, one statement per constant (a handful), each in its own savepoint
    so a refusal leaves an enclosing transaction (the dry run's) usable."""
    bad: dict[tuple[str, str, str], str] = {}
    for t in targets.target:
        table = tables.get(t.schema_table)
        for name, value in t.set_columns.items():
            column = table.columns.get(name) if table else None
            if column is None or isinstance(value, ColumnDefault):
                continue
            try:
                async with _savepoint(conn) as c:
                    await c.fetchval(constant_check_sql(column.type), constant_text(value))
            except (asyncpg.DataError, asyncpg.SyntaxOrAccessError) as err:
                bad[(*t.schema_table, name)] = f"[{err.sqlstate}] {err}"
    return bad


@asynccontextmanager
async def _savepoint(conn: asyncpg.Connection | asyncpg.Pool) -> AsyncIterator[asyncpg.Connection]:
    if isinstance(conn, asyncpg.Pool):
        async with conn.acquire() as c, c.transaction():
            yield c
    else:
        async with conn.transaction():
            yield conn


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


def _check_anonymize(t: CleanupTarget, table: Table, catalog: Catalog, problems: list[str]) -> TargetPlan:
    """Each anonymized column exists, can be set, and takes what its kind writes; the plan knows
    which random_columns are uuid (the others get `anon-<uuid>` text)."""
    uuids: list[str] = []
    for name in t.anonymized_columns:
        col = table.columns.get(name)
        where = f"target {t.label}: column {name!r}"
        if col is None:
            problems.append(f"{where} does not exist in {table.full} (fix: remove it from the target)")
        elif col.generated or col.identity:
            problems.append(f"{where} is generated or an identity: it cannot be set (fix: remove it from the target)")
        elif name in t.null_columns and col.not_null:
            problems.append(
                f"{where} is NOT NULL (fix: erase it with set_columns = {{ {name} = <a constant> }} or "
                f"{{ {name} = {{ default = true }} }}, or ALTER TABLE {table.full} ALTER COLUMN {name} DROP NOT NULL)"
            )
        elif name in t.hash_columns and not _holds_text(col, HEX_HASH_CHARS):
            problems.append(
                f"{where} is {col.type}: a keyed hash is {HEX_HASH_CHARS} hex characters of text "
                f"(fix: erase it by set_columns, or null it; or ALTER TABLE {table.full} ALTER COLUMN {name} TYPE text)"
            )
        elif name in t.set_columns:
            _check_set_column(t, table, col, catalog, problems)
        elif name in t.random_columns:
            if col.type == "uuid":
                uuids.append(name)
            elif not _holds_text(col, RANDOM_TEXT_CHARS):
                problems.append(
                    f"{where} is {col.type}: a random replacement is a uuid, or {RANDOM_TEXT_CHARS} characters of "
                    f"text (anon-<uuid>) (fix: erase it with set_columns instead)"
                )
    return TargetPlan(key_type=table.columns[t.match_column].type, uuid_columns=tuple(uuids))


def _holds_text(col: Column, chars: int) -> bool:
    """Whether a text column holds `chars` characters (text, varchar without a limit or long enough)."""
    varchar = _VARCHAR.match(col.type)
    short = varchar is not None and varchar.group(1) is not None and int(varchar.group(1)) < chars
    return (col.type == "text" or varchar is not None) and not short


def _check_set_column(t: CleanupTarget, table: Table, col: Column, catalog: Catalog, problems: list[str]) -> None:
    where = f"target {t.label}: column {col.name!r}"
    if isinstance(t.set_columns[col.name], ColumnDefault):
        if not col.has_default and col.not_null:
            problems.append(
                f"{where} has no DEFAULT and is NOT NULL: {{ default = true }} would set NULL "
                f"(fix: set a constant, or ALTER TABLE {table.full} ALTER COLUMN {col.name} SET DEFAULT ...)"
            )
        return
    reason = catalog.bad_constants.get((table.schema, table.name, col.name))
    if reason is not None:
        problems.append(
            f"{where} is {col.type}, which refuses the constant {t.set_columns[col.name]!r}: {reason} "
            f"(fix: a constant of type {col.type})"
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
        plan = _check_anonymize(t, table, catalog, problems)
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


@dataclass(frozen=True)
class CheckedFollowUp:
    """A follow-up as the start-up check planned it: its compiled statement, and the privileges its
    plan uses per table (SELECT to read, UPDATE, DELETE or INSERT where it writes), tables in the
    order the plan names them."""

    follow_up: CompiledFollowUp
    privileges: tuple[tuple[str, str], ...]

    @property
    def tables(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t for t, _ in self.privileges))


def _plan_privileges(plan: object) -> list[tuple[str, str]]:
    """(schema.relation, privilege) for every relation an EXPLAIN (FORMAT JSON, VERBOSE) plan names:
    a ModifyTable node's operation (UPDATE, DELETE, INSERT), SELECT for every scan."""
    found: list[tuple[str, str]] = []
    if isinstance(plan, dict):
        if "Relation Name" in plan:
            verb = str(plan["Operation"]).upper() if plan.get("Node Type") == "ModifyTable" else "SELECT"
            found.append((f"{plan.get('Schema', '')}.{plan['Relation Name']}", verb))
        for value in plan.values():
            found += _plan_privileges(value)
    elif isinstance(plan, list):
        for value in plan:
            found += _plan_privileges(value)
    return found


async def check_follow_ups(conn: asyncpg.Connection, targets: CleanupTargets) -> list[CheckedFollowUp]:
    """Compile each follow-up with the recorded key type and plan it (EXPLAIN, never run): a statement
    that does not parse, names a missing table or column, lacks a privilege, or touches the service's
    own tables is refused, named by its file and line, with the fix."""
    if not targets.follow_up:
        return []
    key_type = await conn.fetchval(SQL.recorded_account_key_type) or "text"
    service = await conn.fetchrow(SQL.service_schema)
    service_schema = service["schema_name"] if service else None
    checked: list[CheckedFollowUp] = []
    problems: list[str] = []
    for i, f in enumerate(targets.follow_up):
        compiled = CompiledFollowUp(f.name, f.phase, compile_statement(f.statement, key_type))
        try:
            async with _savepoint(conn) as c:
                raw = await c.fetchval("EXPLAIN (FORMAT JSON, VERBOSE) " + compiled.sql, [])
            plan = json.loads(raw) if isinstance(raw, str) else raw
        except asyncpg.PostgresError as err:
            if db.connection_lost(err):
                raise
            fix = (
                "GRANT the privilege named to the worker's role"
                if err.sqlstate == "42501"
                else f"$1 is a {key_type}[] of the batch's account keys; fix the statement or the schema"
            )
            problems.append(f"{targets.follow_up_label(i)}: [{err.sqlstate}] {err} (fix: {fix})")
            continue
        privileges = list(dict.fromkeys(_plan_privileges(plan)))
        own = [
            t for t in dict.fromkeys(t for t, _ in privileges) if service_schema and t.startswith(f"{service_schema}.")
        ]
        if own:
            problems.append(
                f"{targets.follow_up_label(i)}: touches the service's own tables ({', '.join(own)}): "
                "a follow-up changes the game's tables only"
            )
        checked.append(CheckedFollowUp(compiled, tuple(privileges)))
    if problems:
        raise TargetsRefused(problems)
    return checked
