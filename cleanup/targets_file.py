"""A targets file's mistakes as an operator reads them: the file, the line, the key and the fix.

A TOML syntax error names its line itself; a schema error (pydantic) names a path of keys
(`target`, 2, `acton`), which is found again in the file's text: the line of the key inside the
third `[[target]]` table, else the table's header. An unknown key or value is matched against the
known ones (`acton` -> did you mean `action`?). Nothing here reads the database: a pure-TOML
mistake is reported before any connection is made.
"""

from __future__ import annotations

import contextlib
import difflib
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from core.errors import InputError

_TOML_AT = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$")
_HEADER = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.\"' -]+?)\s*\]\]?")
_KEY = re.compile(r"^\s*([A-Za-z0-9_-]+)\s*=")


class TargetsFileError(InputError):
    """The targets file cannot be read or declares no valid targets (exit 2, naming file and line)."""


@dataclass(frozen=True)
class _Section:
    """One table of the file: its name, its index among the tables of that name, its header line."""

    name: str
    index: int
    line: int


def _sections(lines: Sequence[str]) -> list[tuple[_Section, int, int]]:
    """Each table (`[name]` or `[[name]]`) with the range of lines it covers, 1-based, end excluded;
    the keys before the first header are the root table ('')."""
    found: list[tuple[_Section, int]] = [(_Section("", 0, 1), 1)]
    seen: dict[str, int] = {}
    for n, text in enumerate(lines, 1):
        m = _HEADER.match(text)
        if m:
            name = m.group(2).strip()
            index = seen.get(name, -1) + 1
            seen[name] = index
            found.append((_Section(name, index, n), n))
    ends = [start for _, start in found[1:]] + [len(lines) + 1]
    return [(section, start, end) for (section, start), end in zip(found, ends, strict=True)]


def _key_line(lines: Sequence[str], start: int, end: int, key: str) -> int | None:
    for n in range(start, end):
        m = _KEY.match(lines[n - 1])
        if m and m.group(1) == key:
            return n
    return None


def locate(text: str, loc: Sequence[str | int]) -> int:
    """The line of a pydantic error's key path in the file: the key in the n-th `[[target]]`, else
    that table's header, else the top-level key or table of that name, else line 1."""
    lines = text.splitlines()
    sections = _sections(lines)
    if len(loc) >= 2 and isinstance(loc[0], str) and isinstance(loc[1], int):
        for section, start, end in sections:
            if section.name == loc[0] and section.index == loc[1]:
                key = loc[2] if len(loc) > 2 and isinstance(loc[2], str) else None
                return (key and _key_line(lines, start + 1, end, key)) or section.line
    if loc and isinstance(loc[0], str):
        for section, _, _ in sections:
            if section.name == loc[0]:
                return section.line
        root_end = sections[1][1] if len(sections) > 1 else len(lines) + 1
        return _key_line(lines, 1, root_end, loc[0]) or 1
    return 1


def _suggest(word: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else f" (expected one of: {', '.join(known)})"


def _where(loc: Sequence[str | int], data: Any) -> str:
    """`target #3 (game.users)`: the target an error is in, by its position and its table."""
    if len(loc) >= 2 and loc[0] in ("target", "follow_up") and isinstance(loc[1], int):
        name = ""
        with contextlib.suppress(Exception):
            name = f" ({data[loc[0]][loc[1]]['table' if loc[0] == 'target' else 'name']})"
        return f"{loc[0]} #{loc[1] + 1}{name}"
    return "the file"


def _problem(error: Mapping[str, Any], data: Any, fields: Mapping[str, Sequence[str]]) -> tuple[Sequence[Any], str]:
    """One pydantic error as (key path, message with the fix)."""
    loc: Sequence[Any] = error["loc"]
    kind, key = error["type"], str(loc[-1]) if loc else ""
    where = _where(loc, data)
    if len(loc) > 3 and loc[2] == "set_columns":  # one problem per column, whichever member of the union
        return loc[:4], (
            f"{where}: set_columns.{loc[3]} must be a constant (a string, number or boolean) or "
            "{ default = true } (the column's DEFAULT), never SQL"
        )
    if kind == "extra_forbidden":
        known = fields[loc[0]] if len(loc) == 3 and loc[0] in ("target", "follow_up") else fields[""]
        if len(loc) == 1 and "target" in known:
            return loc, (
                f"unknown table [[{key}]]{_suggest(key, known)}: each target is a [[target]] table, "
                "each follow-up statement a [[follow_up]] table"
            )
        return loc, f"{where}: unknown key '{key}'{_suggest(key, known)}"
    if kind == "literal_error" and key in fields:
        return loc, f"{where}: {key} = {error['input']!r} is not allowed{_suggest(str(error['input']), fields[key])}"
    if kind == "missing":
        return loc, f"{where}: missing key '{key}' (fix: add `{key} = ...`)"
    path = ".".join(str(p) for p in loc[2:]) if len(loc) > 2 else ""
    message = str(error["msg"]).removeprefix("Value error, ")
    return loc, f"{where}{f' key {path!r}' if path else ''}: {message}"


def _deduplicated(problems: list[tuple[Sequence[Any], str]]) -> list[tuple[Sequence[Any], str]]:
    """A key missing because it was misspelled is told once, at the misspelling (which names it)."""
    meant = {(tuple(loc[:-1]), m.group(1)) for loc, text in problems if (m := re.search(r"did you mean `(\w+)`", text))}
    return [
        (loc, text)
        for loc, text in problems
        if not (text.endswith("(fix: add `" + str(loc[-1]) + " = ...`)") and (tuple(loc[:-1]), loc[-1]) in meant)
    ]


def describe_file_error(
    path: Path, text: str, err: tomllib.TOMLDecodeError | ValidationError, fields: Mapping[str, Sequence[str]]
) -> str:
    """`path:line: what is wrong (the fix)`, one line per problem."""
    if isinstance(err, tomllib.TOMLDecodeError):
        message = str(err)
        at = _TOML_AT.search(message)
        line = int(at.group(1)) if at else 1
        lines = text.splitlines()
        shown = f": `{lines[line - 1].strip()}`" if 0 < line <= len(lines) else ""
        return f"{path}:{line}: not valid TOML: {_TOML_AT.sub('', message)}{shown}"
    data: Any = None
    with contextlib.suppress(Exception):
        data = tomllib.loads(text)
    problems = _deduplicated(
        list(dict.fromkeys((tuple(loc), m) for loc, m in (_problem(e, data, fields) for e in err.errors())))
    )
    return "\n".join(f"{path}:{locate(text, loc)}: {message}" for loc, message in problems)
