"""A small funcaccel training run for torchrun that can kill one worker once, mid-epoch.

Run by ``tests/test_resume.py``::

    python -m torch.distributed.run --standalone --nproc_per_node 2 --max-restarts 1 \\
        tests/scripts/elastic_train.py --checkpoints DIR --out DIR \\
        [--kill-at-step 5 --kill-marker FILE]

Every ``--save-every`` optimizer steps the run saves a checkpoint (keeping the last
two). With ``--kill-at-step S``, rank 1 kills itself with SIGKILL when it reaches
optimizer step ``S``, but only if ``--kill-marker`` does not exist yet (it creates
it first), so only the first attempt dies. torchrun then restarts both workers,
which resume from ``latest_checkpoint`` and finish. Rank 0 prints
``param_sha256=<hex>`` of the final parameters; every rank writes what it saw to
``--out/attempt<restart>_rank<rank>.json``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import signal
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data import Dataset

from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.checkpoint import latest_checkpoint
from funcaccel.checkpoint import load_checkpoint
from funcaccel.checkpoint import save_checkpoint
from funcaccel.context import DistributedContext
from funcaccel.context import build_context
from funcaccel.context import close_context
from funcaccel.loader import LoaderState
from funcaccel.loader import iter_batches
from funcaccel.loader import shard_loader
from funcaccel.model import unwrap_model
from funcaccel.model import wrap_model
from funcaccel.scheduler import maybe_step_scheduler


class Samples(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """``size`` samples; sample ``i`` is its id, 4 features and a target."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        x = torch.randn(4, generator=torch.Generator().manual_seed(index))
        return index, x, (x[:1] - 2 * x[2:3]).tanh()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--accumulation-steps", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--kill-at-step", type=int, default=None)
    parser.add_argument("--kill-marker", type=Path, default=None)
    args = parser.parse_args(argv)
    if (args.kill_at_step is None) != (args.kill_marker is None):
        parser.error("--kill-at-step and --kill-marker go together")
    return args


def param_sha256(model: nn.Module) -> str:
    """Return the SHA-256 of the parameters' bytes, in order."""
    digest = hashlib.sha256()
    for param in unwrap_model(model).parameters():
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def _maybe_die(ctx: DistributedContext, args: argparse.Namespace, step: int) -> None:
    marker: Path | None = args.kill_marker
    if ctx.process_index != 1 or step != args.kill_at_step or marker is None:
        return
    try:
        marker.touch(exist_ok=False)
    except FileExistsError:  # a restarted attempt: live on
        return
    os.kill(os.getpid(), signal.SIGKILL)


def train(ctx: DistributedContext, args: argparse.Namespace) -> str:
    """Train (resuming from the latest checkpoint if any); return ``param_sha256``."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))
    model = wrap_model(ctx, net)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
    data = DataLoader(Samples(args.samples), batch_size=args.batch_size, shuffle=True)
    loader = shard_loader(ctx, data, seed=3)
    grad = GradState(accumulation_steps=args.accumulation_steps)
    state = LoaderState()
    torch.manual_seed(10 + ctx.process_index)
    resumed_from = latest_checkpoint(args.checkpoints)
    if resumed_from is not None:
        loaded = load_checkpoint(
            ctx, resumed_from, models=model, optimizers=opt, schedulers=sched
        )
        assert loaded.grad is not None and loaded.loader is not None
        grad, state = loaded.grad, loaded.loader
    seen: list[tuple[int, int]] = []
    while state.epoch < args.epochs:
        for batch in iter_batches(loader, state):
            ids, x, y = batch.data
            seen += [(batch.epoch, i) for i in ids.tolist()]
            _, grad = accumulate_step(
                ctx,
                grad,
                model,
                opt,
                functools.partial(_loss, model, x, y),
                end_of_dataloader=batch.is_last,
            )
            maybe_step_scheduler(ctx, sched, grad, loader=loader)
            state = batch.state
            if not grad.sync_gradients:
                continue
            if grad.optimizer_steps % args.save_every == 0:
                save_checkpoint(
                    ctx,
                    args.checkpoints,
                    models=model,
                    optimizers=opt,
                    schedulers=sched,
                    grad=grad,
                    loader=state,
                    keep_last=2,
                )
            _maybe_die(ctx, args, grad.optimizer_steps)
    digest = param_sha256(model)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    report = {
        "resumed_from": None if resumed_from is None else resumed_from.name,
        "seen": seen,
        "param_sha256": digest,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"attempt{attempt}_rank{ctx.process_index}.json"
    path.write_text(json.dumps(report))
    return digest


def main(argv: Sequence[str] | None = None) -> None:
    """Build the context from torchrun's environment, train, print the digest."""
    args = parse_args(argv)
    ctx = build_context(cpu=True)
    try:
        digest = train(ctx, args)
    finally:
        close_context(ctx)
    if ctx.is_main_process:
        print(f"param_sha256={digest}", flush=True)


if __name__ == "__main__":
    main()
