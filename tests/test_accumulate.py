"""GradState, the pure accumulation rules, and accumulate_step against plain PyTorch.

One-process checks run here; the DDP and FSDP2 checks run every scenario of a world
size in one spawn (``_scenarios``) and compare with a plain one-process reference
computed in this process.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from torch import nn
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.functional import mse_loss
from torch.nn.parallel import DistributedDataParallel

from funcaccel._typing import MixedPrecision
from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.accumulate import advance_grad_state
from funcaccel.accumulate import should_skip_grad_sync
from funcaccel.accumulate import should_sync
from funcaccel.accumulate import sync_ctx
from funcaccel.accumulate import window_grad_factor
from funcaccel.context import DistributedContext
from funcaccel.kwargs import AutocastKwargs
from funcaccel.kwargs import GradScalerKwargs
from funcaccel.mixed_precision import build_grad_scaler
from funcaccel.mixed_precision import clip_grad_norm_
from funcaccel.mixed_precision import optimizer_parameters
from funcaccel.mixed_precision import optimizer_step
from funcaccel.mixed_precision import rescale_grads_
from funcaccel.sync import no_sync
from funcaccel.testing import run_ranks
from tests.fixtures import rank_ctx

ONE = DistributedContext()
F64 = torch.float64

# --- helpers shared by the one-process and distributed checks -------------------


def _net(seed: int = 0, dtype: torch.dtype = F64) -> nn.Sequential:
    """A tiny MLP whose parameters depend only on ``seed``."""
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in net.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=dtype) * 0.7)
    return net


def _data(n: int, dtype: torch.dtype = F64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return (
        torch.randn(n, 3, generator=gen, dtype=dtype),
        torch.randn(n, 2, generator=gen, dtype=dtype),
    )


def _sgd(params: Any) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _loss_fn(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> Callable[[], torch.Tensor]:
    return lambda: mse_loss(model(x), y)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _record_step_grads(
    opt: torch.optim.Optimizer, params: Sequence[torch.Tensor]
) -> list[list[torch.Tensor]]:
    """Record, at every ``opt.step()``, the gradients the step sees."""
    seen: list[list[torch.Tensor]] = []

    def hook(*_: object) -> None:
        seen.append([_full(p.grad) for p in params if p.grad is not None])

    opt.register_step_pre_hook(hook)
    return seen


def _reference(
    windows: Sequence[Sequence[torch.Tensor]],
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    max_grad_norm: float | None = None,
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], list[nn.Module]]:
    """Plain PyTorch: each window (a list of index batches) is one optimizer step.

    The loss of a window is the mean of its micro-batch losses (equal batches: the
    loss of the whole window taken as one batch). Returns the gradients each step
    used, the final parameters and a copy of the model at the start of each window.
    """
    net = _net()
    opt = _sgd(net.parameters())
    grads: list[list[torch.Tensor]] = []
    starts: list[nn.Module] = []
    for window in windows:
        starts.append(copy.deepcopy(net))
        opt.zero_grad()
        if all(len(b) == len(window[0]) for b in window):
            idx = torch.cat(list(window))
            loss = mse_loss(net(x[idx]), y[idx])
        else:
            losses = [mse_loss(net(x[b]), y[b]) for b in window]
            loss = torch.stack(losses).sum() / len(window)
        torch.autograd.backward(loss)
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), max_grad_norm)
        grads.append([_full(p.grad) for p in net.parameters() if p.grad is not None])
        opt.step()
    return grads, [_full(p) for p in net.parameters()], starts


def _grads_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    net = copy.deepcopy(net)
    loss = mse_loss(net(x), y)
    return [g.detach() for g in torch.autograd.grad(loss, list(net.parameters()))]


def _close(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], tol: float = 1e-12
) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u, v, rtol=tol, atol=tol)


def _windows(steps: Sequence[GradState]) -> list[int]:
    """Indices of the micro-steps that synced."""
    return [i for i, s in enumerate(steps) if s.sync_gradients]


# --- GradState ------------------------------------------------------------------


def test_grad_state_defaults_form_the_initial_state() -> None:
    grad = GradState()
    assert grad.to_dict() == {
        "accumulation_steps": 1,
        "micro_step": 0,
        "sync_gradients": True,
        "end_of_dataloader": False,
        "step_was_skipped": False,
        "optimizer_steps": 0,
        "sync_with_dataloader": True,
        "sync_each_batch": False,
        "window_items": None,
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        grad.micro_step = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fields", "error", "pattern"),
    [
        (
            {"accumulation_steps": 0},
            ValueError,
            r"accumulation_steps must be >= 1; got 0",
        ),
        (
            {"accumulation_steps": True},
            TypeError,
            r"accumulation_steps must be an int; got True \(bool\)",
        ),
        (
            {"accumulation_steps": 2.0},
            TypeError,
            r"accumulation_steps must be an int; got 2.0",
        ),
        (
            {"micro_step": -1},
            ValueError,
            r"micro_step \(-1\) must be in \[0, accumulation_steps=1\)",
        ),
        (
            {"accumulation_steps": 3, "micro_step": 3, "sync_gradients": False},
            ValueError,
            r"micro_step \(3\)",
        ),
        ({"optimizer_steps": -2}, ValueError, r"optimizer_steps must be >= 0; got -2"),
        (
            {"sync_each_batch": 1},
            TypeError,
            r"sync_each_batch must be a bool; got 1 \(int\)",
        ),
        (
            {"end_of_dataloader": "yes"},
            TypeError,
            r"end_of_dataloader must be a bool; got 'yes'",
        ),
        (
            {"accumulation_steps": 3, "micro_step": 1},
            ValueError,
            r"sync_gradients \(True\) must be true exactly when micro_step == 0.*Pass sync_gradients=False",
        ),
        ({"sync_gradients": False}, ValueError, r"Pass sync_gradients=True"),
        (
            {
                "accumulation_steps": 2,
                "micro_step": 1,
                "sync_gradients": False,
                "step_was_skipped": True,
            },
            ValueError,
            r"step_was_skipped=True needs sync_gradients=True",
        ),
        (
            {
                "accumulation_steps": 2,
                "micro_step": 1,
                "sync_gradients": False,
                "end_of_dataloader": True,
            },
            ValueError,
            r"end_of_dataloader=True with sync_with_dataloader=True",
        ),
    ],
)
def test_grad_state_rejects_invalid_fields(
    fields: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=r"^GradState: .*" + pattern):
        GradState(**fields)


def test_grad_state_allows_an_open_window_at_the_end_without_sync_with_dataloader() -> (
    None
):
    grad = GradState(
        accumulation_steps=2,
        micro_step=1,
        sync_gradients=False,
        end_of_dataloader=True,
        sync_with_dataloader=False,
    )
    assert not grad.sync_gradients


@st.composite
def grad_states(draw: st.DrawFn) -> GradState:
    """Any valid GradState (every reachable combination of fields)."""
    k = draw(st.integers(1, 64))
    micro_step = draw(st.integers(0, k - 1))
    synced = micro_step == 0
    with_dataloader = draw(st.booleans())
    end = draw(st.booleans()) if synced or not with_dataloader else False
    return GradState(
        accumulation_steps=k,
        micro_step=micro_step,
        sync_gradients=synced,
        end_of_dataloader=end,
        step_was_skipped=draw(st.booleans()) if synced else False,
        optimizer_steps=draw(st.integers(0, 10**12)),
        sync_with_dataloader=with_dataloader,
        sync_each_batch=draw(st.booleans()),
    )


@given(grad_states())
def test_grad_state_dict_round_trip(state: GradState) -> None:
    assert GradState.from_dict(state.to_dict()) == state
    assert GradState.from_dict(json.loads(json.dumps(state.to_dict()))) == state
    data = state.to_dict()
    data["micro_step"] = -1
    assert state.micro_step != -1  # to_dict returned a copy


def test_grad_state_from_dict_rejects_bad_input() -> None:
    data: dict[str, object] = dict(GradState().to_dict())
    with pytest.raises(
        TypeError, match=r"GradState.from_dict: data must be a mapping; got .* \(list\)"
    ):
        GradState.from_dict([("micro_step", 0)])  # type: ignore[arg-type]
    del data["micro_step"]
    data["epoch"] = 1
    with pytest.raises(
        ValueError, match=r"missing \['micro_step'\], unknown \['epoch'\]"
    ):
        GradState.from_dict(data)
    bad = dict(GradState().to_dict(), optimizer_steps="3")
    with pytest.raises(
        TypeError, match=r"GradState: optimizer_steps must be an int; got '3'"
    ):
        GradState.from_dict(bad)


# --- the pure rules -------------------------------------------------------------


def _walk(
    grad: GradState, flags: Sequence[bool], *, skipped: Sequence[bool] = ()
) -> list[GradState]:
    states = []
    skips = list(skipped) or [False] * len(flags)
    for flag, skip in zip(flags, skips, strict=True):
        grad = advance_grad_state(grad, end_of_dataloader=flag, step_was_skipped=skip)
        states.append(grad)
    return states


EPOCH_FLAGS = [False] * 9 + [True]


def test_spec_table_k4_ten_batches_restarts_each_epoch() -> None:
    states = _walk(GradState(accumulation_steps=4), EPOCH_FLAGS * 2)
    for epoch in (0, 1):
        part = states[10 * epoch : 10 * epoch + 10]
        assert [s.sync_gradients for s in part] == [
            False, False, False, True, False, False, False, True, False, True,
        ]  # fmt: skip
        assert [s.micro_step for s in part] == [1, 2, 3, 0, 1, 2, 3, 0, 1, 0]
        assert [s.end_of_dataloader for s in part] == EPOCH_FLAGS
    assert states[-1].optimizer_steps == 6


def test_spec_example_sync_with_dataloader_false_runs_windows_across_epochs() -> None:
    grad = GradState(accumulation_steps=4, sync_with_dataloader=False)
    states = _walk(grad, EPOCH_FLAGS * 2)
    assert _windows(states) == [3, 7, 11, 15, 19]  # epoch 0: 3, 7; epoch 1: 1, 5, 9
    assert [s.micro_step for s in states[8:12]] == [1, 2, 3, 0]
    assert states[9].end_of_dataloader and not states[9].sync_gradients


@settings(max_examples=200)
@given(n=st.integers(1, 60), k=st.integers(1, 9), epochs=st.integers(1, 3))
def test_n_micro_steps_give_ceil_n_over_k_syncs_per_epoch(
    n: int, k: int, epochs: int
) -> None:
    flags = ([False] * (n - 1) + [True]) * epochs
    states = _walk(GradState(accumulation_steps=k), flags)
    assert len(_windows(states)) == math.ceil(n / k) * epochs
    assert states[-1].micro_step == 0
    assert states[-1].optimizer_steps == math.ceil(n / k) * epochs
    syncs = _windows(states)
    sizes = [b - a for a, b in zip([-1, *syncs], syncs, strict=False)]
    assert all(1 <= m <= k for m in sizes)
    assert sum(sizes) == n * epochs


@given(grad_states(), st.booleans(), st.booleans())
def test_advance_builds_the_state_the_validating_constructor_builds(
    grad: GradState, end: bool, skip: bool
) -> None:
    synced = should_sync(grad, end_of_dataloader=end)
    after = advance_grad_state(
        grad, end_of_dataloader=end, step_was_skipped=skip and synced
    )
    assert after == GradState.from_dict(after.to_dict())  # every field set, and valid
    assert after == dataclasses.replace(
        grad,
        micro_step=0 if synced else grad.micro_step + 1,
        sync_gradients=synced,
        end_of_dataloader=end,
        step_was_skipped=skip and synced,
        optimizer_steps=grad.optimizer_steps + int(synced and not skip),
    )
    assert hash(after) == hash(GradState.from_dict(after.to_dict()))


def test_pure_rules_reject_non_bool_flags() -> None:
    with pytest.raises(
        TypeError, match=r"should_sync: end_of_dataloader must be a bool; got 1 \(int\)"
    ):
        should_sync(GradState(), end_of_dataloader=1)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"advance_grad_state: step_was_skipped must be a bool; got None",
    ):
        advance_grad_state(GradState(), step_was_skipped=None)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"should_sync: end_of_dataloader must be a bool; got 'x'"
    ):
        advance_grad_state(GradState(), end_of_dataloader="x")  # type: ignore[arg-type]


def test_advance_counts_only_applied_updates_and_rejects_impossible_skips() -> None:
    states = _walk(
        GradState(accumulation_steps=1), [False] * 3, skipped=[False, True, False]
    )
    assert [s.step_was_skipped for s in states] == [False, True, False]
    assert [s.optimizer_steps for s in states] == [1, 1, 2]
    with pytest.raises(
        ValueError,
        match=r"advance_grad_state: step_was_skipped must be False when the micro-step does not sync \(micro_step=0, accumulation_steps=2\); got True",
    ):
        advance_grad_state(GradState(accumulation_steps=2), step_was_skipped=True)


def test_should_sync_and_window_factor() -> None:
    open_2 = GradState(accumulation_steps=4, micro_step=2, sync_gradients=False)
    assert not should_sync(open_2)
    assert should_sync(open_2, end_of_dataloader=True)
    assert window_grad_factor(open_2) == 1.0
    assert window_grad_factor(open_2, end_of_dataloader=True) == 4 / 3
    last = GradState(accumulation_steps=4, micro_step=3, sync_gradients=False)
    assert window_grad_factor(last) == 1.0 and should_sync(last)
    with pytest.raises(
        TypeError, match=r"should_sync: grad must be a GradState; got 3"
    ):
        should_sync(3)  # type: ignore[arg-type]


TWO = rank_ctx(2, 1)


@pytest.mark.parametrize(
    ("ctx", "grad", "end", "expected"),
    [
        (ONE, GradState(accumulation_steps=4), False, False),
        (TWO, GradState(accumulation_steps=4), False, True),
        (TWO, GradState(accumulation_steps=4), True, False),
        (TWO, GradState(accumulation_steps=4, sync_with_dataloader=False), True, True),
        (TWO, GradState(accumulation_steps=4, sync_each_batch=True), False, False),
        (TWO, GradState(accumulation_steps=1), False, False),
    ],
)
def test_should_skip_grad_sync_table(
    ctx: DistributedContext, grad: GradState, end: bool, expected: bool
) -> None:
    assert should_skip_grad_sync(ctx, grad, end_of_dataloader=end) is expected


def test_sync_ctx_leaves_plain_modules_alone() -> None:
    net = _net()
    with sync_ctx(TWO, GradState(accumulation_steps=2), [net, net]):
        loss = mse_loss(net(torch.ones(1, 3, dtype=F64)), torch.zeros(1, 2, dtype=F64))
        torch.autograd.backward(loss)
    assert all(p.grad is not None for p in net.parameters())
    with pytest.raises(
        TypeError, match=r"sync_ctx: every item of models must be a Module"
    ):
        sync_ctx(ONE, GradState(), [net, "net"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"sync_ctx: ctx must be a DistributedContext"):
        sync_ctx(None, GradState(), net)  # type: ignore[arg-type]


# --- accumulate_step, one process -------------------------------------------------


def _run(
    ctx: DistributedContext,
    batches: Sequence[torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    grad: GradState,
    *,
    epochs: int = 1,
    **options: Any,
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], list[GradState]]:
    net = _net()
    opt = _sgd(net.parameters())
    seen = _record_step_grads(opt, list(net.parameters()))
    states = []
    for _ in range(epochs):
        for i, idx in enumerate(batches):
            _, grad = accumulate_step(
                ctx, grad, net, opt, _loss_fn(net, x[idx], y[idx]),
                end_of_dataloader=i == len(batches) - 1, **options,
            )  # fmt: skip
            states.append(grad)
    return seen, [_full(p) for p in net.parameters()], states


def _chunks(n: int, bs: int) -> list[torch.Tensor]:
    return [torch.arange(i, min(i + bs, n)) for i in range(0, n, bs)]


def _split_windows(batches: Sequence[torch.Tensor], k: int) -> list[list[torch.Tensor]]:
    return [list(batches[i : i + k]) for i in range(0, len(batches), k)]


@settings(max_examples=40)
@given(n_batches=st.integers(1, 11), k=st.integers(1, 5), bs=st.integers(1, 3))
def test_one_process_accumulation_equals_each_window_as_one_batch(
    n_batches: int, k: int, bs: int
) -> None:
    x, y = _data(n_batches * bs)
    batches = _chunks(n_batches * bs, bs)
    seen, params, states = _run(
        ONE, batches, x, y, GradState(accumulation_steps=k), epochs=2
    )
    expected_grads, expected_params, _ = _reference(
        _split_windows(batches, k) * 2, x, y
    )
    assert len(seen) == states[-1].optimizer_steps == 2 * math.ceil(n_batches / k)
    for got, want in zip(seen, expected_grads, strict=True):
        _close(got, want)
    _close(params, expected_params)


@pytest.mark.parametrize(("n", "bs", "k"), [(10, 3, 2), (11, 4, 4), (7, 2, 3)])
def test_one_process_ragged_last_micro_batch_gets_the_mean_of_micro_batch_losses(
    n: int, bs: int, k: int
) -> None:
    x, y = _data(n)
    batches = _chunks(n, bs)
    seen, params, _ = _run(ONE, batches, x, y, GradState(accumulation_steps=k))
    expected_grads, expected_params, _ = _reference(_split_windows(batches, k), x, y)
    for got, want in zip(seen, expected_grads, strict=True):
        _close(got, want)
    _close(params, expected_params)


def test_sync_with_dataloader_false_windows_span_epochs_exactly() -> None:
    x, y = _data(10)
    batches = _chunks(10, 1)
    grad = GradState(accumulation_steps=4, sync_with_dataloader=False)
    seen, params, states = _run(ONE, batches, x, y, grad, epochs=2)
    assert _windows(states) == [3, 7, 11, 15, 19]
    two_epochs = batches * 2  # window 3 is batches 8, 9 of epoch 0 and 0, 1 of epoch 1
    expected_grads, expected_params, _ = _reference(_split_windows(two_epochs, 4), x, y)
    for got, want in zip(seen, expected_grads, strict=True):
        _close(got, want)
    _close(params, expected_params)


def test_short_last_window_gets_the_full_gradient_of_its_one_batch() -> None:
    x, y = _data(3)
    batches = _chunks(3, 1)  # k=2: windows {0, 1} and the 1-batch tail {2}
    seen, _, states = _run(ONE, batches, x, y, GradState(accumulation_steps=2))
    assert _windows(states) == [1, 2]
    # Plain PyTorch: the model after the first update, then batch 2's own gradient.
    net = _net()
    opt = _sgd(net.parameters())
    torch.autograd.backward(mse_loss(net(x[:2]), y[:2]))
    opt.step()
    _close(seen[1], _grads_of(net, x[2:3], y[2:3]))
    half = [
        g / 2 for g in _grads_of(net, x[2:3], y[2:3])
    ]  # what Accelerate 1.15 applies
    assert not torch.allclose(seen[1][0], half[0])


def test_effective_loss_weights_of_the_spec_table() -> None:
    # Batch i's loss is w[i]: the gradient a step sees is each batch's weight.
    w = nn.Parameter(torch.zeros(10, dtype=F64))
    opt = torch.optim.SGD([w], lr=1.0)
    seen = _record_step_grads(opt, [w])
    grad = GradState(accumulation_steps=4)
    for i in range(10):
        _, grad = accumulate_step(
            ONE, grad, nn.Module(), opt, _pick(w, i), end_of_dataloader=i == 9
        )
    total = torch.stack([g[0] for g in seen]).sum(0)
    assert total.tolist() == [0.25] * 8 + [0.5] * 2
    assert len(seen) == 3


def _pick(w: torch.Tensor, i: int) -> Callable[[], torch.Tensor]:
    return lambda: w[i] * 1.0


def test_non_sync_micro_steps_never_step_or_zero() -> None:
    x, y = _data(2)
    net = _net()
    before = [_full(p) for p in net.parameters()]
    opt = _sgd(net.parameters())
    loss, grad = accumulate_step(
        ONE, GradState(accumulation_steps=3), net, opt, _loss_fn(net, x[:1], y[:1])
    )
    assert not grad.sync_gradients and grad.optimizer_steps == 0
    _close([_full(p) for p in net.parameters()], before)
    _close([_full(p.grad) for p in net.parameters() if p.grad is not None],
           [g / 3 for g in _grads_of(net, x[:1], y[:1])])  # fmt: skip
    assert not loss.requires_grad
    assert loss.item() == pytest.approx(mse_loss(_net()(x[:1]), y[:1]).item())
    _, grad = accumulate_step(
        ONE, grad, net, opt, _loss_fn(net, x[1:], y[1:]), end_of_dataloader=True
    )
    assert grad.sync_gradients and grad.optimizer_steps == 1
    assert all(p.grad is None for p in net.parameters())


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 67),
    dtype=st.sampled_from(
        [torch.float64, torch.float32, torch.bfloat16, torch.float16]
    ),
    shape=st.sampled_from([(), (1,), (1, 1)]),
    seed=st.integers(0, 2**16),
)
def test_micro_step_gradients_equal_backward_of_loss_over_k_bit_for_bit(
    k: int, dtype: torch.dtype, shape: tuple[int, ...], seed: int
) -> None:
    # accumulate_step seeds backward with 1/k instead of dividing the loss; the
    # gradients must be exactly those of the hand-written backward(loss / k).
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 3, generator=gen, dtype=dtype)
    y = torch.randn(5, 2, generator=gen, dtype=dtype)
    net, ref = _net(seed, dtype), _net(seed, dtype)

    def loss_of(model: nn.Module) -> torch.Tensor:
        return mse_loss(model(x), y).reshape(shape)

    grad = GradState(accumulation_steps=k + 1)  # never closes: grads stay visible
    for _ in range(min(k, 3)):
        _, grad = accumulate_step(
            ONE, grad, net, _sgd(net.parameters()), lambda: loss_of(net)
        )
        torch.autograd.backward(loss_of(ref) / (k + 1))
    for got, want in zip(net.parameters(), ref.parameters(), strict=True):
        assert got.grad is not None and want.grad is not None
        assert torch.equal(got.grad, want.grad)


def test_a_leaf_or_subclass_loss_gets_the_gradient_of_loss_over_k() -> None:
    # A loss that is a leaf (or a tensor subclass) takes the plain loss / k path;
    # the shared 1/k seed of the other losses must come out of it unchanged.
    w = nn.Parameter(torch.tensor(2.0, dtype=F64))
    opt = torch.optim.SGD([w], lr=0.0)
    leaf = torch.tensor(3.0, dtype=F64, requires_grad=True)
    grad = GradState(accumulation_steps=4)
    _, grad = accumulate_step(ONE, grad, nn.Module(), opt, lambda: w * 1.0)
    _, grad = accumulate_step(ONE, grad, nn.Module(), opt, lambda: leaf)
    assert leaf.grad is not None and leaf.grad.item() == 0.25
    leaf.grad.add_(1.0)  # the user changes the leaf's gradient in place
    _, grad = accumulate_step(ONE, grad, nn.Module(), opt, lambda: w * 1.0)
    assert w.grad is not None and w.grad.item() == 0.5


class _TripleGradInPlace(torch.autograd.Function):
    """Identity whose backward (against autograd's advice) changes its input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g.mul_(3.0)


def _scale_in_place(g: torch.Tensor) -> None:
    g.mul_(2.0)


def _hooked(mse: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    # The loss's hook gets the seed itself and changes it in place.
    mse.register_hook(_scale_in_place)  # type: ignore[no-untyped-call]
    return mse


def _behind_function(mse: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    # A node behind the loss changes the seed in place.
    out: torch.Tensor = _TripleGradInPlace.apply(mse)  # type: ignore[no-untyped-call]
    return out


def _aliased(mse: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    # extra.grad becomes a view of the seed, later accumulated into in place.
    return mse + extra.squeeze()


LOSS_SHAPES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "hook": _hooked,
    "function": _behind_function,
    "alias": _aliased,
}


def _same_grads(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> None:
    for got, want in zip(a, b, strict=True):
        assert (got.grad is None and want.grad is None) or (
            got.grad is not None
            and want.grad is not None
            and torch.equal(got.grad, want.grad)
        )


@pytest.mark.parametrize("shape", list(LOSS_SHAPES))
def test_the_seed_is_never_shared_with_hooks_nodes_or_gradients(shape: str) -> None:
    # Three micro-steps of a loss that changes or keeps the seed, and a short
    # window's rescale; then an ordinary loss: all equal to backward(loss / k).
    x, y = _data(4)
    nets = [_net(), _net()]
    extras = [nn.Parameter(torch.zeros(1, dtype=F64)) for _ in nets]
    opt = torch.optim.SGD([*nets[0].parameters(), extras[0]], lr=0.0)
    make = LOSS_SHAPES[shape]

    def loss_fn(i: int) -> Callable[[], torch.Tensor]:
        return lambda: make(mse_loss(nets[0](x[i : i + 1]), y[i : i + 1]), extras[0])

    grad = GradState(accumulation_steps=4)
    for i in range(3):
        end = i == 2  # a short window: its gradients are rescaled by 4/3 in place
        _, grad = accumulate_step(
            ONE, grad, nets[0], opt, loss_fn(i), end_of_dataloader=end
        )
        torch.autograd.backward(
            make(mse_loss(nets[1](x[i : i + 1]), y[i : i + 1]), extras[1]) / 4
        )
        if i == 1:  # compare before the window closes and zeroes the gradients
            _same_grads(
                [*nets[0].parameters(), extras[0]], [*nets[1].parameters(), extras[1]]
            )
    after, reference = _net(1), _net(1)
    _, _ = accumulate_step(
        ONE, GradState(accumulation_steps=4), after, _sgd(after.parameters()),
        _loss_fn(after, x[3:], y[3:]),
    )  # fmt: skip
    torch.autograd.backward(mse_loss(reference(x[3:]), y[3:]) / 4)
    _same_grads(list(after.parameters()), list(reference.parameters()))


def test_a_complex_loss_is_refused_as_backward_refuses_it() -> None:
    w = nn.Parameter(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(RuntimeError, match="real scalar outputs"):
        accumulate_step(
            ONE,
            GradState(accumulation_steps=2),
            nn.Module(),
            torch.optim.SGD([w], lr=0.1),
            lambda: (w * w).sum(),
        )


def test_custom_loop_from_the_public_pieces_matches_accumulate_step() -> None:
    x, y = _data(7)
    batches = _chunks(7, 1)
    seen, params, _ = _run(
        ONE, batches, x, y, GradState(accumulation_steps=3), max_grad_norm=0.3
    )
    net = _net()
    opt = _sgd(net.parameters())
    grad = GradState(accumulation_steps=3)
    for i, idx in enumerate(batches):
        last = i == len(batches) - 1
        syncs = should_sync(grad, end_of_dataloader=last)
        factor = window_grad_factor(grad, end_of_dataloader=last)
        with sync_ctx(ONE, grad, net, end_of_dataloader=last):
            torch.autograd.backward(
                mse_loss(net(x[idx]), y[idx]) / grad.accumulation_steps
            )
        if syncs:
            rescale_grads_(opt, factor)
            clip_grad_norm_(optimizer_parameters(opt), 0.3)
            optimizer_step(opt)
            opt.zero_grad(set_to_none=True)
        grad = advance_grad_state(grad, end_of_dataloader=last)
    _close([_full(p) for p in net.parameters()], params)


def test_max_grad_norm_clips_like_plain_pytorch() -> None:
    x, y = _data(6)
    batches = _chunks(6, 1)
    seen, params, _ = _run(
        ONE, batches, x, y, GradState(accumulation_steps=4), max_grad_norm=0.05
    )
    want_grads, want_params, _ = _reference(
        _split_windows(batches, 4), x, y, max_grad_norm=0.05
    )
    for got, want in zip(seen, want_grads, strict=True):
        _close(got, want)
        assert torch.cat([g.flatten() for g in got]).norm().item() == pytest.approx(
            0.05
        )
    _close(params, want_params)


def test_max_grad_norm_with_scaler_matches_a_plain_scaler_loop() -> None:
    ctx = dataclasses.replace(ONE, mixed_precision="fp16")
    x, y = _data(5, torch.float32)
    batches = _chunks(5, 1)
    k, clip = 2, 0.1
    net = _net(dtype=torch.float32)
    opt = _sgd(net.parameters())
    scaler = build_grad_scaler(ctx, GradScalerKwargs(init_scale=1024.0))
    grad = GradState(accumulation_steps=k)
    for i, idx in enumerate(batches):
        _, grad = accumulate_step(
            ctx, grad, net, opt, _loss_fn(net, x[idx], y[idx]),
            end_of_dataloader=i == 4, scaler=scaler, max_grad_norm=clip,
        )  # fmt: skip
    plain = _net(dtype=torch.float32)
    plain_opt = _sgd(plain.parameters())
    plain_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for window in _split_windows(batches, k):
        for idx in window:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = mse_loss(plain(x[idx]), y[idx])
            torch.autograd.backward(plain_scaler.scale(loss / len(window)))
        plain_scaler.unscale_(plain_opt)
        torch.nn.utils.clip_grad_norm_(plain.parameters(), clip)
        plain_scaler.step(plain_opt)
        plain_scaler.update()
        plain_opt.zero_grad()
    assert grad.optimizer_steps == 3
    _close(
        [_full(p) for p in net.parameters()],
        [_full(p) for p in plain.parameters()],
        1e-5,
    )
    assert scaler is not None and scaler.get_scale() == plain_scaler.get_scale()


def test_spec_scaler_example_ok_inf_ok() -> None:
    ctx = dataclasses.replace(ONE, mixed_precision="fp16")
    scaler = build_grad_scaler(ctx, GradScalerKwargs(init_scale=4))
    net = _net(dtype=torch.float32)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = _data(3, torch.float32)
    grad, skipped, changed, scales, dtypes = GradState(), [], [], [], []

    def loss_fn(i: int) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            out = net(x[i : i + 1])
            dtypes.append(out.dtype)
            loss = mse_loss(out, y[i : i + 1])
            return loss * float("inf") if i == 1 else loss

        return run

    for i in range(3):
        before = [_full(p) for p in net.parameters()]
        _, grad = accumulate_step(ctx, grad, net, opt, loss_fn(i), scaler=scaler)
        skipped.append(grad.step_was_skipped)
        changed.append(
            any(
                not torch.equal(a, _full(b))
                for a, b in zip(before, net.parameters(), strict=True)
            )
        )
        assert scaler is not None
        scales.append(scaler.get_scale())
    assert skipped == [False, True, False]
    assert changed == [True, False, True]
    assert scales == [4.0, 2.0, 2.0]
    assert grad.optimizer_steps == 2
    assert dtypes == [torch.float16] * 3


@pytest.mark.parametrize(
    ("mixed", "kwargs", "dtype"),
    [
        ("no", None, torch.float32),
        ("bf16", None, torch.bfloat16),
        ("bf16", AutocastKwargs(enabled=False), torch.float32),
        ("fp16", AutocastKwargs(enabled=False), torch.float32),
    ],
)
def test_loss_fn_runs_under_the_context_autocast(
    mixed: MixedPrecision, kwargs: AutocastKwargs | None, dtype: torch.dtype
) -> None:
    ctx = dataclasses.replace(ONE, mixed_precision=mixed)
    net = _net(dtype=torch.float32)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    dtypes = []

    def loss_fn() -> torch.Tensor:
        out: torch.Tensor = net(torch.ones(2, 3))
        dtypes.append(out.dtype)
        return out.float().pow(2).mean()

    accumulate_step(
        ctx,
        GradState(),
        net,
        opt,
        loss_fn,
        scaler=build_grad_scaler(ctx),
        autocast_kwargs=kwargs,
    )
    assert dtypes == [dtype]


def test_several_optimizers_and_models_step_together() -> None:
    x, y = _data(7)
    first, second = nn.Linear(3, 5).double(), nn.Linear(5, 2).double()
    ref_first, ref_second = copy.deepcopy(first), copy.deepcopy(second)
    opts = [
        _sgd(first.parameters()),
        torch.optim.SGD(second.parameters(), lr=0.1, momentum=0.9),
    ]
    ref_opt = _sgd([*ref_first.parameters(), *ref_second.parameters()])
    grad, ref_grad = GradState(accumulation_steps=3), GradState(accumulation_steps=3)
    for i in range(7):
        xb, yb = x[i : i + 1], y[i : i + 1]
        last = i == 6
        ours = _loss_fn(nn.Sequential(first, second), xb, yb)
        theirs = _loss_fn(nn.Sequential(ref_first, ref_second), xb, yb)
        _, grad = accumulate_step(
            ONE, grad, (first, second), opts, ours, end_of_dataloader=last
        )
        _, ref_grad = accumulate_step(
            ONE, ref_grad, ref_first, ref_opt, theirs, end_of_dataloader=last
        )
    assert grad == ref_grad and grad.optimizer_steps == 3
    _close(
        [*first.parameters(), *second.parameters()],
        [*ref_first.parameters(), *ref_second.parameters()],
    )


def test_several_optimizers_with_scaler_report_a_skip_of_any() -> None:
    ctx = dataclasses.replace(ONE, mixed_precision="fp16")
    scaler = build_grad_scaler(ctx, GradScalerKwargs(init_scale=8.0))
    a, b = nn.Linear(2, 2), nn.Linear(2, 1)
    opts = (
        torch.optim.SGD(a.parameters(), lr=0.1),
        torch.optim.SGD(b.parameters(), lr=0.1),
    )
    a_before, b_before = (
        [_full(p) for p in a.parameters()],
        [_full(p) for p in b.parameters()],
    )

    def loss_fn() -> torch.Tensor:
        out: torch.Tensor = b(a(torch.ones(1, 2)))
        return out.float().sum() + a.weight.sum() * float("inf")

    _, grad = accumulate_step(ctx, GradState(), [a, b], opts, loss_fn, scaler=scaler)
    assert grad.step_was_skipped and grad.optimizer_steps == 0
    _close([_full(p) for p in a.parameters()], a_before, 0.0)
    assert not torch.equal(_full(b.weight), b_before[0])
    assert scaler is not None and scaler.get_scale() == 4.0


def _no_grad_loss() -> torch.Tensor:
    return torch.tensor(1.0)


def test_accumulate_step_rejects_bad_input() -> None:
    net = _net()
    opt = _sgd(net.parameters())
    ok = _loss_fn(net, torch.ones(1, 3, dtype=F64), torch.ones(1, 2, dtype=F64))
    grad = GradState(accumulation_steps=2)
    cases: list[tuple[Callable[[], object], type[Exception], str]] = [
        (lambda: accumulate_step(ONE, grad, net, opt, lambda: 1.5), TypeError,  # type: ignore[arg-type, return-value]
         r"accumulate_step: loss_fn\(\)'s result must be .* torch.Tensor; got 1.5 \(float\)"),
        (lambda: accumulate_step(ONE, grad, net, opt, lambda: net(torch.ones(2, 3, dtype=F64))), ValueError,
         r"accumulate_step: loss_fn\(\)'s result must be a scalar loss; got tensor\(shape=\(2, 2\)"),
        (lambda: accumulate_step(ONE, grad, net, opt, _no_grad_loss), ValueError,
         r"accumulate_step: loss_fn\(\)'s result must be a loss that requires grad"),
        (lambda: accumulate_step(ONE, grad, net, opt, 3), TypeError,  # type: ignore[arg-type]
         r"accumulate_step: loss_fn must be a callable .*got 3 \(int\)"),
        (lambda: accumulate_step(ONE, grad, net, opt, ok, end_of_dataloader=1), TypeError,  # type: ignore[arg-type]
         r"accumulate_step: end_of_dataloader must be a bool; got 1 \(int\)\. Pass batch\.is_last\.$"),
        (lambda: accumulate_step(dataclasses.replace(ONE, mixed_precision="fp16"), grad, net, opt, ok), ValueError,
         r"accumulate_step: scaler must be a torch.amp.GradScaler when ctx.mixed_precision is 'fp16'; got None.*build_grad_scaler"),
        (lambda: accumulate_step(ONE, grad, net, opt, ok, scaler=1.0), TypeError,  # type: ignore[arg-type]
         r"accumulate_step: scaler must be a torch.amp.GradScaler or None; got 1.0"),
        (lambda: accumulate_step(ONE, grad, net, opt, ok, max_grad_norm=0), ValueError,
         r"accumulate_step: max_grad_norm must be > 0; got 0"),
        (lambda: accumulate_step(ONE, grad, net, opt, ok, max_grad_norm="1"), TypeError,  # type: ignore[arg-type]
         r"accumulate_step: max_grad_norm must be a number; got '1'"),
        (lambda: accumulate_step(ONE, {"micro_step": 0}, net, opt, ok), TypeError,  # type: ignore[arg-type]
         r"accumulate_step: grad must be a GradState; got \{'micro_step': 0\}"),
        (lambda: accumulate_step("ctx", grad, net, opt, ok), TypeError,  # type: ignore[arg-type]
         r"accumulate_step: ctx must be a DistributedContext; got 'ctx' \(str\)"),
        (lambda: accumulate_step(ONE, grad, [], opt, ok), ValueError,
         r"accumulate_step: model is an empty sequence"),
        (lambda: accumulate_step(ONE, grad, net, net, ok), TypeError,  # type: ignore[arg-type]
         r"accumulate_step: optimizer must be an Optimizer or a sequence of them; got Sequential"),
        (lambda: accumulate_step(TWO, grad, net, opt, ok), RuntimeError,
         r"accumulate_step: ctx has num_processes=2 but no default process group"),
    ]  # fmt: skip
    for call, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            call()
    assert all(p.grad is None for p in net.parameters())


# --- DDP and FSDP2 on real gloo processes ----------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One distributed run: ``steps`` micro-steps of ``bs`` samples on each rank."""

    wrap: str
    steps: int
    bs: int
    k: int
    sync_each_batch: bool = False
    max_grad_norm: float | None = None


def _counting_hook(
    state: list[int], bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    state.append(1)
    return default_hooks.allreduce_hook(
        dist.distributed_c10d._get_default_group(), bucket
    )


# DDP checks the hook's annotations at run time, and postponed annotations are
# strings here: give it the real objects.
_counting_hook.__annotations__.update(
    bucket=GradBucket, state=list, **{"return": torch.futures.Future[torch.Tensor]}
)


def _wrap(case: Case, net: nn.Sequential) -> tuple[nn.Module, list[int]]:
    calls: list[int] = []
    if case.wrap == "ddp":
        ddp = DistributedDataParallel(net)
        ddp.register_comm_hook(calls, _counting_hook)
        return ddp, calls
    fully_shard(net[0])
    fully_shard(net[2])
    fully_shard(net)
    return net, calls


def _run_case(ctx: DistributedContext, case: Case) -> dict[str, Any]:
    p, r = ctx.num_processes, ctx.process_index
    x, y = _data(case.steps * case.bs * p)
    model, calls = _wrap(case, _net())
    opt = _sgd(model.parameters())
    seen = _record_step_grads(opt, list(model.parameters()))
    grad = GradState(accumulation_steps=case.k, sync_each_batch=case.sync_each_batch)
    rows = []
    for j in range(case.steps):
        idx = torch.arange((j * p + r) * case.bs, (j * p + r + 1) * case.bs)
        before = len(calls)
        _, grad = accumulate_step(
            ctx, grad, model, opt, _loss_fn(model, x[idx], y[idx]),
            end_of_dataloader=j == case.steps - 1, max_grad_norm=case.max_grad_norm,
        )  # fmt: skip
        # The gradients left after the micro-step (DDP only; FSDP2 shards them).
        grads = (
            [_full(q.grad) for q in model.parameters() if q.grad is not None]
            if case.wrap == "ddp"
            else []
        )
        rows.append(
            {
                "synced": grad.sync_gradients,
                "allreduces": len(calls) - before,
                "grads": grads,
                "norm": grad.grad_norm,
            }
        )
    return {
        "rows": rows,
        "seen": seen,
        "params": [_full(q) for q in model.parameters()],
        "grad": grad,
    }


class _Boom(Exception):
    pass


def _restore_checks(ctx: DistributedContext) -> dict[str, Any]:
    """Enter the no-sync context, fail inside it, and look at the models after."""
    x = torch.ones(2, 3, dtype=F64)
    ddp = DistributedDataParallel(_net())
    fsdp = _net()
    fully_shard(fsdp)
    grad = GradState(accumulation_steps=2)
    out: dict[str, Any] = {}
    try:
        with sync_ctx(ctx, grad, [ddp, fsdp, nn.Linear(1, 1)]):
            out["ddp_inside"] = ddp.require_backward_grad_sync
            torch.autograd.backward(fsdp(x).sum())
            out["fsdp_grads_inside"] = [q.grad is None for q in fsdp.parameters()]
            raise _Boom
    except _Boom:
        pass
    out["ddp_after"] = ddp.require_backward_grad_sync
    with sync_ctx(
        ctx, GradState(accumulation_steps=2, micro_step=1, sync_gradients=False), ddp
    ):
        out["ddp_on_sync_step"] = ddp.require_backward_grad_sync
    torch.autograd.backward(
        fsdp(x).sum()
    )  # sync is on again: both backward passes are reduced
    out["fsdp_grads_after"] = [
        _full(q.grad) for q in fsdp.parameters() if q.grad is not None
    ]
    out["fsdp_norm"] = clip_grad_norm_(list(fsdp.parameters()), 0.5)
    out["fsdp_clipped"] = [
        _full(q.grad) for q in fsdp.parameters() if q.grad is not None
    ]
    return out


def _scenarios(ctx: DistributedContext, cases: list[Case]) -> dict[str, Any]:
    return {
        "cases": [_run_case(ctx, case) for case in cases],
        "restore": _restore_checks(ctx),
    }


CASES: dict[int, list[Case]] = {
    2: [
        Case("ddp", steps=5, bs=1, k=2),  # n=10, bs=1, k=2 in docs/accumulate.md
        Case("ddp", steps=7, bs=1, k=3),
        Case("ddp", steps=5, bs=2, k=3),
        Case("ddp", steps=7, bs=1, k=3, sync_each_batch=True),
        Case("ddp", steps=7, bs=1, k=3, max_grad_norm=0.05),
        Case("fsdp", steps=7, bs=1, k=3),
        Case("fsdp", steps=5, bs=2, k=3, max_grad_norm=0.05),
    ],
    3: [Case("ddp", steps=5, bs=1, k=2), Case("fsdp", steps=4, bs=1, k=3)],
}


@pytest.fixture(scope="module", params=[2, 3])
def distributed(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    world: int = request.param
    return world, run_ranks(_scenarios, world, CASES[world], start_method="forkserver")


def _global_windows(case: Case, world: int) -> list[list[torch.Tensor]]:
    """Each window as one batch of the global samples its micro-steps cover."""
    size = case.bs * world
    bounds = [*range(0, case.steps, case.k), case.steps]
    return [
        [torch.arange(a * size, b * size)]
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]


@pytest.mark.distributed
def test_distributed_accumulation_equals_one_process_on_global_windows(
    distributed: tuple[int, list[dict[str, Any]]],
) -> None:
    world, ranks = distributed
    for n_case, case in enumerate(CASES[world]):
        x, y = _data(case.steps * case.bs * world)
        want_grads, want_params, _ = _reference(
            _global_windows(case, world), x, y, max_grad_norm=case.max_grad_norm
        )
        for rank in ranks:
            result = rank["cases"][n_case]
            assert (
                result["grad"].optimizer_steps
                == len(want_grads)
                == math.ceil(case.steps / case.k)
            )
            for got, want in zip(result["seen"], want_grads, strict=True):
                _close(got, want, 1e-10)
            _close(result["params"], want_params, 1e-10)


@pytest.mark.distributed
def test_grad_norm_is_the_global_pre_clip_norm_on_every_rank(
    distributed: tuple[int, list[dict[str, Any]]],
) -> None:
    # GradState.grad_norm after a syncing micro-step: the norm of the whole
    # window's mean gradient before clipping (DDP's all-reduced gradient; FSDP2's
    # shards made whole), bit for bit the same on every rank; None elsewhere.
    world, ranks = distributed
    clipped = []
    for n_case, case in enumerate(CASES[world]):
        rows = [rank["cases"][n_case]["rows"] for rank in ranks]
        if case.max_grad_norm is None:
            assert all(row["norm"] is None for rank in rows for row in rank)
            continue
        clipped.append(case.wrap)
        x, y = _data(case.steps * case.bs * world)
        windows = _global_windows(case, world)
        _, _, starts = _reference(windows, x, y, max_grad_norm=case.max_grad_norm)
        want = [
            torch.cat([g.flatten() for g in _grads_of(start, x[w[0]], y[w[0]])]).norm()
            for start, w in zip(starts, windows, strict=True)
        ]
        first = [row["norm"] for row in rows[0] if row["synced"]]
        _close(first, want, 1e-10)
        assert want[0] > case.max_grad_norm  # the norm before clipping
        for rank in rows:
            assert all(row["norm"] is None for row in rank if not row["synced"])
            norms = [row["norm"] for row in rank if row["synced"]]
            assert all(torch.equal(a, b) for a, b in zip(norms, first, strict=True))
    assert world != 2 or sorted(clipped) == ["ddp", "fsdp"]


def _want_synced(case: Case) -> list[bool]:
    """Whether each micro-step must sync: the k-th of its window, or the last."""
    return [(j + 1) % case.k == 0 or j == case.steps - 1 for j in range(case.steps)]


@pytest.mark.distributed
def test_ddp_all_reduces_only_on_sync_micro_steps(
    distributed: tuple[int, list[dict[str, Any]]],
) -> None:
    world, ranks = distributed
    ddp_cases = [(n, case) for n, case in enumerate(CASES[world]) if case.wrap == "ddp"]
    assert ddp_cases
    for n_case, case in ddp_cases:
        want = _want_synced(case)
        assert sum(want) == math.ceil(case.steps / case.k) and not all(want)
        for rank in ranks:
            rows = rank["cases"][n_case]["rows"]
            assert [row["synced"] for row in rows] == want
            for synced, row in zip(want, rows, strict=True):
                if synced or case.sync_each_batch:
                    assert row["allreduces"] >= 1
                else:
                    assert row["allreduces"] == 0


def _clipped(grads: list[torch.Tensor], max_norm: float | None) -> list[torch.Tensor]:
    """``grads`` as ``clip_grad_norm_(..., max_norm)`` leaves them."""
    if max_norm is None:
        return grads
    total = torch.cat([g.flatten() for g in grads]).norm()
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return [g * factor for g in grads]


@pytest.mark.distributed
def test_ddp_gradients_are_local_between_syncs_and_all_reduced_on_sync(
    distributed: tuple[int, list[dict[str, Any]]],
) -> None:
    # docs/accumulate.md, 'Semantics: gradient accumulation', two ranks, n=10, bs=1,
    # k=2: after micro-step 1 of a window rank 0 holds g(0)/2 and rank 1 g(1)/2
    # (then g(4)/2, g(5)/2); after micro-step 2 both step with
    # (g(0)+g(2)+g(1)+g(3))/4. Generally: between syncs each rank holds its own sum
    # / k so far; a sync step steps with the mean of those over ranks (times k / m
    # for a short last window of m), then clears the gradients.
    world, ranks = distributed
    checked = []
    for n_case, case in enumerate(CASES[world]):
        if case.wrap != "ddp" or case.sync_each_batch:
            continue
        checked.append(case)
        x, y = _data(case.steps * case.bs * world)
        windows = _global_windows(case, world)
        _, _, starts = _reference(windows, x, y, max_grad_norm=case.max_grad_norm)
        want_synced = _want_synced(case)
        sync_steps = [j for j, synced in enumerate(want_synced) if synced]
        assert not all(want_synced)  # every case has micro-steps that must not sync
        # own[r][j]: rank r's own gradient sum / k after micro-step j of its window.
        own: list[list[list[torch.Tensor]]] = []
        for r in range(world):
            acc: list[torch.Tensor] = []
            own.append([])
            for j in range(case.steps):
                idx = torch.arange(
                    (j * world + r) * case.bs, (j * world + r + 1) * case.bs
                )
                g = _grads_of(starts[j // case.k], x[idx], y[idx])
                if j % case.k == 0:
                    acc = [0.0 * gi for gi in g]
                acc = [a + b / case.k for a, b in zip(acc, g, strict=True)]
                own[r].append(acc)
        for r, rank in enumerate(ranks):
            result = rank["cases"][n_case]
            rows = result["rows"]
            assert [row["synced"] for row in rows] == want_synced
            for j, row in enumerate(rows):
                if want_synced[j]:
                    assert row["grads"] == []  # zero_grad(set_to_none=True)
                else:
                    _close(row["grads"], own[r][j], 1e-12)
            assert len(result["seen"]) == len(sync_steps)
            for seen, j in zip(result["seen"], sync_steps, strict=True):
                m = j % case.k + 1
                mean = [
                    sum(gs, torch.zeros_like(gs[0])) / world * (case.k / m)
                    for gs in zip(*(own[q][j] for q in range(world)), strict=True)
                ]
                _close(seen, _clipped(mean, case.max_grad_norm), 1e-10)
        if world == 2 and case == Case("ddp", steps=5, bs=1, k=2):
            g0 = _grads_of(starts[0], x[0:1], y[0:1])
            g1 = _grads_of(starts[0], x[1:2], y[1:2])
            _close(ranks[0]["cases"][n_case]["rows"][0]["grads"], [g / 2 for g in g0])
            _close(ranks[1]["cases"][n_case]["rows"][0]["grads"], [g / 2 for g in g1])
            both = [
                sum(gs) / 4
                for gs in zip(
                    *(
                        _grads_of(starts[0], x[i : i + 1], y[i : i + 1])
                        for i in range(4)
                    ),
                    strict=True,
                )
            ]
            _close(ranks[0]["cases"][n_case]["seen"][0], both)
            _close(ranks[1]["cases"][n_case]["seen"][0], both)
    assert checked and (world != 2 or Case("ddp", steps=5, bs=1, k=2) in checked)


@pytest.mark.distributed
def test_no_sync_contexts_are_restored_also_on_error(
    distributed: tuple[int, list[dict[str, Any]]],
) -> None:
    world, ranks = distributed
    net = _net()
    x = torch.ones(2, 3, dtype=F64)
    expected = [
        2 * g for g in torch.autograd.grad(net(x).sum(), list(net.parameters()))
    ]
    for rank in ranks:
        out = rank["restore"]
        assert out["ddp_inside"] is False and out["ddp_after"] is True
        assert out["ddp_on_sync_step"] is True
        assert out["fsdp_grads_inside"] == [True] * 4
        _close(out["fsdp_grads_after"], expected, 1e-12)
        # clip_grad_norm_ on sharded gradients: the global norm, a plain tensor.
        norm = torch.cat([g.flatten() for g in expected]).norm()
        assert type(out["fsdp_norm"]) is torch.Tensor
        _close([out["fsdp_norm"]], [norm], 1e-12)
        _close(out["fsdp_clipped"], [g * 0.5 / (norm + 1e-6) for g in expected], 1e-12)


def test_a_static_graph_ddp_is_refused_where_sync_would_be_skipped(
    tmp_path: Path,
) -> None:
    # torch's DDP with static_graph=True fails inside no_sync(); funcaccel says why
    # before entering it. (A one-rank group stands in for the world of two that
    # the hand-built context describes: only no_sync's entry is exercised.)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rdv", world_size=1, rank=0
    )
    try:
        ddp = DistributedDataParallel(_net(), static_graph=True)
        two = rank_ctx(2, 0)
        x, y = _data(1)
        with pytest.raises(
            ValueError,
            match=r"accumulate_step: the model's DDP static_graph must be False",
        ):
            accumulate_step(
                two,
                GradState(accumulation_steps=2),
                ddp,
                _sgd(ddp.parameters()),
                _loss_fn(ddp, x, y),
            )
        with pytest.raises(ValueError, match=r"sync_ctx: .*sync_each_batch=True"):
            with sync_ctx(two, GradState(accumulation_steps=2), [ddp, nn.Linear(1, 1)]):
                pass
        # One no-sync context behind all three: the same refusal, word for word.
        with pytest.raises(ValueError) as from_no_sync:
            with no_sync(two, ddp):
                pass
        with pytest.raises(ValueError) as from_sync_ctx:
            with sync_ctx(two, GradState(accumulation_steps=2), ddp):
                pass
        assert str(from_no_sync.value).removeprefix("no_sync") == str(
            from_sync_ctx.value
        ).removeprefix("sync_ctx")
        # All-reducing every micro-step is what static_graph allows.
        _, grad = accumulate_step(
            two,
            GradState(accumulation_steps=2, sync_each_batch=True),
            ddp,
            _sgd(ddp.parameters()),
            _loss_fn(ddp, x, y),
        )
        assert grad.micro_step == 1
        del ddp
    finally:
        dist.destroy_process_group()
