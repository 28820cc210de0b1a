"""An optimizer built before ``wrap_model`` shards the model with FSDP2.

``fully_shard`` replaces every parameter with a new ``DTensor`` one. Accelerate's
examples build the optimizer first: passed to ``wrap_model(..., optimizers=...)``
it must train exactly as one built afterwards; forgotten, ``accumulate_step`` must
refuse to step instead of training nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.context import DistributedContext
from funcaccel.model import FSDPOptions
from funcaccel.model import unwrap_model
from funcaccel.model import wrap_model
from funcaccel.testing import run_ranks

STEPS: int = 3
LR: float = 0.1
Params = dict[str, torch.Tensor]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.second = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.second(torch.tanh(self.first(x)))
        return out


def _make_net() -> _Net:
    torch.manual_seed(0)
    return _Net().double()


def _optimizer(net: _Net) -> torch.optim.SGD:
    """Two groups with their own learning rates, and momentum state."""
    groups = [
        {"params": list(net.first.parameters()), "lr": LR},
        {"params": list(net.second.parameters()), "lr": LR / 2},
    ]
    return torch.optim.SGD(groups, momentum=0.9)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    xs = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    return xs, torch.randn(8, 3, generator=generator, dtype=torch.float64)


def _params(model: nn.Module) -> Params:
    out: Params = {}
    for name, param in unwrap_model(model).named_parameters():
        tensor = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = tensor.detach().clone()
    return out


def _full_batch_step(net: _Net, optimizer: torch.optim.Optimizer) -> None:
    xs, ys = _data()
    optimizer.zero_grad()
    torch.autograd.backward(F.mse_loss(net(xs), ys))
    optimizer.step()


def _reference(steps: int) -> Params:
    net = _make_net()
    optimizer = _optimizer(net)
    for _ in range(steps):
        _full_batch_step(net, optimizer)
    return _params(net)


def _fit(
    ctx: DistributedContext, model: nn.Module, optimizer: torch.optim.Optimizer
) -> Params:
    xs, ys = _data()
    xs, ys = xs[ctx.process_index :: 2], ys[ctx.process_index :: 2]
    grad = GradState()
    for _ in range(STEPS):
        _, grad = accumulate_step(
            ctx, grad, model, optimizer, lambda: F.mse_loss(model(xs), ys)
        )
    return _params(model)


def _order_worker(ctx: DistributedContext) -> dict[str, Any]:
    out: dict[str, Any] = {}
    net = _make_net()
    model = wrap_model(ctx, net, fsdp=FSDPOptions())
    out["right_order"] = _fit(ctx, model, _optimizer(net))

    net = _make_net()
    optimizer = _optimizer(net)
    model = wrap_model(
        ctx, net, fsdp=FSDPOptions(shard_modules=(nn.Linear,)), optimizers=optimizer
    )
    out["lrs"] = [group["lr"] for group in optimizer.param_groups]
    out["all_dtensors"] = all(
        isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]
    )
    out["passed"] = _fit(ctx, model, optimizer)

    # One step before wrapping leaves momentum buffers of the full shape: they
    # must follow their parameters into the shards.
    net = _make_net()
    optimizer = _optimizer(net)
    _full_batch_step(net, optimizer)
    model = wrap_model(ctx, net, fsdp=FSDPOptions(), optimizers=[optimizer])
    out["with_state"] = _fit(ctx, model, optimizer)

    net = _make_net()
    optimizer = _optimizer(net)
    model = wrap_model(ctx, net, fsdp=FSDPOptions())
    before = _params(model)
    try:
        _fit(ctx, model, optimizer)
    except ValueError as error:
        out["forgotten"] = str(error)
    else:
        out["forgotten"] = None
    out["forgotten_unchanged"] = all(
        torch.equal(before[k], v) for k, v in _params(model).items()
    )
    return out


@pytest.fixture(scope="module")
def order_results() -> list[dict[str, Any]]:
    return run_ranks(_order_worker, 2, start_method="forkserver")


def _assert_close(got: Params, want: Params) -> None:
    assert got.keys() == want.keys()
    for key in got:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-12)


@pytest.mark.distributed
def test_wrap_model_rebinds_an_optimizer_built_before_fsdp(
    order_results: list[dict[str, Any]],
) -> None:
    initial = _params(_make_net())
    want = _reference(STEPS)
    for result in order_results:
        assert result["lrs"] == [LR, LR / 2]
        assert result["all_dtensors"]
        assert result["passed"]["first.weight"].ne(initial["first.weight"]).all()
        _assert_close(result["passed"], result["right_order"])
        _assert_close(result["passed"], want)


@pytest.mark.distributed
def test_wrap_model_shards_the_optimizer_state_it_rebinds(
    order_results: list[dict[str, Any]],
) -> None:
    want = _reference(STEPS + 1)
    for result in order_results:
        _assert_close(result["with_state"], want)


@pytest.mark.distributed
def test_accumulate_step_refuses_an_optimizer_fsdp_left_behind(
    order_results: list[dict[str, Any]],
) -> None:
    for result in order_results:
        message = result["forgotten"]
        assert message is not None, "trained on stale parameters without an error"
        assert message.startswith("accumulate_step: optimizer holds none of")
        assert "wrap_model(ctx, model, fsdp=..., optimizers=optimizer)" in message
        assert result["forgotten_unchanged"]


def test_wrap_model_one_process_leaves_the_optimizer_alone() -> None:
    net = _make_net()
    optimizer = _optimizer(net)
    groups = [list(g["params"]) for g in optimizer.param_groups]
    assert wrap_model(DistributedContext(), net, optimizers=optimizer) is net
    assert [list(g["params"]) for g in optimizer.param_groups] == groups


def test_wrap_model_refuses_optimizers_of_the_wrong_type() -> None:
    with pytest.raises(
        TypeError,
        match=r"wrap_model: every item of optimizers must be an Optimizer; got 3",
    ):
        wrap_model(DistributedContext(), _make_net(), optimizers=[3])  # type: ignore[list-item]
