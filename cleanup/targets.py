"""Declarative cleanup targets, and the one set-based statement they compile into.

A target names a table (schema-qualified; unqualified means `public`), the column holding the
account key (`match_column`, of any type: text, uuid, bigint, ...) and an action: `delete`,
`archive` (move the rows into `archive_table`) or `anonymize` (keep the row: `null_columns` set
to NULL, `hash_columns` replaced by a keyed hash, so a UNIQUE column stays unique). The same table
may appear in several targets with different match columns (a friendship matched by either side).

Targets apply in declared order within the batch's one statement (each waits for the one before),
so children come before their parents. Rows an `ON DELETE CASCADE` would remove are counted, not
missed: every table a cascade reaches from a deleted target must itself be declared before it,
matching on a column of that foreign key that references the parent's match column, so its own
target removes (and counts) exactly the rows the cascade would, and the cascade finds none left.
The start-up check (cleanup.schema_check) refuses any other cascade.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.config import CleanupSettings, read
from core.queries import load

DEFAULT_TARGETS_FILE = Path(__file__).resolve().parent / "targets.toml"
IDENTIFIER = r"^[a-z_][a-z0-9_]{0,62}$"
QUALIFIED = r"^([a-z_][a-z0-9_]{0,62}\.)?[a-z_][a-z0-9_]{0,62}$"
DEFAULT_SCHEMA = "public"
ANONYMIZE_KEY_ENV = "CLEANUP_ANONYMIZE_KEY"
MIN_ANONYMIZE_KEY_BYTES = 16
# The keyed hash of an anonymized column: HMAC-SHA256 in core Postgres (no pgcrypto), its inner
# and outer padded keys bound as parameters (never in the statement's text), hex-encoded (64 chars).
HMAC_BLOCK = 64


def split_name(name: str) -> tuple[str, str]:
    """`schema.table` -> (schema, table); an unqualified name is in `public`."""
    schema, _, table = name.rpartition(".")
    return schema or DEFAULT_SCHEMA, table


def q(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def qualified(name: str) -> str:
    schema, table = split_name(name)
    return f"{q(schema)}.{q(table)}"


class CleanupTarget(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    table: str = Field(pattern=QUALIFIED)
    match_column: str = Field(default="account_id", pattern=IDENTIFIER)
    action: Literal["delete", "archive", "anonymize"]
    archive_table: str | None = Field(default=None, pattern=QUALIFIED)
    null_columns: tuple[str, ...] = ()
    hash_columns: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _keys_fit_the_action(self) -> CleanupTarget:
        name = f"target {self.table!r}"
        if self.action == "archive" and not self.archive_table:
            raise ValueError(f"{name}: action 'archive' needs archive_table")
        if self.action != "archive" and self.archive_table:
            raise ValueError(f"{name}: archive_table is only for action 'archive'")
        if self.action == "anonymize":
            if not (self.null_columns or self.hash_columns):
                raise ValueError(f"{name}: action 'anonymize' needs null_columns or hash_columns")
        elif self.null_columns or self.hash_columns:
            raise ValueError(f"{name}: null_columns and hash_columns are only for action 'anonymize'")
        columns = [*self.null_columns, *self.hash_columns]
        bad = [c for c in columns if not _is_identifier(c)]
        if bad:
            raise ValueError(f"{name}: not a column name: {bad}")
        if len(columns) != len(set(columns)):
            raise ValueError(f"{name}: a column is listed twice in null_columns/hash_columns")
        if self.match_column in columns:
            raise ValueError(f"{name}: the match column {self.match_column!r} cannot be nulled or hashed")
        return self

    @property
    def label(self) -> str:
        """How messages name the target: its table, and its match column when that is not the default."""
        return self.table if self.match_column == "account_id" else f"{self.table} ({self.match_column})"

    @property
    def schema_table(self) -> tuple[str, str]:
        return split_name(self.table)


def _is_identifier(name: str) -> bool:
    return re.fullmatch(IDENTIFIER, name) is not None


class CleanupTargets(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    target: list[CleanupTarget] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_target_per_table_and_column(self) -> CleanupTargets:
        keys = [(t.schema_table, t.match_column) for t in self.target]
        if len(keys) != len(set(keys)):
            raise ValueError("a table may appear in several targets only with different match_columns")
        anonymized = {t.schema_table for t in self.target if t.action == "anonymize"}
        removed = {t.schema_table for t in self.target if t.action != "anonymize"}
        both = sorted(".".join(s) for s in anonymized & removed)
        if both:
            raise ValueError(f"tables both anonymized and deleted/archived: {both} (one statement changes a row once)")
        return self

    @property
    def fingerprint(self) -> str:
        """What identifies this target set: the same targets give the same fingerprint on every node."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @property
    def hashes(self) -> bool:
        return any(t.hash_columns for t in self.target)


