"""A tiny loader for `.sql` files of named queries (`-- name: some_query` starts each one)."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

SQL_DIR = Path(__file__).resolve().parent / "sql"
_NAME = re.compile(r"^--\s*name:\s*(?P<name>[a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


class Queries(dict[str, str]):
    def __getattr__(self, name: str) -> str:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no query named {name!r}") from None


@cache
def load(filename: str) -> Queries:
    text = (SQL_DIR / filename).read_text()
    parts = _NAME.split(text)
    queries = Queries()
    # parts = [preamble, name1, body1, name2, body2, ...]
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"{filename}: query {name!r} defined twice")
        queries[name] = body.strip().rstrip(";")
    return queries
