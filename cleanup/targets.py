"""Declarative cleanup targets, and the one set-based statement they compile into.

A target names a table (schema-qualified; unqualified means `public`), the column holding the
account key (`match_column`, of any type: text, uuid, bigint, ...) and an action: `delete`,
`archive` (move the rows into `archive_table`) or `anonymize` (keep the row: `null_columns` set
to NULL, `set_columns` to a constant or their DEFAULT (erased), `random_columns` to a random UUID
(anonymous, still unique), `hash_columns` to a keyed hash (a pseudonym: the same value, the same
hash, so a UNIQUE column stays unique)). The same table may appear in several targets with
different match columns (a friendship matched by either side).

Targets apply in declared order within the batch's one statement (each waits for the one before),
so children come before their parents. Rows an `ON DELETE CASCADE` would remove are counted, not
missed: every table a cascade reaches from a deleted target must itself be declared before it,
matching on a column of that foreign key that references the parent's match column, so its own
target removes (and counts) exactly the rows the cascade would, and the cascade finds none left.
The start-up check (cleanup.target_check) refuses any other cascade.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from cleanup.follow_ups import FollowUp
from cleanup.targets_file import TargetsFileError, describe_file_error, locate
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


class ColumnDefault(BaseModel):
    """`{ default = true }` in set_columns: the column's own DEFAULT."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default: Literal[True]


def _no_nul(value: object) -> object:
    if isinstance(value, str) and "\0" in value:
        raise ValueError("a set_columns constant cannot hold a NUL character")
    return value


# A set_columns value: a TOML string, integer, float or boolean constant, or the column's DEFAULT.
SetValue = Annotated[StrictBool | StrictInt | StrictFloat | StrictStr | ColumnDefault, AfterValidator(_no_nul)]
ANONYMIZE_KEYS = ("null_columns", "hash_columns", "set_columns", "random_columns")


