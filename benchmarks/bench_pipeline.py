"""Pipeline schedules on gloo: step time, idle share per rank, peak activations per stage.

For each pipeline size in ``--pps`` (default 2 and 4, as many gloo processes) and
each schedule, fresh processes (forked from a server that has only imported torch
and funcaccel) build a float32 chain of ``--layers`` ``Linear + Tanh`` blocks of
width ``--width`` between an input and an output layer, wrap it with
``wrap_model(..., pipeline=PipelineOptions(...))`` (an even cut; 2 stages per
rank for the interleaved, looped and V schedules) and run ``--steps`` timed
``pipeline_step``s (SGD, ``--microbatches`` micro-batches of a ``--batch`` batch)
after ``--warmup`` untimed ones. Each rank reports

* its step time (median over the timed steps);
* its **busy** time: the same stages, forward and backward over the same
  micro-batches, run alone in the same process without any communication
  (median of ``--steps`` repeats); the **idle share** is ``1 - busy / step``:
  the part of the step spent waiting for the other stages or communicating
  (the pipeline bubble plus transfers);
* the peak bytes of activations its stages held for backward at once during a
  step (tensors saved by autograd, counted by a ``saved_tensors_hooks`` pair and
  freed when autograd drops them), and its parameters.

The reference row is plain PyTorch: the whole model in one process, forward and
backward over the whole batch and an SGD step (median of ``--steps``), timed in
this process before the pipelines run; the noise-control row is the same again.
``× plain`` is a step time over plain PyTorch's. Every process runs one thread.
The first step's loss of each pipeline is printed against the plain model's
(same seed: the same initial values), as the ``|loss - plain|`` column.

    PYTHONPATH=. python benchmarks/bench_pipeline.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing
from torch import nn

from funcaccel import GradState
from funcaccel import InitProcessGroupKwargs
from funcaccel import Pipeline
from funcaccel import PipelineOptions
from funcaccel import build_context
from funcaccel import build_mesh
from funcaccel import close_context
from funcaccel import pipeline_step
from funcaccel import wrap_model

MiB = 2**20
REFERENCE = "plain PyTorch (one process)"
NOISE = "plain PyTorch again (noise control)"
SCHEDULES = {
    "gpipe": 1,
    "1f1b": 1,
    "interleaved_1f1b": 2,
    "looped_bfs": 2,
    "interleaved_zero_bubble": 2,
    "zbv_zero_bubble": 2,
}


class Chain(nn.Module):
    """``inp``, ``blocks.0 .. blocks.{n-1}``, ``out``: a chain of units."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)
        )
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        y: torch.Tensor = self.out(x)
        return y


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (
        torch.randn(args.batch, 16, generator=gen),
        torch.randn(args.batch, 4, generator=gen),
    )


class SavedBytes:
    """Count the bytes autograd holds for backward; remember the peak."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        size = tensor.numel() * tensor.element_size()
        self.live += size
        self.peak = max(self.peak, self.live)
        return _Held(self, tensor, size)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        tensor: torch.Tensor = held.tensor
        return tensor


class _Held:
    def __init__(self, owner: SavedBytes, tensor: torch.Tensor, size: int) -> None:
        self.owner, self.tensor, self.size = owner, tensor, size

    def __del__(self) -> None:
        self.owner.live -= self.size


def _plain(args: argparse.Namespace) -> tuple[float, float, float]:
    """Median step ms, peak saved MiB and first loss of the whole model."""
    torch.manual_seed(0)
    model = Chain(args.width, args.layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, t = _batch(args)
    saved, times, first = SavedBytes(), [], 0.0
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            loss = _loss(model(x), t)
        torch.autograd.backward(loss)
        opt.step()
        opt.zero_grad()
        if step == 0:
            first = float(loss.detach())
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, saved.peak / MiB, first


def _busy_ms(pipe: Pipeline, args: argparse.Namespace, width_in: list[int]) -> float:
    """The stages' forward and backward over the micro-batches, alone."""
    rows = args.batch // args.microbatches
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        for module, features in zip(pipe.stage_modules, width_in, strict=True):
            for _ in range(args.microbatches):
                x = torch.randn(rows, features, requires_grad=True)
                torch.autograd.backward(module(x).sum())
        times.append(time.perf_counter() - start)
    pipe.zero_grad(set_to_none=True)
    return statistics.median(times) * 1e3


