"""FSDP2's reduce-scatter on gloo: in place, released at once, same gradients as torch's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard

from funcaccel.context import DistributedContext
from funcaccel.model import FSDPOptions
from funcaccel.model import wrap_model
from funcaccel.model._fsdp_gloo import gloo_reduce_scatter_class
from funcaccel.model._fsdp_gloo import install_gloo_reduce_scatter
from funcaccel.testing import run_ranks


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def _local_grads(model: nn.Module, ctx: DistributedContext) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1 + ctx.process_index)
    xs = torch.randn(5, 4, generator=gen)
    torch.autograd.backward(model(xs).square().sum())
    return [p.grad.to_local().clone() for p in model.parameters()]  # type: ignore[union-attr]


def _worker(ctx: DistributedContext) -> dict[str, Any]:
    cls = gloo_reduce_scatter_class()
    assert cls is not None
    comm = cls()
    world, rank = ctx.num_processes, ctx.process_index
    out: dict[str, Any] = {}
    for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
        inp = torch.arange(world * 5, dtype=torch.float32) * (rank + 1) / 3
        want = torch.empty(5)
        # torch's own reduce-scatter (renamed reduce_scatter_single in 2.13).
        reference = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        reference(want, inp.clone(), op=op)
        got = torch.empty(5)
        assert comm(got, inp, dist.group.WORLD, op) is None
        out[f"equal_{op}"] = torch.equal(got, want)
        out[f"released_{op}"] = inp.untyped_storage().nbytes()
    # An asynchronous call is torch's own: the input keeps its storage.
    inp = torch.ones(world * 2)
    got = torch.empty(2)
    work = comm(got, inp, dist.group.WORLD, dist.ReduceOp.SUM, async_op=True)
    work.wait()
    out["async"] = (got.tolist(), inp.untyped_storage().nbytes())

    options = FSDPOptions(shard_modules=(nn.Linear,))
    model = wrap_model(ctx, _net(), fsdp=options)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    out["comms"] = [
        type(group._reduce_scatter_comm).__name__
        for unit in units
        for group in unit._get_fsdp_state()._fsdp_param_groups
    ]
    out["grads"] = _local_grads(model, ctx)
    # torch's default FSDP2 on the same model and batch.
    plain = _net()
    mesh = init_device_mesh("cpu", (world,))
    for module in (plain[0], plain[2], plain):
        fully_shard(module, mesh=mesh)
    out["plain_grads"] = _local_grads(plain, ctx)
    out["installed_on_meta"] = install_gloo_reduce_scatter(
        plain, torch.device("meta"), mesh.get_all_groups()
    )
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_reduce_scatter_in_place_and_released(world: int) -> None:
    for result in run_ranks(_worker, world, start_method="forkserver"):
        for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            assert result[f"equal_{op}"]
            assert result[f"released_{op}"] == 0
        assert result["async"] == ([float(world)] * 2, world * 2 * 4)
        # wrap_model installs it on every unit holding parameters (the two
        # Linear; the root holds none of its own).
        assert result["comms"] == ["GlooReduceScatter"] * 2
        # Bitwise the gradients of torch's default reduce-scatter.
        for got, want in zip(result["grads"], result["plain_grads"], strict=True):
            assert torch.equal(got, want)
        assert result["installed_on_meta"] == 0