def load_targets(path: Path | None = None) -> CleanupTargets:
    """The targets file: `path`, else CLEANUP_TARGETS_FILE, else cleanup/targets.toml."""
    path = path or read(CleanupSettings).targets_file or DEFAULT_TARGETS_FILE
    with open(path, "rb") as f:
        return CleanupTargets.model_validate(tomllib.load(f))


def targets_from_json(data: str) -> CleanupTargets:
    return CleanupTargets.model_validate_json(data)


def configured_anonymize_key() -> str:
    """CLEANUP_ANONYMIZE_KEY (or CLEANUP_ANONYMIZE_KEY_FILE); empty when unset."""
    secret = read(CleanupSettings).anonymize_key
    return secret.get_secret_value() if secret else ""


def anonymize_key_pads(key: str | None = None) -> tuple[bytes, bytes]:
    """The HMAC-SHA256 inner and outer padded keys of the anonymize key (CLEANUP_ANONYMIZE_KEY).

    Raises ValueError (naming the setting, never the value) when it is unset or too short."""
    raw = (configured_anonymize_key() if key is None else key).encode()
    if len(raw) < MIN_ANONYMIZE_KEY_BYTES:
        raise ValueError(
            f"targets hash columns: set {ANONYMIZE_KEY_ENV} to a secret of at least "
            f"{MIN_ANONYMIZE_KEY_BYTES} bytes (the same on every worker: a changed key breaks nothing "
            "already hashed, but hashes the same value differently)"
        )
    if len(raw) > HMAC_BLOCK:
        raw = hashlib.sha256(raw).digest()
    raw = raw.ljust(HMAC_BLOCK, b"\0")
    return bytes(b ^ 0x36 for b in raw), bytes(b ^ 0x5C for b in raw)


def hmac_hex(key: str, value: str) -> str:
    """What an anonymized column holds, computed in Python (for tests and for matching a known value)."""
    return hmac.new(key.encode(), value.encode(), hashlib.sha256).hexdigest()


# --- compiling against the live schema --------------------------------------------------------------


class TargetPlan(BaseModel):
    """What the start-up check learned about one target on the live schema: how it compiles."""

    model_config = ConfigDict(frozen=True)

    key_type: str  # the match column's own type, e.g. uuid, bigint, text
    copy_columns: tuple[str, ...] = ()  # archive: columns copied by name
    overriding: bool = False  # archive: an identity GENERATED ALWAYS column is copied as is


def _keys(key_type: str, source: str) -> str:
    """The applied accounts' keys as an array of the match column's own type, so `= ANY` uses its index."""
    return f"(ARRAY(SELECT account_id FROM {source}))::{key_type}[]"


def _applied(plan: TargetPlan, column: str) -> str:
    """Whether a returned row's `column` is an applied account's key: a lookup in a hash of the
    batch's keys, built once (an `= ANY` of the array would compare each row with every key)."""
    return f"({column} IN (SELECT a.account_id::{plan.key_type} FROM applied a))"


def _hash(column: str, inner: str, outer: str) -> str:
    value = f"convert_to(t.{q(column)}::text, 'UTF8')"
    return f"encode(sha256({outer} || sha256({inner} || {value})), 'hex')"


def _action(
    name: str, t: CleanupTarget, plan: TargetPlan, where: str, pads: tuple[str, str], columns: tuple[str, ...] = ()
) -> list[str]:
    """The CTE(s) of one target, `name` (and `name`_moved); `where` selects its rows, already gated on
    the target before it.
    Its rows come back as `key` (the account each row was matched by: its receipt), or, given
    `columns` (one statement for several targets of the table), as `k0`, `k1`, ... those columns."""
    table = qualified(t.table)
    if columns:
        key = ", ".join(f"t.{q(c)} AS k{j}" for j, c in enumerate(columns))
        archived_key = ", ".join(f"{q(c)} AS k{j}" for j, c in enumerate(columns))
    else:
        key, archived_key = f"t.{q(t.match_column)} AS key", f"{q(t.match_column)} AS key"
    if t.action == "delete":
        return [f"{name} AS (DELETE FROM {table} t WHERE {where} RETURNING {key})"]
    if t.action == "anonymize":
        sets = [f"{q(c)} = NULL" for c in t.null_columns] + [f"{q(c)} = {_hash(c, *pads)}" for c in t.hash_columns]
        return [f"{name} AS (UPDATE {table} t SET {', '.join(sets)} WHERE {where} RETURNING {key})"]
    assert t.archive_table is not None
    cols = ", ".join(q(c) for c in plan.copy_columns)
    overriding = " OVERRIDING SYSTEM VALUE" if plan.overriding else ""
    return [
        f"{name}_moved AS (DELETE FROM {table} t WHERE {where} RETURNING t.*)",
        f"{name} AS (INSERT INTO {qualified(t.archive_table)} ({cols}){overriding}"
        f" SELECT {cols} FROM {name}_moved RETURNING {archived_key})",
    ]


