"""Benchmark resuming a streaming ``datasets.IterableDataset`` through ``shard_loader``.

The time until ``iter_batches(loader, state)`` yields its first batch, resuming a
stream (local JSON Lines files read with ``load_dataset(..., streaming=True)``, a
``map`` doing a little work per sample) at 10 %, 50 % and 90 % of an epoch:

- **load**: ``state`` is a ``batch.state`` of the loader, which carries the
  stream's own position (``stream_state``), so the resume loads it;
- **replay**: the same position without the stream's state (what a resume cost
  before, and still costs a stream with no ``state_dict``): the skipped samples
  are read and dropped;
- a noise control: the 10 % load once more, whose ratio to itself shows how far
  the machine's noise moves a ratio.

Ratios are to the load at 10 %, paired within each repeat (the variants run
interleaved, in a rotating order, so machine load hits them alike). Times are CPU
time of this process (no workers). Needs ``datasets`` (``pip install
'funcaccel[data]'``). Run: ``python benchmarks/bench_stream_resume.py [--repeats 15]
[--samples 20000]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import torch
from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset

from funcaccel.context import DistributedContext
from funcaccel.loader import LoaderState
from funcaccel.loader import ShardedLoader
from funcaccel.loader import iter_batches
from funcaccel.loader import shard_loader

BATCH = 32
SHARDS = 5  # 10, 50 and 90 % then fall inside a file (see benchmarks/README.md)
PERCENTS = (10, 50, 90)


def _write_corpus(root: Path, samples: int) -> list[str]:
    """``samples`` JSON lines ``{"id": i, "x": [16 floats]}`` in ``SHARDS`` files."""
    per = -(-samples // SHARDS)
    files = []
    for shard in range(SHARDS):
        path = root / f"part{shard}.jsonl"
        ids = range(shard * per, min(samples, (shard + 1) * per))
        rows = (
            json.dumps({"id": i, "x": [i / (k + 1) for k in range(16)]}) for i in ids
        )
        path.write_text("\n".join(rows) + "\n")
        files.append(str(path))
    return files


def _features(example: dict[str, Any]) -> dict[str, Any]:
    """A little work per sample, as a tokenizer would do."""
    example["norm"] = sum(v * v for v in example["x"]) ** 0.5
    return example


def _stream(files: list[str], cache: Path) -> Any:
    ds = datasets.load_dataset(
        "json", data_files=files, split="train", streaming=True, cache_dir=str(cache)
    )
    return ds.map(_features).with_format("torch")


class Rows(IterableDataset[dict[str, torch.Tensor]]):
    """The same samples from memory, with a position it saves and loads in O(1)."""

    def __init__(self, samples: int) -> None:
        self.samples, self.start, self.at = samples, 0, 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.at, self.start = self.start, 0
        while self.at < self.samples:
            i = self.at
            self.at += 1
            x = torch.tensor([i / (k + 1) for k in range(16)])
            yield {"id": torch.tensor(i), "x": x, "norm": x.norm()}

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["at"]


def _first(loader: ShardedLoader, state: LoaderState) -> None:
    next(iter_batches(loader, state))


def _time(run: Callable[[], None]) -> float:
    # CPU time of this process: a shared machine disturbs it far less than wall time.
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
    """One table row: times, and the median and IQR of the paired ratios."""
    median = statistics.median(samples)
    q1, _, q3 = statistics.quantiles(samples, n=4)
    ratios = [a / b for a, b in zip(samples, reference, strict=True)]
    r1, _, r3 = statistics.quantiles(ratios, n=4)
    return (
        f"| {name} | {median:.3f} | {q1:.3f} – {q3:.3f} | {min(samples):.3f} "
        f"| {statistics.median(ratios):.3f}× | {r1:.3f} – {r3:.3f} |"
    )


def _states(loader: ShardedLoader) -> dict[int, LoaderState]:
    """The ``batch.state`` at each percentage of one unbroken epoch."""
    states = [batch.state for batch in iter_batches(loader)]
    return {p: states[max(len(states) * p // 100, 1) - 1] for p in PERCENTS}


def _table(source: Any, repeats: int) -> list[str]:
    """Time the loads and the replays from ``source``; return the table's rows."""
    data = DataLoader(source, batch_size=BATCH)
    loader = shard_loader(DistributedContext(), data, dispatch_batches=False)
    states = _states(loader)
    variants: dict[str, Callable[[], None]] = {}
    for p, state in states.items():
        assert state.stream_state is not None
        plain = LoaderState(
            epoch=state.epoch,
            global_batches=state.global_batches,
            global_batch_size=state.global_batch_size,
        )
        variants[f"load {p}"] = partial(_first, loader, state)
        variants[f"replay {p}"] = partial(_first, loader, plain)
    variants["control"] = partial(_first, loader, states[PERCENTS[0]])
    times = _measure(variants, repeats)
    base = times[f"load {PERCENTS[0]}"]
    lines = [
        _row(f"load the state at {p} %", times[f"load {p}"], base) for p in PERCENTS
    ]
    lines.append(_row("load at 10 % again (noise control)", times["control"], base))
    lines += [
        _row(f"replay to {p} % (the cost it replaces)", times[f"replay {p}"], base)
        for p in PERCENTS
    ]
    return lines


def main() -> None:
    """Build the corpus, take the states, time the resumes and print the tables."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--samples", type=int, default=20000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    header = (
        "| what | median ms | IQR ms | min ms | median paired ratio | IQR of ratio |\n"
        "|---|---|---|---|---|---|"
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        files = _write_corpus(root, args.samples)
        hf = _table(_stream(files, root / "cache"), args.repeats)
    print(
        f"## Resume a stream: {args.samples} samples in {SHARDS} JSON Lines files, "
        f"batch {BATCH}, one process, {args.repeats} interleaved repeats\n"
    )
    print(header)
    print("\n".join(hf))
    print(
        f"\n## The same samples from memory (a stream of our own: O(1) "
        f"load_state_dict), {args.repeats} interleaved repeats\n"
    )
    print(header)
    print("\n".join(_table(Rows(args.samples), args.repeats)))


if __name__ == "__main__":
    main()
