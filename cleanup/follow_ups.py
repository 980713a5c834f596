"""Declared follow-up statements: SQL a game needs run with each batch of cleaned accounts, in the
batch's own transaction, to keep its derived state right (recount the friends of the players whose
friendships the batch deletes, a group's member count).

A `[[follow_up]]` of the targets file has a `name`, a `phase` ("before" the batch's target
statements, or "after" them) and a `statement` that uses `$1` for the batch's account keys. `$1` is
compiled into a typed array parameter, `(($1::text[])::<the recorded key type>[])`, so the
statement compares it with its own columns without a cast of its own when the key type is theirs.

- "before" runs before the targets, with the keys of the accounts the batch is about to clean
  (judged by the batch statement's own verdicts, their rows locked): the rows it needs (a
  player's friendships) are still there.
- "after" runs after them, with the keys of the accounts the batch cleaned: it sees what the
  targets changed.

Both commit with the batch (the targets' effects, the idempotency record, the receipt) or not at
all; a batch that cleans no account runs none. Each one's row count (the statement's command tag)
is recorded in the receipt of every account of its batch, beside the batch's size: a follow-up
acts on the batch's accounts together (a friend of two players is recounted once).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:  # asyncpg stays out of the targets file's import (`targets check` on a broken file is quick)
    import asyncpg

IDENTIFIER = r"^[a-z_][a-z0-9_]{0,62}$"
_PARAM = re.compile(r"\$(\d+)")
_KEYS = re.compile(r"\$1(?!\d)")
Phase = Literal["before", "after"]


class FollowUp(BaseModel):
    """One `[[follow_up]]` of the targets file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=IDENTIFIER)
    phase: Phase
    statement: str = Field(min_length=1)

    @field_validator("statement")
    @classmethod
    def _one_parameter_the_keys(cls, statement: str) -> str:
        used = set(_PARAM.findall(statement))
        if "1" not in used:
            raise ValueError(
                "a follow-up acts on the batch's accounts: use $1 (their keys, an array) in the statement, "
                "e.g. WHERE user_id = ANY($1)"
            )
        if used - {"1"}:
            others = ", ".join(f"${n}" for n in sorted(used - {"1"}, key=int))
            raise ValueError(f"a follow-up has one parameter, $1 (the batch's account keys); remove {others}")
        return statement


def compile_statement(statement: str, key_type: str) -> str:
    """The follow-up with `$1` as the batch's keys, an array of the recorded key type (text, uuid
    or bigint): the keys travel as text and are cast once, in the statement."""
    keys = "($1::text[])" if key_type == "text" else f"(($1::text[])::{key_type}[])"
    return _KEYS.sub(keys, statement.strip().rstrip(";"))


@dataclass(frozen=True)
class CompiledFollowUp:
    name: str
    phase: Phase
    sql: str


def row_count(status: str) -> int:
    """The rows of a command tag: `UPDATE 3`, `DELETE 2`, `INSERT 0 5`, `SELECT 4` (its last number)."""
    last = status.rsplit(" ", 1)[-1]
    return int(last) if last.isdigit() else 0


FOLLOW_UP_ATTRIBUTE = "cleanup_follow_up"


def failed_follow_up(error: BaseException) -> str | None:
    """The follow-up an error came from (its name), when it came from one."""
    name = getattr(error, FOLLOW_UP_ATTRIBUTE, None)
    return str(name) if name else None


async def run_phase(
    conn: asyncpg.Connection, follow_ups: tuple[CompiledFollowUp, ...], phase: Phase, keys: list[str]
) -> list[dict[str, object]]:
    """Run the follow-ups of `phase` on these keys, in declared order; their counts for the receipt.
    An error is raised as it is (its SQLSTATE decides retry or isolation), marked with the
    follow-up's name so a failure isolated to an account names it."""
    counts: list[dict[str, object]] = []
    if not keys:
        return counts
    for f in follow_ups:
        if f.phase != phase:
            continue
        try:
            status = await conn.execute(f.sql, keys)
        except Exception as err:  # its SQLSTATE (if any) decides; the name only says where
            setattr(err, FOLLOW_UP_ATTRIBUTE, f.name)
            raise
        counts.append({"name": f.name, "phase": f.phase, "rows": row_count(status), "batch_accounts": len(keys)})
    return counts
