"""Overhead of funcaccel's DDP training loop against the same loop in plain PyTorch.

Two gloo processes on CPU train the same MLP on the same pre-built micro-batches
with gradient accumulation 4 and a StepLR scheduler, two ways:

* plain PyTorch: ``DistributedDataParallel``, forward and backward of ``loss / k``
  inside ``no_sync()`` except on every k-th micro-batch, then ``step()``, the
  scheduler stepped ``num_processes`` times (as funcaccel does without
  ``split_batches``) and ``zero_grad(set_to_none=True)``;
* funcaccel: ``wrap_model`` + ``accumulate_step`` + ``maybe_step_scheduler``.

The number of micro-batches is a multiple of k, so both compute exactly the same
updates (the script checks that both models end with equal parameters). Epochs of
the two loops alternate, in a rotating order, within the same two processes, so
machine noise hits both alike; each epoch starts after a barrier and its time is the
slower rank's. Two tables: the wall time of each epoch (the slower rank's, communication
included) and the CPU time of each rank's training thread (Python, forward and
backward; not gloo's own threads), which is where funcaccel's overhead lies and
which is less noisy. Each gives the median, the interquartile range, the ratio of
medians and the median of the per-repetition ratios (funcaccel / plain). The plain
loop runs a second time, with a model of its own, as a noise control: its ratio to
the first shows how far noise alone moves a ratio in that run.

    PYTHONPATH=. python benchmarks/bench_ddp.py --repeats 40
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing
from torch import nn
from torch.nn.functional import mse_loss
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import StepLR

from funcaccel import DistributedContext
from funcaccel import GradState
from funcaccel import InitProcessGroupKwargs
from funcaccel import accumulate_step
from funcaccel import build_context
from funcaccel import close_context
from funcaccel import maybe_step_scheduler
from funcaccel import wrap_model

ACCUMULATION_STEPS = 4
WORLD_SIZE = 2
Batches = list[tuple[torch.Tensor, torch.Tensor]]
Epoch = Callable[[], None]


def _objects(
    hidden: int, ctx: DistributedContext | None
) -> tuple[nn.Module, torch.optim.Optimizer, StepLR]:
    """Build the model (DDP: by hand without ctx, else wrap_model), optimizer, scheduler."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 1),
    )  # fmt: skip
    model = DistributedDataParallel(net) if ctx is None else wrap_model(ctx, net)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    return model, optimizer, StepLR(optimizer, step_size=10, gamma=0.99)


def plain_epoch(hidden: int, batches: Batches) -> tuple[Epoch, nn.Module]:
    """Return one epoch of the loop in plain PyTorch, and its model."""
    model, optimizer, scheduler = _objects(hidden, None)
    assert isinstance(model, DistributedDataParallel)
    k, world = ACCUMULATION_STEPS, dist.get_world_size()

    def run() -> None:
        for i, (x, y) in enumerate(batches):
            if (i + 1) % k:
                with model.no_sync():
                    torch.autograd.backward(mse_loss(model(x), y) / k)
                continue
            torch.autograd.backward(mse_loss(model(x), y) / k)
            optimizer.step()
            for _ in range(world):
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)

    return run, model


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return mse_loss(model(x), y)


def funcaccel_epoch(
    ctx: DistributedContext, hidden: int, batches: Batches
) -> tuple[Epoch, nn.Module]:
    """Return one epoch of the same loop through funcaccel, and its model."""
    model, optimizer, scheduler = _objects(hidden, ctx)
    last = len(batches) - 1

    def run() -> None:
        grad = GradState(accumulation_steps=ACCUMULATION_STEPS)
        for i, (x, y) in enumerate(batches):
            _, grad = accumulate_step(
                ctx,
                grad,
                model,
                optimizer,
                functools.partial(_loss, model, x, y),
                end_of_dataloader=i == last,
            )
            maybe_step_scheduler(ctx, scheduler, grad, schedule_counts="batches")

    return run, model


