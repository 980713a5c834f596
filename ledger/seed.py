"""A realistic business day for the ledger reconciliation, generated server-side in one statement.

N payments over S shards, with a configurable rate of each discrepancy (see `seed_ledger_day` in
ledger/queries.sql). Pure SQL over generate_series, so 1,000,000 payments need no round trips.
"""

from __future__ import annotations

from datetime import date

import asyncpg
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from core.errors import InputError
from core.queries import load
from ledger.models import DEFAULT_SHARDS, MAX_SHARDS

SQL = load(__file__)
MAX_PAYMENTS = 50_000_000


class LedgerSeedSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    business_date: date
    payments: int = Field(ge=1, le=MAX_PAYMENTS)
    shards: int = Field(default=DEFAULT_SHARDS, ge=1, le=MAX_SHARDS)
    refund_rate: float = Field(default=0.01, ge=0, le=1)
    small_mismatch_rate: float = Field(default=0.01, ge=0, le=1)
    large_mismatch_rate: float = Field(default=0.002, ge=0, le=1)
    unsettled_rate: float = Field(default=0.005, ge=0, le=1)
    unknown_rate: float = Field(default=0.002, ge=0, le=1)
    duplicate_rate: float = Field(default=0.005, ge=0, le=1)
    tolerance_cents: int = Field(default=50, ge=1, le=1_000_000)
    games: int = Field(default=8, ge=1, le=1000)

    @model_validator(mode="after")
    def _rates_fit(self) -> LedgerSeedSpec:
        total = self.refund_rate + self.small_mismatch_rate + self.large_mismatch_rate + self.unsettled_rate
        if total > 0.98:
            raise ValueError(f"the per-payment discrepancy rates add up to {total:.3f}; at most 0.98")
        return self


class LedgerSeedResult(BaseModel):
    business_date: date
    shards: int
    created: bool
    payments: int
    report_rows: int
    refunds_not_recorded: int
    small_mismatches: int
    large_mismatches: int
    never_settled: int
    refunds_ok: int
    unknown_payments: int
    duplicate_report_rows: int

    @property
    def expected_corrections(self) -> int:
        return self.refunds_not_recorded + self.small_mismatches + self.never_settled

    @property
    def expected_review(self) -> int:
        return self.large_mismatches + self.unknown_payments

    @property
    def expected_discrepancies(self) -> int:
        return self.expected_corrections + self.expected_review


def seed_spec(**values: object) -> LedgerSeedSpec:
    try:
        return LedgerSeedSpec.model_validate(values)
    except ValidationError as err:
        raise InputError("; ".join(f"{_flag(e['loc'])}: {e['msg']}" for e in err.errors())) from None


def _flag(loc: tuple[int | str, ...]) -> str:
    """The command-line flag of a seed field (`payments` -> `--payments`), as the user typed it."""
    name = ".".join(str(p) for p in loc)
    return f"--{name.replace('_', '-')}" if name else "input"


async def seed_ledger_day(pool: asyncpg.Pool, spec: LedgerSeedSpec) -> LedgerSeedResult:
    """Load one business day (ledger + provider report); a date already loaded is left as it is."""
    row = await pool.fetchrow(SQL.seed_ledger_day, *SQL.bind("seed_ledger_day", **spec.model_dump()))
    assert row is not None
    if row["days_created"]:
        # Fresh statistics after a bulk load, or the planner judges a batch as if the tables were empty.
        await pool.execute(SQL.analyze_ledger)
    values = dict(row)
    created = bool(values.pop("days_created"))
    return LedgerSeedResult(business_date=spec.business_date, shards=spec.shards, created=created, **values)
