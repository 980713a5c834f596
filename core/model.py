"""The one pydantic base of every workflow and activity payload, and of what the Python API returns
(docs/api.md): unknown fields are an error (a typo in an input never passes silently) and payloads
are immutable once built.

Imported by workflow modules inside the sandbox, so nothing here may import asyncpg.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

from pydantic import BaseModel, ConfigDict


class Model(BaseModel):
    # NaN and infinities are never valid: NaN passes every ge/le bound a field could declare.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @classmethod
    def from_row(cls, row: Mapping[str, Any], **extra: Any) -> Self:
        """The model of a database row (an asyncpg Record): its columns are the model's fields,
        named alike in the query; `extra` gives fields the row does not hold."""
        return cls.model_validate(dict(row) | extra)


class Report(Model):
    """A status report whose fields depend on what its sources answered (Temporal, the live query
    of a running workflow, the database): a field no source gave stays None. `given()` is the
    report with only the fields its sources gave: what the CLI prints, as it always has."""

    def given(self) -> dict[str, Any]:
        return self.model_dump(include=set(self.model_fields_set))