def _one_statement(a: CleanupTarget, b: CleanupTarget, a_plan: TargetPlan, b_plan: TargetPlan) -> bool:
    """Whether two targets of one table apply as one statement: the same action with the same
    settings, keys of one type."""
    same = a.model_dump(exclude={"match_column"}) == b.model_dump(exclude={"match_column"})
    return same and a_plan.key_type == b_plan.key_type


def _target_groups(targets: CleanupTargets, plans: list[TargetPlan]) -> list[list[int]]:
    """The declared targets in runs of consecutive targets of one table with one action (a friendship
    matched by either side): each run is one statement, in declared order."""
    groups: list[list[int]] = []
    for i, t in enumerate(targets.target):
        if groups and _one_statement(targets.target[groups[-1][0]], t, plans[groups[-1][0]], plans[i]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


# The anonymize hash reads the key's pads from the service's table (cleanup.anonymize_key) inside
# the statement: the key is never a parameter or a literal that the server could log.
PADS = ("(SELECT inner_pad FROM anonymize_key)", "(SELECT outer_pad FROM anonymize_key)")


def compile_partition_batch(targets: CleanupTargets, plans: list[TargetPlan]) -> str:
    """Build the partition batch statement: claim check, idempotency record, every target, outbox.

    Each target compares its match column with the applied accounts' keys cast to the column's own
    type, and waits for the target declared before it (its CTE reads that one's count first).
    Consecutive targets of one table with one action (a friendship matched by either side) are one
    statement over the rows any of their columns matches, each row counted for the first of them
    whose column matches (`t{i}` selects its own from `t{first}_rows`). One statement reads the
    table's rows in one pass, in the order of the table (a bitmap of both indexes), so two
    partitions that both meet a row shared by their accounts (a friendship of two accounts of one
    cohort) lock such rows in the same order and wait for each other instead of deadlocking, as
    two passes, by user_a and then by user_b, do.
    Anonymize hashes read the key's pads from the service's table (PADS)."""
    ctes: list[str] = []
    counts: list[str] = []
    pads = PADS

    def matched(i: int, column: str) -> str:
        return f"{column} = ANY ({_keys(plans[i].key_type, 'applied')})"

    groups = _target_groups(targets, plans)
    for group in groups:
        first = group[0]
        t = targets.target[first]
        after = f" AND (SELECT count(*) FROM t{first - 1}) >= 0" if first > 0 else ""  # declared order
        if len(group) == 1:
            ctes += _action(f"t{first}", t, plans[first], matched(first, f"t.{q(t.match_column)}") + after, pads)
        else:
            columns = tuple(targets.target[i].match_column for i in group)
            where = "(" + " OR ".join(matched(i, f"t.{q(c)}") for i, c in zip(group, columns, strict=True)) + ")"
            ctes += _action(f"t{first}_rows", t, plans[first], where + after, pads, columns)
            # Each row once, for the first target whose column holds an applied account.
            sides = [f"WHEN {_applied(plans[i], f'r.k{j}')} IS TRUE THEN {j}" for j, i in enumerate(group)]
            side = f"CASE {' '.join(sides)} END"
            keys = " ".join(f"WHEN {j} THEN r.k{j}" for j in range(len(group)))
            ctes.append(
                f"t{first}_keyed AS (SELECT s.side, CASE s.side {keys} END AS key"
                f" FROM t{first}_rows r, LATERAL (SELECT {side} AS side) s)"
            )
            ctes += [f"t{i} AS (SELECT key FROM t{first}_keyed WHERE side = {j})" for j, i in enumerate(group)]
        counts += [f"(SELECT count(*) FROM t{i}) AS rows_t{i}" for i in group]
    ctes.append(_receipt_cte(targets, plans, groups))
    template = load(__file__).cleanup_partition_batch
    return template.replace("/*target_ctes*/", ",\n".join(ctes) + ",").replace(
        "/*target_counts*/", ", " + ", ".join(counts)
    )


def _receipt_cte(targets: CleanupTargets, plans: list[TargetPlan], groups: list[list[int]]) -> str:
    """The erasure receipt of each account applied in this batch, in the batch's transaction: rows
    per declared target (in declared order), counted by account once per statement (a grouped
    count joined by the key in its column's type, never a scan of a target's rows per account; the
    targets of one statement counted by side in one grouping, so one join, whose estimate is the
    statement's). Names and counts only."""
    joins: list[str] = []
    rows: dict[int, str] = {}
    for group in groups:
        g = group[0]
        on = f"c{g}.key = a.account_id::{plans[g].key_type}"
        if len(group) == 1:
            joins.append(f"LEFT JOIN (SELECT key, count(*) AS n FROM t{g} GROUP BY key) c{g} ON {on}")
            rows[g] = f"c{g}.n"
            continue
        sides = ", ".join(f"count(*) FILTER (WHERE side = {j}) AS n{j}" for j in range(len(group)))
        joins.append(f"LEFT JOIN (SELECT key, {sides} FROM t{g}_keyed GROUP BY key) c{g} ON {on}")
        rows |= {i: f"c{g}.n{j}" for j, i in enumerate(group)}
    entries = ", ".join(
        f"jsonb_build_object('target', '{t.table}', 'action', '{t.action}', 'rows', coalesce({rows[i]}, 0))"
        for i, t in enumerate(targets.target)
    )
    return (
        "receipts AS (INSERT INTO erasure_receipts (account_id, cleanup_version, cleanup_id, targets)"
        f" SELECT a.account_id, a.cleanup_version, $1, jsonb_build_array({entries}) FROM applied a {' '.join(joins)}"
        " ON CONFLICT DO NOTHING RETURNING 1)"
    )


_KEYSET_FILTER = "/*batch_filter*/c.account_id > $3"


def subset_statement(batch_sql: str) -> str:
    """The batch statement over an explicit set of accounts ($3 text[], $4 its length) instead of a
    keyset page: what bisection runs on each half of a batch that failed deterministically."""
    if _KEYSET_FILTER not in batch_sql:
        raise ValueError("not a compiled partition batch statement")
    return batch_sql.replace(_KEYSET_FILTER, "c.account_id = ANY($3::text[])")


def compile_target_probes(targets: CleanupTargets, plans: list[TargetPlan]) -> list[tuple[str, str]]:
    """Per target, its action for one account ($1): run (and rolled back) only for an account already
    isolated as failing, to tell which declared target its error comes from."""
    probes: list[tuple[str, str]] = []
    for i, (t, plan) in enumerate(zip(targets.target, plans, strict=True)):
        where = f"t.{q(t.match_column)} = ANY ({_keys(plan.key_type, 'probed')})"
        ctes = ", ".join(_action(f"t{i}", t, plan, where, PADS))
        probes.append((t.table, f"WITH probed AS (SELECT $1::text AS account_id), {ctes} SELECT count(*) FROM t{i}"))
    return probes


PreviewScope = Literal["cohort", "account"]


def compile_preview(targets: CleanupTargets, plans: list[TargetPlan], scope: PreviewScope) -> str:
    """The dry-run statement: accounts in scope, already renewed, reminders to write and one row
    count per declared target (`rows_t{i}`, in declaration order); $1 is the deadline or the account.
    A row that an earlier target of the same table takes (a friendship of two accounts in scope) is
    counted by that target only, as in the cleanup."""
    counts = []
    for i, t in enumerate(targets.target):
        matched = [
            f"t.{q(e.match_column)} = ANY ({_keys(p.key_type, 'scope')})"
            for e, p in zip(targets.target[: i + 1], plans, strict=False)
            if e.schema_table == t.schema_table
        ]
        earlier = "".join(f" AND ({m}) IS NOT TRUE" for m in matched[:-1])
        counts.append(f"(SELECT count(*) FROM {qualified(t.table)} t WHERE {matched[-1]}{earlier})::int AS rows_t{i}")
    where = "a.renewal_deadline = $1" if scope == "cohort" else "a.account_id = $1"
    template = load(__file__).preview_cleanup
    return template.replace("/*scope*/", where).replace("/*target_counts*/", ", " + ", ".join(counts))
