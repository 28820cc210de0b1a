"""Model wrapping: DDP with its communication hook, or FSDP2; unwrapping; state placement.

``wrap_model(ctx, model, ddp_kwargs, fsdp=...)`` moves a module to ``ctx.device`` and,
with several processes, wraps it in ``DistributedDataParallel`` (every field of
``DistributedDataParallelKwargs``, then the communication hook it names) or shards it
with FSDP2 (``torch.distributed.fsdp.fully_shard``, options in ``FSDPOptions``).
``unwrap_model`` walks back to the user's module through DDP, FSDP and
``torch.compile``. ``move_optimizer_state_`` puts an optimizer's state on its
parameters' device after they moved.

With one process nothing is wrapped:

>>> from funcaccel.context import DistributedContext
>>> net = torch.nn.Linear(2, 1)
>>> wrap_model(DistributedContext(), net) is net
True
>>> unwrap_model(net) is net
True
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Final
from typing import TypeAlias

import torch
from torch import nn
from torch.nn.parallel import DataParallel
from torch.nn.parallel import DistributedDataParallel

from funcaccel._checks import as_tuple_of
from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._ctx_checks import check_context
from funcaccel._dist_types import is_deepspeed_engine
from funcaccel._dist_types import is_fsdp_module
from funcaccel._typing import Stateful
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group
from funcaccel.grad_state import GradState
from funcaccel.kwargs import DDPCommunicationHookType
from funcaccel.kwargs import DistributedDataParallelKwargs
from funcaccel.mesh import ParallelMesh
from funcaccel.mesh import check_mesh
from funcaccel.model._deepspeed import build_engine
from funcaccel.model._deepspeed_options import DeepSpeedOptions
from funcaccel.model._fsdp import FSDPOptions
from funcaccel.model._fsdp import check_fsdp_options
from funcaccel.model._fsdp import shard_model
from funcaccel.model._mesh import check_mesh_wrapping
from funcaccel.model._mesh import wrap_on_mesh
from funcaccel.model._meta import check_meta_init
from funcaccel.model._meta import has_meta_tensors
from funcaccel.model._meta import materialize_

__all__ = [
    "FSDPOptions",
    "move_optimizer_state_",
    "unwrap_model",
    "wrap_model",
]

# (state, GradBucket) -> future of the reduced bucket; mypy cannot see
# torch.distributed.GradBucket, so the bucket is typed Any.
_CommHook: TypeAlias = Callable[[Any, Any], torch.futures.Future[torch.Tensor]]


def _hook(hook_type: DDPCommunicationHookType) -> _CommHook:
    """Return torch's hook for ``hook_type`` (its module is imported on first use)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    hooks: dict[DDPCommunicationHookType, _CommHook] = {
        DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
        DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
        DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
        DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook,
    }
    return hooks[hook_type]


