"""``wrap_model``: one call that picks the strategy; ``move_optimizer_state_``.

``wrap_model`` checks the combination of its arguments once, then composes the
strategy functions (``wrap_ddp``, ``wrap_fsdp``, ``wrap_mesh``,
``wrap_deepspeed``, each in its own file) with ``materialize_meta`` in the order
a ``meta`` model needs.

With one process nothing is wrapped:

>>> from funcaccel.context import DistributedContext
>>> net = torch.nn.Linear(2, 1)
>>> wrap_model(DistributedContext(), net) is net
True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Final

import torch
from torch import nn

from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._typing import Stateful
from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState
from funcaccel.kwargs import DistributedDataParallelKwargs
from funcaccel.mesh import ParallelMesh
from funcaccel.model._compile_options import ActivationCheckpointOptions
from funcaccel.model._compile_options import CompileOptions
from funcaccel.model._ddp import changed_fields
from funcaccel.model._ddp import check_ddp
from funcaccel.model._ddp import ddp_
from funcaccel.model._deepspeed import build_engine
from funcaccel.model._deepspeed_options import DeepSpeedOptions
from funcaccel.model._fast_step import check_fast_step
from funcaccel.model._fast_step import then_wrap
from funcaccel.model._fsdp import FSDP_OR_NONE
from funcaccel.model._fsdp import FSDPOptions
from funcaccel.model._fsdp import check_fsdp
from funcaccel.model._fsdp import fsdp_
from funcaccel.model._mesh import check_mesh_setup
from funcaccel.model._mesh import mesh_
from funcaccel.model._meta import check_meta_init
from funcaccel.model._meta import wrap_materialized
from funcaccel.model._pipeline import build_pipeline
from funcaccel.model._pipeline_options import PipelineOptions
from funcaccel.model._rebind import as_optimizers
from funcaccel.model._wrappers import check_unwrapped

__all__ = ["move_optimizer_state_", "wrap_model"]

_CALLER: Final = "wrap_model"
_DEEPSPEED: Final = (
    "a DeepSpeedOptions when scheduler= or grad= is given (they configure a "
    "DeepSpeed engine)"
)
_NO_MESH: Final = "None without a mesh (tp_plan needs a mesh with tp > 1)"
_PASS_MESH: Final = "Pass mesh=build_mesh(ctx, tp=...) as well, or tp_plan=None."
_ALONE: Final = "None with deepspeed= (a DeepSpeed engine cannot be combined)"


def wrap_model(
    ctx: DistributedContext,
    model: nn.Module,
    ddp_kwargs: DistributedDataParallelKwargs | None = None,
    *,
    fsdp: FSDPOptions | None = None,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
    mesh: ParallelMesh | None = None,
    tp_plan: Mapping[str, Any] | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    deepspeed: DeepSpeedOptions | None = None,
    scheduler: Stateful | None = None,
    grad: GradState | None = None,
    compile: CompileOptions | None = None,
    activation_checkpointing: ActivationCheckpointOptions | None = None,
    pipeline: PipelineOptions | None = None,
) -> nn.Module:
    """Move ``model`` to ``ctx.device`` in place, then wrap it for ``ctx``'s world.

    One entry point for every strategy, so a script switches strategy by an
    argument: DDP by default (``wrap_ddp``), FSDP2 with ``fsdp`` (``wrap_fsdp``),
    tensor / hybrid parallelism with ``mesh`` and ``tp_plan`` (``wrap_mesh``), a
    DeepSpeed ZeRO engine with ``deepspeed`` (``wrap_deepspeed``). A model built
    on the ``meta`` device gets storage too (``materialize_meta``): after sharding,
    only this rank's shards. With one process the module itself is returned.
    Every combination is checked before anything changes.

    Args:
        ctx: the distributed context.
        model: the user's module; changed in place (moved, sharded).
        ddp_kwargs: DDP options and communication hook.
        fsdp, mesh, tp_plan: FSDP2 options; a ``ParallelMesh`` and its plan.
        optimizers: optimizers built on ``model``'s parameters, re-pointed in
            place where sharding replaces them (the one optimizer, with DeepSpeed).
        init_fn: initialises one module of a ``meta`` model (default:
            ``reset_parameters()``).
        deepspeed, scheduler, grad: a ZeRO engine's options, the scheduler it
            checkpoints and the run's ``GradState``.
        compile, activation_checkpointing: per-block in-place compilation and
            activation checkpointing, applied before sharding / DDP
            (``apply_activation_checkpointing``, then ``compile_blocks``).
        pipeline: cut ``model`` into pipeline stages on ``mesh`` (``pp > 1``)
            and return this rank's as a ``Pipeline`` (docs/pipeline.md); TP and
            FSDP2 / replication apply inside each stage.

    Returns:
        ``model``, a ``DistributedDataParallel`` wrapping it, or DeepSpeed's engine.

    With 2 processes, ``wrap_model(ctx, net)`` returns DDP on both ranks, and
    ``wrap_model(ctx, net, fsdp=FSDPOptions(), optimizers=opt)`` returns ``net``
    sharded in place (rank 0 keeps the first half of each weight's rows), with
    ``opt`` holding the new parameters. docs/model.md has the full semantics,
    the per-rank examples and every error (``TypeError``, ``ValueError``, and
    ``RuntimeError`` for a missing process group).

    >>> net = torch.nn.Linear(2, 1)  # one process: nothing to shard
    >>> wrap_model(DistributedContext(), net, fsdp=FSDPOptions()) is net
    True
    """
    _check_arguments(ctx, model, ddp_kwargs, fsdp)
    if pipeline is not None:
        others: dict[str, object] = {
            "ddp_kwargs": ddp_kwargs,
            "deepspeed": deepspeed,
            "scheduler": scheduler,
            "grad": grad,
        }
        _check_pipeline_arguments(others, optimizers)
        check_fast_step(_CALLER, model, activation_checkpointing, compile)
        fast = (activation_checkpointing, compile)
        return build_pipeline(ctx, model, pipeline, mesh, tp_plan, fsdp, init_fn, fast)
    check_fast_step(_CALLER, model, activation_checkpointing, compile)
    opts = as_optimizers(_CALLER, optimizers)
    if deepspeed is not None or scheduler is not None or grad is not None:
        given = (ddp_kwargs, fsdp, mesh, tp_plan, compile, activation_checkpointing)
        _check_deepspeed_arguments(deepspeed, *given)
        assert deepspeed is not None
        return build_engine(_CALLER, ctx, model, deepspeed, opts, scheduler, grad)
    kwargs = DistributedDataParallelKwargs() if ddp_kwargs is None else ddp_kwargs
    wrap: Callable[[nn.Module], nn.Module]
    if mesh is not None:
        mesh = check_mesh_setup(_CALLER, ctx, model, mesh, tp_plan, fsdp, kwargs)
        wrap = functools.partial(mesh_, ctx, mesh, tp_plan, fsdp, kwargs, opts)
    elif tp_plan is not None:
        fail_value(_CALLER, "tp_plan", tp_plan, _NO_MESH, _PASS_MESH)
    elif fsdp is not None:
        check_fsdp(_CALLER, ctx, fsdp)
        wrap = functools.partial(fsdp_, ctx, fsdp, opts)
    else:
        check_ddp(_CALLER, ctx, kwargs)
        wrap = functools.partial(ddp_, ctx, kwargs)
    check_meta_init(_CALLER, model, init_fn)
    tp = mesh is not None and mesh.tp > 1
    shards = ctx.num_processes > 1 and (fsdp is not None or tp)
    wrap = then_wrap(activation_checkpointing, compile, wrap)
    return wrap_materialized(ctx, model, init_fn, opts, wrap, shards=shards)


def _check_pipeline_arguments(others: dict[str, object], optimizers: object) -> None:
    for name, value in others.items():
        if value is not None:
            what = "None with pipeline= (not supported with pipeline stages)"
            fail_value(_CALLER, name, value, what, f"Leave {name} out.")
    if optimizers != ():
        what = "() with pipeline= (each rank holds only its stages' parameters)"
        hint = "Build the optimizer afterwards on the Pipeline's parameters()."
        fail_value(_CALLER, "optimizers", optimizers, what, hint)


def _check_arguments(
    ctx: object, model: object, ddp_kwargs: object, fsdp: object
) -> None:
    check_unwrapped(_CALLER, ctx, model)
    kind = DistributedDataParallelKwargs
    check_type(_CALLER, "ddp_kwargs", ddp_kwargs, kind, optional=True)
    hint = "Use fsdp=FSDPOptions() for the defaults."
    check_type(
        _CALLER, "fsdp", fsdp, FSDPOptions, what=FSDP_OR_NONE, hint=hint, optional=True
    )
    # Refused at every world size (and for default kwargs too), so that a script
    # tried on one process fails there, not first on the cluster.
    if fsdp is not None and isinstance(ddp_kwargs, kind):
        msg = f"{_CALLER}: ddp_kwargs only configure DDP, but fsdp was given; got {changed_fields(ddp_kwargs)}. Pass ddp_kwargs=None with fsdp, or fsdp=None for DDP."
        raise ValueError(msg)


def _check_deepspeed_arguments(
    deepspeed: object,
    ddp_kwargs: object,
    fsdp: object,
    mesh: object,
    tp_plan: object,
    compile: object = None,
    activation_checkpointing: object = None,
) -> None:
    if deepspeed is None:
        fail_value(
            _CALLER,
            "deepspeed",
            deepspeed,
            _DEEPSPEED,
            "Pass deepspeed=DeepSpeedOptions(...) too, or leave them out.",
        )
    check_type(_CALLER, "deepspeed", deepspeed, DeepSpeedOptions, optional=True)
    given = {"ddp_kwargs": ddp_kwargs, "fsdp": fsdp, "mesh": mesh, "tp_plan": tp_plan}
    given |= {
        "compile": compile,
        "activation_checkpointing": activation_checkpointing,
    }
    for name, value in given.items():
        if value is not None:
            fail_value(_CALLER, name, value, _ALONE, "Pass one of them.")


def move_optimizer_state_(optimizer: torch.optim.Optimizer) -> int:
    """Move ``optimizer``'s state tensors in place onto their parameters' device.

    Use after the parameters moved (``wrap_model`` moves them in place, so an
    optimizer built or loaded before it keeps state on the old device). The rule is
    the one ``Optimizer.load_state_dict`` applies: floating-point state takes the
    parameter's dtype and device, other tensors its device, and ``"step"`` is left
    as is unless the group is ``capturable`` or ``fused`` (then float32 on the
    parameter's device). Non-tensor state and the parameters are left unchanged.

    Args:
        optimizer: a torch optimizer; its ``state`` entries are replaced in place.

    Returns:
        The number of state tensors that were moved or cast.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.

    >>> param = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    >>> param.grad = torch.ones(2)
    >>> opt.step()
    >>> param.data = param.data.double()
    >>> move_optimizer_state_(opt), opt.state[param]["momentum_buffer"].dtype
    (1, torch.float64)
    """
    kind, what = torch.optim.Optimizer, "a torch.optim.Optimizer"
    check_type("move_optimizer_state_", "optimizer", optimizer, kind, what=what)
    moved = 0
    for group in optimizer.param_groups:
        special_step = bool(group.get("capturable")) or bool(group.get("fused"))
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            for key, value in list(state.items()):
                if not isinstance(value, torch.Tensor):
                    continue
                placed = _placed(
                    value, param, is_step=key == "step", special=special_step
                )
                if placed is not value:
                    state[key] = placed
                    moved += 1
    return moved


def _placed(
    value: torch.Tensor, param: torch.Tensor, *, is_step: bool, special: bool
) -> torch.Tensor:
    if is_step:
        if special:
            return value.to(dtype=torch.float32, device=param.device)
        return value
    if param.is_floating_point() and value.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device)
    return value.to(device=param.device)
