"""Leaving a process that has used the Temporal SDK.

The SDK's Rust runtime keeps native threads that can call into Python while the interpreter
finalizes; on a loaded machine that aborts a process whose work is already done
(`Fatal Python error: PyGILState_Release`, SIGABRT), so a clean exit code becomes -6. Entry points
therefore flush what they wrote and leave without finalizing.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int | None) -> NoReturn:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to deliver
            pass
    os._exit(code or 0)
