"""`python -m devstack` (and `./dev`): the commands of a checkout, beside the operator CLI.

  up       start the embedded Temporal dev server and Postgres, record their addresses
  down     stop them and forget their addresses
  seed     demo accounts with their game data at a deadline
  demo     the end-to-end demonstration with its own workers
  harness  the fault-injection harness (`harness --help` for its options)

The global options and the exit codes are the operator CLI's (`deadline-cleanup --help`); after
`up`, the checkout's commands (`python starter.py ...`, `python worker.py`) find the stack.
"""

from __future__ import annotations

import argparse
import sys

import starter
from core.addresses import missing_addresses
from core.cli import CliParser, Commands, add_connection_flags, emit, key_values
from core.config import Settings, dev_env_file, mask_url
from demo import cli as demo_cli
from devstack import embedded


async def cmd_up(args: argparse.Namespace, settings: Settings) -> None:
    """`up` starts the embedded stack (the one command that does, with the demo, the harness and the
    tests) and records its addresses in <state dir>/dev/env, where this checkout's later commands
    find them."""
    started = missing_addresses(settings)
    resolved = embedded.resolve(settings)
    env_file = embedded.write_dev_env(resolved, started) if started else None
    emit(
        args,
        {
            "temporal": resolved.temporal_address,
            "ui": resolved.ui_url(),
            "database_url": mask_url(resolved.database_url),
            "env_file": str(env_file) if env_file else None,
        },
        key_values,
    )


async def cmd_down(args: argparse.Namespace, settings: Settings) -> None:
    stopped = embedded.DevServer(settings.state_dir).stop()
    was_running = embedded.stop_embedded_postgres(settings.state_dir)
    dev_env_file(settings.state_dir).unlink(missing_ok=True)
    emit(
        args,
        {"temporal": stopped, "postgres": "stopped" if was_running else "not running"},
        lambda d: f"embedded Temporal dev server: {stopped}; embedded Postgres: {d['postgres']}",
    )


async def cmd_harness(args: argparse.Namespace, settings: Settings) -> None:
    from harness.cli import run_harness_cli  # lazy: the other commands never load the harness

    await run_harness_cli(args.rest, settings)


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="python -m devstack", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_connection_flags(parser)
    commands = Commands(parser.add_subparsers(dest="command", required=True, title="commands"))
    commands.add("up", cmd_up, "start the embedded stack (if not running) and record its addresses for later commands")
    commands.add("down", cmd_down, "stop the embedded stack and forget its addresses")
    demo_cli.register(commands)
    help = "run the fault-injection harness (`harness --help` for its options)"
    p = commands.sub.add_parser("harness", help=help, description=help, add_help=False)
    p.set_defaults(handler=cmd_harness, takes_rest=True)  # its arguments are parsed by harness.cli
    return parser


def main(argv: list[str] | None = None) -> int:
    return starter.run(build_parser(), sys.argv[1:] if argv is None else argv)
