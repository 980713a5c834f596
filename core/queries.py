"""A tiny loader for `.sql` files of named queries (`-- name: some_query` starts each one).

Each job keeps its SQL beside its code: `load(cleanup.__file__)` reads `cleanup/queries.sql`.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

MIGRATIONS_DIR = Path(__file__).resolve().parent / "sql" / "migrations"
_NAME = re.compile(r"^--\s*name:\s*(?P<name>[a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


class Queries(dict[str, str]):
    def __getattr__(self, name: str) -> str:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no query named {name!r}") from None


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
        queries[name] = body.strip().rstrip(";")
    return queries