def constant_text(value: StrictBool | StrictInt | StrictFloat | StrictStr) -> str:
    """A set_columns constant as the text its column's type reads (a TOML boolean as true/false)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def sql_constant(value: SetValue) -> str:
    """A set_columns value as SQL: `DEFAULT`, or a quoted literal of unknown type that the column's own
    type reads. An E'' string with its backslashes and quotes doubled means the same whatever
    standard_conforming_strings is, so no value from the file ever becomes SQL text."""
    if isinstance(value, ColumnDefault):
        return "DEFAULT"
    return "E'" + constant_text(value).replace("\\", "\\\\").replace("'", "''") + "'"


def constant_check_sql(type_name: str) -> str:
    """Whether a constant ($1, text) is a value of `type_name` (the catalog's format_type spelling,
    never the file's): what the column's type makes of it when the cleanup sets it."""
    return f"SELECT CAST($1::text AS {type_name})"


class CleanupTarget(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    table: str = Field(pattern=QUALIFIED)
    match_column: str = Field(default="account_id", pattern=IDENTIFIER)
    action: Literal["delete", "archive", "anonymize"]
    archive_table: str | None = Field(default=None, pattern=QUALIFIED)
    null_columns: tuple[str, ...] = ()
    hash_columns: tuple[str, ...] = ()
    # Erased: each column set to a constant (a quoted literal, converted by the column's own type)
    # or to its DEFAULT (`{ default = true }`); never SQL text from the file.
    set_columns: dict[str, SetValue] = Field(default_factory=dict)
    # Anonymous: a fresh random value per row (a random UUID; in text `anon-<uuid>`), unique but
    # linked to nothing, unlike a keyed hash (the same input gives the same output).
    random_columns: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _keys_fit_the_action(self) -> CleanupTarget:
        name = f"target {self.table!r}"
        if self.action == "archive" and not self.archive_table:
            raise ValueError(f"{name}: action 'archive' needs archive_table")
        if self.action != "archive" and self.archive_table:
            raise ValueError(f"{name}: archive_table is only for action 'archive'")
        if self.action == "anonymize":
            if not self.anonymized_columns:
                raise ValueError(
                    f"{name}: action 'anonymize' needs null_columns, hash_columns, set_columns or random_columns"
                )
        elif self.anonymized_columns:
            raise ValueError(f"{name}: {', '.join(ANONYMIZE_KEYS)} are only for action 'anonymize'")
        columns = self.anonymized_columns
        bad = [c for c in columns if not _is_identifier(c)]
        if bad:
            raise ValueError(f"{name}: not a column name: {bad}")
        if len(columns) != len(set(columns)):
            raise ValueError(f"{name}: a column is listed twice in {', '.join(ANONYMIZE_KEYS)}")
        if self.match_column in columns:
            raise ValueError(f"{name}: the match column {self.match_column!r} cannot be anonymized")
        return self

    @property
    def anonymized_columns(self) -> list[str]:
        """Every column the anonymize action changes, in declared order of its kinds."""
        return [*self.null_columns, *self.hash_columns, *self.set_columns, *self.random_columns]

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
    # Statements run with each batch's account keys, before or after its targets (cleanup.follow_ups).
    follow_up: list[FollowUp] = Field(default_factory=list)
    # Where each follow-up is declared (`file:line`), when read from a file: how messages name it.
    _follow_up_lines: dict[int, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _one_target_per_table_and_column(self) -> CleanupTargets:
        names = [f.name for f in self.follow_up]
        if len(names) != len(set(names)):
            raise ValueError(f"follow-up names must be unique, got {names}")
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
        # Keys added since fingerprints were first recorded count only when used: a target set
        # that does not use them keeps the fingerprint it was recorded with.
        dumped = self.model_dump(mode="json")
        if not dumped["follow_up"]:
            del dumped["follow_up"]
        for target in dumped["target"]:
            for key in ("set_columns", "random_columns"):
                if not target[key]:
                    del target[key]
        canonical = json.dumps(dumped, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @property
    def hashes(self) -> bool:
        return any(t.hash_columns for t in self.target)

    def follow_up_label(self, i: int, key: str = "statement") -> str:
        """How messages name follow-up `i`: `file:line: follow_up 'name' (key)` when read from a file."""
        where = self._follow_up_lines.get(i)
        name = f"follow_up {self.follow_up[i].name!r} ({key})"
        return f"{where}: {name}" if where else name

    def located(self, path: Path, text: str) -> CleanupTargets:
        """These targets, their follow-ups named by the file and line of their statement."""
        self._follow_up_lines = {
            i: f"{path}:{locate(text, ('follow_up', i, 'statement'))}" for i in range(len(self.follow_up))
        }
        return self


def targets_path(path: Path | None = None) -> Path:
    """The targets file in use: `path` (the settings' CLEANUP_TARGETS_FILE, or a flag's), else
    cleanup/targets.toml."""
    return Path(path or DEFAULT_TARGETS_FILE)


def load_targets(path: Path | None = None) -> CleanupTargets:
    """The targets file: `path` (`settings.cleanup.targets_file`), else cleanup/targets.toml. A file that
    cannot be read, is not TOML or does not declare valid targets raises TargetsFileError (exit 2)
    naming the file, the line and the key, with the fix."""
    path = targets_path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise TargetsFileError(f"{path}: cannot read the targets file ({err})") from None
    try:
        return CleanupTargets.model_validate(tomllib.loads(text)).located(path, text)
    except (tomllib.TOMLDecodeError, ValidationError) as err:
        raise TargetsFileError(describe_file_error(path, text, err, target_fields())) from None


def target_fields() -> dict[str, tuple[str, ...]]:
    """What may be written where in a targets file: the top-level keys, a target's keys, and the
    values of the keys that take one of a few."""
    return {
        "": tuple(CleanupTargets.model_fields),
        "target": tuple(CleanupTarget.model_fields),
        "follow_up": tuple(FollowUp.model_fields),
        "action": ("delete", "archive", "anonymize"),
        "phase": ("before", "after"),
    }


def targets_from_json(data: str) -> CleanupTargets:
    return CleanupTargets.model_validate_json(data)


def anonymize_key_pads(key: str) -> tuple[bytes, bytes]:
    """The HMAC-SHA256 inner and outer padded keys of the anonymize key (CLEANUP_ANONYMIZE_KEY).

    Raises ValueError (naming the setting, never the value) when it is unset or too short."""
    raw = key.encode()
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
    uuid_columns: tuple[str, ...] = ()  # anonymize: random_columns of type uuid (the others are text)


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


def _erasures(t: CleanupTarget, plan: TargetPlan) -> list[str]:
    """The SET clauses of set_columns (a quoted constant, or DEFAULT) and random_columns (a fresh
    random UUID per row: unique, linked to nothing; in a text column behind `anon-`)."""
    sets = [f"{q(c)} = {sql_constant(v)}" for c, v in t.set_columns.items()]
    return sets + [
        f"{q(c)} = gen_random_uuid()" if c in plan.uuid_columns else f"{q(c)} = 'anon-' || gen_random_uuid()::text"
        for c in t.random_columns
    ]


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
        sets += _erasures(t, plan)
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
    if targets.follow_up:
        counts += DEFERRED_RECEIPT_COLUMNS
    template = load(__file__).cleanup_partition_batch
    return template.replace("/*target_ctes*/", ",\n".join(ctes) + ",").replace(
        "/*target_counts*/", ", " + ", ".join(counts)
    )


# With follow-ups, the batch statement returns its receipts instead of writing them: the batch writes
# them after its "after" follow-ups, with their counts (the receipt is append-only), in its transaction.
DEFERRED_RECEIPT_COLUMNS = [
    "ARRAY(SELECT account_id FROM applied ORDER BY account_id) AS applied_keys",
    "(SELECT jsonb_agg(jsonb_build_object('account_id', account_id, 'cleanup_version', cleanup_version,"
    " 'targets', targets)) FROM receipts)::text AS receipts",
]


def _receipt_cte(targets: CleanupTargets, plans: list[TargetPlan], groups: list[list[int]]) -> str:
    """The erasure receipt of each account applied in this batch, in the batch's transaction: rows
    per declared target (in declared order, each named by its table and match column: two targets
    of one table are told apart), counted by account once per statement (a grouped
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
        f"jsonb_build_object('target', '{t.table}', 'match_column', '{t.match_column}', 'action', '{t.action}',"
        f" 'rows', coalesce({rows[i]}, 0))"
        for i, t in enumerate(targets.target)
    )
    select = f"SELECT a.account_id, a.cleanup_version, jsonb_build_array({entries}) AS targets FROM applied a"
    if targets.follow_up:  # written by the batch after its follow-ups (DEFERRED_RECEIPT_COLUMNS)
        return f"receipts AS ({select} {' '.join(joins)})"
    # The target set it ran with, and those `retry-failed --with-current-targets` replaced.
    cleanup_id = _batch_param("cleanup_id")
    replaced = (
        f"(SELECT nullif(r.replaced_fingerprints, '{{}}') FROM cleanup_target_runs r WHERE r.cleanup_id = {cleanup_id})"
    )
    return (
        "receipts AS (INSERT INTO erasure_receipts"
        " (account_id, cleanup_version, cleanup_id, targets, target_set, replaced_target_sets)"
        f" SELECT a.account_id, a.cleanup_version, {cleanup_id}, jsonb_build_array({entries}),"
        f" '{targets.fingerprint}', {replaced} FROM applied a {' '.join(joins)} ON CONFLICT DO NOTHING RETURNING 1)"
    )


def _batch_param(name: str) -> str:
    """The `$n` the loader gave parameter `name` of cleanup_partition_batch: the fragments spliced
    into the compiled statement refer to its parameters by position."""
    return f"${load(__file__).params['cleanup_partition_batch'].index(name) + 1}"


_KEYSET_FILTER = f"/*batch_filter*/c.account_id > {_batch_param('after_account_id')}"
_JUDGED = "/*judged*/"


def judge_statement(batch_sql: str) -> str:
    """The batch statement (either form) up to its verdicts: the keys of the accounts it is about to
    clean, their rows locked, judged exactly as it judges them (what "before" follow-ups act on)."""
    head, found, _ = batch_sql.partition(_JUDGED)
    if not found:
        raise ValueError("not a compiled partition batch statement")
    keys = "SELECT ARRAY(SELECT account_id FROM verdicts WHERE verdict = 'apply' ORDER BY account_id)"
    return head.rstrip().rstrip(",") + "\n" + keys


def subset_statement(batch_sql: str) -> str:
    """The batch statement over an explicit set of accounts (text[], in the place of the keyset's
    :after_account_id; :batch_size its length) instead of a keyset page: what bisection runs on
    each half of a batch that failed deterministically."""
    if _KEYSET_FILTER not in batch_sql:
        raise ValueError("not a compiled partition batch statement")
    return batch_sql.replace(_KEYSET_FILTER, f"c.account_id = ANY({_batch_param('after_account_id')}::text[])")


def compile_target_probes(targets: CleanupTargets, plans: list[TargetPlan]) -> list[tuple[str, str]]:
    """Per target, its action for one account ($1): run (and rolled back) only for an account already
    isolated as failing, to tell which declared target its error comes from."""
    probes: list[tuple[str, str]] = []
    for i, (t, plan) in enumerate(zip(targets.target, plans, strict=True)):
        where = f"t.{q(t.match_column)} = ANY ({_keys(plan.key_type, 'probed')})"
        ctes = ", ".join(_action(f"t{i}", t, plan, where, PADS))
        probes.append((t.table, f"WITH probed AS (SELECT $1::text AS account_id), {ctes} SELECT count(*) FROM t{i}"))
    return probes


PreviewScope = Literal["cohort", "account", "window"]
_PREVIEW_SCOPES = {
    "cohort": "a.renewal_deadline = $1",
    "account": "a.account_id = $1",
    # deadlines from $1 (included) to $2 (excluded; NULL: no upper bound)
    "window": "a.renewal_deadline >= $1 AND ($2::timestamptz IS NULL OR a.renewal_deadline < $2)",
}


def compile_preview(targets: CleanupTargets, plans: list[TargetPlan], scope: PreviewScope) -> str:
    """The dry-run statement: accounts in scope, already renewed, reminders to write and one row
    count per declared target (`rows_t{i}`, in declaration order); $1 is the deadline, the account, or
    the window's start ($2 its end).
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
    where = _PREVIEW_SCOPES[scope]
    template = load(__file__).preview_cleanup
    return template.replace("/*scope*/", where).replace("/*target_counts*/", ", " + ", ".join(counts))
