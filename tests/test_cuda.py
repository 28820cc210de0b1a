"""Mixed precision, the grad scaler and the profiler on a CUDA device.

Skipped without CUDA. Each check compares funcaccel with the same loop written in
plain PyTorch on the same device (fp16 with ``GradScaler``, bf16 autocast), or
reads what the profiler recorded on the GPU. The checks of pinned-memory loading,
CUDA checkpoints, CUDA contexts and ``wrap_model`` on CUDA live with their modules.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.functional import mse_loss

from funcaccel._typing import MixedPrecision
from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.context import DistributedContext
from funcaccel.kwargs import GradScalerKwargs
from funcaccel.kwargs import ProfileKwargs
from funcaccel.mixed_precision import autocast_ctx
from funcaccel.mixed_precision import build_grad_scaler
from funcaccel.profiler import build_profiler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

K = 2  # accumulation steps
STEPS = 6  # micro-batches; the 4th has an infinite loss (a scaler skip under fp16)


def _cuda_ctx(precision: MixedPrecision) -> DistributedContext:
    return DistributedContext(device=torch.device("cuda", 0), mixed_precision=precision)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).cuda()


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(4, 8, generator=gen).cuda(),
            torch.randn(4, 1, generator=gen).cuda(),
        )
        for _ in range(STEPS)
    ]


def _loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor, i: int) -> torch.Tensor:
    loss = mse_loss(net(x), y)
    return loss * float("inf") if i == 3 else loss


def _plain(precision: MixedPrecision) -> tuple[nn.Module, list[float]]:
    """The loop in plain PyTorch: autocast, GradScaler by hand, step every K."""
    net, dtype = _net(), torch.float16 if precision == "fp16" else torch.bfloat16
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda", init_scale=4.0, enabled=precision == "fp16")
    scales = []
    for i, (x, y) in enumerate(_data()):
        with torch.autocast("cuda", dtype=dtype):
            loss = _loss(net, x, y, i)
        torch.autograd.backward(scaler.scale(loss / K))
        if (i + 1) % K == 0:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            scales.append(scaler.get_scale() if precision == "fp16" else 1.0)
    return net, scales


def _ours(precision: MixedPrecision) -> tuple[nn.Module, list[GradState], list[float]]:
    ctx, net = _cuda_ctx(precision), _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = build_grad_scaler(ctx, GradScalerKwargs(init_scale=4.0))
    grad, states, scales = GradState(accumulation_steps=K), [], []

    def loss_fn(x: torch.Tensor, y: torch.Tensor, i: int) -> Callable[[], torch.Tensor]:
        return lambda: _loss(net, x, y, i)

    for i, (x, y) in enumerate(_data()):
        _, grad = accumulate_step(ctx, grad, net, opt, loss_fn(x, y, i), scaler=scaler)
        if grad.sync_gradients:
            states.append(grad)
            scales.append(scaler.get_scale() if scaler is not None else 1.0)
    return net, states, scales


def test_fp16_with_grad_scaler_matches_plain_pytorch_and_reports_the_skip() -> None:
    want, want_scales = _plain("fp16")
    got, states, scales = _ours("fp16")
    assert [s.step_was_skipped for s in states] == [False, True, False]
    assert states[-1].optimizer_steps == 2
    assert scales == want_scales == [4.0, 2.0, 2.0]
    for a, b in zip(got.parameters(), want.parameters(), strict=True):
        assert a.device.type == "cuda"
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _loss_fn(
    net: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> Callable[[], torch.Tensor]:
    return lambda: mse_loss(net(x), y)


def test_bf16_autocast_matches_plain_pytorch() -> None:
    # An infinite loss under bf16 (no scaler) makes every parameter non-finite in
    # both loops alike, so use the first three micro-batches only: they sync once.
    ctx = _cuda_ctx("bf16")
    with autocast_ctx(ctx):
        out = _net()(torch.ones(2, 8, device="cuda"))
    assert out.dtype == torch.bfloat16
    want, got = _net(), _net()
    opt_want = torch.optim.SGD(want.parameters(), lr=0.1)
    opt_got = torch.optim.SGD(got.parameters(), lr=0.1)
    grad = GradState(accumulation_steps=K)
    for i, (x, y) in enumerate(_data()[:3]):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = mse_loss(want(x), y)
        torch.autograd.backward(loss / K)
        if (i + 1) % K == 0:
            opt_want.step()
            opt_want.zero_grad(set_to_none=True)
        _, grad = accumulate_step(ctx, grad, got, opt_got, _loss_fn(got, x, y))
    assert grad.optimizer_steps == 1 and grad.micro_step == 1
    for a, b in zip(got.parameters(), want.parameters(), strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_profiler_records_gpu_kernels(tmp_path: Path) -> None:
    ctx = _cuda_ctx("no")
    with build_profiler(ctx, ProfileKwargs(output_trace_dir=tmp_path)):
        x = torch.ones(64, 64, device="cuda")
        (x @ x).sum().item()
    trace = json.loads((tmp_path / "profile_0.json").read_text())
    categories = {str(event.get("cat", "")).lower() for event in trace["traceEvents"]}
    assert "kernel" in categories
