"""``GradState.grad_norm``: the pre-clip norm ``accumulate_step`` measured.

One process here: the norm and the parameters equal, bit for bit, a hand-written
loop that calls ``torch.nn.utils.clip_grad_norm_(model.parameters())``, also when
the optimizer's param groups list the parameters in another order. The global
norm under tensor parallelism is checked here at 2 ranks; at 2 and 3 ranks under
DDP and FSDP2 in ``test_accumulate.py``; a DeepSpeed ZeRO-2 engine's in
``test_grad_norm_deepspeed.py`` (and ``test_deepspeed_step.py``, on a stand-in).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from typing import NamedTuple

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.parallel import RowwiseParallel

from funcaccel.accumulate import accumulate_step
from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState
from funcaccel.mesh import build_mesh
from funcaccel.model import wrap_model
from funcaccel.testing import run_ranks
from tests.fixtures import TpMLP

K = 3
MICRO = 7  # windows of 3, 3 and a short last one of 1
MAX_NORM = 0.5


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with the usual no-decay group first: biases before weights."""
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    groups: list[dict[str, Any]] = [
        {"params": biases, "weight_decay": 0.0},
        {"params": weights},
    ]
    return torch.optim.AdamW(groups, lr=0.01)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(5, 4, generator=gen) * 3, torch.randn(5, 3, generator=gen))
        for _ in range(MICRO)
    ]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


class _ByHand(NamedTuple):
    norms: list[torch.Tensor]  # what clip_grad_norm_(model.parameters()) returned
    params: list[torch.Tensor]  # at the end
    model_order: list[torch.Tensor]  # get_total_norm of the grads, model order
    group_order: list[torch.Tensor]  # the same in param-group order


