"""The one builder of a cleanup's workflow input, used by the CLI, the planner and the Python API.

A caller says what to clean (a `CleanupScope`: one account, a cohort of one instant, or a range of
deadlines) and how, where it differs from the defaults (a `StartCleanup` request: every option None
takes the settings' `CleanupDefaults`); `cleanup_input` judges the two and returns the
`RenewalCleanupInput`. No other code builds one.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import NamedTuple, TypeVar

from pydantic import ValidationError

from cleanup.models import RenewalCleanupInput
from core.config import CleanupDefaults
from core.errors import InputError, validation_message
from core.model import Model


class StartCleanup(Model):
    """One cleanup to start: a cohort (`deadline`, an instant every one of its accounts has) or one
    account (`account_id`), exactly one of them. Every option left None is the settings' default
    (core.config.CleanupDefaults: the same for the planner's cleanups)."""

    deadline: datetime | None = None
    account_id: str | None = None
    partitions: int | None = None
    max_parallel_partitions: int | None = None
    batch_size: int | None = None
    claim_chunk_size: int | None = None
    claim_streams: int | None = None
    heartbeat_timeout_seconds: float | None = None
    heartbeat_interval_seconds: float | None = None
    step_timeout_seconds: float = 300.0
    note: str = ""
    # A cohort with no active account is refused unless allowed (or its run exists).
    allow_empty: bool = False
    # Tolerance of accounts whose cleanup fails deterministically: a count (`3`) or a percent of the
    # claimed accounts (`5%`); beyond it the run fails after settling. None: no limit.
    max_failed: str | int | None = None


class CleanupScope(NamedTuple):
    """What a cleanup covers: its workflow ID (the business key), the deadlines (the one instant
    `deadline_from`, or the range [deadline_from, deadline_until)) and the accounts.

    `partitions` None: the request's, else the defaults'. `one_activity`: the planner's cohort that
    fits one batch claims, cleans and settles in one activity."""

    workflow_id: str
    deadline_from: datetime
    account_id: str | None = None
    expected_version: int | None = None
    partitions: int | None = None
    accounts_in_scope: int = 0
    deadline_until: datetime | None = None
    wake_early_seconds: float = 0.0
    one_activity: bool = False
    planner: str | None = None  # what this cleanup shares with the deadline planner


T = TypeVar("T")
_TOLERANCE = re.compile(r"^\s*(?P<value>\d+(?:\.\d+)?)\s*(?P<percent>%?)\s*$")


def parse_failed_tolerance(text: str | int | None) -> tuple[int | None, float | None]:
    """`--max-failed`: a count (`3`) or a percent of the claimed accounts (`5%`)."""
    if text is None:
        return None, None
    if isinstance(text, int):
        if text < 0:
            raise InputError(f"--max-failed must not be negative, got {text}")
        return text, None
    match = _TOLERANCE.match(text)
    if match is None:
        raise InputError(f"--max-failed takes a count or a percent, e.g. 3 or 5%, got {text!r}")
    if match["percent"]:
        percent = float(match["value"])
        if percent > 100:
            raise InputError(f"--max-failed percent must be at most 100%, got {text!r}")
        return None, percent
    if "." in match["value"]:
        raise InputError(f"--max-failed count must be a whole number, got {text!r}")
    return int(match["value"]), None


def cleanup_input(scope: CleanupScope, request: StartCleanup, defaults: CleanupDefaults) -> RenewalCleanupInput:
    """The workflow's input: the request's options, the defaults for those it leaves None, bad
    values refused (InputError, exit 2). Parallelism and claim streams are at most the partitions."""
    max_failed, max_failed_percent = parse_failed_tolerance(request.max_failed)
    partitions = scope.partitions or _given(request.partitions, defaults.partitions)
    try:
        return RenewalCleanupInput(
            cleanup_id=scope.workflow_id,
            deadline_from=scope.deadline_from,
            deadline_until=scope.deadline_until,
            account_id=scope.account_id,
            expected_version=scope.expected_version,
            partitions=partitions,
            max_parallel_partitions=min(
                _given(request.max_parallel_partitions, defaults.max_parallel_partitions), partitions
            ),
            batch_size=_given(request.batch_size, defaults.batch_size),
            claim_chunk_size=_given(request.claim_chunk_size, defaults.claim_chunk_size),
            claim_streams=min(_given(request.claim_streams, defaults.claim_streams), partitions),
            heartbeat_timeout_seconds=_given(request.heartbeat_timeout_seconds, defaults.heartbeat_timeout_seconds),
            heartbeat_interval_seconds=(
                request.heartbeat_interval_seconds
                if request.heartbeat_interval_seconds is not None
                else defaults.heartbeat_interval_seconds
            ),
            step_timeout_seconds=request.step_timeout_seconds,
            note=request.note,
            max_failed=max_failed,
            max_failed_percent=max_failed_percent,
            wake_early_seconds=scope.wake_early_seconds,
            one_activity=scope.one_activity,
        )
    except ValidationError as err:
        raise InputError(validation_message(err)) from None


def _given(value: T | None, default: T) -> T:
    return default if value is None else value
