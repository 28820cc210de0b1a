"""``estimate_memory``: one training step at a world size, on fake tensors, in this process.

For each rank it estimates (rank 0, and the last rank when the shards are
uneven) a fake process group of ``world_size`` is started, the model is built on
``meta`` under a fake-tensor mode, wrapped by ``wrap_model`` exactly as the real
run wraps it (so the estimate shards what the run shards), and two optimizer
steps of ``accumulation_steps`` micro-batches each run through
``accumulate_step`` under torch's memory tracker (``FSDPMemTracker`` for an
FSDP2 model, ``MemTracker`` otherwise). Nothing is computed and no tensor of the
model gets storage: a 7B-parameter model at 1,024 ranks needs a few hundred MiB.

DDP cannot hold fake parameters (its reducer allocates in C++), so a DDP plan
runs the step on the unwrapped model, which is what each DDP rank holds, and
adds DDP's gradient buckets, held all along: one flat copy of the gradients,
none with ``gradient_as_bucket_view=True`` and ``accumulation_steps=1`` (the
gradients are then the buckets' views).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import Final

import torch
from torch import nn

from funcaccel._checks import check_int
from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._typing import MixedPrecision
from funcaccel.grad_state import GradState
from funcaccel.kwargs import DistributedDataParallelKwargs
from funcaccel.mesh import build_mesh
from funcaccel.model import FSDPOptions
from funcaccel.model import Pipeline
from funcaccel.model import PipelineOptions
from funcaccel.planning._counting import DEVICE_KINDS
from funcaccel.planning._counting import build_tracker
from funcaccel.planning._counting import device_rounding
from funcaccel.planning._counting import held_bytes
from funcaccel.planning._counting import is_uneven
from funcaccel.planning._counting import peak_parts
from funcaccel.planning._counting import tracking_repeated_calls
from funcaccel.planning._estimate import MemoryEstimate
from funcaccel.planning._estimate import RankMemory
from funcaccel.planning._fake_world import fake_tensor_mode
from funcaccel.planning._fake_world import fake_world_ctx
from funcaccel.planning._pipeline_memory import check_pipeline_arguments
from funcaccel.planning._pipeline_memory import cut_and_step
from funcaccel.planning._pipeline_memory import pipeline_strategy
from funcaccel.planning._steps import accumulate_step_fn
from funcaccel.planning._steps import fake_batch
from funcaccel.planning._steps import no_init

__all__ = ["estimate_memory", "plan_strategy"]

_CALLER: Final = "estimate_memory"
_STEPS: Final = 2  # the second step has the optimizer's state from the first
_DDP_BUCKETS: Final = "DDP gradient buckets"


def plan_strategy(
    world_size: int, dp_replicate: int, dp_shard: int, tp: int, fsdp: object
) -> str:
    """Name what ``wrap_model`` builds for these sizes.

    >>> plan_strategy(8, 1, 1, 1, None), plan_strategy(8, 2, 4, 1, FSDPOptions())
    ('ddp', 'hsdp')
    >>> plan_strategy(8, 1, 4, 2, FSDPOptions()), plan_strategy(1, 1, 1, 1, None)
    ('fsdp+tp', 'none')
    """
    if world_size == 1:
        return "none"
    if fsdp is None and tp == 1:
        return "ddp"
    if dp_replicate * dp_shard == 1:
        return "tp"
    base = "replicate" if fsdp is None else "hsdp" if dp_replicate > 1 else "fsdp"
    return base + ("+tp" if tp > 1 else "")


def _check_arguments(
    model_fn: object,
    world_size: object,
    optimizer_fn: object,
    accumulation_steps: object,
    margin: object,
    loss_fn: object,
) -> None:
    if not callable(model_fn) or isinstance(model_fn, nn.Module):
        fail_type(
            _CALLER,
            "model_fn",
            model_fn,
            "a function that builds the model",
            "Pass e.g. model_fn=lambda: Net(config) (it is called on the meta device).",
        )
    check_int(_CALLER, "world_size", world_size, 1)
    if not callable(optimizer_fn):
        fail_type(
            _CALLER,
            "optimizer_fn",
            optimizer_fn,
            "a function from the parameters to an optimizer",
            "Pass e.g. optimizer_fn=lambda ps: torch.optim.AdamW(ps, lr=1e-4).",
        )
    check_int(_CALLER, "accumulation_steps", accumulation_steps, 1)
    check_type(_CALLER, "margin", margin, (int, float))
    assert isinstance(margin, int | float)
    if not (math.isfinite(margin) and margin >= 0):
        fail_value(_CALLER, "margin", margin, "a finite fraction >= 0", "Use e.g. 0.1.")
    if loss_fn is not None and not callable(loss_fn):
        fail_type(
            _CALLER, "loss_fn", loss_fn, "a function of the model's output or None"
        )


def estimate_memory(
    model_fn: Callable[[], nn.Module],
    batch: object,
    *,
    world_size: int,
    optimizer_fn: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    pp: int = 1,
    dp_replicate: int = 1,
    dp_shard: int | None = None,
    tp: int = 1,
    tp_plan: Mapping[str, Any] | None = None,
    fsdp: FSDPOptions | None = None,
    ddp_kwargs: DistributedDataParallelKwargs | None = None,
    pipeline: PipelineOptions | None = None,
    accumulation_steps: int = 1,
    mixed_precision: MixedPrecision = "no",
    loss_fn: Callable[..., torch.Tensor] | None = None,
    margin: float = 0.1,
    device: str | None = None,
    **wrap_options: Any,
) -> MemoryEstimate:
    """Estimate each rank's memory for a training step at ``world_size``, in this process.

    The model is built by ``model_fn()`` on the ``meta`` device (under fake
    tensors for DDP, which wraps the whole model), wrapped with
    ``wrap_model(ctx, model, ddp_kwargs, fsdp=fsdp, mesh=build_mesh(ctx, ...),
    tp_plan=tp_plan, **wrap_options)`` for the rank's context in a fake group of
    ``world_size`` (so the plan shards exactly what the run shards), given
    ``optimizer_fn(parameters)`` and trained for two optimizer steps of
    ``accumulation_steps`` micro-batches of ``batch`` through
    ``accumulate_step``, all on fake tensors. ``wrap_options`` reach
    ``wrap_model`` unchanged (``init_fn=``, and the options it gains later, such
    as activation checkpointing); ``init_fn`` defaults to one that does nothing,
    as values do not matter. A mesh is built when ``pp > 1``, ``tp > 1``,
    ``dp_replicate > 1`` or ``fsdp`` is given; otherwise several ranks mean DDP.

    With ``pp > 1`` and ``pipeline=PipelineOptions(...)`` the model is built
    whole on fake tensors, cut by ``wrap_model(..., pipeline=pipeline)`` and
    trained through ``pipeline_step`` (``accumulation_steps`` pipeline steps
    per window) with torch's own schedule; one rank of every pipeline stage is
    estimated (the first of its ranks, ``p * world_size // pp``), since each
    holds other layers. ``batch`` is then what ``pipeline_step`` takes, one
    data-parallel rank's ``(inputs, targets)`` for all micro-batches.

    With ``world_size=8`` and ``fsdp=FSDPOptions()`` a 1B-parameter float32
    model with AdamW holds 0.5 GB of parameters, 0.5 GB of gradients and 1 GB of
    Adam state per rank (``parameters / 8 * 4`` bytes each, twice for Adam), and
    peaks higher with the gathered layers, activations and buffers.

    Args:
        model_fn: builds the model (called under ``torch.device("meta")``).
        batch: one micro-batch of one rank, as the model takes it: a tensor, a
            tuple of arguments or a mapping of keyword arguments; real or
            ``meta`` tensors, only their shapes and dtypes are used. With
            ``pipeline``: ``(inputs, targets)`` of one pipeline step.
        world_size: the number of ranks planned for (any, e.g. 4,096).
        optimizer_fn: builds the optimizer from the wrapped model's parameters.
        pp, dp_replicate, dp_shard, tp: the mesh, as ``build_mesh`` takes it;
            ``dp_shard=None`` is the rest of the world with ``fsdp``, else 1.
        tp_plan, fsdp, ddp_kwargs, pipeline: as ``wrap_model`` takes them;
            ``pipeline`` is required with ``pp > 1`` (and refused without).
        accumulation_steps: micro-batches (pipeline steps) per optimizer step.
        mixed_precision: the context's autocast mode (``"no"``, ``"bf16"``,
            ``"fp16"``), as ``build_context(mixed_precision=...)``; ``"no"``
            with ``pipeline``, as ``pipeline_step`` requires.
        loss_fn: turns the model's output into the loss; by default its ``loss``
            attribute, else the sum of its floating-point tensors. With
            ``pipeline``: ``loss_fn(output, target)``, as ``pipeline_step``
            takes it (by default the same, the target unused).
        margin: the fraction added in ``peak_with_margin`` for what is not
            counted (``MemoryEstimate.not_counted``).
        device: the device kind the run will use, ``"cpu"`` or ``"cuda"``
            (each tensor's bytes rounded up to CUDA's 512-byte allocator
            blocks); ``None`` is ``"cuda"`` when this process sees a GPU, else
            ``"cpu"``, as ``build_context`` picks.
        wrap_options: more keyword arguments of ``wrap_model``.

    Returns:
        The ``MemoryEstimate``, bytes per rank.

    Raises:
        TypeError, ValueError: a bad argument (``pp > 1`` without ``pipeline``
            or the reverse, a pipeline batch that is not a pair of tensors), or
            what ``build_mesh``, ``wrap_model`` or ``pipeline_step`` refuse for
            this world (a mesh that does not divide it, a tp_plan naming a
            missing module, a model that is not a chain of units).
        RuntimeError: a default process group already exists in this process.
    """
    _check_arguments(
        model_fn, world_size, optimizer_fn, accumulation_steps, margin, loss_fn
    )
    check_int(_CALLER, "pp", pp, 1)
    check_pipeline_arguments(pp, pipeline, batch, mixed_precision)
    plan = _Plan(
        model_fn=model_fn,
        batch=batch,
        world_size=world_size,
        optimizer_fn=optimizer_fn,
        sizes=(
            pp,
            dp_replicate,
            (1 if fsdp is None else -1) if dp_shard is None else dp_shard,
            tp,
        ),
        tp_plan=tp_plan,
        fsdp=fsdp,
        ddp_kwargs=ddp_kwargs,
        pipeline=pipeline,
        accumulation_steps=accumulation_steps,
        mixed_precision=mixed_precision,
        loss_fn=loss_fn,
        wrap_options=wrap_options,
        device=_device_kind(device),
    )
    # Rank 0 first: its mesh checks the sizes against the world. Then the
    # first rank of every other pipeline stage, and after each the last rank
    # of the same stage when its shards are uneven (it holds less).
    found: list[RankMemory] = []
    per_stage = world_size // pp
    firsts = [0]
    while firsts:
        first = firsts.pop(0)
        memory, shape, strategy, uneven = _estimate_rank(first, plan)
        found.append(memory)
        if uneven and per_stage > 1:
            found.append(_estimate_rank(first + per_stage - 1, plan)[0])
        if first == 0:
            firsts = [stage * per_stage for stage in range(1, pp)]
    return MemoryEstimate(
        world_size=world_size,
        mesh=shape,
        strategy=strategy,
        ranks=tuple(found),
        margin=margin,
        device=plan.device,
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Plan:
    """``estimate_memory``'s arguments, checked: what every rank's estimate shares."""

    model_fn: Callable[[], nn.Module]
    batch: object
    world_size: int
    optimizer_fn: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    sizes: tuple[int, int, int, int]  # pp, dp_replicate, dp_shard, tp
    tp_plan: Mapping[str, Any] | None
    fsdp: FSDPOptions | None
    ddp_kwargs: DistributedDataParallelKwargs | None
    pipeline: PipelineOptions | None
    accumulation_steps: int
    mixed_precision: MixedPrecision
    loss_fn: Callable[..., torch.Tensor] | None
    wrap_options: Mapping[str, Any]
    device: str


def _device_kind(device: object) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in DEVICE_KINDS:
        fail_value(
            _CALLER,
            "device",
            device,
            f"one of {DEVICE_KINDS} or None",
            "Pass the kind the run will use, e.g. device='cuda'.",
        )
    assert isinstance(device, str)
    return device


def _estimate_rank(
    rank: int, plan: _Plan
) -> tuple[RankMemory, tuple[int, int, int, int], str, bool]:
    pp, dp_replicate, dp_shard, tp = plan.sizes
    world_size, fsdp = plan.world_size, plan.fsdp
    with fake_world_ctx(
        _CALLER, world_size, rank, mixed_precision=plan.mixed_precision
    ) as ctx:
        # The mesh is built before fake tensors exist: a DeviceMesh reads its
        # layout back from integer tensors, which a fake tensor cannot answer.
        use_mesh = world_size > 1 and (
            pp > 1 or tp > 1 or dp_replicate > 1 or fsdp is not None
        )
        mesh = None
        shape = (1, world_size, 1, 1)
        if use_mesh:
            mesh = build_mesh(
                ctx, pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp
            )
            shape = mesh.shape
        if pp > 1:
            strategy = pipeline_strategy(*shape[1:], fsdp)
        else:
            strategy = plan_strategy(world_size, *shape[1:], fsdp)
        mode = fake_tensor_mode()
        with mode:
            # DDP's, one process's and a pipeline's whole model is built fake
            # (Module.to_empty cannot swap a meta parameter for a fake one; the
            # pipeline's stage cut keeps this rank's units); wrap_model
            # materialises this rank's shards of the rest.
            whole = strategy in ("ddp", "none") or pp > 1
            with torch.device(ctx.device if whole else "meta"):
                model = plan.model_fn()
            if not isinstance(model, nn.Module):
                fail_type(_CALLER, "model_fn()", model, "an nn.Module")
            fake = fake_batch(mode, plan.batch)
            wrap_kwargs = {
                "mesh": mesh,
                "fsdp": fsdp,
                "tp_plan": plan.tp_plan,
                "init_fn": no_init,
                "ddp_kwargs": plan.ddp_kwargs,  # refused with a pipeline, as in the run
                **plan.wrap_options,
            }
            wrapped: nn.Module
            if pp > 1:
                assert plan.pipeline is not None
                wrapped, tracked, step = cut_and_step(
                    ctx, model, fake, plan.pipeline, wrap_kwargs, plan.loss_fn
                )
            else:
                wrapped, step = accumulate_step_fn(
                    ctx,
                    model,
                    fake,
                    wrap_kwargs,
                    whole=whole,
                    mixed_precision=plan.mixed_precision,
                    loss_fn=plan.loss_fn,
                )
                tracked = wrapped
            optimizer = plan.optimizer_fn(list(wrapped.parameters()))
            with device_rounding(plan.device):  # the tracker counts storages from here
                tracker = build_tracker(tracked, optimizer, fake)
                roots = wrapped.stage_modules if isinstance(wrapped, Pipeline) else ()
                with tracking_repeated_calls(tracker, roots), tracker:
                    grad = GradState(accumulation_steps=plan.accumulation_steps)
                    for _ in range(_STEPS * plan.accumulation_steps):
                        grad = step(grad, optimizer)
                        # The trackers keep one forward's per-module stats (and
                        # refuse a second); the peak survives the reset.
                        tracker.reset_mod_stats()
            parts = peak_parts(tracker)
            parameters, gradients, state = held_bytes(wrapped, optimizer, plan.device)
            uneven = is_uneven(wrapped)
        if strategy == "ddp":
            kwargs = plan.ddp_kwargs or DistributedDataParallelKwargs()
            # DDP's buckets are one flat copy of the gradients. With
            # gradient_as_bucket_view the gradients are their views, except in a
            # no-sync micro-step: after zero_grad(set_to_none=True) autograd
            # allocates fresh gradients there, beside the buckets.
            views = kwargs.gradient_as_bucket_view and plan.accumulation_steps == 1
            parts[_DDP_BUCKETS] = 0 if views else gradients
    memory = RankMemory(
        rank=rank,
        stages=wrapped.stage_indices if isinstance(wrapped, Pipeline) else (),
        parameters=parameters,
        gradients=gradients,
        optimizer_state=state,
        peak=sum(parts.values()),
        peak_parts=tuple(parts.items()),
    )
    return memory, shape, strategy, uneven
