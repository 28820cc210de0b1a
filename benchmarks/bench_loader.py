"""Benchmark ``shard_loader`` against a plain ``DataLoader`` at one process.

Measures, in one run with the variants interleaved (so machine load hits them
alike), the median and spread of:

- one epoch of a map-style dataset of tensors (batch 32, no workers): the plain
  ``DataLoader``, ``for batch in shard_loader(...)`` and ``iter_batches(...)``,
  sequential and shuffled, and the plain loader once more as a noise control
  (its ratio to itself shows how far the machine's noise moves a ratio);
- the cost of resuming at 0 %, 50 % and 90 % of an epoch: the time until
  ``iter_batches(loader, state)`` yields its first batch, next to what skipping by
  reading (``islice`` over a plain ``DataLoader``) would cost.

Times are CPU time of this process (the loader runs in it: no workers), which a
shared machine disturbs far less than wall time; the minimum is the least
disturbed run. Ratios are taken within each repeat (paired), then summarised.
Run: ``python benchmarks/bench_loader.py [--repeats 61] [--samples 4096]``.
Prints Markdown tables of ratios to the plain loader (or to resuming at 0 %).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data import Dataset

from funcaccel.context import DistributedContext
from funcaccel.loader import LoaderState
from funcaccel.loader import ShardedLoader
from funcaccel.loader import iter_batches
from funcaccel.loader import shard_loader

BATCH = 32


class TensorPairs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``n`` pairs of a 64-feature float row and an integer label."""

    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 64, generator=generator)
        self.y = torch.randint(0, 10, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def _drain(batches: Iterable[Any]) -> None:
    for _ in batches:
        pass


def _drain_records(loader: ShardedLoader) -> None:
    for _ in iter_batches(loader):
        pass


def _first_record(loader: ShardedLoader, state: LoaderState) -> None:
    next(iter_batches(loader, state))


def _first_read(plain: DataLoader[Any], skip: int) -> None:
    next(itertools.islice(plain, skip, None))


def _time(run: Callable[[], None]) -> float:
    # CPU time of this process, not wall time: on a shared machine, time spent
    # waiting for a core would otherwise swamp differences of a few per cent.
    start = time.process_time_ns()
    run()
    return (time.process_time_ns() - start) / 1e6  # milliseconds


def _measure(
    variants: dict[str, Callable[[], None]], repeats: int
) -> dict[str, list[float]]:
    """Run every variant ``repeats`` times, interleaved, in a rotating order."""
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up
        variants[name]()
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(_time(variants[name]))
    return times


def _row(name: str, samples: list[float], reference: list[float]) -> str:
    """One table row: times, and ratios to ``reference`` paired by repeat.

    Each repeat ran every variant back to back, so the ratio within a repeat
    cancels most of the machine's drift; the median of those ratios is the figure
    to read, and their interquartile range says how sure it is.
    """
    median = statistics.median(samples)
    q1, _, q3 = statistics.quantiles(samples, n=4)
    ratios = [a / b for a, b in zip(samples, reference, strict=True)]
    r1, r2, r3 = statistics.quantiles(ratios, n=4)
    return (
        f"| {name} | {median:.3f} | {q1:.3f} – {q3:.3f} | {min(samples):.3f} "
        f"| {statistics.median(ratios):.3f}× | {r1:.3f} – {r3:.3f} |"
    )


def _epoch_table(dataset: TensorPairs, repeats: int) -> list[str]:
    ctx = DistributedContext()
    lines = []
    for shuffle in (False, True):
        plain = DataLoader(dataset, batch_size=BATCH, shuffle=shuffle)
        loader = shard_loader(ctx, plain, seed=0)
        times = _measure(
            {
                "plain": partial(_drain, plain),
                "control": partial(_drain, plain),
                "iter": partial(_drain, loader),
                "records": partial(_drain_records, loader),
            },
            repeats,
        )
        order = "shuffled" if shuffle else "sequential"
        lines += [
            _row(f"plain DataLoader, {order}", times["plain"], times["plain"]),
            _row(
                f"plain DataLoader again (noise control), {order}",
                times["control"],
                times["plain"],
            ),
            _row(
                f"`for b in shard_loader(...)`, {order}", times["iter"], times["plain"]
            ),
            _row(f"`iter_batches(loader)`, {order}", times["records"], times["plain"]),
        ]
    return lines


def _resume_table(dataset: TensorPairs, repeats: int) -> list[str]:
    ctx = DistributedContext()
    plain = DataLoader(dataset, batch_size=BATCH, shuffle=True)
    loader = shard_loader(ctx, plain, seed=0)
    batches = len(loader)
    variants: dict[str, Callable[[], None]] = {}
    for percent in (0, 50, 90):
        done = batches * percent // 100
        state = LoaderState(global_batches=done, global_batch_size=BATCH)
        variants[f"resume {percent}"] = partial(_first_record, loader, state)
        variants[f"read {percent}"] = partial(_first_read, plain, done)
    times = _measure(variants, repeats)
    base = times["resume 0"]
    lines = []
    for percent in (0, 50, 90):
        lines.append(
            _row(f"`iter_batches` from {percent} %", times[f"resume {percent}"], base)
        )
    for percent in (0, 50, 90):
        lines.append(
            _row(
                f"skip by reading, {percent} % (reference)",
                times[f"read {percent}"],
                base,
            )
        )
    return lines


def main() -> None:
    """Run both benchmarks and print the tables."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--repeats", type=int, default=61)
    parser.add_argument("--samples", type=int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dataset = TensorPairs(args.samples)
    header = (
        "| what | median ms | IQR ms | min ms | median paired ratio | IQR of ratio |\n"
        "|---|---|---|---|---|---|"
    )
    print(
        f"## One epoch: {args.samples} samples, batch {BATCH}, no workers, {args.repeats} interleaved repeats\n"
    )
    print(header)
    print("\n".join(_epoch_table(dataset, args.repeats)))
    print("\n## Resume: time to the first batch (ratio to resuming at 0 %)\n")
    print(header)
    print("\n".join(_resume_table(dataset, args.repeats)))


if __name__ == "__main__":
    main()
