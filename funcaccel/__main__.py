"""The ``python -m funcaccel`` command line.

``python -m funcaccel env [--mesh R,S,T]`` prints the environment report
(``env_report``) for the current process's environment, with the mesh
``dp_replicate=R, dp_shard=S, tp=T`` described for this rank when given. ``python -m funcaccel plot RUN_DIR [--out FILE]``
writes a PNG of the metrics a ``JSONLTracker`` / ``CSVTracker`` logged in
``RUN_DIR`` (``plot_metrics``) and prints its path.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from funcaccel.envreport import env_report
from funcaccel.plot import plot_metrics


def _mesh_sizes(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    try:
        r, s, t = (int(part) for part in parts)
    except ValueError:
        msg = (
            f"expected three integers DP_REPLICATE,DP_SHARD,TP (-1 for the rest), "
            f"e.g. 1,-1,2; got {text!r}"
        )
        raise argparse.ArgumentTypeError(msg) from None
    return (r, s, t)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (``sys.argv[1:]`` when ``None``).

    Returns:
        The exit status: 0 on success, 1 when ``plot`` cannot draw (the reason is
        printed on stderr). A bad command exits with status 2 and a usage message
        (``argparse``).
    """
    parser = argparse.ArgumentParser(
        prog="python -m funcaccel",
        description="funcaccel command line tools.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser(
        "env",
        help="print versions, devices, backends and the context this environment gives",
    )
    env.add_argument(
        "--mesh",
        type=_mesh_sizes,
        default=None,
        metavar="R,S,T",
        help="also show this rank's place in the dp_replicate,dp_shard,tp mesh "
        "(-1 for the rest), e.g. --mesh 1,-1,2",
    )
    plot = commands.add_parser(
        "plot",
        help="write a PNG of the metrics logged to the JSONL/CSV files of a run",
    )
    plot.add_argument(
        "run_dir",
        type=Path,
        metavar="RUN_DIR",
        help="the directory JSONLTracker/CSVTracker wrote into, or one of their files",
    )
    plot.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="FILE",
        help="the PNG to write (default: RUN_DIR/metrics.png)",
    )
    args = parser.parse_args(argv)
    if args.command == "env":
        # The entry point is where the process's environment is read, once.
        print(env_report(os.environ, mesh=args.mesh))
    elif args.command == "plot":
        try:
            written = plot_metrics(args.run_dir, out=args.out)
        except (ImportError, OSError, ValueError) as error:
            print(f"python -m funcaccel plot: {error}", file=sys.stderr)
            return 1
        print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
