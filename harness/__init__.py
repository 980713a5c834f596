"""The evaluation harness: `./dev harness [--profile quick|full] [--seed N] [--json]`.

It starts its own stack (a private Temporal dev server, fresh databases), supervises `python -m
harness.worker` processes (restarting them when they die), injects faults, and counts in the
database whether every effect happened exactly once. See docs/harness.md.
"""
