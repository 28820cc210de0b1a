"""Training-loop overhead of funcaccel's accumulation against plain PyTorch.

A tiny MLP (``--model mlp``, about 15 µs of work per micro-step on one CPU thread) or
a tiny transformer (``--model transformer``: two encoder layers, width 64, 4 heads,
32 tokens a sequence, a few milliseconds a micro-step, the size where users' steps
are) trains for one epoch of micro-batches with gradient accumulation 4 and a
StepLR scheduler, three ways: plain PyTorch (``loss / k``, backward, step every k),
funcaccel (``accumulate_step`` + ``maybe_step_scheduler``) and, when it is
importable, Accelerate (``accumulate`` context, ``backward``, prepared optimizer and
scheduler). Epochs of the variants are interleaved repetition by repetition so that
machine noise hits all alike; the table gives each variant's median epoch time, its
spread (interquartile range) and minimum, and its ratio to plain PyTorch three
ways: of the medians, the median of the per-repetition ratios and of the minima
(the least disturbed by other load on a shared machine). The plain loop runs a
second time as a noise control: its ratio to the first shows how far noise alone
moves a ratio in that run. Times are this thread's
CPU time by default (``--clock wall`` for elapsed time), so that a shared,
overloaded machine adds less noise. One process, CPU, one torch thread by default.

On a GPU machine the same comparison runs on CUDA with autocast, e.g.
``--device cuda --mixed-precision fp16`` (the plain loop then uses
``torch.autocast`` and a ``GradScaler`` by hand; funcaccel ``build_grad_scaler``);
the clock is then wall time with ``torch.cuda.synchronize()`` at the end of each
epoch. After the runs the script checks that the plain and the funcaccel model
end with identical parameters (they apply the same updates), except under fp16,
where the plain loop steps its scheduler also after a step the scaler skipped.

    python benchmarks/bench_loop.py --repeats 30   # after pip install -e . (or PYTHONPATH=.)
    python benchmarks/bench_loop.py --device cuda --mixed-precision bf16
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.functional import mse_loss

from funcaccel._typing import MixedPrecision
from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.context import DistributedContext
from funcaccel.mixed_precision import autocast_dtype
from funcaccel.mixed_precision import build_grad_scaler
from funcaccel.scheduler import maybe_step_scheduler

ACCUMULATION_STEPS = 4
Batches = list[tuple[torch.Tensor, torch.Tensor]]
Epoch = Callable[[], None]


WIDTH = 32
TOKENS = 32


class _TinyTransformer(nn.Module):
    """Two encoder layers over 32 tokens of width 64, pooled to one output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, 64)
        layer = nn.TransformerEncoderLayer(
            64, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.encoder(self.embed(x)).mean(dim=1))
        return out


def _model(seed: int, kind: str) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "transformer":
        return _TinyTransformer()
    return nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU(), nn.Linear(64, 1))


def _batches(n: int, batch_size: int, device: torch.device, kind: str) -> Batches:
    gen = torch.Generator().manual_seed(0)
    shape = (
        (batch_size, TOKENS, WIDTH) if kind == "transformer" else (batch_size, WIDTH)
    )
    return [
        (
            torch.randn(*shape, generator=gen).to(device),
            torch.randn(batch_size, 1, generator=gen).to(device),
        )
        for _ in range(n)
    ]


def _training_objects(
    seed: int, device: torch.device, kind: str
) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = _model(seed, kind).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.99)
    return model, optimizer, scheduler


def plain_epoch(
    ctx: DistributedContext, batches: Batches, kind: str
) -> tuple[Epoch, nn.Module]:
    """Return one epoch of the loop written in plain PyTorch, and its model."""
    model, optimizer, scheduler = _training_objects(0, ctx.device, kind)
    k, last = ACCUMULATION_STEPS, len(batches) - 1
    dtype = autocast_dtype(ctx.mixed_precision)
    if dtype is None:

        def run() -> None:
            for i, (x, y) in enumerate(batches):
                loss = mse_loss(model(x), y)
                torch.autograd.backward(loss / k)
                if (i + 1) % k == 0 or i == last:
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)

        return run, model
    device_type = ctx.device.type
    scaler = torch.amp.GradScaler(device_type, enabled=ctx.mixed_precision == "fp16")

    def run_amp() -> None:
        for i, (x, y) in enumerate(batches):
            with torch.autocast(device_type, dtype=dtype):
                loss = mse_loss(model(x), y)
            torch.autograd.backward(scaler.scale(loss / k))
            if (i + 1) % k == 0 or i == last:
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)

    return run_amp, model


