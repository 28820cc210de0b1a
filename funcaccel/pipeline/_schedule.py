"""torch's schedule for a ``Pipeline``, always built with ``scale_grads=False``.

torch's schedules divide every gradient by the number of micro-batches by
default (``scale_grads=True``), which is right only for one pipeline step of
mean losses and turns accumulation into a moving average. funcaccel builds
every schedule unscaled and applies the one factor the window needs itself
(``pipeline_step``).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any
from typing import Final

import torch

from funcaccel.model import Pipeline

__all__ = ["build_schedule", "check_divisible", "check_same_layout", "run_schedule"]

_CLASSES: Final = MappingProxyType(
    {
        "gpipe": "ScheduleGPipe",
        "1f1b": "Schedule1F1B",
        "interleaved_1f1b": "ScheduleInterleaved1F1B",
        "looped_bfs": "ScheduleLoopedBFS",
        "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
        "zbv_zero_bubble": "ScheduleZBVZeroBubble",
    }
)


def build_schedule(pipe: Pipeline) -> Any:
    """Return ``pipe``'s one torch schedule, built unscaled at the first call.

    Its loss function is ``pipe.loss_slot``, which each step fills in.
    """
    if pipe.schedule is not None:
        return pipe.schedule
    from torch.distributed import pipelining

    name = pipe.options.schedule
    kind = getattr(pipelining, _CLASSES[name])
    n, loss = pipe.options.microbatches, pipe.loss_slot
    if name in ("gpipe", "1f1b"):
        pipe.schedule = kind(pipe.stages[0], n, loss_fn=loss, scale_grads=False)
    else:
        pipe.schedule = kind(list(pipe.stages), n, loss_fn=loss, scale_grads=False)
    return pipe.schedule


def run_schedule(
    pipe: Pipeline, schedule: Any, inputs: Any, target: Any
) -> list[torch.Tensor]:
    """Run one step of ``schedule``: inputs to the first stage, targets to the last.

    Returns the last stage's per-micro-batch losses (empty on other ranks).
    """
    losses: list[torch.Tensor] = []
    args = (inputs,) if pipe.has_first_stage else ()
    if pipe.has_last_stage:
        schedule.step(*args, target=target, losses=losses)
    else:
        schedule.step(*args)
    return losses


def check_divisible(caller: str, batch_size: int, microbatches: int) -> None:
    """Refuse a batch that ``microbatches`` equal parts cannot split."""
    if batch_size % microbatches:
        msg = (
            f"{caller}: the batch's first dimension ({batch_size}) must be a multiple "
            f"of PipelineOptions.microbatches ({microbatches}); got {batch_size}. "
            "Pass a batch size divisible by the micro-batch count, or change "
            "microbatches."
        )
        raise ValueError(msg)


def check_same_layout(
    caller: str, pipe: Pipeline, inputs: torch.Tensor, target: torch.Tensor
) -> None:
    """Refuse a batch whose shapes or dtypes differ from the first step's.

    torch's schedule sizes the buffers between stages once, at its first step;
    a batch of another shape would be sent through buffers of the old one.
    """
    layout = (tuple(inputs.shape), inputs.dtype, tuple(target.shape), target.dtype)
    if pipe.batch_layout is None:
        pipe.batch_layout = layout
        return
    if layout != pipe.batch_layout:
        msg = (
            f"{caller}: every batch of a pipeline must have the first batch's shapes "
            f"and dtypes (inputs, targets) {pipe.batch_layout}; got {layout}. Pad or "
            "drop a short last batch (DataLoader(drop_last=True)), or build another "
            "Pipeline for other shapes."
        )
        raise ValueError(msg)
