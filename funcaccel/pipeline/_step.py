"""``pipeline_step``: one pipeline step (all micro-batches), the exact window gradient.

The schedule runs unscaled (``scale_grads=False``), so after a step each stage
holds the gradient of the sum of what the schedule's loss function returned
over the micro-batches, averaged over the data-parallel ranks by FSDP2 (which
reduces at the end of every step). The loss function given to torch is:

- mean losses: ``loss_fn(output, target) / microbatches``, so a step's gradient
  is that of the batch's mean loss; closing a window of ``m`` steps multiplies
  by ``1 / m`` (a short last window included): the mean over the window, over
  the data-parallel ranks;
- token-weighted (``num_items=``): ``loss_fn(output, target)`` (a sum over
  items) as is; closing the window multiplies by ``dp_size / total`` where
  ``total`` is the window's item count over all data-parallel ranks (each
  data-parallel coordinate counted once, not once per stage or tp rank).

With ``pp=2``, 4 micro-batches and ``accumulation_steps=2``, the first step
leaves the sum of the 4 ``loss / 4`` gradients on each stage, the second adds
its own, and the optimizer steps on half the sum: the gradient of the mean loss
over the 8 micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import Final

import torch
import torch.distributed as dist

from funcaccel._checks import as_tuple_of
from funcaccel._checks import check_norm
from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._ctx_checks import check_context
from funcaccel._dist_types import is_dtensor
from funcaccel._optimizers_hold import check_optimizers_hold
from funcaccel._primitives import all_reduce_ints
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group
from funcaccel.grad_state import GradState
from funcaccel.grad_state import check_grad_state
from funcaccel.grad_state import check_num_items
from funcaccel.grad_state import check_window_kind
from funcaccel.grad_state import is_window_end
from funcaccel.grad_state import next_grad_state
from funcaccel.mixed_precision import optimizer_step
from funcaccel.mixed_precision import rescale_grads_
from funcaccel.model import Pipeline
from funcaccel.pipeline._schedule import build_schedule
from funcaccel.pipeline._schedule import check_divisible
from funcaccel.pipeline._schedule import check_same_layout
from funcaccel.pipeline._schedule import run_schedule

__all__ = ["clip_pipeline_grad_norm_", "pipeline_step"]

_CALLER: Final = "pipeline_step"
_PIPE: Final = "a Pipeline (from wrap_model(..., pipeline=PipelineOptions(...)))"


def _check_batch(batch: object) -> tuple[Any, Any]:
    what = "a pair (inputs, targets) whose first dimension is the batch"
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        fail_value(_CALLER, "batch", batch, what, "Pass batch=(inputs, targets).")
    inputs, target = batch
    for name, value in (("batch[0]", inputs), ("batch[1]", target)):
        check_type(_CALLER, name, value, torch.Tensor, what="a tensor")
    return inputs, target


def pipeline_step(
    ctx: DistributedContext,
    grad: GradState,
    pipe: Pipeline,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    *,
    num_items: int | torch.Tensor | None = None,
    end_of_dataloader: bool = False,
    max_grad_norm: float | None = None,
) -> tuple[torch.Tensor, GradState]:
    """Run one pipeline step and, when the window closes, one exact optimizer step.

    Changes the gradients and the optimizers in place; ``grad`` is left unchanged
    and the next state is returned. Every rank of the pipeline calls it with the
    same ``batch`` (all ranks of one data-parallel coordinate read the same
    batches): the first stage takes ``inputs``, the last ``targets``, split into
    ``pipe.options.microbatches`` equal parts. The window closes every
    ``grad.accumulation_steps`` steps or at ``end_of_dataloader``; the step then
    applies exactly the gradient of the window's mean loss (over micro-batches,
    steps and data-parallel ranks) or, with ``num_items``, the sum of every
    item's loss gradient divided by the window's item count over all
    data-parallel ranks; a window without items steps nothing.

    Args:
        ctx: the distributed context.
        grad: the accumulation state.
        pipe: this rank's stages.
        optimizers: the optimizer(s) over ``pipe.parameters()``.
        batch: ``(inputs, targets)``, the same on every stage.
        loss_fn: ``loss_fn(output, target)`` for one micro-batch: its mean loss,
            or with ``num_items`` its summed loss.
        num_items: this data-parallel rank's item count in ``batch`` (all its
            micro-batches), the same on every stage; ``None`` for mean losses.
        end_of_dataloader: whether ``batch`` is the data's last.
        max_grad_norm: clip to this global norm (over every stage, data- and
            tensor-parallel rank) before stepping; the pre-clip norm goes to
            the new state's ``grad_norm``.

    Returns:
        The step's loss (the batch's mean loss, or summed loss / ``num_items``),
        the same on every stage, and the next ``GradState``.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a batch the micro-batch count does not divide, a window
            that mixes mean and token-weighted steps, a bad ``max_grad_norm``.
        RuntimeError: no process group.
    """
    check_context(_CALLER, ctx)
    if ctx.mixed_precision != "no":
        # Not applied here yet: refused rather than silently run in full precision.
        what = "'no' (pipeline_step does not apply autocast or a grad scaler)"
        fix = "Build the context with mixed_precision='no', or cast the model."
        fail_value(_CALLER, "ctx.mixed_precision", ctx.mixed_precision, what, fix)
    check_grad_state(_CALLER, grad)
    check_type(_CALLER, "pipe", pipe, Pipeline, what=_PIPE)
    opts = as_tuple_of(
        optimizers, torch.optim.Optimizer, caller=_CALLER, name="optimizers"
    )
    inputs, target = _check_batch(batch)
    if not callable(loss_fn):
        fail_value(_CALLER, "loss_fn", loss_fn, "a function (output, target) -> loss")
    if max_grad_norm is not None:
        check_norm(_CALLER, "max_grad_norm", max_grad_norm)
    check_window_kind(_CALLER, grad, num_items is not None)
    items = None if num_items is None else check_num_items(_CALLER, num_items)
    require_process_group(ctx, _CALLER)
    n = pipe.options.microbatches
    check_divisible(_CALLER, inputs.shape[0], n)
    check_divisible(_CALLER, target.shape[0], n)
    check_same_layout(_CALLER, pipe, inputs, target)

    def schedule_loss(output: Any, tgt: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(output, tgt)
        return loss if items is not None else loss / n

    pipe.loss_slot.fn = schedule_loss
    try:
        losses = run_schedule(pipe, build_schedule(pipe), inputs, target)
    finally:
        pipe.loss_slot.fn = None
    loss = _share_loss(pipe, losses, inputs)
    shown = loss / items if items else loss
    synced = is_window_end(grad, end_of_dataloader)
    local = None if items is None else (grad.window_items or 0) + items
    if not synced:
        return shown, next_grad_state(grad, False, end_of_dataloader, False, local)
    mesh = pipe.mesh
    if local is None:
        factor = 1.0 / (grad.micro_step + 1)
    else:
        total = _window_items(ctx, pipe, local)
        if total == 0:  # nothing to average: no update rather than 0/0
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            return shown, next_grad_state(grad, True, end_of_dataloader, True)
        factor = mesh.dp_size / total
    # Once per window: an optimizer built on parameters FSDP2 or tensor
    # parallelism replaced would step nothing, silently.
    check_optimizers_hold(_CALLER, (pipe,), opts)
    rescale_grads_(opts, factor)
    norm = None
    if max_grad_norm is not None:
        norm = clip_pipeline_grad_norm_(pipe, max_grad_norm)
    skipped = optimizer_step(opts)
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    return shown, next_grad_state(grad, True, end_of_dataloader, skipped, None, norm)


def _window_items(ctx: DistributedContext, pipe: Pipeline, local: int) -> int:
    """Return the window's items over the data-parallel ranks, each counted once.

    One all-reduce of two counts per data-parallel rank: the sum and the sum of
    squares of what its ``pp * tp`` ranks passed. They agree (every stage and tp
    rank passed the same count) exactly when ``pp * tp * squares == sum ** 2``.
    """
    mesh = pipe.mesh
    copies = mesh.pp * mesh.tp
    values = [0] * (2 * mesh.dp_size)
    values[mesh.dp_rank], values[mesh.dp_size + mesh.dp_rank] = local, local * local
    sums = all_reduce_ints(ctx, values, caller=_CALLER)
    for d in range(mesh.dp_size):
        if copies * sums[mesh.dp_size + d] != sums[d] * sums[d]:
            msg = (
                f"{_CALLER}: num_items must be the same on every stage and tensor-"
                f"parallel rank of a data-parallel rank (they read the same batch); "
                f"data-parallel rank {d}'s {copies} ranks passed different counts "
                f"(window totals summing to {sums[d]}). Count the items from the "
                "batch itself on every rank, e.g. (labels != -100).sum()."
            )
            raise ValueError(msg)
    return sum(sums[: mesh.dp_size]) // copies


def _share_loss(
    pipe: Pipeline, losses: list[torch.Tensor], like: torch.Tensor
) -> torch.Tensor:
    """Return the last stage's summed micro-batch losses on every stage."""
    if pipe.has_last_stage:
        value = torch.stack([loss.detach() for loss in losses]).sum()
    else:
        dtype = like.dtype if like.is_floating_point() else torch.get_default_dtype()
        value = torch.zeros((), dtype=dtype, device=like.device)
    device_mesh = pipe.mesh.device_mesh
    assert device_mesh is not None
    # A sum over the pp group in which only the last stage's rank is non-zero.
    value = value.to(torch.float64)
    dist.all_reduce(value, group=device_mesh["pp"].get_group())
    return value


