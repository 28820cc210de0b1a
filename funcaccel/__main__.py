"""The ``python -m funcaccel`` command line.

``python -m funcaccel env`` prints the environment report (``env_report``) for the
current process's environment.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from funcaccel.envreport import env_report


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (``sys.argv[1:]`` when ``None``).

    Returns:
        The exit status: 0 on success. A bad command exits with status 2 and a
        usage message (``argparse``).
    """
    parser = argparse.ArgumentParser(
        prog="python -m funcaccel",
        description="funcaccel command line tools.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "env",
        help="print versions, devices, backends and the context this environment gives",
    )
    args = parser.parse_args(argv)
    if args.command == "env":
        # The entry point is where the process's environment is read, once.
        print(env_report(os.environ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
