"""``pipeline_eval``: a forward-only pass through a ``Pipeline``.

The same torch schedule as training runs without backward (``schedule.eval``).
The last stage's outputs and loss are then sent to every rank of its pipeline,
so that ``gather_for_metrics(ctx, outputs, batch=..., mesh=mesh)`` and logging
work on any rank. torch re-prepares the stages when a schedule switches between
training and evaluation, which with FSDP2 clears the parameters' gradients: an
evaluation inside an open accumulation window is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import Final

import torch
import torch.distributed as dist

from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._ctx_checks import check_context
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group
from funcaccel.model import Pipeline
from funcaccel.pipeline._schedule import build_schedule
from funcaccel.pipeline._schedule import check_divisible
from funcaccel.pipeline._schedule import check_same_layout

__all__ = ["pipeline_eval"]

_CALLER: Final = "pipeline_eval"
# torch's zero-bubble schedules keep their split backward actions in eval().
_NO_EVAL: Final = frozenset({"interleaved_zero_bubble", "zbv_zero_bubble"})


def pipeline_eval(
    ctx: DistributedContext,
    pipe: Pipeline,
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``batch`` forward through ``pipe``; return the outputs and the mean loss.

    Every rank of the pipeline calls it with the same ``batch`` (inputs,
    targets), of the shapes training used (the schedule's buffers are sized
    once). Runs under ``torch.no_grad()``; the model's train/eval mode is the
    caller's (``pipe.eval()``). Call it between accumulation windows (after a
    step that synced, or before training).

    With ``pp=2`` and 4 micro-batches of 2 rows, rank 0 (stage 0) and rank 1
    (stage 1) both return the 8 rows of stage 1's output and the mean of the 4
    micro-batch losses.

    Args:
        ctx: the distributed context.
        pipe: this rank's stages.
        batch: ``(inputs, targets)``, the same on every stage.
        loss_fn: ``loss_fn(output, target)``, a micro-batch's mean loss, or
            ``None`` for outputs only.

    Returns:
        The last stage's output for the whole batch and the mean of the
        micro-batch losses (``None`` without ``loss_fn``), on every rank.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a batch the micro-batch count does not divide, or of other
            shapes than training's; gradients left by an open window.
        RuntimeError: no process group.
    """
    check_context(_CALLER, ctx)
    if ctx.mixed_precision != "no":
        what = "'no' (pipeline_eval does not apply autocast)"
        fix = "Build the context with mixed_precision='no', or cast the model."
        fail_value(_CALLER, "ctx.mixed_precision", ctx.mixed_precision, what, fix)
    what = "a Pipeline (from wrap_model(..., pipeline=PipelineOptions(...)))"
    check_type(_CALLER, "pipe", pipe, Pipeline, what=what)
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        what = "a pair (inputs, targets)"
        fail_value(_CALLER, "batch", batch, what, "Pass batch=(inputs, targets).")
    inputs, target = batch
    check_type(_CALLER, "batch[0]", inputs, torch.Tensor, what="a tensor")
    check_type(_CALLER, "batch[1]", target, torch.Tensor, what="a tensor")
    if pipe.options.schedule in _NO_EVAL:
        what = f"a pipeline whose schedule runs forward only; {sorted(_NO_EVAL)} do not in this torch"
        fix = "Evaluate with another schedule (a second Pipeline of the same model)."
        fail_value(_CALLER, "pipe.options.schedule", pipe.options.schedule, what, fix)
    require_process_group(ctx, _CALLER)
    n = pipe.options.microbatches
    check_divisible(_CALLER, inputs.shape[0], n)
    check_same_layout(_CALLER, pipe, inputs, target)
    pending = [name for name, p in pipe.named_parameters() if p.grad is not None]
    if pending:
        what = "no gradients (an open accumulation window would lose them)"
        fix = "Evaluate after the window's last pipeline_step, or zero the gradients."
        fail_value(_CALLER, "the pipeline's parameters", pending, what, fix)
    schedule = build_schedule(pipe)
    losses: list[torch.Tensor] = []

    def mean_part(output: Any, tgt: torch.Tensor) -> torch.Tensor:
        assert loss_fn is not None
        return loss_fn(output, tgt)

    # Without a loss function the slot returns zeros: torch calls it on the last
    # stage whenever the schedule was built with one.
    pipe.loss_slot.fn = mean_part if loss_fn is not None else _no_loss
    args = (inputs,) if pipe.has_first_stage else ()
    try:
        with torch.no_grad():
            if pipe.has_last_stage:
                output = schedule.eval(*args, target=target, losses=losses)
            else:
                output = schedule.eval(*args)
    finally:
        pipe.loss_slot.fn = None
    loss = torch.stack(losses).mean() if pipe.has_last_stage else None
    return _from_last_stage(pipe, output, loss, loss_fn is not None)


def _no_loss(output: Any, target: Any) -> torch.Tensor:
    del target  # no loss asked for
    return torch.zeros((), device=output.device)


def _from_last_stage(
    pipe: Pipeline, output: Any, loss: torch.Tensor | None, with_loss: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Send the last stage's output and loss to every rank of its pipeline."""
    mesh = pipe.mesh
    device_mesh = mesh.device_mesh
    assert device_mesh is not None
    group = device_mesh["pp"].get_group()
    last = mesh.pp_peer(_last_stage_rank(pipe))
    sent: list[Any] = [None]
    if pipe.has_last_stage:
        sent = [(output.detach().cpu(), None if loss is None else loss.detach().cpu())]
    dist.broadcast_object_list(sent, src=last, group=group)
    out, got = sent[0]
    device = pipe.stages[0].device
    value = got.to(device) if with_loss and got is not None else None
    return out.to(device), value


def _last_stage_rank(pipe: Pipeline) -> int:
    """The pipeline rank that runs the last stage (looped or V placement)."""
    last = pipe.num_stages - 1
    if pipe.options.schedule == "zbv_zero_bubble":
        return 0  # the V ends where it began
    return last % pipe.mesh.pp
