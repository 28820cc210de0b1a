"""``join_uneven_inputs``: ranks with different numbers of batches train together."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.functional import mse_loss
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset
from torch.utils.data import TensorDataset

from funcaccel.accumulate import accumulate_step
from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState
from funcaccel.join import join_uneven_inputs
from funcaccel.loader import iter_batches
from funcaccel.loader import shard_loader
from funcaccel.model import wrap_model
from funcaccel.testing import rank_ctx
from funcaccel.testing import run_ranks

Params = list[torch.Tensor]


def _data(samples: int) -> TensorDataset:
    x = torch.linspace(-1.0, 1.0, samples).unsqueeze(1)
    return TensorDataset(x, 3.0 * x + 0.5)


def _train_uneven(
    ctx: DistributedContext, samples: int
) -> tuple[int, int, bool, Params, Params]:
    """Train with funcaccel's join and with plain torch Join on the same batches."""
    torch.manual_seed(0)
    net = nn.Linear(1, 1)
    start = {k: v.clone() for k, v in net.state_dict().items()}
    loader = shard_loader(ctx, DataLoader(_data(samples), batch_size=2))
    model = wrap_model(ctx, net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grad = GradState()
    batches = 0
    with join_uneven_inputs(ctx, model, even_batches=False, loaders=loader) as (
        uneven,
    ):
        for batch in iter_batches(uneven):
            x, y = batch.data
            _, grad = accumulate_step(
                ctx, grad, model, opt, lambda: mse_loss(model(x), y),
                end_of_dataloader=batch.is_last,
            )  # fmt: skip
            batches += 1

    # Plain torch: rank r reads global batches r, r + p, r + 2p, ... of the data.
    reference = nn.Linear(1, 1)
    reference.load_state_dict(start)
    ddp = DistributedDataParallel(reference)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mine = list(DataLoader(_data(samples), batch_size=2))[
        ctx.process_index :: ctx.num_processes
    ]
    with Join([ddp]):
        for x, y in mine:
            ref_opt.zero_grad()
            torch.autograd.backward(mse_loss(ddp(x), y))
            ref_opt.step()
    assert batches == len(mine)
    return (
        batches,
        len(loader),
        loader.even_batches,
        [p.detach().clone() for p in model.parameters()],
        [p.detach().clone() for p in ddp.parameters()],
    )


@pytest.mark.distributed
@pytest.mark.parametrize(("world_size", "samples"), [(2, 6), (3, 10)])
def test_join_lets_uneven_ranks_finish_with_torch_join_gradients(
    world_size: int, samples: int
) -> None:
    results = run_ranks(_train_uneven, world_size, samples, start_method="forkserver")
    counts = [r[0] for r in results]
    assert len(set(counts)) > 1, counts  # the ranks really read uneven data
    for _, length, even, params, reference in results:
        assert (length, even) == (max(counts), True)  # the caller's loader is kept
        for got, want in zip(params, reference, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    for _, _, _, params, _ in results[1:]:  # DDP keeps the replicas equal
        for got, want in zip(params, results[0][3], strict=True):
            assert torch.equal(got, want)


class _Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(8.0).unsqueeze(1))


def _iterable_loader_warns(ctx: DistributedContext) -> tuple[bool, list[str]]:
    model = wrap_model(ctx, nn.Linear(1, 1))
    loader = shard_loader(
        ctx, DataLoader(_Stream(), batch_size=2), dispatch_batches=False
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with join_uneven_inputs(ctx, model, even_batches=False, loaders=[loader]) as (
            same,
        ):
            for x in same:
                model(x).sum().backward()
    return same is loader, [str(w.message) for w in caught if w.category is UserWarning]


@pytest.mark.distributed
def test_join_warns_and_keeps_an_iterable_loader() -> None:
    for same, messages in run_ranks(
        _iterable_loader_warns, 2, start_method="forkserver"
    ):
        assert same
        assert any("loaders [0] are iterable or dispatch" in m for m in messages)


def test_join_refuses_a_model_that_is_not_ddp() -> None:
    with pytest.raises(
        TypeError,
        match=r"join_uneven_inputs: models\[0\] must be a module torch's Join can "
        r"shadow .*; got Linear\(.*\) \(Linear\)\. Wrap it with wrap_model",
    ):
        with join_uneven_inputs(rank_ctx(2, 0), nn.Linear(1, 1), even_batches=False):
            pass


def test_join_refuses_a_plain_dataloader() -> None:
    loader = DataLoader(_data(4), batch_size=2)
    with pytest.raises(TypeError, match=r"loaders\[0\] must be a ShardedLoader"):
        with join_uneven_inputs(rank_ctx(1, 0), nn.Linear(1, 1), loaders=[loader]):  # type: ignore[list-item]
            pass


def test_join_is_a_no_op_at_one_process() -> None:
    ctx = rank_ctx(1, 0)
    loader = shard_loader(ctx, DataLoader(_data(4), batch_size=2))
    with join_uneven_inputs(
        ctx, nn.Linear(1, 1), even_batches=False, loaders=loader
    ) as got:
        assert got == (loader,)
