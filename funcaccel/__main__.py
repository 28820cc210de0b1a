"""The ``python -m funcaccel`` command line.

``python -m funcaccel env [--mesh R,S,T]`` prints the environment report
(``env_report``) for the current process's environment, with the mesh
``dp_replicate=R, dp_shard=S, tp=T`` described for this rank when given. ``python -m funcaccel plot RUN_DIR [--out FILE]``
writes a PNG of the metrics a ``JSONLTracker`` / ``CSVTracker`` logged in
``RUN_DIR`` (``plot_metrics``) and prints its path. ``python -m funcaccel estimate
MODULE:NAME --world-size N [--pp P --dp-replicate R --dp-shard S --tp T --fsdp ...]
[--schedule 1f1b --microbatches M] [--device cuda] [--json]`` prints
``estimate_memory``'s table (or JSON) for that model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        msg = f"expected integers separated by commas, e.g. 32,1024; got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def _add_estimate(commands: Any) -> None:
    estimate = commands.add_parser(
        "estimate",
        help="estimate each rank's memory for a training step at a world size",
        description="Run estimate_memory for a model given as an import path "
        "MODULE:NAME (a function or class returning an nn.Module or a "
        "transformers config), on fake tensors in this process.",
    )
    estimate.add_argument("model", metavar="MODULE:NAME")
    estimate.add_argument("--world-size", type=int, required=True)
    estimate.add_argument(
        "--pp", type=int, default=1, help="pipeline stages' ranks (a chain model)"
    )
    estimate.add_argument("--dp-replicate", type=int, default=1)
    estimate.add_argument(
        "--dp-shard", type=int, default=None, help="default: the rest with --fsdp"
    )
    estimate.add_argument("--tp", type=int, default=1)
    estimate.add_argument("--fsdp", action="store_true", help="shard with FSDP2")
    estimate.add_argument(
        "--tp-plan", default=None, metavar="MODULE:NAME", help="with --tp > 1"
    )
    estimate.add_argument("--batch-size", type=int, default=1, help="per rank")
    estimate.add_argument("--seq-len", type=int, default=2048)
    estimate.add_argument(
        "--input-shape", type=_ints, default=None, metavar="N,D,...",
        help="one micro-batch's shape, for a model that is not from transformers",
    )  # fmt: skip
    estimate.add_argument("--accumulation-steps", type=int, default=1)
    estimate.add_argument(
        "--microbatches", type=int, default=None,
        help="per pipeline step, with --pp (default: pp x stages per rank)",
    )  # fmt: skip
    estimate.add_argument(
        "--schedule", default="1f1b", help="torch's pipeline schedule, with --pp"
    )
    estimate.add_argument(
        "--stages-per-rank", type=int, default=1,
        help="with --pp: 2 or more for the interleaved and zero-bubble schedules",
    )  # fmt: skip
    estimate.add_argument(
        "--optimizer", default="adamw", choices=("adamw", "adam", "sgd")
    )
    estimate.add_argument(
        "--mixed-precision", default="no", choices=("no", "bf16", "fp16")
    )
    estimate.add_argument("--margin", type=float, default=0.1)
    estimate.add_argument(
        "--device", default=None, choices=("cpu", "cuda"),
        help="the device kind sizes are for (cuda: 512-byte blocks); "
        "default cuda when this machine has a GPU, else cpu",
    )  # fmt: skip
    estimate.add_argument("--json", action="store_true", help="print JSON")


def _estimate(args: argparse.Namespace) -> int:
    from funcaccel.planning import estimate_from_path

    try:
        result = estimate_from_path(
            args.model,
            world_size=args.world_size,
            pp=args.pp,
            dp_replicate=args.dp_replicate,
            dp_shard=args.dp_shard,
            tp=args.tp,
            fsdp=args.fsdp,
            tp_plan=args.tp_plan,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            input_shape=args.input_shape,
            accumulation_steps=args.accumulation_steps,
            optimizer=args.optimizer,
            mixed_precision=args.mixed_precision,
            margin=args.margin,
            device=args.device,
            microbatches=args.microbatches,
            schedule=args.schedule,
            stages_per_rank=args.stages_per_rank,
        )
    except (ImportError, AttributeError, TypeError, ValueError) as error:
        prefix, text = "python -m funcaccel estimate", str(error)
        print(text if text.startswith(prefix) else f"{prefix}: {text}", file=sys.stderr)
        return 1
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.table())
    return 0


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
    _add_estimate(commands)
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
    elif args.command == "estimate":
        return _estimate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
