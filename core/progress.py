"""A small progress bar on stderr for long CLI operations; silent when stderr is not a terminal
(so `--json` output and scripts stay clean) unless forced with PROGRESS=1."""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        self.label = label
        self.total = max(total, 1)
        self.stream = stream or sys.stderr
        self.width = width
        self.enabled = self.stream.isatty() or os.environ.get("PROGRESS") == "1"
        self.started = time.monotonic()
        self.done = 0

    def update(self, done: int, note: str = "") -> None:
        self.done = done
        if not self.enabled:
            return
        filled = int(self.width * min(done, self.total) / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.monotonic() - self.started
        self.stream.write(f"\r{self.label} [{bar}] {done}/{self.total} {elapsed:5.1f}s {note}".ljust(100)[:120])
        self.stream.flush()

    def finish(self, note: str = "") -> None:
        self.update(self.done, note)
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
