"""Failpoints: named places where a test can make a worker die for real.

Enabled only through the CLEANUP_FAILPOINTS environment variable, e.g.
`CLEANUP_FAILPOINTS=cleanup_partition.after_commit=exit` (die at the first hit) or
`...=exit@3` (die at the third hit). When the variable is unset, `hit()` is a single dict lookup
on an empty dict.

In-process tests can also register an async hook at a named place (`set_hook`), e.g. to change
data between two batches of a shard while its activity waits; `reached()` awaits it. Without a
hook, `reached()` is one dict lookup.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

_ACTIONS: dict[str, tuple[str, int]] = {}
_HITS: dict[str, int] = {}
_HOOKS: dict[str, Callable[[Any], Awaitable[None]]] = {}

EXIT_CODE = 86


def _parse(spec: str) -> dict[str, tuple[str, int]]:
    actions: dict[str, tuple[str, int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, action = item.partition("=")
        verb, _, nth = action.partition("@")
        if verb != "exit":
            raise ValueError(f"failpoint {name!r}: unknown action {verb!r} (known: exit)")
        actions[name] = (verb, int(nth or 1))
    return actions


def configure(spec: str | None) -> None:
    _ACTIONS.clear()
    _HITS.clear()
    _ACTIONS.update(_parse(spec or ""))


def hit(name: str) -> None:
    """Die here (like `kill -9`: no cleanup, no reply to Temporal) if this failpoint is armed."""
    action = _ACTIONS.get(name)
    if action is None:
        return
    _HITS[name] = _HITS.get(name, 0) + 1
    if _HITS[name] == action[1]:
        sys.stderr.write(f"failpoint {name}: exiting process {os.getpid()}\n")
        sys.stderr.flush()
        os._exit(EXIT_CODE)


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
