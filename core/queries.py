"""A tiny loader for `.sql` files of named queries (`-- name: some_query` starts each one).

Each job keeps its SQL beside its code: `load(cleanup.__file__)` reads `cleanup/queries.sql`.
A query names its parameters (`:cleanup_id`); the loader rewrites them to asyncpg's `$n` once,
and `SQL.bind(name, cleanup_id=...)` puts the values in that order:
`await conn.fetch(SQL.claims_of, *SQL.bind("claims_of", cleanup_id=c))`. A query may instead use
`$n` itself (then `bind` takes the values by position only).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

MIGRATIONS_DIR = Path(__file__).resolve().parent / "sql" / "migrations"
_NAME = re.compile(r"^--\s*name:\s*(?P<name>[a-z_][a-z0-9_]*)\s*$", re.MULTILINE)
# A string literal, a comment, a `::cast`, a positional `$n` or a named `:param`, left to right:
# only a named parameter outside strings and comments is rewritten.
_TOKEN = re.compile(r"'(?:[^']|'')*'|--[^\n]*|::|(?P<positional>\$\d+)|(?<![\w:]):(?P<param>[a-z_][a-z0-9_]*)\b")


def bind_params(params: tuple[str, ...], values: dict[str, Any]) -> tuple[Any, ...]:
    """The positional arguments of a query whose named parameters are `params`, in order: each
    given once, none missing, none unknown (a typo is an error at the call, not a wrong row)."""
    missing = [p for p in params if p not in values]
    unknown = sorted(set(values) - set(params))
    if missing or unknown:
        raise TypeError(f"query parameters: missing {missing}, unknown {unknown}")
    return tuple(values[p] for p in params)


def compile_named(text: str, where: str = "query") -> tuple[str, tuple[str, ...]]:
    """`text` with each `:name` rewritten to `$n` (the same name, the same `$n`)."""
    params: list[str] = []
    positional = False

    def rewrite(match: re.Match[str]) -> str:
        nonlocal positional
        name = match.group("param")
        if match.group("positional"):
            positional = True
        if name is None:
            return match.group(0)
        if name not in params:
            params.append(name)
        return f"${params.index(name) + 1}"

    compiled = _TOKEN.sub(rewrite, text)
    if positional and params:
        raise ValueError(f"{where}: mixes $n and :name parameters")
    return compiled, tuple(params)


class Queries(dict[str, str]):
    """Each query's text (asyncpg takes only `str`), and the names of its parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.params: dict[str, tuple[str, ...]] = {}

    def __getattr__(self, name: str) -> str:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no query named {name!r}") from None

    def bind(self, query: str, **values: Any) -> tuple[Any, ...]:
        """The positional arguments of named query `query` (by its name) from named values."""
        return bind_params(self.params[query], values)


def sql_file(anchor: str, filename: str = "queries.sql") -> Path:
    """The `.sql` file beside `anchor` (a module's or package's `__file__`)."""
    return Path(anchor).resolve().with_name(filename)


@cache
def load(anchor: str, filename: str = "queries.sql") -> Queries:
    path = sql_file(anchor, filename)
    parts = _NAME.split(path.read_text())
    queries = Queries()
    # parts = [preamble, name1, body1, name2, body2, ...]
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"{path}: query {name!r} defined twice")
        queries[name], queries.params[name] = compile_named(body.strip().rstrip(";"), f"{path}: {name}")
    return queries
