"""Logging for workers and the CLI: human-readable by default, one JSON object per line when asked.

Every record emitted from an activity or a workflow carries the Temporal IDs: `workflow_id`,
`workflow_run_id`, `workflow_type`, `activity_id`, `activity_type`, `attempt`, `task_queue`,
`namespace`. They come from the `temporal_activity` / `temporal_workflow` extras that
`activity.logger` / `workflow.logger` add, and, for any other logger used inside an activity or a
workflow, from `activity.info()` / `workflow.info()`.

Log context belongs to the work, not to whatever task happened to be created during it: a task
spawned while an activity runs (asyncpg's pool maintenance, a reconnect, a helper's background job)
inherits the activity's context variables and may outlive it. `work_scope()` (entered around every
activity by core.interceptors) marks the activity finished when it returns, so a line written
later from such a task carries no IDs of the finished activity.

Known secrets (Settings.secrets(): the API key, the encryption key, the database password) and any
`scheme://user:password@` are replaced with `***` before the line is written: in the JSON format, in
each value (message, extra fields, exception and stack text) before it is serialized, so a secret
that JSON would escape (a quote, a backslash, a non-ASCII letter) is still found. Each secret is
also looked for in its escaped forms (Python `repr`, JSON), as a traceback's `KeyError('...')` shows it.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from temporalio import activity, workflow

from core.config import mask_url

CONTEXT_FIELDS = (
    "workflow_id",
    "workflow_run_id",
    "workflow_type",
    "activity_id",
    "activity_type",
    "attempt",
    "task_queue",
    "namespace",
)
_RENAMED = {"run_id": "workflow_run_id"}  # workflow.logger says run_id; activity.logger, workflow_run_id
_RESERVED = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "temporal_activity", "temporal_workflow"}
_RESERVED |= {"activity_info", "workflow_info", "temporal", *CONTEXT_FIELDS}


class _Work:
    """One activity execution; tasks created during it share this object through their copied context."""

    __slots__ = ("finished",)

    def __init__(self) -> None:
        self.finished = False


_WORK: ContextVar[_Work | None] = ContextVar("deadline_cleanup_work", default=None)


@contextmanager
def work_scope() -> Iterator[None]:
    """Around one activity execution: lines logged from tasks that outlive it carry none of its IDs."""
    work = _Work()
    token = _WORK.set(work)
    try:
        yield
    finally:
        work.finished = True
        _WORK.reset(token)


def finished_work() -> bool:
    """True in a task that inherited the context of an activity that has since finished."""
    work = _WORK.get()
    return work is not None and work.finished


def temporal_context(record: logging.LogRecord | None = None) -> dict[str, Any]:
    """The Temporal IDs of the activity or workflow this code runs in ({} outside both, and {} in a
    task that outlived the activity it was created in)."""
    if finished_work():
        return {}
    for extra in ("temporal_activity", "temporal_workflow"):
        details = getattr(record, extra, None) if record is not None else None
        if isinstance(details, Mapping):
            ctx = {_RENAMED.get(k, k): v for k, v in details.items() if v is not None}
            return {k: v for k, v in ctx.items() if k in CONTEXT_FIELDS}
    try:
        if activity.in_activity():
            info = activity.info()
            return {
                "workflow_id": info.workflow_id,
                "workflow_run_id": info.workflow_run_id,
                "workflow_type": info.workflow_type,
                "activity_id": info.activity_id,
                "activity_type": info.activity_type,
                "attempt": info.attempt,
                "task_queue": info.task_queue,
                "namespace": info.namespace,
            }
        if workflow.in_workflow():
            winfo = workflow.info()
            return {
                "workflow_id": winfo.workflow_id,
                "workflow_run_id": winfo.run_id,
                "workflow_type": winfo.workflow_type,
                "attempt": winfo.attempt,
                "task_queue": winfo.task_queue,
                "namespace": winfo.namespace,
            }
    except Exception:  # never let logging fail the code that logs
        return {}
    return {}


class TemporalContextFilter(logging.Filter):
    """Puts the Temporal IDs on the record as attributes (and as `record.temporal` for formatters)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "temporal"):
            ctx = temporal_context(record)
            record.temporal = ctx
            for key, value in ctx.items():
                setattr(record, key, value)
        return True


class _Redacting(logging.Formatter):
    def __init__(self, fmt: str | None = None, secrets: Iterable[str] = ()) -> None:
        super().__init__(fmt)
        found = {form for s in secrets if s and len(s) >= 3 for form in _escaped_forms(s)}
        self.secrets = sorted(found, key=len, reverse=True)  # longest first: no part of one is left

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return mask_url(text) or ""

    def redact_value(self, value: object) -> object:
        """`value` with every string in it redacted; what JSON cannot hold natively becomes its redacted
        `str` here, so nothing reaches the serializer unredacted."""
        if isinstance(value, str):
            return self.redact(value)
        if isinstance(value, bool | int | float) or value is None:
            return value
        if isinstance(value, Mapping):
            return {self.redact(str(k)): self.redact_value(v) for k, v in value.items()}
        if isinstance(value, list | tuple | set | frozenset):
            return [self.redact_value(v) for v in value]
        return self.redact(str(value))


def _escaped_forms(secret: str) -> set[str]:
    """The secret as written raw, by `repr` (a traceback's `KeyError('...')`) and by JSON."""
    forms = {secret, repr(secret)[1:-1], json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1]}
    return {f for f in forms if len(f) >= 3}


class TextFormatter(_Redacting):
    """`time LEVEL logger message [workflow_id=... activity_type=... attempt=...]`."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s", secrets)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        ctx: Mapping[str, Any] = getattr(record, "temporal", None) or temporal_context(record)
        if ctx:
            first, sep, rest = text.partition("\n")
            tags = " ".join(f"{k}={ctx[k]}" for k in CONTEXT_FIELDS if k in ctx and k != "namespace")
            text = f"{first} [{tags}]{sep}{rest}"
        return self.redact(text)


class JsonFormatter(_Redacting):
    """One JSON object per line: ts, level, logger, message, the Temporal IDs, any other extras."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": self._message(record),
        }
        ctx: Mapping[str, Any] = getattr(record, "temporal", None) or temporal_context(record)
        out.update(ctx)
        for key, value in vars(record).items():
            if key not in _RESERVED and not key.startswith("_"):
                out.setdefault(key, value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(self.redact_value(out))

    def _message(self, record: logging.LogRecord) -> str:
        """The message with its arguments redacted before formatting (a `%r` would escape a secret)."""
        args = record.args
        if isinstance(args, Mapping):
            args = {k: self._redacted_arg(v) for k, v in args.items()}
        elif isinstance(args, tuple):
            args = tuple(self._redacted_arg(a) for a in args)
        try:
            text = str(record.msg) % args if args else str(record.msg)
        except (TypeError, ValueError):  # a malformed call: the message as logging itself would show it
            text = record.getMessage()
        return self.redact(text)

    def _redacted_arg(self, arg: object) -> object:
        return self.redact(arg) if isinstance(arg, str) else arg


def configure(fmt: str = "text", *, level: int = logging.INFO, secrets: Iterable[str] = ()) -> logging.Handler:
    """Replace the root logger's handlers with one stderr handler in `fmt` ("text" or "json")."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(secrets=secrets) if fmt == "json" else TextFormatter(secrets))
    handler.addFilter(TemporalContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    ids_as_fields_only()
    return handler


def ids_as_fields_only() -> None:
    """The IDs are fields (and tags in text): the SDK's adapters need not append them to messages."""
    activity.logger.activity_info_on_message = False
    workflow.logger.workflow_info_on_message = False
