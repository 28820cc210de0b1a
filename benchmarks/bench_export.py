"""Asynchronous checkpoints' training stall, and save_model against safetensors itself.

(a) **Stall.** An MLP's model and AdamW state (``--hidden`` wide, ``--layers``
deep) is checkpointed with ``save_checkpoint`` synchronously (the loop is blocked
for the whole write, fsync and SHA-256 included) and with ``asynchronous=True``,
where the loop is blocked only until the state is staged in CPU memory; the
background write is then waited for outside the timed region. The asynchronous
save is timed twice: as a first save (the CPU copy is allocated) and as a loop's
next save, passed the previous save's handle (``pending=``), which stages into
that save's CPU copy instead of allocating one. The synchronous
save runs twice, the second time as the noise control. Target: stall ≤ 0.2× the
synchronous save.

(b) **Export.** ``save_model(ctx, model, dir)`` (one ``model.safetensors``,
written into a temporary directory, fsynced, swapped in) against
``safetensors.torch.save_file(model.state_dict(), path)`` of the same state dict,
itself run twice (noise control). Target: within 1.1×. A row with ``save_file``
followed by an fsync of the file shows what durability alone costs, and a row
doing by hand what ``save_model`` does for a durable atomic export (``save_file``
into a temporary directory, fsync of the file and that directory, rename, fsync
of the parent) is the like-for-like reference: the ratio to it is funcaccel's own
cost.

Variants are interleaved repetition by repetition; times are wall clock (disk
writes happen outside this thread). One process, CPU.

    python benchmarks/bench_export.py --repeats 10   # after pip install -e . (or PYTHONPATH=.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from funcaccel.checkpoint import PendingCheckpoint
from funcaccel.checkpoint import save_checkpoint
from funcaccel.checkpoint import save_model
from funcaccel.context import DistributedContext

Run = Callable[[], float]


def _model(hidden: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
    model = nn.Sequential(*blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, hidden)).square().mean().backward()
    opt.step()  # fills the optimizer's state (two moments per parameter)
    return model, opt


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _measure(variants: dict[str, Run], repeats: int) -> dict[str, list[float]]:
    for run in variants.values():  # warm-up: page cache, allocator, imports
        run()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(repeats):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            samples[name].append(variants[name]())
    return samples


def _table(title: str, samples: dict[str, list[float]], reference: str) -> None:
    base = samples[reference]
    print(f"\n## {title}\n")
    print("| variant | median ms | IQR ms | min ms | ratio of medians | median paired ratio |")
    print("|---|---|---|---|---|---|")
    for name, values in samples.items():
        q1, median, q3 = _quartiles(values)
        ratio = median / statistics.median(base)
        paired = statistics.median(v / b for v, b in zip(values, base, strict=True))
        print(
            f"| {name} | {median * 1e3:.2f} | {(q3 - q1) * 1e3:.2f} | "
            f"{min(values) * 1e3:.2f} | {ratio:.3f}× | {paired:.3f}× |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None, help="where files go (a temporary dir)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ctx = DistributedContext()
    model, opt = _model(args.hidden, args.layers)
    state = model.state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    work = Path(tempfile.mkdtemp(dir=args.dir))

    def fresh(name: str) -> Path:
        path = work / name
        shutil.rmtree(path, ignore_errors=True)
        return path

    def sync_save(name: str) -> Run:
        def run() -> float:
            root = fresh(name)
            start = time.perf_counter()
            save_checkpoint(ctx, root, models=model, optimizers=opt)
            return time.perf_counter() - start

        return run

    def async_stall() -> float:
        root = fresh("async")
        start = time.perf_counter()
        pending = save_checkpoint(ctx, root, models=model, optimizers=opt, asynchronous=True)
        stall = time.perf_counter() - start
        pending.wait()
        return stall

    # As a training loop saves: each save gets the previous one's handle, so it
    # stages into that save's CPU copy. Its wait() ran before (outside the timing),
    # as in a loop where the previous save has long been written.
    previous: list[PendingCheckpoint] = []

    def async_reused_stall() -> float:
        root = fresh("async-reused")
        before = previous.pop() if previous else None
        start = time.perf_counter()
        pending = save_checkpoint(
            ctx, root, models=model, optimizers=opt, asynchronous=True, pending=before
        )
        stall = time.perf_counter() - start
        pending.wait()
        previous.append(pending)
        return stall

    def export() -> float:
        root = fresh("export")
        start = time.perf_counter()
        save_model(ctx, model, root)
        return time.perf_counter() - start

    def fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def reference(name: str, *, durable: bool = False) -> Run:
        def run() -> float:
            root = fresh(name)
            root.mkdir()
            start = time.perf_counter()
            save_file(state, root / "model.safetensors", metadata={"format": "pt"})
            if durable:
                with (root / "model.safetensors").open("rb") as file:
                    os.fsync(file.fileno())
            return time.perf_counter() - start

        return run

    def atomic_reference() -> float:
        """The durable atomic write by hand: what save_model does, minus funcaccel."""
        root = fresh("ref-atomic")
        temporary = fresh(".ref-atomic.tmp")
        temporary.mkdir()
        start = time.perf_counter()
        save_file(state, temporary / "model.safetensors", metadata={"format": "pt"})
        with (temporary / "model.safetensors").open("rb") as file:
            os.fsync(file.fileno())
        fsync_dir(temporary)
        os.rename(temporary, root)
        fsync_dir(work)
        return time.perf_counter() - start

    try:
        stall = _measure(
            {
                "synchronous save_checkpoint": sync_save("sync"),
                "synchronous again (noise control)": sync_save("sync2"),
                "asynchronous, first save: stall until staged": async_stall,
                "asynchronous, next save (pending=): stall until staged": async_reused_stall,
            },
            args.repeats,
        )
        exports = _measure(
            {
                "safetensors.torch.save_file": reference("ref"),
                "save_file again (noise control)": reference("ref2"),
                "save_file + fsync of the file": reference("ref3", durable=True),
                "save_file, fsync of file and directory, rename, fsync of parent": atomic_reference,
                "save_model": export,
            },
            args.repeats,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"MLP {args.layers} x {args.hidden}: model {nbytes / 1e6:.1f} MB (+ AdamW "
        f"state {2 * nbytes / 1e6:.1f} MB in checkpoints), {args.repeats} interleaved "
        f"repetitions, wall clock, {args.threads} torch thread(s), files in {work.parent}"
    )
    _table("Training stall of a checkpoint", stall, "synchronous save_checkpoint")
    _table("Export of the model's weights", exports, "safetensors.torch.save_file")


if __name__ == "__main__":
    main()
