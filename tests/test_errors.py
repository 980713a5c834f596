"""One base exception; "unavailable" is not "bad input"; each job's failures live in its package."""

from __future__ import annotations

import inspect
from types import ModuleType

import pytest

import cleanup.errors
import core.errors
import ledger.errors
import outbox.errors
from core.errors import DeadlineCleanupError, InputError, Unavailable

MODULES = [core.errors, cleanup.errors, ledger.errors, outbox.errors]


def exceptions_of(module: ModuleType) -> list[type[BaseException]]:
    return [
        c
        for _, c in inspect.getmembers(module, inspect.isclass)
        if issubclass(c, BaseException) and c.__module__ == module.__name__
    ]


@pytest.mark.parametrize("module", MODULES, ids=[m.__name__ for m in MODULES])
def test_every_project_exception_has_the_one_base(module: ModuleType) -> None:
    found = exceptions_of(module)
    assert found or module is ledger.errors  # the ledger raises typed failures only
    assert [c.__name__ for c in found if not issubclass(c, DeadlineCleanupError)] == []


def test_unavailable_services_are_not_bad_input() -> None:
    for kind in (core.errors.TemporalUnavailable, core.errors.DatabaseUnavailable):
        assert issubclass(kind, Unavailable) and not issubclass(kind, InputError)


def test_core_names_no_job_failure() -> None:
    platform = {t.value for t in core.errors.ErrorType}
    jobs = [cleanup.errors.CleanupFailure, ledger.errors.LedgerFailure, outbox.errors.OutboxFailure]
    job_types = {t.value for kind in jobs for t in kind}
    assert platform.isdisjoint(job_types)
    # A job's non-retryable failures are in its retry policy, not in another job's.
    assert set(cleanup.errors.NON_RETRYABLE) <= set(cleanup.errors.CLEANUP_RETRY.non_retryable_error_types or [])
    assert not set(ledger.errors.NON_RETRYABLE) & set(cleanup.errors.CLEANUP_RETRY.non_retryable_error_types or [])
