"""Train a small MLP on scikit-learn's bundled handwritten digits with funcaccel.

One process:        python examples/train_digits.py
Two processes:      torchrun --standalone --nproc_per_node 2 examples/train_digits.py
Resume after a stop: run the same command again with the same --checkpoint-dir.

Uses every main part of funcaccel: the context from torchrun's environment, a
sharded shuffled loader with a seed, gradient accumulation, optional bf16 autocast,
DDP, a scheduler, a progress bar and one summary line per epoch on the main process,
JSON-lines (and TensorBoard when installed) tracking into a run directory
(``runs/digits-<date>-<time>`` unless ``--run-dir`` says otherwise), a loss-curve
picture drawn from the JSON lines at the end, optional profiling of a few steps,
checkpoints with automatic resume, and test metrics gathered across ranks without
the duplicates that even out the last batch. The last line printed is
``param_sha256: <hex>``, a digest of the final parameters, so an
interrupted-and-resumed run can be checked against an uninterrupted one.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data import TensorDataset

import funcaccel as fa


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--accumulation-steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    parser.add_argument("--train-samples", type=int, default=None, help="cap (tests)")
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--save-every", type=int, default=20, help="optimizer steps")
    parser.add_argument("--stop-after", type=int, default=None, help="optimizer steps")
    parser.add_argument(
        "--run-dir",
        "--log-dir",
        dest="run_dir",
        type=Path,
        default=None,
        help="metrics, TensorBoard files and the loss curve (default: runs/digits-<time>)",
    )
    parser.add_argument("--profile-dir", type=Path, default=None)
    return parser.parse_args(argv)


def digits_split(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Return (train, test) datasets: a fixed 80/20 split of the 1797 digits."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def build_net(ctx: fa.DistributedContext, seed: int) -> nn.Module:
    fa.set_seed(ctx, seed)  # the same initial weights on every rank
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10)
    )


def param_digest(model: nn.Module) -> str:
    """SHA-256 over the parameters' bytes, in state_dict order."""
    digest = hashlib.sha256()
    for name, tensor in fa.unwrap_model(model).state_dict().items():
        digest.update(name.encode())
        data = tensor.detach().cpu().contiguous().flatten().view(torch.uint8)
        digest.update(data.numpy().tobytes())
    return digest.hexdigest()


def default_run_dir(ctx: fa.DistributedContext) -> Path:
    """``runs/digits-<date>-<time>`` (a new one), chosen by the main process."""
    chosen = None
    if ctx.is_main_process:
        base = Path("runs") / time.strftime("digits-%Y%m%d-%H%M%S")
        chosen, n = base, 1
        while chosen.exists():  # two runs started within the same second
            chosen, n = base.with_name(f"{base.name}-{n}"), n + 1
    return Path(fa.broadcast_object(ctx, str(chosen)))


def make_trackers(ctx: fa.DistributedContext, run_dir: Path) -> list[fa.Tracker]:
    trackers: list[fa.Tracker] = [fa.JSONLTracker(run_dir / "metrics.jsonl")]
    if importlib.util.find_spec("tensorboard") is not None:
        trackers.append(fa.TensorBoardTracker(run_dir / "tensorboard"))
    return trackers


@dataclass
class EpochMeter:
    """This rank's running totals over one epoch, for its summary line."""

    start: float
    loss_sum: float = 0.0
    batches: int = 0
    samples: int = 0

    def add(self, loss: torch.Tensor, samples: int) -> None:
        self.loss_sum += loss.item()
        self.batches += 1
        self.samples += samples

    def summary(self, ctx: fa.DistributedContext) -> tuple[float, float]:
        """``(mean loss, samples per second)`` over every rank: a collective."""
        totals = torch.tensor(
            [self.loss_sum, self.batches, self.samples], dtype=torch.float64
        )
        loss_sum, batches, samples = fa.reduce(ctx, totals).tolist()
        seconds = max(time.monotonic() - self.start, 1e-9)
        return loss_sum / max(batches, 1), samples / seconds


def report_run(
    ctx: fa.DistributedContext, run_dir: Path, checkpoint_dir: Path | None
) -> None:
    """Print where the metrics, the picture and the checkpoints went (main only)."""
    if not ctx.is_main_process:
        return
    print(f"metrics written to {run_dir / 'metrics.jsonl'}")
    if importlib.util.find_spec("tensorboard") is not None:
        print(f"view with: tensorboard --logdir {run_dir / 'tensorboard'}")
    else:
        print("TensorBoard: not installed (pip install 'funcaccel[tensorboard]')")
    try:
        picture = fa.plot_metrics(run_dir, title=f"train_digits: {run_dir}")
    except ImportError as error:
        print(f"loss curve: not drawn ({error})")
    else:
        print(f"loss curve: {picture}")
    if checkpoint_dir is None:
        print("checkpoints: none (pass --checkpoint-dir DIR to save and resume)")
    else:
        print(f"checkpoints: {checkpoint_dir} (the same command resumes from there)")


def profile_ctx(
    ctx: fa.DistributedContext, profile_dir: Path | None
) -> contextlib.AbstractContextManager[torch.profiler.profile | None]:
    """Profile a few steps (wait 1, warm up 1, record 3) when a directory is given."""
    if profile_dir is None:
        return contextlib.nullcontext()
    kwargs = fa.ProfileKwargs(
        schedule_option={"wait": 1, "warmup": 1, "active": 3, "repeat": 1},
        output_trace_dir=str(profile_dir),
    )
    return fa.build_profiler(ctx, kwargs)


