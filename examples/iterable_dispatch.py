"""Stream an ``IterableDataset`` with ``dispatch_batches=True``: rank 0 reads, all train.

Rank 0 alone iterates the generator, groups ``num_processes`` batches into a global
batch and sends every rank its rows; the last global batch is evened out with rows
from the first. ``gather_for_metrics(ctx, ..., batch=batch)`` drops those repeated
rows again, so an evaluation counts every sample exactly once.

    PYTHONPATH=. python examples/iterable_dispatch.py --samples 45
    PYTHONPATH=. python -m torch.distributed.run --standalone --nproc_per_node 2 \
        examples/iterable_dispatch.py --samples 45
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.functional import binary_cross_entropy_with_logits as bce
from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset

from funcaccel import DistributedContext
from funcaccel import GradState
from funcaccel import LoaderState
from funcaccel import ShardedLoader
from funcaccel import accumulate_step
from funcaccel import build_context
from funcaccel import close_context
from funcaccel import gather_for_metrics
from funcaccel import iter_batches
from funcaccel import print_main
from funcaccel import set_seed
from funcaccel import shard_loader
from funcaccel import wrap_model

Sample = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # features, label, sample id


class Stream(IterableDataset[Sample]):
    """``samples`` synthetic points of a fixed linear classification problem."""

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def __iter__(self) -> Iterator[Sample]:
        gen = torch.Generator().manual_seed(0)
        direction = torch.randn(4, generator=gen)
        for index in range(self.samples):
            x = torch.randn(4, generator=gen)
            yield x, (x @ direction > 0).float(), torch.tensor(index)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Return the mean loss of ``model`` on one batch."""
    return bce(model(x).squeeze(1), y)


def evaluate(
    ctx: DistributedContext, model: nn.Module, loader: ShardedLoader
) -> dict[str, torch.Tensor]:
    """Return every sample's id, loss and correctness, gathered from all ranks."""
    parts: list[dict[str, torch.Tensor]] = []
    with torch.no_grad():
        for batch in iter_batches(loader, LoaderState()):
            x, y, ids = batch.data
            logits = model(x).squeeze(1)
            mine = {
                "id": ids,
                "loss": bce(logits, y, reduction="none"),
                "correct": ((logits > 0) == (y > 0.5)).float(),
            }
            parts.append(gather_for_metrics(ctx, mine, batch=batch))  # repeats dropped
    return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}


def train(ctx: DistributedContext, args: argparse.Namespace) -> str:
    """Train as the arguments say; return the result line to print."""
    set_seed(ctx, 0)  # the same initial weights everywhere; DDP syncs them too
    model = wrap_model(ctx, nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    data = DataLoader(Stream(args.samples), batch_size=args.batch_size)
    loader = shard_loader(ctx, data, dispatch_batches=True)
    before = evaluate(ctx, model, loader)
    grad = GradState()
    for epoch in range(args.epochs):
        for batch in iter_batches(loader, LoaderState(epoch=epoch)):
            x, y, _ = batch.data
            loss_fn = functools.partial(loss_of, model, x, y)
            _, grad = accumulate_step(
                ctx, grad, model, optimizer, loss_fn, end_of_dataloader=batch.is_last
            )
    after = evaluate(ctx, model, loader)
    return (
        f"iterable_dispatch: processes={ctx.num_processes} "
        f"samples={after['id'].numel()} unique={len(set(after['id'].tolist()))} "
        f"first_loss={before['loss'].mean():.6f} final_loss={after['loss'].mean():.6f} "
        f"accuracy={after['correct'].mean():.4f} optimizer_steps={grad.optimizer_steps}"
    )


def main() -> None:
    """Parse the sizes, train, print the result on the main process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    ctx = build_context()
    try:
        result = train(ctx, args)
    finally:
        close_context(ctx)
    print_main(ctx, result)


if __name__ == "__main__":
    main()
