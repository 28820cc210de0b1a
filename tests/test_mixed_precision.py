"""autocast_ctx, build_grad_scaler and the scaler-aware step helpers (one process, CPU)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from funcaccel._checks import as_tuple_of
from funcaccel.context import DistributedContext
from funcaccel.kwargs import AutocastKwargs
from funcaccel.kwargs import GradScalerKwargs
from funcaccel.mixed_precision import autocast_ctx
from funcaccel.mixed_precision import autocast_dtype
from funcaccel.mixed_precision import build_grad_scaler
from funcaccel.mixed_precision import clip_grad_norm_
from funcaccel.mixed_precision import optimizer_parameters
from funcaccel.mixed_precision import optimizer_step
from funcaccel.mixed_precision import rescale_grads_
from funcaccel.mixed_precision import unscale_grads_

NO = DistributedContext()
FP16 = dataclasses.replace(NO, mixed_precision="fp16")
BF16 = dataclasses.replace(NO, mixed_precision="bf16")


def _matmul_dtype() -> torch.dtype:
    return (torch.ones(2, 2) @ torch.ones(2, 2)).dtype


# --- autocast_ctx -------------------------------------------------------------


@pytest.mark.parametrize(
    ("ctx", "expected"),
    [(NO, torch.float32), (FP16, torch.float16), (BF16, torch.bfloat16)],
)
def test_autocast_ctx_casts_to_the_context_dtype(
    ctx: DistributedContext, expected: torch.dtype
) -> None:
    with autocast_ctx(ctx):
        assert _matmul_dtype() == expected
    assert _matmul_dtype() == torch.float32
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("ctx", [FP16, BF16])
def test_autocast_ctx_nested_disabled_gives_float32(ctx: DistributedContext) -> None:
    with autocast_ctx(ctx):
        with autocast_ctx(ctx, AutocastKwargs(enabled=False)):
            assert _matmul_dtype() == torch.float32
        assert _matmul_dtype() != torch.float32


def test_autocast_ctx_no_ignores_kwargs() -> None:
    with autocast_ctx(NO, AutocastKwargs(enabled=True, cache_enabled=False)):
        assert not torch.is_autocast_enabled("cpu")
        assert _matmul_dtype() == torch.float32


@pytest.mark.parametrize("cache_enabled", [True, False])
def test_autocast_ctx_forwards_cache_enabled(cache_enabled: bool) -> None:
    with autocast_ctx(BF16, AutocastKwargs(cache_enabled=cache_enabled)):
        assert torch.is_autocast_cache_enabled() is cache_enabled


def test_autocast_ctx_returns_a_fresh_unentered_context() -> None:
    manager = autocast_ctx(BF16)
    assert _matmul_dtype() == torch.float32
    with manager:
        assert _matmul_dtype() == torch.bfloat16


def test_autocast_ctx_rejects_bad_arguments() -> None:
    with pytest.raises(
        TypeError, match=r"autocast_ctx: ctx must be a Distributed.*got 'bf16' \(str\)"
    ):
        autocast_ctx("bf16")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"autocast_ctx: kwargs must be an AutocastKwargs.*got \{"
    ):
        autocast_ctx(BF16, {"enabled": False})  # type: ignore[arg-type]


def test_autocast_dtype_table_and_error() -> None:
    assert [autocast_dtype(m) for m in ("no", "fp16", "bf16")] == [
        None,
        torch.float16,
        torch.bfloat16,
    ]
    with pytest.raises(ValueError, match=r"autocast_dtype: .*got 'fp8'"):
        autocast_dtype("fp8")  # type: ignore[arg-type]


# --- build_grad_scaler ---------------------------------------------------------


def test_build_grad_scaler_fp16_on_cpu_uses_the_kwargs() -> None:
    kwargs = GradScalerKwargs(
        init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7
    )
    scaler = build_grad_scaler(FP16, kwargs)
    assert isinstance(scaler, torch.amp.GradScaler)
    assert scaler.is_enabled()
    assert scaler._device == "cpu"
    assert scaler.get_scale() == 8.0
    assert scaler.get_growth_factor() == 4.0
    assert scaler.get_backoff_factor() == 0.25
    assert scaler.get_growth_interval() == 7


def test_build_grad_scaler_defaults_and_disabled() -> None:
    scaler = build_grad_scaler(FP16)
    assert scaler is not None and scaler.get_scale() == 65536.0
    disabled = build_grad_scaler(FP16, GradScalerKwargs(enabled=False))
    assert disabled is not None and not disabled.is_enabled()


@pytest.mark.parametrize("ctx", [NO, BF16])
def test_build_grad_scaler_is_none_without_fp16(ctx: DistributedContext) -> None:
    assert build_grad_scaler(ctx, GradScalerKwargs(init_scale=2.0)) is None


def test_build_grad_scaler_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"build_grad_scaler: ctx must be"):
        build_grad_scaler(None)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"build_grad_scaler: kwargs must be a GradScalerKwargs"
    ):
        build_grad_scaler(FP16, AutocastKwargs())  # type: ignore[arg-type]


# --- unscale / clip / step -----------------------------------------------------


def _param(values: list[float], grad: list[float]) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.tensor(values))
    param.grad = torch.tensor(grad)
    return param


def test_unscale_grads_unscales_once_per_step() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.5)
    torch.autograd.backward(scaler.scale((w * torch.tensor([1.0, 2.0])).sum()))
    assert w.grad is not None and w.grad.tolist() == [4.0, 8.0]
    assert unscale_grads_(scaler, opt) == 1
    assert unscale_grads_(scaler, [opt]) == 0
    assert w.grad.tolist() == [1.0, 2.0]
    optimizer_step(opt, scaler=scaler)
    assert w.tolist() == [0.5, 0.0]
    # After update() the next step unscales again.
    opt.zero_grad()
    torch.autograd.backward(scaler.scale(w.sum()))
    assert unscale_grads_(scaler, opt) == 1


def test_unscale_grads_after_step_keeps_torchs_error() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.5)
    torch.autograd.backward(scaler.scale(w.sum()))
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        unscale_grads_(scaler, opt)


def test_unscale_grads_with_disabled_scaler_does_nothing() -> None:
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    w = _param([1.0], [3.0])
    assert unscale_grads_(scaler, torch.optim.SGD([w], lr=1.0)) == 0
    assert w.grad is not None and w.grad.tolist() == [3.0]


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_grad_norm_matches_torch(norm_type: float, max_norm: float) -> None:
    ours = [_param([0.0, 0.0], [3.0, -4.0]), _param([0.0], [12.0])]
    theirs = [_param([0.0, 0.0], [3.0, -4.0]), _param([0.0], [12.0])]
    norm = clip_grad_norm_(ours, max_norm, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type=norm_type)
    torch.testing.assert_close(norm, expected)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_clip_grad_norm_with_scaler_unscales_first_and_only_once() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=1.0)
    torch.autograd.backward(scaler.scale((w * torch.tensor([3.0, 4.0])).sum()))
    norm = clip_grad_norm_([w], 1.0, scaler=scaler, optimizer=opt)
    assert norm.item() == pytest.approx(5.0)
    # A second clip (say, of another parameter subset) must not unscale again.
    again = clip_grad_norm_([w], 1.0, scaler=scaler, optimizer=[opt])
    assert again.item() == pytest.approx(1.0)
    assert optimizer_step(opt, scaler=scaler) is False
    torch.testing.assert_close(w.detach(), torch.tensor([-0.6, -0.8]))


def test_clip_grad_norm_rejects_bad_arguments() -> None:
    w = _param([0.0], [1.0])
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(
        ValueError,
        match=r"clip_grad_norm_: optimizer must be the optimizer\(s\) owning the "
        r"parameters when a scaler is given; got None\. Their gradients are unscaled",
    ):
        clip_grad_norm_([w], 1.0, scaler=scaler)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(
            ValueError, match=r"clip_grad_norm_: max_norm must be > 0; got"
        ):
            clip_grad_norm_([w], bad)
    with pytest.raises(
        TypeError, match=r"clip_grad_norm_: max_norm must be a number; got '1'"
    ):
        clip_grad_norm_([w], "1")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"clip_grad_norm_: max_norm must be a number; got True"
    ):
        clip_grad_norm_([w], True)
    # Any real number will do, numpy's included.
    assert clip_grad_norm_([w], np.float32(0.5)).item() == pytest.approx(1.0)  # type: ignore[arg-type]
    assert w.grad is not None and w.grad.item() == pytest.approx(0.5)
    with pytest.raises(
        ValueError, match=r"clip_grad_norm_: norm_type must be > 0; got -2"
    ):
        clip_grad_norm_([w], 1.0, norm_type=-2)
    with pytest.raises(
        TypeError, match=r"clip_grad_norm_: scaler must be a torch.amp.GradScaler"
    ):
        clip_grad_norm_([w], 1.0, scaler=object(), optimizer=None)  # type: ignore[arg-type]


def _inf_step(scaler: torch.amp.GradScaler, *params: torch.Tensor) -> None:
    loss = sum((p * float("inf")).sum() for p in params)
    assert isinstance(loss, torch.Tensor)
    torch.autograd.backward(scaler.scale(loss))


def test_optimizer_step_without_scaler_steps_every_optimizer() -> None:
    a, b = _param([1.0], [1.0]), _param([1.0], [2.0])
    opts = [torch.optim.SGD([a], lr=1.0), torch.optim.SGD([b], lr=0.5)]
    assert optimizer_step(opts) is False
    assert a.tolist() == [0.0] and b.tolist() == [0.0]


def test_optimizer_step_reports_a_scaler_skip_and_halves_the_scale() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    _inf_step(scaler, w)
    assert optimizer_step(opt, scaler=scaler) is True
    assert w.tolist() == [1.0, 1.0]
    assert scaler.get_scale() == 2.0
    opt.zero_grad()
    torch.autograd.backward(scaler.scale(w.sum()))
    assert optimizer_step(opt, scaler=scaler) is False
    torch.testing.assert_close(w.detach(), torch.tensor([0.9, 0.9]))


def test_optimizer_step_detects_a_skip_when_the_scale_cannot_shrink() -> None:
    # The scale underflows to 0; a later overflow then leaves it at 0, so
    # comparing scales would miss the skip. The scaler's inf record does not.
    scaler = torch.amp.GradScaler("cpu", init_scale=1.4e-45)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    _inf_step(scaler, w)
    assert optimizer_step(opt, scaler=scaler) is True
    assert scaler.get_scale() == 0.0
    opt.zero_grad()
    _inf_step(scaler, w)
    assert optimizer_step(opt, scaler=scaler) is True
    assert scaler.get_scale() == 0.0
    assert w.tolist() == [1.0, 1.0]


def test_optimizer_step_with_several_optimizers_skips_only_the_overflowing_one() -> (
    None
):
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    opts = (torch.optim.SGD([a], lr=0.5), torch.optim.SGD([b], lr=0.5))
    torch.autograd.backward(scaler.scale((a * float("inf")).sum() + b.sum()))
    assert optimizer_step(opts, scaler=scaler) is True
    assert a.tolist() == [1.0]  # skipped by torch for this optimizer only
    assert b.tolist() == [0.5]
    assert scaler.get_scale() == 2.0


def test_optimizer_step_detects_a_skip_of_a_fused_optimizer() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([w], lr=0.1, fused=True)
    _inf_step(scaler, w)
    assert optimizer_step(opt, scaler=scaler) is True
    assert w.tolist() == [1.0, 1.0]
    opt.zero_grad()
    torch.autograd.backward(scaler.scale(w.sum()))
    assert optimizer_step(opt, scaler=scaler) is False
    assert w.tolist() != [1.0, 1.0]


def test_optimizer_step_with_disabled_scaler_always_steps() -> None:
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    w = _param([1.0], [2.0])
    assert optimizer_step(torch.optim.SGD([w], lr=1.0), scaler=scaler) is False
    assert w.tolist() == [-1.0]


def test_optimizer_step_rejects_bad_arguments() -> None:
    w = _param([1.0], [2.0])
    with pytest.raises(
        TypeError, match=r"optimizer_step: optimizer must be an Optimizer or a sequence"
    ):
        optimizer_step(w)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"optimizer_step: optimizer is an empty sequence"
    ):
        optimizer_step([])
    with pytest.raises(TypeError, match=r"optimizer_step: scaler must be"):
        optimizer_step(torch.optim.SGD([w], lr=1.0), scaler="no")  # type: ignore[arg-type]


def test_rescale_grads_and_optimizer_parameters() -> None:
    a, b, shared = _param([0.0], [1.0]), _param([0.0], [2.0]), _param([0.0], [3.0])
    no_grad = torch.nn.Parameter(torch.zeros(1))
    opts = [
        torch.optim.SGD([a, shared], lr=1.0),
        torch.optim.SGD([{"params": [b]}, {"params": [shared, no_grad]}], lr=1.0),
    ]
    params = optimizer_parameters(opts)
    assert [id(p) for p in params] == [id(a), id(shared), id(b), id(no_grad)]
    assert rescale_grads_(opts, 0.5) == 3  # shared once, no_grad skipped
    grads = [p.grad.tolist() for p in (a, b, shared) if p.grad is not None]
    assert grads == [[0.5], [1.0], [1.5]]


def test_as_tuple_of_accepts_one_or_many_and_names_bad_items() -> None:
    assert as_tuple_of((1, 2), int, caller="f", name="x") == (1, 2)
    with pytest.raises(
        TypeError, match=r"f: every item of x must be an int; got 'a' \(str\)"
    ):
        as_tuple_of([1, "a"], int, caller="f", name="x")  # type: ignore[list-item]
    with pytest.raises(
        TypeError, match=r"f: x must be an int or a sequence of them; got 'ab'"
    ):
        as_tuple_of("ab", int, caller="f", name="x")