def clip_pipeline_grad_norm_(pipe: Pipeline, max_norm: float) -> torch.Tensor:
    """Clip ``pipe``'s gradients in place to a global 2-norm of ``max_norm``.

    The norm is that of the whole model's gradient: each ``DTensor`` gradient
    (FSDP2, tensor parallelism) counts whole, then the squares are summed over
    the pipeline ranks. Every rank of the pipeline must call it.

    Returns:
        The pre-clip norm (float64, the same on every rank).
    """
    check_norm("clip_pipeline_grad_norm_", "max_norm", max_norm)
    grads = [p.grad for p in pipe.parameters() if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for g in grads:
            norm = torch.linalg.vector_norm(g, 2.0)
            whole = norm.full_tensor() if is_dtensor(norm) else norm
            squares = squares + whole.detach().to("cpu", torch.float64) ** 2
        device_mesh = pipe.mesh.device_mesh
        assert device_mesh is not None
        group = device_mesh["pp"].get_group()
        device = grads[0].device if grads else torch.device("cpu")
        if dist.get_backend(group) == "nccl":
            squares = squares.to(device)
        dist.all_reduce(squares, group=group)
        total = squares.sqrt().cpu()
        coef = min(1.0, max_norm / (float(total) + 1e-6))
        if coef < 1.0 and math.isfinite(coef):
            for g in grads:
                local = g.to_local() if is_dtensor(g) else g
                local.mul_(coef)
    return total
