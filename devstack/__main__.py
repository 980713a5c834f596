"""`python -m devstack ...`: the checkout's development commands (devstack.cli)."""

from core.process import exit_now
from devstack.cli import main

if __name__ == "__main__":
    exit_now(main())
