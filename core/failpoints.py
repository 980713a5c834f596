"""Failpoints: named places where a test can make a worker die, stop or freeze, for real.

Armed only when CLEANUP_FAILPOINTS_ENABLED=1 (the tests and the harness set it; a production
worker never should): then CLEANUP_FAILPOINTS arms them, e.g.
`CLEANUP_FAILPOINTS=cleanup_partition.after_commit=exit` (die at the first hit, like `kill -9`),
`...=exit@3` (die at the third hit), `...=term@3` (send itself SIGTERM at the third hit, as a
deploy would, and go on: the worker shuts down gracefully) or `cleanup_partition.in_batch=stop@2`
(freeze at the second hit: the process sends itself SIGSTOP, as a VM paused by its host or a
process stuck in a long GC would be, and goes on from there when it gets SIGCONT). When the
variable is unset, `hit()` is a single dict lookup on an empty dict. Without the enable setting a
spec arms nothing (a stray variable must not make a production worker die on purpose), and a
WARNING says so; each armed failpoint is named in a WARNING when the process starts.

With CLEANUP_FAILPOINTS_ONCE_DIR set, an armed failpoint fires in only one of the processes that
share that directory: the first to reach its hit creates `<dir>/<name>` and fires; the others (a
retry on another worker, hitting the same place) pass. So every worker of a pool can be armed and
whichever reaches the place first is the one that dies or freezes.

Several processes can also share one failpoint (CLEANUP_FAILPOINTS_FILE=path, the harness's kill
lanes): the file holds the spec, the hits counted across every process that reads it and, once one
process acted, what it did, where and when (`fired`), so exactly one of them acts, at the N-th hit
of the lane. The harness rewrites the file to arm the next run; an absent file arms nothing.

In-process tests can also register an async hook at a named place (`set_hook`), e.g. to change
data between two batches of a shard while its activity waits; `reached()` awaits it. Without a
hook, `reached()` is one dict lookup.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from core.config import process_switch, switched_on

_ACTIONS: dict[str, tuple[str, int]] = {}
_HITS: dict[str, int] = {}
_HOOKS: dict[str, Callable[[Any], Awaitable[None]]] = {}

EXIT_CODE = 86
VERBS = ("exit", "term", "stop")
ONCE_DIR_ENV = "CLEANUP_FAILPOINTS_ONCE_DIR"
SHARED_FILE_ENV = "CLEANUP_FAILPOINTS_FILE"
ENABLED_ENV = "CLEANUP_FAILPOINTS_ENABLED"
_SHARED: list[Path] = []
log = logging.getLogger(__name__)


def _parse(spec: str) -> dict[str, tuple[str, int]]:
    actions: dict[str, tuple[str, int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, action = item.partition("=")
        verb, _, nth = action.partition("@")
        if verb not in VERBS:
            raise ValueError(f"failpoint {name!r}: unknown action {verb!r} (known: {', '.join(VERBS)})")
        actions[name] = (verb, int(nth or 1))
    return actions


def enabled_by_env() -> bool:
    return switched_on(ENABLED_ENV)


def configure(spec: str | None, shared_file: str | None = None, *, enabled: bool = True) -> None:
    """Arm the failpoints of `spec` and of `shared_file`, only if `enabled`; WARNING either way."""
    _ACTIONS.clear()
    _HITS.clear()
    _SHARED.clear()
    if not (spec or shared_file):
        return
    if not enabled:
        log.warning("failpoints NOT armed: %s is set but %s is not 1", "CLEANUP_FAILPOINTS", ENABLED_ENV)
        return
    _ACTIONS.update(_parse(spec or ""))
    _SHARED[:] = [Path(shared_file)] if shared_file else []
    for name, (verb, nth) in _ACTIONS.items():
        log.warning("failpoint armed: %s=%s@%d (this process will %s there)", name, verb, nth, verb)
    if shared_file:
        log.warning("failpoints armed by the shared file %s", shared_file)


def arm_shared(path: Path, spec: str) -> None:
    """Arm the failpoint shared through `path` for the next run: no hit counted, nothing fired."""
    _parse(spec)  # fail here, in the caller, on a bad spec
    path.write_text(json.dumps({"spec": spec, "hits": {}, "fired": None}))


def shared_state(path: Path) -> dict[str, Any]:
    """The shared file's state: {"spec", "hits", "fired": None or {point, action, pid, at}}."""
    with contextlib.suppress(FileNotFoundError, ValueError):
        return dict(json.loads(path.read_text()))
    return {"spec": "", "hits": {}, "fired": None}


def _act(name: str, verb: str) -> None:
    if verb == "stop":
        sys.stderr.write(f"failpoint {name}: stopping process {os.getpid()}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSTOP)  # returns once the process is continued
        sys.stderr.write(f"failpoint {name}: process {os.getpid()} continued\n")
        sys.stderr.flush()
        return
    if verb == "term":
        sys.stderr.write(f"failpoint {name}: sending SIGTERM to process {os.getpid()}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGTERM)
        return
    sys.stderr.write(f"failpoint {name}: exiting process {os.getpid()}\n")
    sys.stderr.flush()
    os._exit(EXIT_CODE)


def _hit_shared(path: Path, name: str) -> None:
    """Count the hit in the shared file (under an exclusive lock); act if it is the armed N-th one."""
    verb = None
    with contextlib.suppress(FileNotFoundError), open(path, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            state = json.loads(f.read() or "{}")
        except ValueError:
            return
        action = _parse(state.get("spec", "")).get(name)
        if action is None or state.get("fired"):
            return
        hits = state.setdefault("hits", {})
        hits[name] = hits.get(name, 0) + 1
        if hits[name] == action[1]:
            verb = action[0]
            state["fired"] = {"point": name, "action": verb, "pid": os.getpid(), "at": time.time()}
        f.seek(0)
        f.truncate()
        f.write(json.dumps(state))
        f.flush()
    if verb is not None:
        _act(name, verb)


def _first_to_fire(name: str) -> bool:
    """Without CLEANUP_FAILPOINTS_ONCE_DIR: always. With it: only the first process to get here."""
    once_dir = process_switch(ONCE_DIR_ENV)
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
    """Die here (`exit`: like `kill -9`, no cleanup, no reply to Temporal), send this process
    SIGTERM (`term`) or freeze here until SIGCONT (`stop`) if this failpoint is armed for this hit."""
    if _SHARED:
        _hit_shared(_SHARED[0], name)
    action = _ACTIONS.get(name)
    if action is None:
        return
    _HITS[name] = _HITS.get(name, 0) + 1
    if _HITS[name] == action[1] and _first_to_fire(name):
        _act(name, action[0])


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


configure(
    process_switch("CLEANUP_FAILPOINTS") or None, process_switch(SHARED_FILE_ENV) or None, enabled=enabled_by_env()
)