def evaluate(
    ctx: fa.DistributedContext, model: nn.Module, loader: fa.ShardedLoader
) -> float:
    """Accuracy over the whole test set, each sample counted exactly once."""
    model.eval()
    correct = total = 0
    with torch.no_grad(), fa.autocast_ctx(ctx):
        for batch in fa.iter_batches(loader):
            x, y = batch.data
            hits = (model(x).argmax(dim=1) == y).long()
            gathered = fa.gather_for_metrics(ctx, hits, batch=batch)
            correct += int(gathered.sum())
            total += gathered.numel()
    model.train()
    assert total == len(loader.dataset), (total, len(loader.dataset))
    return correct / total


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = fa.build_context(mixed_precision="bf16" if args.bf16 else "no")
    try:
        # The model lives inside train(), so DDP is freed before the group closes.
        train(ctx, args)
    finally:
        fa.close_context(ctx)


def train(ctx: fa.DistributedContext, args: argparse.Namespace) -> None:
    """Train, evaluate and print the results (on the main process)."""
    train_set, test_set = digits_split(args.seed)
    if args.train_samples is not None:
        train_set = TensorDataset(*(t[: args.train_samples] for t in train_set.tensors))
    loader = fa.shard_loader(
        ctx,
        DataLoader(train_set, batch_size=args.batch_size, shuffle=True),
        seed=args.seed,
    )
    test_loader = fa.shard_loader(ctx, DataLoader(test_set, batch_size=64))
    model = fa.wrap_model(ctx, build_net(ctx, args.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    steps_per_epoch = -(-len(loader) // args.accumulation_steps)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=args.lr,
        total_steps=args.epochs * steps_per_epoch * ctx.num_processes,
    )
    grad = fa.GradState(accumulation_steps=args.accumulation_steps)
    start = fa.LoaderState()
    if args.checkpoint_dir is not None:
        latest = fa.latest_checkpoint(args.checkpoint_dir)
        if latest is not None:
            loaded = fa.load_checkpoint(
                ctx, latest, models=model, optimizers=optimizer, schedulers=scheduler
            )
            grad = loaded.grad or grad
            start = loaded.loader or start
            fa.print_main(ctx, f"resumed from {latest.name} at {start}")

    run_dir = args.run_dir if args.run_dir is not None else default_run_dir(ctx)
    trackers = make_trackers(ctx, run_dir)
    fa.store_config(ctx, trackers, {k: str(v) for k, v in vars(args).items()})
    stopped = False
    with profile_ctx(ctx, args.profile_dir) as profiler:
        for epoch in range(start.epoch, args.epochs):
            fresh = fa.LoaderState(epoch=epoch)
            state = start if epoch == start.epoch else fresh
            meter = EpochMeter(start=time.monotonic())
            batches = fa.progress(
                ctx,
                fa.iter_batches(loader, state),
                total=len(loader) if state == fresh else None,
                desc=f"epoch {epoch + 1}/{args.epochs}",
                every=max(1, len(loader) // 4),  # without a terminal: 4 lines an epoch
            )
            for batch in batches:
                x, y = batch.data
                loss, grad = fa.accumulate_step(
                    ctx,
                    grad,
                    model,
                    optimizer,
                    lambda: F.cross_entropy(model(x), y),
                    end_of_dataloader=batch.is_last,
                )
                fa.maybe_step_scheduler(ctx, scheduler, grad, loader=loader)
                meter.add(loss, len(y))
                if profiler is not None:
                    profiler.step()
                if not grad.sync_gradients:
                    continue  # the window is still open
                step = grad.optimizer_steps
                lr = float(scheduler.get_last_lr()[0])
                fa.log_metrics(
                    ctx,
                    trackers,
                    {"loss": loss.item(), "lr": lr, "epoch": batch.epoch},
                    step=step,
                )
                stopped = args.stop_after is not None and step >= args.stop_after
                if args.checkpoint_dir is not None and (
                    step % args.save_every == 0 or stopped
                ):
                    fa.save_checkpoint(
                        ctx,
                        args.checkpoint_dir,
                        models=model,
                        optimizers=optimizer,
                        schedulers=scheduler,
                        grad=grad,
                        loader=batch.state,
                        keep_last=2,
                    )
                if stopped:
                    break
            if stopped:
                break
            epoch_loss, rate = meter.summary(ctx)
            lr = float(scheduler.get_last_lr()[0])
            fa.print_main(
                ctx,
                f"epoch {epoch + 1}/{args.epochs}: loss {epoch_loss:.4f}, "
                f"lr {lr:.2e}, {rate:.0f} samples/s",
            )
            fa.log_metrics(
                ctx,
                trackers,
                {"epoch_loss": epoch_loss, "samples_per_s": rate},
                step=grad.optimizer_steps,
            )
    if stopped:
        fa.finish_trackers(ctx, trackers)
        fa.print_main(ctx, f"stopped after {grad.optimizer_steps} optimizer steps")
        report_run(ctx, run_dir, args.checkpoint_dir)
        return
    accuracy = evaluate(ctx, model, test_loader)
    fa.log_metrics(
        ctx, trackers, {"test_accuracy": accuracy}, step=grad.optimizer_steps
    )
    fa.finish_trackers(ctx, trackers)
    fa.print_main(ctx, f"optimizer_steps: {grad.optimizer_steps}")
    fa.print_main(ctx, f"test_accuracy: {accuracy:.4f}")
    report_run(ctx, run_dir, args.checkpoint_dir)
    fa.print_main(ctx, f"param_sha256: {param_digest(model)}")


if __name__ == "__main__":
    main()
