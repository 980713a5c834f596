"""`python -m devstack harness ...` (and `./dev harness`): parsed here, loaded only when invoked."""

from __future__ import annotations

import argparse
import json
import sys

from core.config import Settings
from core.errors import InputError

EXIT_VIOLATION = 1


async def cmd_harness(args: argparse.Namespace, settings: Settings) -> None:
    from harness.common import PROFILES, Row
    from harness.runner import render_details, render_recovery, render_table, run_profile
    from harness.scenarios import all_scenarios

    if args.profile not in PROFILES:
        raise InputError(f"unknown profile {args.profile!r}: quick or full")
    only = [s.strip() for s in args.scenarios.split(",")] if args.scenarios else None
    known = all_scenarios()
    if only and (bad := [s for s in only if s not in known]):
        raise InputError(f"unknown scenario(s) {', '.join(bad)}; known: {', '.join(known)}")

    def progress(row: Row) -> None:
        if not args.json:
            verdict = "PASS" if row.passed else "FAIL"
            print(f"  {row.scenario}: {verdict} in {row.seconds} s", file=sys.stderr, flush=True)

    if not args.json:
        print(f"harness: profile {args.profile}, seed {args.seed}", file=sys.stderr, flush=True)
    report = await run_profile(
        args.profile, args.seed, only, args.inject_violation, args.inject_ordering_violation, progress=progress
    )
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(render_table(report))
        recovery = render_recovery(report)
        if recovery:
            print("\nrecovery per stop (from the stop to the work under way on another worker)")
            print(recovery)
        if args.details or not report["passed"]:
            print(render_details(report))
        print(f"\n{'all invariants held' if report['passed'] else 'INVARIANTS VIOLATED'} in {report['seconds']} s")
    if not report["passed"]:
        raise SystemExit(EXIT_VIOLATION)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m devstack harness", description="run the fault-injection harness: scenarios, DB checks, a table"
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--profile", default="quick", choices=["quick", "full"], help="quick (CI) or full (200+ kills)")
    p.add_argument("--seed", type=int, default=7, help="seed of every random choice (default 7)")
    p.add_argument("--scenarios", help="comma-separated subset, e.g. replay,kill (default: all)")
    p.add_argument("--details", action="store_true", help="print evidence and notes under the table")
    p.add_argument(
        "--inject-violation",
        action="store_true",
        help="write a duplicate reminder into the database during 'replay' (proves the harness can fail)",
    )
    p.add_argument(
        "--inject-ordering-violation",
        action="store_true",
        help="write a settlement revision stamped before the one it follows during 'replay' "
        "(proves the ordering column can fail)",
    )
    return p


async def run_harness_cli(argv: list[str], settings: Settings) -> None:
    """`python -m devstack harness ARGS`: loaded only when invoked."""
    await cmd_harness(build_parser().parse_args(argv), settings)
