"""Asynchronous checkpoints' training stall, and save_model against safetensors itself.

(a) **Stall.** An MLP's model and AdamW state (``--hidden`` wide, ``--layers``
deep) is checkpointed in the middle of training: each variant times a save and
the accumulation window that follows it (``--accumulation`` forward and backward
passes of ``--batch`` rows, then the optimizer step), and the stall is that time
minus the median time of a window without a save, measured in the same run (and
run twice: the second is the noise control). A synchronous ``save_checkpoint``
blocks for the whole write (fsync and SHA-256 included).
``save_checkpoint_async`` returns once the state is staged: what only the
optimizer changes (parameters, AdamW's moments) is copied into CPU memory in the
background while the window's forward and backward passes run, and the window's
optimizer step waits for that copy if it is not done; the background write is
waited for outside the timed region. The asynchronous save is timed as a first
save (the CPU copy is allocated) and as a loop's next save, passed the previous
save's handle (``pending=``), which stages into that save's memory. Target:
stall ≤ 0.2× the synchronous save's. ``--batch 2 --accumulation 1`` leaves the
background copy almost no work to overlap with, so the stall is then about the
copy itself.

(b) **Export.** ``save_model(ctx, model, dir)`` (one ``model.safetensors``,
written into a temporary directory, swapped in) against
``safetensors.torch.save_file(model.state_dict(), path)`` of the same state dict,
itself run twice (noise control). Target: within 1.1×. ``save_model(...,
durable=True)`` also fsyncs; it is measured in a second group against doing by
hand what the durable export does (``save_file`` into a temporary directory,
fsync of the file and that directory, rename, fsync of the parent), beside
``save_file`` followed by an fsync of the file.

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
from funcaccel.checkpoint import save_checkpoint_async
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
    print(
        "| variant | median ms | IQR ms | min ms | ratio of medians | median paired ratio |"
    )
    print("|---|---|---|---|---|---|")
    for name, values in samples.items():
        q1, median, q3 = _quartiles(values)
        ratio = median / statistics.median(base)
        paired = statistics.median(v / b for v, b in zip(values, base, strict=True))
        print(
            f"| {name} | {median * 1e3:.2f} | {(q3 - q1) * 1e3:.2f} | "
            f"{min(values) * 1e3:.2f} | {ratio:.3f}× | {paired:.3f}× |"
        )


WINDOW = "a window, no save"
SYNC = "synchronous save_checkpoint"
SYNC_AGAIN = "synchronous again (noise control)"
FIRST = "asynchronous, first save"
NEXT = "asynchronous, next save (pending=)"
ATOMIC = "save_file, fsync of file and directory, rename, fsync of parent"


def _stall_table(
    windows: dict[str, list[float]],
    calls: dict[str, list[float]],
    blocked: dict[str, list[float]],
) -> None:
    """Print each save's stall: the time the loop is blocked, and its window's extra time.

    The loop is blocked in the call and, after an asynchronous one, in the
    step's wait for the background copy; that sum, timed directly, is the stall
    the target is about. A window's time minus a window's without a save also
    counts the background thread's competition for the cores (and the
    machine's noise: see the two rows without a save).
    """
    base = statistics.median(windows[WINDOW])
    extra = {name: [t - base for t in values] for name, values in windows.items()}
    sync = statistics.median(blocked[SYNC][1:])  # [0]: the warm-up
    print("\n## Training stall of a checkpoint\n")
    print(f"A window without a save: median {base * 1e3:.2f} ms.\n")
    print(
        "| variant | the call, median ms | blocked (call + step's wait), median ms "
        "| blocked IQR ms | blocked / synchronous | window's extra time, median ms |"
    )
    print("|---|---|---|---|---|---|")
    for name, values in extra.items():
        extra_ms = f"{statistics.median(values) * 1e3:.2f}"
        if name not in calls:
            print(f"| {name} | - | - | - | - | {extra_ms} |")
            continue
        q1, median, q3 = _quartiles(blocked[name][1:])
        print(
            f"| {name} | {statistics.median(calls[name][1:]) * 1e3:.2f} | "
            f"{median * 1e3:.2f} | {(q3 - q1) * 1e3:.2f} | {median / sync:.3f}× | {extra_ms} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64, help="rows per micro-batch")
    parser.add_argument(
        "--accumulation", type=int, default=4, help="micro-batches per window"
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="where files go (a temporary dir)"
    )
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

    inputs = torch.randn(args.batch, args.hidden)

    def window(pending: object = None) -> float:
        """Run one window; return how long its step waited for a save's copy."""
        for _ in range(args.accumulation):
            model(inputs).square().mean().backward()
        blocked = 0.0
        if isinstance(pending, PendingCheckpoint):
            # What the step's pre-hook would wait, timed on its own (it then
            # finds the copy made and does not wait again).
            start = time.perf_counter()
            pending.wait_staged()
            blocked = time.perf_counter() - start
        opt.step()
        opt.zero_grad()
        return blocked

    def alone() -> float:
        start = time.perf_counter()
        window()
        return time.perf_counter() - start

    calls: dict[str, list[float]] = {}
    blocked: dict[str, list[float]] = {}

    def timed(name: str, save: Callable[[Path], object]) -> Run:
        """Time ``save`` and the window after it; keep the call's own time apart."""

        def run() -> float:
            root = fresh(str(abs(hash(name))))
            start = time.perf_counter()
            pending = save(root)
            returned = time.perf_counter()
            waited = window(pending)
            end = time.perf_counter()
            if isinstance(pending, PendingCheckpoint):
                pending.wait()  # outside the timing: the writer had the window's time
            calls.setdefault(name, []).append(returned - start)
            blocked.setdefault(name, []).append(returned - start + waited)
            return end - start

        return run

    def sync_save(root: Path) -> object:
        return save_checkpoint(ctx, root, models=model, optimizers=opt)

    def async_save(root: Path) -> object:
        return save_checkpoint_async(ctx, root, models=model, optimizers=opt)

    # As a training loop saves: each save gets the previous one's handle, so it
    # stages into that save's CPU copy. Its wait() ran before (outside the timing),
    # as in a loop where the previous save has long been written.
    previous: list[PendingCheckpoint] = []

    def async_next_save(root: Path) -> object:
        before = previous.pop() if previous else None
        pending = save_checkpoint_async(
            ctx, root, models=model, optimizers=opt, pending=before
        )
        previous.append(pending)
        return pending

    def export(*, durable: bool) -> Run:
        def run() -> float:
            root = fresh(f"export-{durable}")
            start = time.perf_counter()
            save_model(ctx, model, root, durable=durable)
            return time.perf_counter() - start

        return run

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
        """The durable atomic write by hand: what save_model(..., durable=True) does, minus funcaccel."""
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
        windows = _measure(
            {
                WINDOW: alone,
                "a window, no save, again (noise control)": alone,
                SYNC: timed(SYNC, sync_save),
                SYNC_AGAIN: timed(SYNC_AGAIN, sync_save),
                FIRST: timed(FIRST, async_save),
                NEXT: timed(NEXT, async_next_save),
            },
            args.repeats,
        )
        # Two groups: the fsyncs of the durable variants hold up the file
        # system's journal, which would otherwise also delay the metadata steps
        # (mkdir, rename) of the variants interleaved with them.
        exports = _measure(
            {
                "safetensors.torch.save_file": reference("ref"),
                "save_file again (noise control)": reference("ref2"),
                "save_model": export(durable=False),
            },
            args.repeats,
        )
        durables = _measure(
            {
                ATOMIC: atomic_reference,
                "the same again (noise control)": atomic_reference,
                "save_file + fsync of the file": reference("ref3", durable=True),
                "save_model(..., durable=True)": export(durable=True),
            },
            args.repeats,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"MLP {args.layers} x {args.hidden}: model {nbytes / 1e6:.1f} MB (+ AdamW "
        f"state {2 * nbytes / 1e6:.1f} MB in checkpoints), {args.repeats} interleaved "
        f"repetitions, wall clock, {args.threads} torch thread(s), windows of "
        f"{args.accumulation} x {args.batch} rows, files in {work.parent}"
    )
    _stall_table(windows, calls, blocked)
    _table("Export of the model's weights", exports, "safetensors.torch.save_file")
    _table("Durable export (fsynced)", durables, ATOMIC)


if __name__ == "__main__":
    main()
