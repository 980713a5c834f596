"""The ordinary worker plus the harness's redelivery workflow: `python -m harness.worker`.

It is `worker.py` (its `main`) with one extra workflow; it prints `HARNESS_WORKER_READY pid=N` once
it polls, so the supervisor knows when a (re)started process is up. Most scenarios drive their
cleanups themselves, so this worker ensures the deadline planner only when CLEANUP_PLANNER says so
explicitly (a lane with `planner=True`, scenario 13). Failpoints come from CLEANUP_FAILPOINTS like
for any worker.
"""

from __future__ import annotations

import os

import worker as app_worker
from core.process import exit_now
from harness.redelivery import HarnessRedeliverWorkflow

READY = "HARNESS_WORKER_READY"


def _ready() -> None:
    print(f"{READY} pid={os.getpid()} failpoints={os.environ.get('CLEANUP_FAILPOINTS', '')}", flush=True)


if __name__ == "__main__":
    planner = "CLEANUP_PLANNER" in os.environ  # and not off (the worker's settings.planner_enabled)
    exit_now(app_worker.main([], extra_workflows=[HarnessRedeliverWorkflow], on_ready=_ready, planner=planner))