def measure(ctx: DistributedContext, args: argparse.Namespace) -> dict[str, Any]:
    """Time both loops, interleaved; return rank 0's summary (slowest rank per epoch)."""
    gen = torch.Generator().manual_seed(1 + ctx.process_index)  # each rank its data
    batches = [
        (
            torch.randn(args.batch_size, 64, generator=gen),
            torch.randn(args.batch_size, 1, generator=gen),
        )
        for _ in range(args.micro_batches)
    ]
    plain, plain_model = plain_epoch(args.hidden, batches)
    ours, our_model = funcaccel_epoch(ctx, args.hidden, batches)
    variants = {
        "plain PyTorch DDP": plain,
        "plain PyTorch DDP again (noise control)": plain_epoch(args.hidden, batches)[0],
        "funcaccel": ours,
    }
    names = list(variants)
    for _ in range(args.warmup):
        for run in variants.values():
            run()
    wall = torch.zeros(len(names), args.repeats, dtype=torch.float64)
    cpu = torch.zeros_like(wall)
    for rep in range(args.repeats):
        shift = rep % len(names)  # rotate so that neither loop always runs first
        for j in [*range(shift, len(names)), *range(shift)]:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.thread_time()
            variants[names[j]]()
            wall[j, rep] = time.perf_counter() - start
            cpu[j, rep] = time.thread_time() - start_cpu
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the epoch ends when both ranks do
    dist.all_reduce(cpu)
    cpu /= dist.get_world_size()
    same = all(
        torch.equal(a, b)
        for a, b in zip(plain_model.parameters(), our_model.parameters(), strict=True)
    )
    return {
        "wall": dict(zip(names, wall.tolist(), strict=True)),
        "cpu": dict(zip(names, cpu.tolist(), strict=True)),
        "same": same,
    }


def worker(rank: int, tmp: str, args: argparse.Namespace) -> None:
    """One of the two processes: build the context, measure, rank 0 writes the results."""
    torch.set_num_threads(args.threads)
    cores = sorted(os.sched_getaffinity(0))
    if args.pin and len(cores) >= WORLD_SIZE:  # one core each: less migration noise
        os.sched_setaffinity(0, {cores[rank]})
    env = {"WORLD_SIZE": str(WORLD_SIZE), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    init = InitProcessGroupKwargs(init_method=f"file://{tmp}/rendezvous")
    ctx = build_context(cpu=True, init_kwargs=init, environ=env)
    try:
        result = measure(ctx, args)
        gc.collect()  # free the DDP models (reference cycles) while the group lives
    finally:
        close_context(ctx)
    if ctx.is_main_process:
        Path(tmp, "result.json").write_text(json.dumps(result))


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _rows(times: dict[str, list[float]], micro_batches: int) -> list[str]:
    base = times["plain PyTorch DDP"]
    rows = []
    for name, values in times.items():
        q1, median, q3 = _quartiles(values)
        ratio = median / statistics.median(base)
        paired = statistics.median(v / b for v, b in zip(values, base, strict=True))
        rows.append(
            f"| {name} | {median * 1e3:.2f} | {(q3 - q1) * 1e3:.2f} | "
            f"{min(values) * 1e3:.2f} | {median / micro_batches * 1e6:.1f} | "
            f"{ratio:.3f}× | {paired:.3f}× | {min(values) / min(base):.3f}× |"
        )
    return rows


def report(args: argparse.Namespace, result: dict[str, Any]) -> str:
    """Return the Markdown tables of the results."""
    lines = [
        f"{WORLD_SIZE} gloo processes x {args.threads} thread(s), MLP 64-{args.hidden}-"
        f"{args.hidden}-1, {args.micro_batches} micro-batches of {args.batch_size}, "
        f"accumulation {ACCUMULATION_STEPS}, {args.repeats} interleaved repetitions "
        f"(after {args.warmup} warm-up), {'one core per rank' if args.pin else 'unpinned'}"
        f"; equal final parameters: {result['same']}",
    ]
    for key, title in (
        ("wall", "Wall time of an epoch (slower rank)"),
        ("cpu", "CPU time of the training thread per epoch (mean of ranks)"),
    ):
        lines += [
            "",
            title,
            "",
            "| loop | median ms/epoch | IQR ms | min ms | µs/micro-step | ratio of "
            "medians | median paired ratio | ratio of minima |",
            "|---|---|---|---|---|---|---|---|",
            *_rows(result[key], args.micro_batches),
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batches", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--no-pin", dest="pin", action="store_false", help="do not pin rank r to core r"
    )
    args = parser.parse_args()
    if args.micro_batches % ACCUMULATION_STEPS:
        parser.error(f"--micro-batches must be a multiple of {ACCUMULATION_STEPS}")
    with tempfile.TemporaryDirectory() as tmp:
        context = torch.multiprocessing.get_context("spawn")
        processes = [
            context.Process(target=worker, args=(rank, tmp, args))
            for rank in range(WORLD_SIZE)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        codes = [process.exitcode for process in processes]
        if any(codes):
            raise SystemExit(f"bench_ddp: workers exited with {codes}")
        result = json.loads(Path(tmp, "result.json").read_text())
    print(report(args, result))
    if not result["same"]:
        raise SystemExit("bench_ddp: the plain and funcaccel models differ")


if __name__ == "__main__":
    main()
