"""``no_sync`` and ``sync_in_backward`` on real DDP ranks (gloo)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Literal

import pytest
import torch
import torch.distributed as dist
from torch import nn

from funcaccel.context import DistributedContext
from funcaccel.model import wrap_model
from funcaccel.sync import no_sync
from funcaccel.sync import sync_in_backward
from funcaccel.testing import rank_ctx
from funcaccel.testing import run_ranks

Mode = Literal["trigger", "local", "sync_after"]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _window(ctx: DistributedContext, mode: Mode) -> tuple[list[torch.Tensor], ...]:
    """Two forwards in no_sync, two backwards; return DDP's, local and mean grads."""
    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    plain = copy.deepcopy(net)
    model = wrap_model(ctx, net)
    scale = float(ctx.process_index + 1)
    xa, xb = torch.full((2, 3), scale), torch.arange(6.0).view(2, 3) * scale
    if mode == "sync_after":  # no_sync alone: the next backward outside syncs
        with no_sync(ctx, model):
            model(xa).pow(2).sum().backward()
        model(xb).pow(2).sum().backward()
    else:
        with no_sync(ctx, model):
            loss_a = model(xa).pow(2).sum()
            loss_b = model(xb).pow(2).sum()
        loss_a.backward()
        if mode == "trigger":
            with sync_in_backward(ctx, model):
                loss_b.backward()
        else:
            loss_b.backward()
    (plain(xa).pow(2).sum() + plain(xb).pow(2).sum()).backward()
    local = _grads(plain)
    mean = [g.clone() for g in local]
    for g in mean:
        dist.all_reduce(g)
        g.div_(ctx.num_processes)
    return _grads(model), local, mean


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["trigger", "sync_after"])
def test_the_syncing_backward_leaves_the_mean_of_the_accumulated_gradients(
    mode: Mode, world: int
) -> None:
    for got, _, mean in run_ranks(_window, world, mode, start_method="forkserver"):
        for g, m in zip(got, mean, strict=True):
            torch.testing.assert_close(g, m)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_without_sync_in_backward_gradients_stay_local(world: int) -> None:
    results = run_ranks(_window, world, "local", start_method="forkserver")
    for got, local, _ in results:
        for g, want in zip(got, local, strict=True):
            torch.testing.assert_close(g, want)
    assert not torch.equal(results[0][0][0], results[1][0][0])


def test_at_one_process_both_are_null_contexts() -> None:
    ctx = rank_ctx(1, 0)
    net = nn.Linear(2, 1)
    with no_sync(ctx, net), sync_in_backward(ctx, net):
        net(torch.ones(1, 2)).sum().backward()
    assert net.weight.grad is not None


def test_no_sync_refuses_what_is_not_a_module() -> None:
    with pytest.raises(
        TypeError, match=r"no_sync: model must be an nn.Module; got .* \(int\)"
    ):
        no_sync(rank_ctx(1, 0), 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"sync_in_backward: ctx must be a Distrib"):
        sync_in_backward(None, nn.Linear(1, 1))  # type: ignore[arg-type]


def test_sync_in_backward_refuses_an_fsdp2_module(tmp_path: Path) -> None:
    # FSDP2 decides at backward time; one gloo process builds a real FSDP2 module
    # and a two-rank context reaches the check.
    from torch.distributed.fsdp import fully_shard

    init = f"file://{tmp_path}/rendezvous"
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    try:
        net = nn.Linear(2, 2)
        fully_shard(net)
        with pytest.raises(
            TypeError,
            match=r"sync_in_backward: model must be a DDP or plain module, not an "
            r"FSDP2 one; got .*after leaving no_sync\(ctx, model\) instead\.$",
        ):
            sync_in_backward(rank_ctx(2, 0), net)
    finally:
        dist.destroy_process_group()
