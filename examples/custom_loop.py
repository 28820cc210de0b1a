"""Gradient accumulation written with funcaccel's pieces instead of ``accumulate_step``.

Each micro-batch runs forward and backward of ``loss / k`` inside ``sync_ctx`` (DDP
``no_sync`` while the window is open); the micro-step that closes a window rescales a
short one by ``k / m``, clips (unscaling first under fp16), steps and zeroes the
gradients; ``advance_grad_state`` returns the next ``GradState``.

    PYTHONPATH=. python examples/custom_loop.py --mixed-precision fp16
    PYTHONPATH=. python -m torch.distributed.run --standalone --nproc_per_node 2 \
        examples/custom_loop.py
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn.functional import mse_loss
from torch.utils.data import DataLoader
from torch.utils.data import TensorDataset

from funcaccel import Batch
from funcaccel import DistributedContext
from funcaccel import GradScalerKwargs
from funcaccel import GradState
from funcaccel import LoaderState
from funcaccel import advance_grad_state
from funcaccel import autocast_ctx
from funcaccel import build_context
from funcaccel import build_grad_scaler
from funcaccel import clip_grad_norm_
from funcaccel import close_context
from funcaccel import iter_batches
from funcaccel import optimizer_step
from funcaccel import print_main
from funcaccel import reduce
from funcaccel import rescale_grads_
from funcaccel import set_seed
from funcaccel import shard_loader
from funcaccel import should_sync
from funcaccel import sync_ctx
from funcaccel import window_grad_factor
from funcaccel import wrap_model


def micro_step(
    ctx: DistributedContext,
    grad: GradState,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    batch: Batch,
) -> tuple[torch.Tensor, bool, GradState]:
    """Train on one micro-batch; return its loss, whether a step was skipped, the next state."""
    inputs, targets = batch.data
    end = batch.is_last  # the end of the data closes the window early
    with sync_ctx(ctx, grad, model, end_of_dataloader=end):  # forward AND backward
        with autocast_ctx(ctx):
            loss = mse_loss(model(inputs), targets)
        scaled = loss / grad.accumulation_steps  # k, even in a short window (below)
        torch.autograd.backward(scaled if scaler is None else scaler.scale(scaled))
    skipped = False
    if should_sync(grad, end_of_dataloader=end):
        factor = window_grad_factor(grad, end_of_dataloader=end)  # k / m
        if factor != 1.0:
            rescale_grads_(optimizer, factor)
        clip_grad_norm_(model.parameters(), 1.0, scaler=scaler, optimizer=optimizer)
        skipped = optimizer_step(optimizer, scaler=scaler)
        optimizer.zero_grad(set_to_none=True)
    after = advance_grad_state(grad, end_of_dataloader=end, step_was_skipped=skipped)
    return loss.detach(), skipped, after


def train(ctx: DistributedContext, args: argparse.Namespace) -> str:
    """Train as the arguments say; return the result line to print."""
    set_seed(ctx, 0)  # the same data on every rank; DDP also syncs the weights
    x = torch.randn(args.samples, 8)
    y = x @ torch.randn(8, 1) * 0.5 + 0.1 * torch.randn(args.samples, 1)
    model = wrap_model(ctx, nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = build_grad_scaler(ctx, GradScalerKwargs(init_scale=1024.0))  # fp16 only
    data = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)
    loader = shard_loader(ctx, data, seed=0)
    grad = GradState(accumulation_steps=args.accumulation_steps)
    losses: list[float] = []  # mean micro-batch loss of each epoch, over all ranks
    skipped_steps = 0  # optimizer steps the fp16 scaler skipped (inf/NaN gradients)
    for epoch in range(args.epochs):
        epoch_losses = []
        for batch in iter_batches(loader, LoaderState(epoch=epoch)):
            loss, skipped, grad = micro_step(ctx, grad, model, optimizer, scaler, batch)
            epoch_losses.append(loss.float())
            skipped_steps += skipped
        mean = reduce(ctx, torch.stack(epoch_losses).mean(), reduction="mean")
        losses.append(mean.item())
    return (
        f"custom_loop: processes={ctx.num_processes} first_loss={losses[0]:.6f} "
        f"final_loss={losses[-1]:.6f} optimizer_steps={grad.optimizer_steps} "
        f"skipped_steps={skipped_steps}"
    )


def main() -> None:
    """Parse the sizes, train, print the result on the main process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accumulation-steps", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--mixed-precision", default="no", choices=("no", "bf16", "fp16")
    )
    args = parser.parse_args()

    ctx = build_context(mixed_precision=args.mixed_precision)
    try:
        result = train(ctx, args)
    finally:
        close_context(ctx)
    print_main(ctx, result)


if __name__ == "__main__":
    main()
