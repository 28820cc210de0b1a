"""What the collective guard costs: calls with it on (the default) against "off".

At 2 and 4 gloo processes on this machine, each rank times ``gather_for_metrics``
of a small tensor (8 floats) and ``save_checkpoint`` of a small model, with
``collective_timeout=None`` (the guard on, bounded by the group's timeout) and with
``collective_timeout="off"``. The variants are interleaved repetition by
repetition; the "off" variant runs twice, and the ratio of its second run to its
first is the noise-control row. The table gives, per world size and call, rank 0's
median time per call and the ratios of the medians.

The group rendezvouses as torchrun's does (a TCP store on 127.0.0.1, a free port)
unless ``--store file`` picks a ``file://`` store (what ``launch`` and the tests use;
it polls, so each guarded call costs more there).

    python benchmarks/bench_guard.py --repeats 7
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.multiprocessing.spawn import start_processes

from funcaccel._group import end_process_group
from funcaccel._group import start_process_group
from funcaccel.checkpoint import save_checkpoint
from funcaccel.collectives import gather_for_metrics
from funcaccel.context import CollectiveTimeout
from funcaccel.testing import rank_ctx

VARIANTS = ("off", "on", "off again")
Timings = dict[str, dict[str, list[float]]]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _per_call(call: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - start) / n


def _worker(
    rank: int, world: int, init: str, out: Path, repeats: int, gathers: int
) -> None:
    torch.set_num_threads(1)
    start_process_group("gloo", init_method=init, world_size=world, rank=rank)
    base = rank_ctx(world, rank)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    small = torch.ones(8)
    timings: Timings = {"gather_for_metrics": {}, "save_checkpoint": {}}
    checkpoints = out.parent / "checkpoints"  # beside the output: every rank's
    for repeat in range(repeats):
        for variant in VARIANTS:
            mode: CollectiveTimeout = None if variant == "on" else "off"
            ctx = dataclasses.replace(base, collective_timeout=mode)
            gather = partial(gather_for_metrics, ctx, small, batch=None)
            seconds = _per_call(gather, gathers)
            timings["gather_for_metrics"].setdefault(variant, []).append(seconds)
            where = checkpoints / f"{variant}-{repeat}"
            save = partial(save_checkpoint, ctx, where, models=model, keep_last=1)
            seconds = _per_call(save, 3)
            timings["save_checkpoint"].setdefault(variant, []).append(seconds)
    end_process_group()
    if rank == 0:
        out.write_text(json.dumps(timings))


def _run(world: int, store: str, repeats: int, gathers: int) -> Timings:
    with tempfile.TemporaryDirectory() as tmp:
        init = (
            f"file://{tmp}/rendezvous"
            if store == "file"
            else f"tcp://127.0.0.1:{_free_port()}"
        )
        out = Path(tmp) / "timings"
        start_processes(  # type: ignore[no-untyped-call]
            _worker, args=(world, init, out, repeats, gathers), nprocs=world
        )
        timings: Timings = json.loads(out.read_text())
        return timings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--gathers", type=int, default=50, help="calls per timing")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--store", choices=["tcp", "file"], default="tcp")
    args = parser.parse_args(argv)
    print(f"store: {args.store}, repeats: {args.repeats}, rank 0's medians")
    print("| world | call | off (ms) | on (ms) | on / off | noise control |")
    print("|---|---|---|---|---|---|")
    for world in args.worlds:
        timings = _run(world, args.store, args.repeats, args.gathers)
        for call, by_variant in timings.items():
            med = {v: statistics.median(t) * 1e3 for v, t in by_variant.items()}
            print(
                f"| {world} | {call} | {med['off']:.3f} | {med['on']:.3f} | "
                f"{med['on'] / med['off']:.3f}x | "
                f"{med['off again'] / med['off']:.3f}x |"
            )


if __name__ == "__main__":
    main()
