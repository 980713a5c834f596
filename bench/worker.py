"""The ordinary worker plus the benchmarks' bare reference workflow: `python -m bench.worker`.

It is `worker.py` (its `main`) with the extra workflow and activity; the benchmarks drive their
cleanups themselves, so it does not ensure the deadline planner.
"""

from __future__ import annotations

import worker as app_worker
from bench.bare_workflow import BareDeadlineWorkflow, noop
from core.process import exit_now

if __name__ == "__main__":
    exit_now(app_worker.main([], extra_workflows=[BareDeadlineWorkflow], extra_activities=[noop], planner=False))
