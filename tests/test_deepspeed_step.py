"""The fp16 seams of accumulate_step's DeepSpeed path, on a stand-in engine.

DeepSpeed's fp16 needs a GPU (or a CPU with fp16 kernels, which this one lacks),
so these checks drive ``deepspeed_step`` with an object that behaves like the
engine and its ZeRO optimizer where funcaccel touches them: the loss scale that
carries a short window's correction, the dynamic scaler halving it on an
overflow, and the overflow flag that becomes ``GradState.step_was_skipped``.
Runs without DeepSpeed installed.
"""

from __future__ import annotations

import pytest
import torch

from funcaccel import GradState
from funcaccel._deepspeed_step import deepspeed_step
from funcaccel.context import DistributedContext

K = 3


class _Zero:
    """The attributes of a ZeRO optimizer that funcaccel reads and writes."""

    def __init__(self, loss_scale: float) -> None:
        self.loss_scale = loss_scale
        self.clip_grad = 0.0
        self.overflow = False


class _Engine:
    """Records what each step saw; overflows (halving the scale) when told to."""

    def __init__(
        self, loss_scale: float, overflow_on_step: bool, clipping: float = 0.0
    ) -> None:
        self.optimizer = _Zero(loss_scale)
        self.clipping = clipping
        self.basic_optimizer = object()
        self.overflow_on_step = overflow_on_step
        self.boundaries: list[bool] = []
        self.scales_seen: list[float] = []
        self.norm: float | None = None

    def gradient_clipping(self) -> float:
        return self.clipping

    def gradient_accumulation_steps(self) -> int:
        return K

    def get_global_grad_norm(self) -> float | None:
        return self.norm

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        self.boundaries.append(boundary)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        torch.autograd.backward(loss)

    def step(self) -> None:
        if not self.boundaries[-1]:
            return
        self.scales_seen.append(self.optimizer.loss_scale)
        # ZeRO's scaled norm over its loss scale; a stand-in value per step.
        self.norm = 5.0 / self.optimizer.loss_scale
        self.optimizer.overflow = self.overflow_on_step
        if self.overflow_on_step:
            self.optimizer.loss_scale /= 2


def _run(
    engine: _Engine, micro_steps: int, max_grad_norm: float | None = None
) -> GradState:
    weight = torch.ones(2, requires_grad=True)
    grad = GradState(accumulation_steps=K)
    for step in range(micro_steps):
        _, grad = deepspeed_step(
            DistributedContext(),
            grad,
            engine,
            engine.optimizer,
            lambda: (weight * 2.0).sum(),
            end_of_dataloader=step == micro_steps - 1,
            scaler=None,
            max_grad_norm=max_grad_norm,
            autocast_kwargs=None,
            num_items=None,
        )
    return grad


@pytest.mark.parametrize("overflow", [False, True])
def test_a_full_window_leaves_the_loss_scale_to_the_engine(overflow: bool) -> None:
    engine = _Engine(1024.0, overflow)
    grad = _run(engine, K)
    assert engine.boundaries == [False, False, True]
    assert engine.scales_seen == [1024.0]  # no correction on a full window
    assert engine.optimizer.loss_scale == (512.0 if overflow else 1024.0)
    assert grad.step_was_skipped is overflow
    assert grad.optimizer_steps == (0 if overflow else 1)


@pytest.mark.parametrize("overflow", [False, True])
def test_a_short_window_scales_its_step_and_restores_the_dynamic_scale(
    overflow: bool,
) -> None:
    # One micro-step closing the loader's last window: the engine divided by K, so
    # the step runs with the scale divided by K / 1, then the scale comes back:
    # unchanged, or the engine's halving of it kept (a skipped fp16 step).
    engine = _Engine(1024.0, overflow)
    grad = _run(engine, 1)
    assert engine.boundaries == [True]
    assert engine.scales_seen == [pytest.approx(1024.0 / K)]
    assert engine.optimizer.loss_scale == pytest.approx(512.0 if overflow else 1024.0)
    assert grad.step_was_skipped is overflow
    assert grad.micro_step == 0 and grad.optimizer_steps == (0 if overflow else 1)


def test_max_grad_norm_other_than_the_configs_clipping_is_refused() -> None:
    engine = _Engine(1.0, False, clipping=1.0)
    with pytest.raises(
        ValueError,
        match=r"^accumulate_step: max_grad_norm must be None or the engine config's "
        r"gradient_clipping \(1\.0\); got 0\.5\.$",
    ):
        _run(engine, 1, max_grad_norm=0.5)
    assert engine.boundaries == []  # refused before the forward
    _run(engine, 1, max_grad_norm=1.0)  # the same value is fine
    assert engine.optimizer.clip_grad == 0.0  # restored after the step


def test_grad_norm_is_the_engines_norm_of_the_step_when_clipping() -> None:
    engine = _Engine(1.0, False, clipping=1.0)
    grad = _run(engine, 1, max_grad_norm=1.0)  # a short window: scale 1 / K
    assert grad.grad_norm is not None
    assert grad.grad_norm.dtype == torch.float64 and grad.grad_norm.dim() == 0
    assert grad.grad_norm.item() == 5.0 / (1.0 / K)  # the k / m correction included
    assert _run(_Engine(1.0, False, clipping=1.0), 1).grad_norm is None  # not asked
