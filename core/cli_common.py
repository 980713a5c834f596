"""What every CLI command shares: JSON or human output, tables, and the services a command opens."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from datetime import date, datetime
from typing import Any

from core import db, embedded
from core.config import Settings
from core.temporal import connect


def json_default(value: object) -> object:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return str(value)


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, str | int):
        return str(value)
    if isinstance(value, dict | list):
        return json.dumps(value, default=json_default)
    return str(json_default(value))


def key_values(data: dict[str, Any]) -> str:
    width = max(len(k) for k in data)
    return "\n".join(f"{k.ljust(width)}  {_cell(v)}" for k, v in data.items())


def table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    if not rows:
        return "(none)"
    columns = columns or list(rows[0])
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))
    body = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join([line, "  ".join("-" * w for w in widths), *body])


def emit(args: argparse.Namespace, data: Any, human: Callable[[Any], str] | None = None) -> None:
    """`--json` (or no human form): JSON; otherwise the human form, key/value lines by default."""
    if getattr(args, "json", False):
        print(json.dumps(data, default=json_default, indent=2))
    elif human is not None:
        print(human(data))
    elif isinstance(data, dict):
        print(key_values(data))
    else:
        print(json.dumps(data, default=json_default, indent=2))


class CliContext:
    """Opens what a command needs (embedded services, migrated pool, client) and closes it after."""

    def __init__(self, settings: Settings) -> None:
        self.settings = embedded.resolve(settings)

    async def __aenter__(self) -> CliContext:
        assert self.settings.database_url is not None
        await db.migrate_url(self.settings.database_url)
        self.pool = await db.create_pool(self.settings.database_url, max_size=4)
        self.client = await connect(self.settings)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.pool.close()