def _by_hand(max_norm: float | None) -> _ByHand:
    """The loop a user writes: backward(loss / k), clip model.parameters(), step."""
    model = _model()
    opt = _optimizer(model)
    norms: list[torch.Tensor] = []
    model_order: list[torch.Tensor] = []
    group_order: list[torch.Tensor] = []
    for i, (x, y) in enumerate(_batches()):
        torch.autograd.backward(_loss(model, x, y) / K)
        last = i == MICRO - 1
        if (i + 1) % K == 0 or last:
            m = i % K + 1
            if m != K:  # the short last window: its mean, not its sum over k
                for param in model.parameters():
                    assert param.grad is not None
                    param.grad.mul_(K / m)
            # torch's clip_grad_norm_ sums get_total_norm over the list it is given.
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            model_order.append(torch.nn.utils.get_total_norm(grads))
            in_groups = [p for group in opt.param_groups for p in group["params"]]
            group_order.append(
                torch.nn.utils.get_total_norm([p.grad for p in in_groups])
            )
            if max_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                norms.append(norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
    params = [p.detach().clone() for p in model.parameters()]
    return _ByHand(norms, params, model_order, group_order)


def _with_accumulate_step(
    max_grad_norm: float | None,
) -> tuple[list[GradState], list[torch.Tensor]]:
    ctx = DistributedContext()
    model = _model()
    opt = _optimizer(model)
    grad = GradState(accumulation_steps=K)
    states = []
    for i, (x, y) in enumerate(_batches()):
        _, grad = accumulate_step(
            ctx,
            grad,
            model,
            opt,
            lambda: _loss(model, x, y),
            end_of_dataloader=i == MICRO - 1,
            max_grad_norm=max_grad_norm,
        )
        states.append(grad)
    return states, [p.detach().clone() for p in model.parameters()]


def test_grad_norm_is_clip_grad_norm_of_model_parameters_bit_for_bit() -> None:
    states, params = _with_accumulate_step(MAX_NORM)
    want = _by_hand(MAX_NORM)
    got = [s.grad_norm for s in states if s.sync_gradients]
    assert len(got) == len(want.norms) == 3
    for g, n in zip(got, want.norms, strict=True):
        assert g is not None and torch.equal(g, n)
    assert all(torch.equal(p, q) for p, q in zip(params, want.params, strict=True))
    assert all(n > MAX_NORM for n in want.norms)  # every window was clipped
    # The optimizer's order changes the last bits on this data: the model's order
    # is what makes the equality above exact.
    assert want.norms == want.model_order != want.group_order


def test_grad_norm_is_none_on_open_windows_and_without_clipping() -> None:
    states, _ = _with_accumulate_step(MAX_NORM)
    assert [s.grad_norm is None for s in states] == [
        not s.sync_gradients for s in states
    ]
    unclipped, _ = _with_accumulate_step(None)
    assert all(s.grad_norm is None for s in unclipped)


def test_infinite_max_grad_norm_measures_without_clipping() -> None:
    states, params = _with_accumulate_step(math.inf)
    want = _by_hand(None)
    assert all(torch.equal(p, q) for p, q in zip(params, want.params, strict=True))
    got = [s.grad_norm for s in states if s.grad_norm is not None]
    assert torch.equal(torch.stack(got), torch.stack(want.model_order))


def test_grad_norm_stays_out_of_the_checkpoint_dict_and_of_equality() -> None:
    plain = GradState(accumulation_steps=2, optimizer_steps=3)
    measured = dataclasses.replace(plain, grad_norm=torch.tensor(1.5))
    assert "grad_norm" not in measured.to_dict()
    assert measured.to_dict() == plain.to_dict()
    assert GradState.from_dict(measured.to_dict()) == measured == plain
    assert hash(measured) == hash(plain)
    # A dict written before window_items and grad_norm existed still loads.
    older = {k: v for k, v in plain.to_dict().items() if k != "window_items"}
    assert GradState.from_dict(older) == plain
    with pytest.raises(ValueError, match=r"unknown \['grad_norm'\]"):
        GradState.from_dict({**plain.to_dict(), "grad_norm": 1.5})


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        (
            {"grad_norm": 1.5},
            TypeError,
            r"^GradState: grad_norm must be a 0-dim tensor or None; got 1\.5",
        ),
        (
            {"grad_norm": torch.ones(2)},
            ValueError,
            r"^GradState: grad_norm must be a 0-dim tensor \(the total norm\) or "
            r"None; got a tensor of shape \(2,\)\.$",
        ),
        (
            {"micro_step": 1, "sync_gradients": False, "grad_norm": torch.tensor(1.0)},
            ValueError,
            r"^GradState: grad_norm is measured by the micro-step that closes a "
            r"window, so micro_step must be 0; got micro_step=1\. Pass grad_norm=None\.$",
        ),
    ],
)
def test_grad_state_checks_grad_norm(
    fields: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        GradState(accumulation_steps=2, **fields)  # type: ignore[arg-type]


def _tp_norms(ctx: DistributedContext, tp: int) -> list[torch.Tensor]:
    """Norms of 2 windows (2 + a short 1) of a float64 MLP, tensor-parallel or not."""
    torch.manual_seed(0)
    model: nn.Module = TpMLP().double()
    if tp > 1:
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        mesh = build_mesh(ctx, dp_replicate=1, dp_shard=1, tp=tp)
        model = wrap_model(ctx, model, mesh=mesh, tp_plan=plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)  # the same data on every tp rank
    grad = GradState(accumulation_steps=2)
    norms = []
    for step in range(3):
        x = torch.randn(4, 4, generator=gen, dtype=torch.float64)
        y = torch.randn(4, 3, generator=gen, dtype=torch.float64)
        _, grad = accumulate_step(
            ctx,
            grad,
            model,
            opt,
            lambda: _loss(model, x, y),
            end_of_dataloader=step == 2,
            max_grad_norm=0.1,
        )
        if grad.grad_norm is not None:
            norms.append(grad.grad_norm)
    return norms


@pytest.mark.distributed
def test_tensor_parallel_grad_norm_is_the_whole_models_on_every_rank() -> None:
    want = _tp_norms(DistributedContext(), 1)
    assert len(want) == 2 and all(n > 0.1 for n in want)
    results = run_ranks(_tp_norms, 2, 2, start_method="forkserver")
    for norms in results:
        assert all(type(n) is torch.Tensor for n in norms)  # not a DTensor
        assert all(torch.equal(a, b) for a, b in zip(norms, results[0], strict=True))
        torch.testing.assert_close(
            torch.stack(norms), torch.stack(want), rtol=1e-12, atol=0.0
        )
