"""Failpoints: named places where a test can make a worker die, or freeze, for real.

Enabled only through the CLEANUP_FAILPOINTS environment variable, e.g.
`CLEANUP_FAILPOINTS=cleanup_partition.after_commit=exit` (die at the first hit), `...=exit@3` (die
at the third hit) or `cleanup_partition.in_batch=stop@2` (freeze at the second hit: the process
sends itself SIGSTOP, as a VM paused by its host or a process stuck in a long GC would be, and goes
on from there when it gets SIGCONT). When the variable is unset, `hit()` is a single dict lookup on
an empty dict.

With CLEANUP_FAILPOINTS_ONCE_DIR set, an armed failpoint fires in only one of the processes that
share that directory: the first to reach its hit creates `<dir>/<name>` and fires; the others (a
retry on another worker, hitting the same place) pass. So every worker of a pool can be armed and
whichever reaches the place first is the one that dies or freezes.

In-process tests can also register an async hook at a named place (`set_hook`), e.g. to change
data between two batches of a shard while its activity waits; `reached()` awaits it. Without a
hook, `reached()` is one dict lookup.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

_ACTIONS: dict[str, tuple[str, int]] = {}
_HITS: dict[str, int] = {}
_HOOKS: dict[str, Callable[[Any], Awaitable[None]]] = {}
_VERBS = ("exit", "stop")

EXIT_CODE = 86
ONCE_DIR_ENV = "CLEANUP_FAILPOINTS_ONCE_DIR"


def _parse(spec: str) -> dict[str, tuple[str, int]]:
    actions: dict[str, tuple[str, int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, action = item.partition("=")
        verb, _, nth = action.partition("@")
        if verb not in _VERBS:
            raise ValueError(f"failpoint {name!r}: unknown action {verb!r} (known: {', '.join(_VERBS)})")
        actions[name] = (verb, int(nth or 1))
    return actions


def configure(spec: str | None) -> None:
    _ACTIONS.clear()
    _HITS.clear()
    _ACTIONS.update(_parse(spec or ""))


def _first_to_fire(name: str) -> bool:
    """Without CLEANUP_FAILPOINTS_ONCE_DIR: always. With it: only the first process to get here."""
    once_dir = os.environ.get(ONCE_DIR_ENV)
    if not once_dir:
        return True
    try:
        fd = os.open(Path(once_dir) / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as token:
        token.write(f"{os.getpid()}\n")
    return True


def hit(name: str) -> None:
    """Die here (`exit`: like `kill -9`, no cleanup, no reply to Temporal) or freeze here until
    SIGCONT (`stop`) if this failpoint is armed."""
    action = _ACTIONS.get(name)
    if action is None:
        return
    _HITS[name] = _HITS.get(name, 0) + 1
    if _HITS[name] != action[1] or not _first_to_fire(name):
        return
    verb = action[0]
    sys.stderr.write(f"failpoint {name}: {'exiting' if verb == 'exit' else 'stopping'} process {os.getpid()}\n")
    sys.stderr.flush()
    if verb == "exit":
        os._exit(EXIT_CODE)
    os.kill(os.getpid(), signal.SIGSTOP)  # returns once the process is continued
    sys.stderr.write(f"failpoint {name}: process {os.getpid()} continued\n")
    sys.stderr.flush()


def set_hook(name: str, hook: Callable[[Any], Awaitable[None]] | None) -> None:
    """Register (or, with None, remove) an in-process async hook at `name` (tests only)."""
    if hook is None:
        _HOOKS.pop(name, None)
    else:
        _HOOKS[name] = hook


async def reached(name: str, context: Any = None) -> None:
    """Await the hook registered at `name`, if any, with `context` (e.g. the shard's checkpoint)."""
    hook = _HOOKS.get(name)
    if hook is not None:
        await hook(context)


configure(os.environ.get("CLEANUP_FAILPOINTS"))
