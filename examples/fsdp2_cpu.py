"""Shard a model with FSDP2 (``fully_shard``) on CPU with gloo, then train as usual.

``wrap_model(ctx, model, fsdp=FSDPOptions(shard_modules=(Block,)))`` makes each
``Block`` and then the root an FSDP unit: every rank keeps only its rows of each
parameter, gathered for forward and backward. The training loop is the ordinary
one; ``accumulate_step`` turns gradient sync off on accumulation micro-steps. With
one process nothing is sharded and the same loop trains the plain module.

    PYTHONPATH=. python examples/fsdp2_cpu.py
    PYTHONPATH=. python -m torch.distributed.run --standalone --nproc_per_node 2 \
        examples/fsdp2_cpu.py
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.functional import mse_loss
from torch.utils.data import DataLoader
from torch.utils.data import TensorDataset

from funcaccel import DistributedContext
from funcaccel import FSDPOptions
from funcaccel import GradState
from funcaccel import LoaderState
from funcaccel import accumulate_step
from funcaccel import build_context
from funcaccel import close_context
from funcaccel import iter_batches
from funcaccel import print_main
from funcaccel import reduce
from funcaccel import set_seed
from funcaccel import shard_loader
from funcaccel import wrap_model


class Block(nn.Module):
    """A residual MLP block: the unit FSDP2 shards (a transformer block, in real life)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(x))


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Return the mean squared error of ``model`` on one batch."""
    return mse_loss(model(x), y)


def local_numel(model: nn.Module) -> int:
    """Return how many parameter elements this rank holds (its shards under FSDP2)."""
    return sum(
        p.to_local().numel() if isinstance(p, DTensor) else p.numel()
        for p in model.parameters()
    )


def train(ctx: DistributedContext, args: argparse.Namespace) -> str:
    """Train as the arguments say; return the result line to print."""
    set_seed(ctx, 0)  # the same data and initial weights on every rank
    x = torch.randn(args.samples, 8)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    net = nn.Sequential(nn.Linear(8, 16), Block(16), Block(16), nn.Linear(16, 1))
    full = local_numel(net)
    model = wrap_model(ctx, net, fsdp=FSDPOptions(shard_modules=(Block,)))
    # After wrap_model: FSDP2 replaces the parameters by sharded DTensors.
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    data = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)
    loader = shard_loader(ctx, data, seed=0)
    grad = GradState(accumulation_steps=args.accumulation_steps)
    losses: list[float] = []  # mean micro-batch loss of each epoch, over all ranks
    for epoch in range(args.epochs):
        epoch_losses = []
        for batch in iter_batches(loader, LoaderState(epoch=epoch)):
            loss_fn = functools.partial(loss_of, model, *batch.data)
            loss, grad = accumulate_step(
                ctx, grad, model, optimizer, loss_fn, end_of_dataloader=batch.is_last
            )
            epoch_losses.append(loss)
        mean = reduce(ctx, torch.stack(epoch_losses).mean(), reduction="mean")
        losses.append(mean.item())
    return (
        f"fsdp2_cpu: processes={ctx.num_processes} first_loss={losses[0]:.6f} "
        f"final_loss={losses[-1]:.6f} optimizer_steps={grad.optimizer_steps} "
        f"local_params={local_numel(model)} full_params={full}"
    )


def main() -> None:
    """Parse the sizes, train, print the result on the main process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accumulation-steps", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    ctx = build_context(cpu=True)  # gloo, even on a machine with GPUs
    try:
        result = train(ctx, args)
    finally:
        close_context(ctx)
    print_main(ctx, result)


if __name__ == "__main__":
    main()
