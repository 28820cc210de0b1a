"""clip_grad_value_: clamps in place, unscales first (once) with an fp16 scaler."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import funcaccel as fa
from funcaccel.context import DistributedContext
from funcaccel.testing import run_ranks


def param_with_grad(values: list[float]) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(len(values)))
    param.grad = torch.tensor(values)
    return param


def test_clamps_every_gradient_in_place() -> None:
    a = param_with_grad([-3.0, 0.25, 2.0])
    b = param_with_grad([0.5, -0.75])
    none = torch.nn.Parameter(torch.zeros(2))
    grad_a = a.grad
    fa.clip_grad_value_([a, none, b], 0.5)
    assert a.grad is grad_a  # in place
    assert a.grad is not None and a.grad.tolist() == [-0.5, 0.25, 0.5]
    assert b.grad is not None and b.grad.tolist() == [0.5, -0.5]
    assert none.grad is None


def test_accepts_one_tensor_a_generator_and_no_gradients_at_all() -> None:
    a = param_with_grad([4.0])
    fa.clip_grad_value_(a, 1.0)
    assert a.grad is not None and a.grad.tolist() == [1.0]
    model = torch.nn.Linear(2, 1)
    fa.clip_grad_value_(model.parameters(), 1.0)  # no .grad anywhere: nothing to do
    assert all(p.grad is None for p in model.parameters())
    b = param_with_grad([-9.0, 9.0])
    fa.clip_grad_value_((p for p in [b]), 2.0)
    assert b.grad is not None and b.grad.tolist() == [-2.0, 2.0]


def test_infinite_clip_value_changes_nothing() -> None:
    a = param_with_grad([-(2.0**100), 5.0])
    fa.clip_grad_value_([a], math.inf)
    assert a.grad is not None and a.grad.tolist() == [-(2.0**100), 5.0]


@given(
    values=st.lists(
        st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=20
    ),
    clip=st.floats(1e-3, 1e3),
)
def test_matches_an_elementwise_clamp(values: list[float], clip: float) -> None:
    param = param_with_grad(values)
    fa.clip_grad_value_([param], clip)
    bound = torch.tensor(clip).item()  # clip in float32, as the gradient
    expected = [max(-bound, min(bound, v)) for v in torch.tensor(values).tolist()]
    assert param.grad is not None and param.grad.tolist() == expected


def _scaled_step(clip_twice: bool) -> tuple[list[float], list[float]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.tensor([[4.0, -2.0, 0.1]])
    scaler.scale(model(x).sum() * 3).backward()
    fa.clip_grad_value_(model.parameters(), 1.0, scaler=scaler, optimizer=opt)
    if clip_twice:
        fa.clip_grad_value_(model.parameters(), 1.0, scaler=scaler, optimizer=opt)
    grads = [
        g
        for p in model.parameters()
        if p.grad is not None
        for g in p.grad.flatten().tolist()
    ]
    fa.optimizer_step(opt, scaler=scaler)
    return grads, [w for p in model.parameters() for w in p.detach().flatten().tolist()]


@pytest.mark.parametrize("clip_twice", [False, True])
def test_unscales_first_and_only_once(clip_twice: bool) -> None:
    # The true gradients: d/dw of 3 * (w . x + b) = 3x, 3; clamped to [-1, 1].
    torch.manual_seed(0)
    start = torch.nn.Linear(3, 1)
    w0 = start.weight.detach().flatten().tolist() + start.bias.detach().tolist()
    clamped = [1.0, -1.0, 0.3, 1.0]
    grads, weights = _scaled_step(clip_twice)
    assert grads == pytest.approx(clamped)
    assert weights == pytest.approx([w - g for w, g in zip(w0, clamped, strict=True)])


def test_a_scaler_needs_the_optimizer() -> None:
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(
        ValueError,
        match=r"^clip_grad_value_: optimizer must be the optimizer\(s\) owning the "
        r"parameters when a scaler is given; got None\.",
    ):
        fa.clip_grad_value_([param_with_grad([1.0])], 1.0, scaler=scaler)
    with pytest.raises(
        TypeError, match=r"^clip_grad_value_: scaler must be a torch\.amp\.GradScaler"
    ):
        fa.clip_grad_value_([param_with_grad([1.0])], 1.0, scaler=object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "kind", "match"),
    [
        (0, ValueError, r"clip_value must be > 0; got 0"),
        (-1.0, ValueError, r"clip_value must be > 0; got -1\.0"),
        (math.nan, ValueError, r"clip_value must be > 0; got nan"),
        ("1", TypeError, r"clip_value must be a number; got '1' \(str\)"),
        (True, TypeError, r"clip_value must be a number; got True \(bool\)"),
    ],
)
def test_clip_value_is_checked(value: Any, kind: type[Exception], match: str) -> None:
    with pytest.raises(kind, match=rf"^clip_grad_value_: {match}"):
        fa.clip_grad_value_([param_with_grad([1.0])], value)


def _clip_mean_grad(ctx: DistributedContext) -> list[float]:
    # What DDP's backward leaves: the mean of every rank's gradient (done by hand
    # with reduce, lighter than starting DDP), then clipped on every rank.
    param = torch.nn.Parameter(torch.zeros(2))
    x = torch.tensor([1.0 + 2 * ctx.process_index, -0.5])
    torch.autograd.backward((param * x).sum())
    assert param.grad is not None
    param.grad = fa.reduce(ctx, param.grad, reduction="mean")
    fa.clip_grad_value_([param], 2.0)
    result: list[float] = param.grad.tolist()
    return result


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_clip_grad_value_of_the_mean_gradient(world: int) -> None:
    results = run_ranks(_clip_mean_grad, world, start_method="forkserver")
    # The mean of 1, 3, 5, ... over `world` ranks is `world`; clamped to 2.
    expected = [min(2.0, float(world)), -0.5]
    assert results == [expected] * world
