"""``wrap_ddp``: ``DistributedDataParallel`` with the communication hook it names.

``check_ddp`` and ``ddp_`` are its two halves (refuse before anything changes;
wrap), so that ``wrap_model`` can give a ``meta`` model storage between them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from typing import Final
from typing import TypeAlias

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group
from funcaccel.kwargs import DDPCommunicationHookType
from funcaccel.kwargs import DistributedDataParallelKwargs
from funcaccel.model._meta import has_meta_tensors
from funcaccel.model._wrappers import check_unwrapped

__all__ = ["changed_fields", "check_ddp", "ddp_", "refuse_meta", "wrap_ddp"]

_BF16_DEVICES: Final = "'bf16' needs a CUDA (NCCL) or XPU (XCCL) device."
_ON_META: Final = "a module on a real device: DDP broadcasts its parameters"
_MATERIALIZE: Final = "Give it storage first with materialize_meta(ctx, model)."

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
# Devices whose torch.distributed backends can all-reduce bfloat16 (NCCL, XCCL).
_BF16_COMM_DEVICES: Final = frozenset({"cuda", "xpu"})


def changed_fields(kwargs: DistributedDataParallelKwargs) -> str:
    # The whole repr runs to 300 characters; the fields set are what matters.
    default = DistributedDataParallelKwargs()
    changed = ", ".join(
        f"{field.name}={getattr(kwargs, field.name)!r}"
        for field in dataclasses.fields(kwargs)
        if getattr(kwargs, field.name) != getattr(default, field.name)
    )
    return f"DistributedDataParallelKwargs({changed})"


def _check_hook_device(
    caller: str, ctx: DistributedContext, kwargs: DistributedDataParallelKwargs
) -> None:
    # torch raises a TypeError about CUDA/NCCL versions only once the hook is
    # registered; refuse earlier with a message that says what to use instead.
    cannot = f"'fp16' or 'no' on {ctx.device} (backend {ctx.backend!r}), which cannot all-reduce bfloat16"
    for field in ("comm_hook", "comm_wrapper"):
        bf16 = getattr(kwargs, field) == DDPCommunicationHookType.BF16
        if bf16 and ctx.device.type not in _BF16_COMM_DEVICES:
            fail_value(caller, f"ddp_kwargs.{field}", "bf16", cannot, _BF16_DEVICES)


def _build_ddp(
    ctx: DistributedContext,
    model: nn.Module,
    kwargs: DistributedDataParallelKwargs,
    caller: str,
) -> DistributedDataParallel:
    _refuse_fake(caller, model)
    device_kwargs: dict[str, Any] = {}
    if ctx.device.type == "cuda":
        device_kwargs = {
            "device_ids": [ctx.local_process_index],
            "output_device": ctx.local_process_index,
        }
    ddp = DistributedDataParallel(model, **kwargs.to_kwargs(), **device_kwargs)
    _register_comm_hook(ddp, kwargs)
    return ddp


def _refuse_fake(caller: str, model: nn.Module) -> None:
    """Refuse fake parameters (a dry run's), which DDP's C++ reducer cannot hold."""
    from torch._subclasses.fake_tensor import is_fake

    if any(is_fake(p) for p in model.parameters()):
        msg = (
            f"{caller}: DistributedDataParallel cannot wrap a model whose "
            "parameters are fake tensors (got one built under a fake-tensor mode, "
            "as in dry_run(..., tensors='fake')): its C++ reducer reads every "
            "parameter and allocates gradient buckets of their size. Dry-run a DDP "
            "model with tensors='real' and a small configuration of it (each DDP "
            "rank holds the whole model, so estimate_memory gives its memory), or "
            "shard it with fsdp=FSDPOptions() or a mesh."
        )
        raise ValueError(msg)


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


def check_ddp(
    caller: str, ctx: DistributedContext, kwargs: DistributedDataParallelKwargs
) -> None:
    """Refuse, before anything changes, DDP options ``ctx`` cannot run; need its group.

    Raises:
        ValueError: a bfloat16 hook or wrapper on a device whose backend cannot
            all-reduce bfloat16 (CPU/gloo).
        RuntimeError: several processes without a matching default group.
    """
    if ctx.num_processes > 1:
        _check_hook_device(caller, ctx, kwargs)
        require_process_group(ctx, caller)


def refuse_meta(caller: str, model: nn.Module) -> None:
    """Refuse a model with ``meta`` tensors, which DDP cannot replicate."""
    if has_meta_tensors(model):
        fail_value(caller, "model", model, _ON_META, _MATERIALIZE)


def ddp_(
    ctx: DistributedContext,
    kwargs: DistributedDataParallelKwargs,
    model: nn.Module,
    *,
    caller: str = "wrap_model",
) -> nn.Module:
    """Wrap ``model`` in DDP when there is something to synchronise (see ``wrap_ddp``).

    ``model`` comes last, so that ``wrap_model`` can bind the rest beforehand.
    """
    if ctx.num_processes == 1 or not any(p.requires_grad for p in model.parameters()):
        return model
    return _build_ddp(ctx, model, kwargs, caller)


def wrap_ddp(
    ctx: DistributedContext,
    model: nn.Module,
    ddp_kwargs: DistributedDataParallelKwargs | None = None,
) -> nn.Module:
    """Move ``model`` to ``ctx.device`` in place, then wrap it in ``DistributedDataParallel``.

    With one process, or no parameter that requires grad, ``model`` itself is
    returned. Otherwise it is ``DistributedDataParallel(model,
    **ddp_kwargs.to_kwargs())`` (plus ``device_ids`` and ``output_device`` on
    CUDA), with the communication hook of ``ddp_kwargs`` registered
    (``"fp16"``/``"bf16"`` compression, PowerSGD, optionally in a compress
    wrapper; docs/model.md). The parameters stay the same objects, so an
    optimizer built before keeps working. ``wrap_model(ctx, model, ddp_kwargs)``
    does the same; use this to say "DDP" in the code.

    With 2 processes, ``wrap_ddp(ctx, net, DistributedDataParallelKwargs(
    comm_hook="fp16"))`` returns a DDP module on both ranks; after one backward
    both hold the mean of their two local gradients, all-reduced in float16.

    Args:
        ctx: the distributed context.
        model: the user's module, not wrapped yet and not on ``meta``.
        ddp_kwargs: DDP options and communication hook; ``None``: the defaults.

    Returns:
        ``model`` or a ``DistributedDataParallel`` wrapping it.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``model`` already wrapped, on ``meta`` or fake; a bfloat16 hook on
            a backend that cannot all-reduce bfloat16 (CPU/gloo).
        RuntimeError: several processes without a matching default group.

    >>> from funcaccel.context import DistributedContext
    >>> net = nn.Linear(2, 1)
    >>> wrap_ddp(DistributedContext(), net) is net  # one process: nothing to wrap
    True
    """
    caller, kind = "wrap_ddp", DistributedDataParallelKwargs
    model = check_unwrapped(caller, ctx, model)
    kwargs = check_type(caller, "ddp_kwargs", ddp_kwargs, kind, optional=True)
    kwargs = kind() if kwargs is None else kwargs
    check_ddp(caller, ctx, kwargs)
    refuse_meta(caller, model)
    model.to(ctx.device)
    return ddp_(ctx, kwargs, model, caller=caller)