def _wrapper(
    wrapper_type: DDPCommunicationHookType,
) -> Callable[[_CommHook], _CommHook]:
    """Return torch's compression wrapper for ``wrapper_type`` (imported on first use)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    wrappers: dict[DDPCommunicationHookType, Callable[[_CommHook], _CommHook]] = {
        DDPCommunicationHookType.FP16: default_hooks.fp16_compress_wrapper,
        DDPCommunicationHookType.BF16: default_hooks.bf16_compress_wrapper,
    }
    return wrappers[wrapper_type]


_POWER_SGD_HOOKS: Final = frozenset(
    {DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD}
)
_MODULE: Final = "a torch.nn.Module"
# Devices whose torch.distributed backends can all-reduce bfloat16 (NCCL, XCCL).
_BF16_COMM_DEVICES: Final = frozenset({"cuda", "xpu"})


def inside_compile(model: nn.Module) -> nn.Module:
    """Return the module inside ``torch.compile``'s wrappers (``._orig_mod``), if any.

    >>> net = nn.Linear(1, 1)
    >>> inside_compile(net) is net
    True
    """
    while isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):
        model = inner
    return model


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
) -> nn.Module:
    """Move ``model`` to ``ctx.device`` in place (as ``.to`` does), then wrap it for ``ctx``.

    With one process the module itself is returned (``ddp_kwargs`` and its hooks are
    unused). With several processes a module with no parameter requiring grad is
    returned unwrapped; otherwise, when ``fsdp`` is ``None``, it is wrapped in
    ``DistributedDataParallel(model, **ddp_kwargs.to_kwargs())`` (plus
    ``device_ids=[ctx.local_process_index]`` and ``output_device`` on CUDA) and the
    communication hook of ``ddp_kwargs`` is registered: ``"fp16"`` / ``"bf16"``
    compress hooks, ``"power_sgd"`` / ``"batched_power_sgd"`` with
    ``PowerSGDState(process_group=None, **comm_state_option)``, optionally inside the
    ``fp16`` / ``bf16`` compress wrapper. With ``fsdp`` the module is sharded in place
    by FSDP2 (see ``FSDPOptions``) and returned: it is its own root. ``forward`` is
    never replaced; autocast is applied by the training step. FSDP2 replaces every
    parameter with a new sharded one, so an optimizer built before ``wrap_model``
    (the order of Accelerate's examples) must be passed in ``optimizers``: its
    param groups are re-pointed in place at the new parameters, keeping their
    order, hyperparameters and state (state tensors sharded like their
    parameter). DDP and one process keep the parameters, and leave ``optimizers``
    untouched. torch 2.13 deprecates
    DDP's ``broadcast_buffers`` and ``check_reduction``: setting either away from
    its default makes DDP emit its ``FutureWarning``, which is passed on as is.

    With 2 processes, ``wrap_model(ctx, net, DistributedDataParallelKwargs(
    comm_hook="fp16"))`` returns a ``DistributedDataParallel`` on both ranks; after
    one backward pass rank 0 and rank 1 hold the same gradient, the mean of their
    two local gradients all-reduced in float16. With ``fsdp=FSDPOptions()`` rank 0
    keeps the first half of each parameter's rows and rank 1 the second half.

    On a ``mesh`` (``build_mesh``), ``tp_plan`` (module name -> torch parallel
    style) is applied first with ``parallelize_module(model, mesh["tp"],
    tp_plan)``; then FSDP2 shards over ``mesh["dp_shard"]`` (HSDP over
    ``["dp_replicate", "dp_shard"]`` when ``dp_replicate > 1``), DDP replicates
    when only ``dp_replicate > 1`` and ``tp == 1``, and FSDP2 with one-rank shards
    replicates a tensor-parallel model over ``dp_replicate`` (DDP cannot hold
    ``DTensor`` parameters). With 4 ranks, ``build_mesh(ctx, dp_shard=2, tp=2)``
    and ``tp_plan={"up": ColwiseParallel(), "down": RowwiseParallel()}``: rank 1
    holds rows 4-5 of ``up.weight`` (8 rows: tensor-parallel half 1, FSDP shard
    0), rank 2 rows 2-3 (half 0, shard 1), and ranks 0/1 and 2/3 see the same
    batches (docs/mesh.md).

    A model built on the ``meta`` device (``with torch.device("meta"):``) is
    sharded while still on meta, and then only each rank's shards get storage:
    every module holding meta tensors of its own is built in full on
    ``ctx.device``, initialised by ``init_fn(module)`` (default: its
    ``reset_parameters()``), and cut down to this rank's part, one module at a
    time. With the same seed on every rank the result equals building the model
    whole and initialising each module in ``model.modules()`` order. Without
    sharding (one process, DDP) the model is materialised whole before wrapping.

    Args:
        ctx: the distributed context.
        model: the user's module; changed in place (moved, and sharded with FSDP).
        ddp_kwargs: DDP options and communication hook; ``None`` for the defaults.
        fsdp: FSDP2 options; ``None`` selects DDP.
        optimizers: optimizers already built on ``model``'s parameters; changed
            in place when FSDP2 replaces the parameters.
        mesh: the ``ParallelMesh`` of ``ctx``; ``None``: every rank is a
            data-parallel rank.
        tp_plan: module names (``fnmatch`` patterns allowed) to parallel styles
            (``ColwiseParallel()``, ``RowwiseParallel()``, ...); required exactly
            when ``mesh.tp > 1``.
        init_fn: for a model on the ``meta`` device: initialises one module's own
            parameters and buffers in place (called under ``torch.no_grad()``);
            ``None`` calls each module's ``reset_parameters()``. Unused for a
            model with no meta tensors.
        deepspeed: build a DeepSpeed ZeRO engine instead (docs/deepspeed.md); the
            engine is returned and from then on owns ``model``, the one optimizer
            in ``optimizers`` (its param groups now hold ZeRO's fp32 partitions)
            and ``scheduler`` (saved in its checkpoints, stepped by
            ``maybe_step_scheduler`` only). Needs a process group at any world size.
        scheduler: with ``deepspeed``, the LR scheduler the engine checkpoints.
        grad: with ``deepspeed``, the run's ``GradState``: its
            ``accumulation_steps`` becomes the engine's.

    Returns:
        ``model``, a ``DistributedDataParallel`` wrapping it, or (with
        ``deepspeed``) DeepSpeed's engine.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``model`` is already wrapped; ``fsdp`` together with
            ``ddp_kwargs``; a bfloat16 hook or wrapper on a device whose backend
            cannot all-reduce bfloat16 (CPU/gloo); FSDP options that do not fit
            ``ctx``; a mesh of another rank or world; ``tp_plan`` without
            ``mesh.tp > 1`` (or missing with it), or naming no submodule, or
            a ``RowwiseParallel`` ``nn.Linear`` whose ``in_features`` ``tp``
            does not divide with no ``ColwiseParallel(use_local_output=False)``
            to hand it a ``DTensor``; ``dp_shard > 1`` without ``fsdp``; ``fsdp`` on a mesh with one
            data-parallel rank; ``ddp_kwargs`` with ``tp > 1``; a meta model
            without ``init_fn`` whose module holding meta tensors has no
            ``reset_parameters``.
        RuntimeError: ``ctx.num_processes > 1`` without a matching default group,
            or a mesh without a ``DeviceMesh``.
    """
    _check_arguments(ctx, model, ddp_kwargs, fsdp)
    opts: tuple[torch.optim.Optimizer, ...] = ()
    if not (isinstance(optimizers, tuple) and not optimizers):
        opts = as_tuple_of(
            optimizers, torch.optim.Optimizer, caller="wrap_model", name="optimizers"
        )
    if deepspeed is not None or scheduler is not None or grad is not None:
        _check_deepspeed_arguments(deepspeed, ddp_kwargs, fsdp, mesh)
        assert deepspeed is not None
        model.to(ctx.device)
        return build_engine(ctx, model, deepspeed, opts, scheduler, grad)
    kwargs = DistributedDataParallelKwargs() if ddp_kwargs is None else ddp_kwargs
    if mesh is not None:
        check_mesh(ctx, mesh, "wrap_model")
        check_mesh_wrapping(
            ctx, model, mesh, tp_plan, fsdp, kwargs != DistributedDataParallelKwargs()
        )
    elif tp_plan is not None:
        what = "None without a mesh (tp_plan needs a mesh with tp > 1)"
        hint = "Pass mesh=build_mesh(ctx, tp=...) as well, or tp_plan=None."
        fail_value("wrap_model", "tp_plan", tp_plan, what, hint)
    if ctx.num_processes > 1:
        if fsdp is None:
            _check_hook_device(ctx, kwargs)
        elif mesh is None:
            check_fsdp_options(ctx, fsdp, "wrap_model")
        require_process_group(ctx, "wrap_model")
    check_meta_init("wrap_model", model, init_fn)
    meta = has_meta_tensors(model)
    sharded = ctx.num_processes > 1 and (
        fsdp is not None or (mesh is not None and mesh.tp > 1)
    )
    if meta and not (sharded and any(p.requires_grad for p in model.parameters())):
        materialize_(model, ctx.device, init_fn, opts)
        meta = False
    if meta:
        _move_real_tensors_(model, ctx.device)
    else:
        model.to(ctx.device)
    wrapped = _wrap(ctx, model, kwargs, fsdp, opts, mesh, tp_plan)
    if meta:
        materialize_(wrapped, ctx.device, init_fn, opts)
    return wrapped


def _wrap(
    ctx: DistributedContext,
    model: nn.Module,
    kwargs: DistributedDataParallelKwargs,
    fsdp: FSDPOptions | None,
    opts: Sequence[torch.optim.Optimizer],
    mesh: ParallelMesh | None,
    tp_plan: Mapping[str, Any] | None,
) -> nn.Module:
    if ctx.num_processes == 1:
        return model
    if mesh is not None:
        wrapped = wrap_on_mesh(ctx, model, mesh, tp_plan, fsdp, opts)
        if wrapped is not None:
            return wrapped
    if not any(param.requires_grad for param in model.parameters()):
        return model
    if fsdp is not None:
        return shard_model(ctx, model, fsdp, opts)
    return _build_ddp(ctx, model, kwargs)


def _move_real_tensors_(model: nn.Module, device: torch.device) -> None:
    # model.to() cannot copy out of meta tensors; move the others one by one.
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if not param.is_meta and param.device != device:
                param.data = param.data.to(device)
        for name, buffer in list(module.named_buffers(recurse=False)):
            if not buffer.is_meta and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def _check_arguments(
    ctx: object, model: object, ddp_kwargs: object, fsdp: object
) -> None:
    caller = "wrap_model"
    check_context(caller, ctx)
    hint = "Pass the module itself, not its parameters or state_dict."
    model = check_type(caller, "model", model, nn.Module, what=_MODULE, hint=hint)
    kwargs_type = DistributedDataParallelKwargs
    check_type(caller, "ddp_kwargs", ddp_kwargs, kwargs_type, optional=True)
    hint = "Use fsdp=FSDPOptions() for the defaults."
    what = "an FSDPOptions or None"  # "an eff", not a_or_an's "a"
    check_type(caller, "fsdp", fsdp, FSDPOptions, what=what, hint=hint, optional=True)
    inner = inside_compile(model)
    if (
        isinstance(inner, (DistributedDataParallel, DataParallel))
        or is_fsdp_module(inner)
        or is_deepspeed_engine(inner)
    ):
        msg = (
            f"wrap_model: model is already wrapped ({type(inner).__name__}); pass "
            "unwrap_model(model), or use the wrapped model as it is."
        )
        raise ValueError(msg)
    if fsdp is not None and ddp_kwargs is not None:
        # Refused at every world size (and for default kwargs too), so that a
        # script tried on one process fails there, not first on the cluster.
        assert isinstance(ddp_kwargs, DistributedDataParallelKwargs)
        msg = (
            f"wrap_model: ddp_kwargs only configure DDP, but fsdp was given; got "
            f"{_changed_fields(ddp_kwargs)}. Pass ddp_kwargs=None with fsdp, or "
            "fsdp=None for DDP."
        )
        raise ValueError(msg)


def _check_deepspeed_arguments(
    deepspeed: object, ddp_kwargs: object, fsdp: object, mesh: object
) -> None:
    caller = "wrap_model"
    if deepspeed is None:
        what = (
            "a DeepSpeedOptions when scheduler= or grad= is given (they configure "
            "a DeepSpeed engine)"
        )
        hint = "Pass deepspeed=DeepSpeedOptions(...) too, or leave them out."
        fail_value(caller, "deepspeed", deepspeed, what, hint)
    check_type(caller, "deepspeed", deepspeed, DeepSpeedOptions, optional=True)
    for name, value in (("ddp_kwargs", ddp_kwargs), ("fsdp", fsdp), ("mesh", mesh)):
        if value is not None:
            what = "None with deepspeed= (a DeepSpeed engine cannot be combined)"
            fail_value(caller, name, value, what, "Pass one of them.")


def _changed_fields(kwargs: DistributedDataParallelKwargs) -> str:
    # The whole repr runs to 300 characters; the fields set are what matters.
    default = DistributedDataParallelKwargs()
    changed = ", ".join(
        f"{field.name}={getattr(kwargs, field.name)!r}"
        for field in dataclasses.fields(kwargs)
        if getattr(kwargs, field.name) != getattr(default, field.name)
    )
    return f"DistributedDataParallelKwargs({changed})"


def _check_hook_device(
    ctx: DistributedContext, kwargs: DistributedDataParallelKwargs
) -> None:
    # torch raises a TypeError about CUDA/NCCL versions only once the hook is
    # registered; refuse earlier with a message that says what to use instead.
    bf16 = DDPCommunicationHookType.BF16
    for field, value in (
        ("comm_hook", kwargs.comm_hook),
        ("comm_wrapper", kwargs.comm_wrapper),
    ):
        if value == bf16 and ctx.device.type not in _BF16_COMM_DEVICES:
            msg = (
                f"wrap_model: {field}='bf16' needs a CUDA (NCCL) or XPU (XCCL) "
                f"device, but ctx.device is {ctx.device} (backend "
                f"{ctx.backend!r}), which cannot all-reduce bfloat16; use "
                f"{field}='fp16' or 'no' on CPU."
            )
            raise ValueError(msg)


def _build_ddp(
    ctx: DistributedContext, model: nn.Module, kwargs: DistributedDataParallelKwargs
) -> DistributedDataParallel:
    device_kwargs: dict[str, Any] = {}
    if ctx.device.type == "cuda":
        device_kwargs = {
            "device_ids": [ctx.local_process_index],
            "output_device": ctx.local_process_index,
        }
    ddp = DistributedDataParallel(model, **kwargs.to_kwargs(), **device_kwargs)
    _register_comm_hook(ddp, kwargs)
    return ddp


def _register_comm_hook(
    ddp: DistributedDataParallel, kwargs: DistributedDataParallelKwargs
) -> None:
    # The kwargs record has already validated the hook/wrapper/state combination;
    # converting again accepts plain strings as well as enum members.
    hook_type = DDPCommunicationHookType(kwargs.comm_hook)
    if hook_type is DDPCommunicationHookType.NO:
        return
    hook = _hook(hook_type)
    state: object = None
    if hook_type in _POWER_SGD_HOOKS:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(
            process_group=None, **kwargs.comm_state_option
        )
    wrapper_type = DDPCommunicationHookType(kwargs.comm_wrapper)
    if wrapper_type is not DDPCommunicationHookType.NO:
        hook = _wrapper(wrapper_type)(hook)
    ddp.register_comm_hook(state, hook)


def _compiled_module_type() -> type[nn.Module] | None:
    # An OptimizedModule can only exist once torch._dynamo is imported, and
    # importing it takes seconds; look it up without importing it.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    found: object = getattr(eval_frame, "OptimizedModule", None)
    if isinstance(found, type) and issubclass(found, nn.Module):
        return found
    return None


def unwrap_model(model: nn.Module) -> nn.Module:
    """Return the user's module inside ``model``; nothing is changed.

    Walks through ``DistributedDataParallel`` / ``DataParallel`` and DeepSpeed
    engines (``.module``; under ZeRO-3 its parameters are partitioned) and
    ``torch.compile``'s ``OptimizedModule`` (``._orig_mod``), in any nesting. An
    FSDP2 module (``fully_shard`` changes the module's class in place) is its own
    root and is returned as is, as is an unwrapped module.

    Args:
        model: a module, possibly wrapped.

    Returns:
        The innermost module; ``model`` itself when it is not wrapped.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    >>> net = torch.nn.Linear(2, 1)
    >>> unwrap_model(torch.nn.DataParallel(net)) is net
    True
    """
    model = check_type("unwrap_model", "model", model, nn.Module, what=_MODULE)
    compiled = _compiled_module_type()
    while True:
        if compiled is not None and isinstance(model, compiled):
            inner = model._orig_mod
        elif isinstance(
            model, (DistributedDataParallel, DataParallel)
        ) or is_deepspeed_engine(model):
            inner = model.module
        else:
            return model
        assert isinstance(inner, nn.Module), type(inner)
        model = inner


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
