"""The one pydantic base of every workflow and activity payload: unknown fields are an error (a
typo in an input never passes silently) and payloads are immutable once built.

Imported by workflow modules inside the sandbox, so nothing here may import asyncpg.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Model(BaseModel):
    # NaN and infinities are never valid: NaN passes every ge/le bound a field could declare.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
