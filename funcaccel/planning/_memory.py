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
adds DDP's gradient buckets (one flat copy of the gradients, none with
``gradient_as_bucket_view=True``), held all along, and a temporary of the
gradients' size that a real DDP step on gloo was measured to hold at its peak.
"""

from __future__ import annotations

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
from funcaccel._tree import tree_map
from funcaccel._typing import MixedPrecision
from funcaccel.accumulate import accumulate_step
from funcaccel.context import DistributedContext
from funcaccel.flops import output_loss
from funcaccel.grad_state import GradState
from funcaccel.kwargs import DistributedDataParallelKwargs
from funcaccel.mesh import build_mesh
from funcaccel.model import FSDPOptions
from funcaccel.model import apply_activation_checkpointing
from funcaccel.model import wrap_model
from funcaccel.planning._counting import DEVICE_KINDS
from funcaccel.planning._counting import build_tracker
from funcaccel.planning._counting import device_rounding
from funcaccel.planning._counting import held_bytes
from funcaccel.planning._counting import is_uneven
from funcaccel.planning._counting import peak_parts
from funcaccel.planning._estimate import MemoryEstimate
from funcaccel.planning._estimate import RankMemory
from funcaccel.planning._fake_world import fake_tensor_mode
from funcaccel.planning._fake_world import fake_world_ctx

__all__ = ["estimate_memory", "plan_strategy"]

_CALLER: Final = "estimate_memory"
_STEPS: Final = 2  # the second step has the optimizer's state from the first
_DDP_BUCKETS: Final = "DDP gradient buckets"
_DDP_COPY: Final = "DDP gradient temporaries"


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


def _no_init(module: nn.Module) -> None:
    del module  # fake tensors: their values do not matter, only their sizes


def _fake_batch(mode: Any, batch: object) -> object:
    def fake(x: object) -> object:
        if not isinstance(x, torch.Tensor):
            return x
        if x.is_meta:
            with mode:
                return torch.empty(x.shape, dtype=x.dtype, device="cpu")
        return mode.from_tensor(x)

    return tree_map(fake, batch)


def _call(model: nn.Module, batch: object) -> object:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, tuple | list):
        return model(*batch)
    return model(batch)


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
    dp_replicate: int = 1,
    dp_shard: int | None = None,
    tp: int = 1,
    tp_plan: Mapping[str, Any] | None = None,
    fsdp: FSDPOptions | None = None,
    ddp_kwargs: DistributedDataParallelKwargs | None = None,
    accumulation_steps: int = 1,
    mixed_precision: MixedPrecision = "no",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
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
    as values do not matter. A mesh is built when ``tp > 1``, ``dp_replicate >
    1`` or ``fsdp`` is given; otherwise several ranks mean DDP.

    With ``world_size=8`` and ``fsdp=FSDPOptions()`` a 1B-parameter float32
    model with AdamW holds 0.5 GB of parameters, 0.5 GB of gradients and 1 GB of
    Adam state per rank (``parameters / 8 * 4`` bytes each, twice for Adam), and
    peaks higher with the gathered layers, activations and buffers.

    Args:
        model_fn: builds the model (called under ``torch.device("meta")``).
        batch: one micro-batch of one rank, as the model takes it: a tensor, a
            tuple of arguments or a mapping of keyword arguments; real or
            ``meta`` tensors, only their shapes and dtypes are used.
        world_size: the number of ranks planned for (any, e.g. 4,096).
        optimizer_fn: builds the optimizer from the wrapped model's parameters.
        dp_replicate, dp_shard, tp: the mesh, as ``build_mesh`` takes it;
            ``dp_shard=None`` is the rest of the world with ``fsdp``, else 1.
        tp_plan, fsdp, ddp_kwargs: as ``wrap_model`` takes them.
        accumulation_steps: micro-batches per optimizer step.
        mixed_precision: the context's autocast mode (``"no"``, ``"bf16"``,
            ``"fp16"``), as ``build_context(mixed_precision=...)``.
        loss_fn: turns the model's output into the loss; by default its ``loss``
            attribute, else the sum of its floating-point tensors.
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
        TypeError, ValueError: a bad argument (``pipeline=``: stages are not
            estimated), or what ``build_mesh`` or
            ``wrap_model`` refuse for this world (a mesh that does not divide it,
            a tp_plan naming a missing module).
        RuntimeError: a default process group already exists in this process.
    """
    _check_arguments(
        model_fn, world_size, optimizer_fn, accumulation_steps, margin, loss_fn
    )
    if wrap_options.get("pipeline") is not None:
        fail_value(
            _CALLER,
            "pipeline",
            wrap_options["pipeline"],
            "None: pipeline stages are not estimated (the stage cut gives the "
            "stage storage with Module.to_empty, which cannot make fake tensors)",
            "Estimate one stage's model (its layers) without pipeline=.",
        )
    kind = _device_kind(device)
    shard = (1 if fsdp is None else -1) if dp_shard is None else dp_shard
    ranks = [0]
    found: list[RankMemory] = []
    mesh_shape = (world_size, 1, 1)
    strategy = "none"
    while ranks:
        rank = ranks.pop(0)
        memory, shape, strategy, uneven = _estimate_rank(
            rank,
            model_fn,
            batch,
            world_size=world_size,
            optimizer_fn=optimizer_fn,
            sizes=(dp_replicate, shard, tp),
            tp_plan=tp_plan,
            fsdp=fsdp,
            ddp_kwargs=ddp_kwargs,
            accumulation_steps=accumulation_steps,
            mixed_precision=mixed_precision,
            loss_fn=loss_fn,
            wrap_options=wrap_options,
            device=kind,
        )
        found.append(memory)
        mesh_shape = shape
        if uneven and rank == 0 and world_size > 1:
            ranks.append(world_size - 1)
    return MemoryEstimate(
        world_size=world_size,
        mesh=mesh_shape,
        strategy=strategy,
        ranks=tuple(found),
        margin=margin,
        device=kind,
    )


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
    rank: int,
    model_fn: Callable[[], nn.Module],
    batch: object,
    *,
    world_size: int,
    optimizer_fn: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    sizes: tuple[int, int, int],
    tp_plan: Mapping[str, Any] | None,
    fsdp: FSDPOptions | None,
    ddp_kwargs: DistributedDataParallelKwargs | None,
    accumulation_steps: int,
    mixed_precision: MixedPrecision,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    wrap_options: Mapping[str, Any],
    device: str,
) -> tuple[RankMemory, tuple[int, int, int], str, bool]:
    dp_replicate, dp_shard, tp = sizes
    with fake_world_ctx(
        _CALLER, world_size, rank, mixed_precision=mixed_precision
    ) as ctx:
        # The mesh is built before fake tensors exist: a DeviceMesh reads its
        # layout back from integer tensors, which a fake tensor cannot answer.
        use_mesh = world_size > 1 and (tp > 1 or dp_replicate > 1 or fsdp is not None)
        mesh = None
        if use_mesh:
            mesh = build_mesh(ctx, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)
            shape = (mesh.dp_replicate, mesh.dp_shard, mesh.tp)
        else:
            shape = (world_size, 1, 1)
        strategy = plan_strategy(world_size, *shape, fsdp)
        mode = fake_tensor_mode()
        with mode:
            # DDP's and one process's whole model is built fake (Module.to_empty
            # cannot swap a meta parameter for a fake one); wrap_model
            # materialises this rank's shards of the rest.
            whole = strategy in ("ddp", "none")
            with torch.device(ctx.device if whole else "meta"):
                model = model_fn()
            if not isinstance(model, nn.Module):
                fail_type(_CALLER, "model_fn()", model, "an nn.Module")
            step_ctx = ctx
            if whole:
                # Each DDP rank holds the whole model; its step is one process's.
                # wrap_model would only move it (fake tensors cannot be moved in
                # place) and checkpoint its blocks, which is done here.
                step_ctx = DistributedContext(mixed_precision=mixed_precision)
                wrapped = model
                checkpointing = wrap_options.get("activation_checkpointing")
                if checkpointing is not None:
                    apply_activation_checkpointing(wrapped, checkpointing)
            else:
                options = {"init_fn": _no_init, **wrap_options}
                wrapped = wrap_model(
                    ctx,
                    model,
                    ddp_kwargs,
                    fsdp=fsdp,
                    mesh=mesh,
                    tp_plan=tp_plan,
                    **options,
                )
            optimizer = optimizer_fn(list(wrapped.parameters()))
            fake = _fake_batch(mode, batch)
            with device_rounding(device):  # the tracker counts storages from here
                tracker = build_tracker(wrapped, optimizer, fake)
                compute_loss = loss_fn or output_loss
                with tracker:
                    grad = GradState(accumulation_steps=accumulation_steps)
                    for _ in range(_STEPS * accumulation_steps):
                        _, grad = accumulate_step(
                            step_ctx,
                            grad,
                            wrapped,
                            optimizer,
                            lambda: compute_loss(_call(wrapped, fake)),
                        )
                        # The trackers keep one forward's per-module stats (and
                        # refuse a second); the peak survives the reset.
                        tracker.reset_mod_stats()
            parts = peak_parts(tracker)
            parameters, gradients, state = held_bytes(wrapped, optimizer, device)
            uneven = is_uneven(wrapped)
        if strategy == "ddp":
            kwargs = ddp_kwargs or DistributedDataParallelKwargs()
            parts[_DDP_BUCKETS] = 0 if kwargs.gradient_as_bucket_view else gradients
            # Measured on gloo: a temporary of the gradients' full size at the
            # peak, besides the buckets (whatever bucket_cap_mb).
            parts[_DDP_COPY] = gradients
    memory = RankMemory(
        rank=rank,
        parameters=parameters,
        gradients=gradients,
        optimizer_state=state,
        peak=sum(parts.values()),
        peak_parts=tuple(parts.items()),
    )
    return memory, shape, strategy, uneven