def _run(ctx: Any, schedule: str, args: argparse.Namespace) -> dict[str, Any]:
    pp = ctx.num_processes
    mesh = build_mesh(ctx, pp=pp, dp_shard=1)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Chain(args.width, args.layers)
    options = PipelineOptions(
        microbatches=args.microbatches,
        schedule=schedule,
        stages_per_rank=SCHEDULES[schedule],
    )
    pipe = wrap_model(ctx, model, mesh=mesh, pipeline=options)
    assert isinstance(pipe, Pipeline)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    batch, grad = _batch(args), GradState()
    saved, times, first = SavedBytes(), [], 0.0
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            loss, grad = pipeline_step(ctx, grad, pipe, opt, batch, _loss)
        if step == 0:
            first = float(loss.detach())
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    width_in = [16 if 0 == index else args.width for index in pipe.stage_indices]
    params = sum(p.numel() * p.element_size() for p in pipe.parameters())
    return {
        "step": statistics.median(times) * 1e3,
        "busy": _busy_ms(pipe, args, width_in),
        "saved": saved.peak / MiB,
        "params": params / MiB,
        "loss": first,
    }


def worker(rank: int, world: int, tmp: str, schedule: str, args: Any) -> None:
    torch.set_num_threads(1)
    env = {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    init = InitProcessGroupKwargs(init_method=f"file://{tmp}/rendezvous")
    ctx = build_context(cpu=True, init_kwargs=init, environ=env)
    try:
        result = _run(ctx, schedule, args)
    finally:
        close_context(ctx)
    Path(tmp, f"rank_{rank}.json").write_text(json.dumps(result))


def _spawn(world: int, schedule: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        context = torch.multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch", "torch.distributed", "funcaccel"])
        processes = [
            context.Process(target=worker, args=(rank, world, tmp, schedule, args))
            for rank in range(world)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=args.timeout)
        for process in processes:
            if process.is_alive():
                process.kill()
        codes = [process.exitcode for process in processes]
        if any(codes):
            raise SystemExit(f"bench_pipeline: {schedule} workers exited with {codes}")
        return [
            json.loads(Path(tmp, f"rank_{r}.json").read_text()) for r in range(world)
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pps", default="2,4", help="pipeline sizes (= processes)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8, help="width x width blocks")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="per run, s")
    args = parser.parse_args()
    chosen = [s for s in args.schedules.split(",") if s]
    unknown = sorted(set(chosen) - set(SCHEDULES))
    if unknown:
        parser.error(f"unknown schedules {unknown}; choose from {list(SCHEDULES)}")
    torch.set_num_threads(1)
    plain = [_plain(args), _plain(args)]
    print(
        f"chain of {args.layers} blocks of width {args.width} (float32), batch "
        f"{args.batch} in {args.microbatches} micro-batches, SGD, gloo, 1 thread per "
        f"process; median of {args.steps} steps after {args.warmup}"
    )
    for pp in (int(p) for p in args.pps.split(",")):
        print(f"\npp={pp} ({pp} processes)\n")
        print(
            "| schedule | step ms (max rank) | × plain | idle share (mean of ranks) "
            "| idle share (max rank) | peak saved activations MiB (max stage) "
            "| params MiB (max rank) | abs(loss - plain) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        ref_ms, ref_saved, ref_loss = plain[0]
        for name, (ms, saved, loss) in zip((REFERENCE, NOISE), plain, strict=True):
            params = sum(
                p.numel() * 4 for p in Chain(args.width, args.layers).parameters()
            )
            print(
                f"| {name} | {ms:.2f} | {ms / ref_ms:.3f}× | 0.000 | 0.000 | "
                f"{saved:.3f} | {params / MiB:.3f} | {abs(loss - ref_loss):.6f} |"
            )
        for schedule in chosen:
            ranks = _spawn(pp, schedule, args)
            step = max(r["step"] for r in ranks)
            idle = [max(0.0, 1 - r["busy"] / r["step"]) for r in ranks]
            print(
                f"| {schedule} | {step:.2f} | {step / ref_ms:.3f}× | "
                f"{statistics.mean(idle):.3f} | {max(idle):.3f} | "
                f"{max(r['saved'] for r in ranks):.3f} | "
                f"{max(r['params'] for r in ranks):.3f} | "
                f"{abs(ranks[0]['loss'] - ref_loss):.6f} |"
            )


if __name__ == "__main__":
    main()