def _loss_fn(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> Callable[[], torch.Tensor]:
    return lambda: mse_loss(model(x), y)


def funcaccel_epoch(
    ctx: DistributedContext, batches: Batches, kind: str
) -> tuple[Epoch, nn.Module]:
    """Return one epoch of the same loop through accumulate_step, and its model."""
    model, optimizer, scheduler = _training_objects(0, ctx.device, kind)
    scaler = build_grad_scaler(ctx)
    last = len(batches) - 1

    def run() -> None:
        grad = GradState(accumulation_steps=ACCUMULATION_STEPS)
        for i, (x, y) in enumerate(batches):
            _, grad = accumulate_step(
                ctx,
                grad,
                model,
                optimizer,
                _loss_fn(model, x, y),
                end_of_dataloader=i == last,
                scaler=scaler,
            )
            maybe_step_scheduler(ctx, scheduler, grad, schedule_counts="batches")

    return run, model


def accelerate_epoch(
    ctx: DistributedContext, batches: Batches, kind: str
) -> Epoch | None:
    """Return one epoch through Accelerate, or None when it is not installed."""
    try:
        accelerate: Any = importlib.import_module("accelerate")
    except ImportError:
        return None
    accelerator = accelerate.Accelerator(
        gradient_accumulation_steps=ACCUMULATION_STEPS,
        cpu=ctx.device.type == "cpu",
        mixed_precision=ctx.mixed_precision,
    )
    model, optimizer, scheduler = accelerator.prepare(
        *_training_objects(0, ctx.device, kind)
    )

    def run() -> None:
        for x, y in batches:
            with accelerator.accumulate(model):
                loss = mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)

    return run


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--micro-batches", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    parser.add_argument("--no-accelerate", action="store_true")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--mixed-precision", choices=("no", "bf16", "fp16"), default="no"
    )
    parser.add_argument(
        "--clock",
        choices=("thread", "wall"),
        default="thread",
        help="thread: CPU time of this thread (with --threads 1 all the work; "
        "unaffected by time spent descheduled on a shared machine); wall: elapsed",
    )
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error(f"--repeats must be at least 2 (quartiles); got {args.repeats}")
    if args.micro_batches % ACCUMULATION_STEPS:
        # A short last window would be scaled differently: funcaccel takes its
        # exact mean, the plain loop's loss / k under-weights it.
        parser.error(f"--micro-batches must be a multiple of {ACCUMULATION_STEPS}")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    clock_name = "wall" if cuda else args.clock
    clock = time.thread_time if clock_name == "thread" else time.perf_counter
    torch.set_num_threads(args.threads)
    precision: MixedPrecision = args.mixed_precision
    ctx = DistributedContext(device=device, mixed_precision=precision)
    kind = args.model
    batches = _batches(args.micro_batches, args.batch_size, device, kind)
    plain_run, plain_model = plain_epoch(ctx, batches, kind)
    ours_run, our_model = funcaccel_epoch(ctx, batches, kind)
    variants: dict[str, Epoch] = {
        "plain PyTorch": plain_run,
        "plain PyTorch again (noise control)": plain_epoch(ctx, batches, kind)[0],
        "funcaccel": ours_run,
    }
    accelerate_run = (
        None if args.no_accelerate else accelerate_epoch(ctx, batches, kind)
    )
    if accelerate_run is not None:
        variants["Accelerate"] = accelerate_run
    for run in variants.values():  # warm-up: allocator, autograd and dispatch caches
        run()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(args.repeats):
        # Rotate the order so that no variant always runs first.
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            if cuda:
                torch.cuda.synchronize(device)
            start = clock()
            variants[name]()
            if cuda:
                torch.cuda.synchronize(device)
            samples[name].append(clock() - start)
    base = samples["plain PyTorch"]
    same = all(
        torch.equal(a, b)
        for a, b in zip(plain_model.parameters(), our_model.parameters(), strict=True)
    )
    if not same and precision != "fp16":
        raise SystemExit("bench_loop: the plain and funcaccel models differ")
    print(
        f"{kind}: {args.micro_batches} micro-batches of {args.batch_size}, accumulation "
        f"{ACCUMULATION_STEPS}, {args.repeats} interleaved repetitions, "
        f"{args.threads} thread(s), {clock_name} clock, device {device}, mixed "
        f"precision {precision}; identical final parameters: {same}\n"
    )
    print(
        "| loop | median ms/epoch | IQR ms | min ms | µs/micro-step | ratio of medians "
        "| median paired ratio | ratio of minima |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, values in samples.items():
        q1, median, q3 = _quartiles(values)
        ratio = median / statistics.median(base)
        paired = statistics.median(v / b for v, b in zip(values, base, strict=True))
        per_step = median / args.micro_batches * 1e6
        best = min(values) / min(base)
        print(
            f"| {name} | {median * 1e3:.2f} | {(q3 - q1) * 1e3:.2f} | "
            f"{min(values) * 1e3:.2f} | {per_step:.1f} | {ratio:.3f}× | {paired:.3f}× "
            f"| {best:.3f}× |"
        )


if __name__ == "__main__":
    main()
