"""``wrap_fsdp``: FSDP2 options and sharding (``torch.distributed.fsdp.fully_shard``).

``wrap_fsdp`` is the FSDP2 strategy of ``wrap_model``; ``check_fsdp`` and
``fsdp_`` are its two halves (refuse before anything changes; shard), so that
``wrap_model`` can give a ``meta`` model storage between them.

>>> import torch
>>> FSDPOptions(shard_modules=[torch.nn.Linear]).shard_modules
(<class 'torch.nn.modules.linear.Linear'>,)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Final
from typing import Literal

import torch
from torch import nn

from funcaccel._checks import check_choice
from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._dist_types import is_fsdp_module
from funcaccel._dist_types import is_instance_if_loaded
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group
from funcaccel.model._fast_order import refuse_compile_wrappers
from funcaccel.model._fsdp_gloo import install_gloo_reduce_scatter
from funcaccel.model._meta import place_
from funcaccel.model._rebind import as_optimizers
from funcaccel.model._rebind import rebind_by_name_
from funcaccel.model._wrappers import check_unwrapped

if TYPE_CHECKING:
    # Imported for real only when sharding: the package takes seconds to import.
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "ACCUMULATION_COMM_ATTRIBUTE",
    "AccumulationComm",
    "FSDPOptions",
    "check_fsdp",
    "check_fsdp_options",
    "fsdp_",
    "shard_model",
    "wrap_fsdp",
]

FSDP_OR_NONE: Final = "an FSDPOptions or None"  # "an eff", not a_or_an's "a"
_CLASSES: Final = "a sequence of nn.Module classes"
_BLOCK_EXAMPLE: Final = "Use e.g. shard_modules=(TransformerBlock,)."
_CLASS: Final = "an nn.Module subclass"
_NOT_AN_INSTANCE: Final = "Pass the class (e.g. nn.Linear), not an instance."
_RESHARD: Final = "a bool, an int or None"
_POLICY_TYPE: Final = ("torch.distributed.fsdp", "MixedPrecisionPolicy")
_POLICY: Final = "a torch.distributed.fsdp.MixedPrecisionPolicy or None"
_POLICY_EXAMPLE: Final = "Use e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16)."
AccumulationComm = Literal[
    "defer_all", "reduce_scatter_each_step", "defer_replica_all_reduce"
]
_COMMS: Final = ("defer_all", "reduce_scatter_each_step", "defer_replica_all_reduce")
ACCUMULATION_COMM_ATTRIBUTE: Final = "_funcaccel_accumulation_comm"
"""The attribute under which a sharded root keeps its ``accumulation_comm``."""
_RESHARD_RANKS: Final = (
    "an int >= 1 (the number of ranks to reshard to), a bool or None"
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FSDPOptions:
    """Options that make ``wrap_model`` shard a module with FSDP2 instead of DDP.

    ``wrap_model`` applies ``fully_shard`` to every submodule that is an instance of
    one of ``shard_modules`` (innermost first), then to the root module, all with
    the same ``reshard_after_forward`` and ``mp_policy``.

    Args:
        shard_modules: submodule classes that become their own FSDP units (for
            example a transformer block class); any sequence, stored as a tuple.
            Empty: only the root is sharded.
        reshard_after_forward: ``True`` frees the gathered parameters after forward
            and gathers them again in backward; ``False`` keeps them; an int ``r``
            (a divisor of the world size) reshards to groups of ``r`` ranks;
            ``None`` is torch's rule (``False`` for the root, ``True`` otherwise).
        mp_policy: torch's ``MixedPrecisionPolicy`` (``param_dtype``,
            ``reduce_dtype``, ``output_dtype``, ``cast_forward_inputs``); ``None``
            computes and reduces in the parameters' dtype.
        accumulation_comm: how gradients travel during an accumulation window
            (the micro-steps ``accumulate_step``, ``sync_ctx`` and ``no_sync``
            run without sync). ``"defer_all"`` (the default): no communication
            until the window's last micro-step, while each rank accumulates
            its *unsharded* gradients (memory of a whole model's gradients).
            ``"reduce_scatter_each_step"``: every micro-step reduce-scatters
            (and on HSDP all-reduces across replicas) into the sharded
            gradients: the least memory, ``k`` times the traffic.
            ``"defer_replica_all_reduce"``: every micro-step reduce-scatters
            inside the shard group, but the all-reduce across replicas (HSDP's
            ``dp_replicate``) waits for the window's end
            (``set_requires_all_reduce(False)``); without replicas it is
            ``"reduce_scatter_each_step"``. All three give the same
            gradients, up to floating-point summation order.

    Raises:
        TypeError: a field of the wrong type.
        ValueError: an integer ``reshard_after_forward`` below 1.
    """

    shard_modules: Sequence[type[nn.Module]] = ()
    reshard_after_forward: bool | int | None = True
    mp_policy: MixedPrecisionPolicy | None = None
    accumulation_comm: AccumulationComm = "defer_all"

    def __post_init__(self) -> None:
        owner, classes = "FSDPOptions", self.shard_modules
        if isinstance(classes, (str, bytes)) or not isinstance(classes, Sequence):
            fail_type(owner, "shard_modules", classes, _CLASSES, _BLOCK_EXAMPLE)
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                fail_type(
                    owner, "every item of shard_modules", cls, _CLASS, _NOT_AN_INSTANCE
                )
        object.__setattr__(self, "shard_modules", tuple(classes))
        reshard, name = self.reshard_after_forward, "reshard_after_forward"
        check_type(owner, name, reshard, (bool, int), what=_RESHARD, optional=True)
        if type(reshard) is int and reshard < 1:
            fail_value(owner, name, reshard, _RESHARD_RANKS)
        policy = self.mp_policy
        if policy is not None and not is_instance_if_loaded(policy, *_POLICY_TYPE):
            fail_type(owner, "mp_policy", policy, _POLICY, _POLICY_EXAMPLE)
        comm = self.accumulation_comm
        check_type(owner, "accumulation_comm", comm, str)
        check_choice(owner, "accumulation_comm", comm, _COMMS)


def check_fsdp_options(
    caller: str,
    ctx: DistributedContext,
    options: FSDPOptions,
    shard_size: int | None = None,
) -> None:
    """Check that ``options`` fit shards over ``shard_size`` ranks (default: the world).

    Raises:
        ValueError: an integer ``reshard_after_forward`` that does not divide the
            world size.

    >>> from funcaccel.context import DistributedType
    >>> ctx = DistributedContext(
    ...     num_processes=4, distributed_type=DistributedType.MULTI_CPU
    ... )
    >>> check_fsdp_options("wrap_model", ctx, FSDPOptions(reshard_after_forward=2))
    >>> check_fsdp_options("wrap_model", ctx, FSDPOptions(reshard_after_forward=3))
    Traceback (most recent call last):
    ...
    ValueError: wrap_model: FSDPOptions.reshard_after_forward must be a divisor of ...
    """
    reshard = options.reshard_after_forward
    world = ctx.num_processes if shard_size is None else shard_size
    where = "the world size" if shard_size is None else "the mesh's dp_shard"
    name, what = "FSDPOptions.reshard_after_forward", f"a divisor of {where} ({world})"
    if type(reshard) is int and world % reshard != 0:
        fail_value(
            caller, name, reshard, what, f"Use a divisor of {world}, or True/False."
        )


def shard_model(
    ctx: DistributedContext,
    model: nn.Module,
    options: FSDPOptions,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    device_mesh: DeviceMesh | None = None,
    caller: str = "wrap_model",
) -> nn.Module:
    """Apply ``fully_shard`` in place to ``model``'s chosen submodules, then to it.

    The mesh is ``device_mesh`` (two dimensions: replicate, shard, for HSDP) or
    one dimension over the default group, on ``ctx.device.type`` (not torch's
    default, which would pick CUDA whenever it exists). Submodules are visited in
    reverse pre-order, so a nested match is sharded before its parent.
    ``fully_shard`` replaces every parameter with a new sharded (``DTensor``)
    one; each of ``optimizers`` is then pointed, in place, at the new parameters
    (see ``rebind_optimizers_``). On CPU with gloo, every unit reduce-scatters its
    gradients in place and frees the buffer at once (see ``_fsdp_gloo``).

    Returns:
        ``model`` itself, now an ``FSDPModule``.

    Raises:
        ValueError: a ``torch.compile`` wrapper among ``model``'s submodules
            (its compiled code would bypass FSDP2's hooks; compile in place).
    """
    refuse_compile_wrappers(caller, model)
    before = dict(model.named_parameters(remove_duplicate=False))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard

    mesh = (
        init_device_mesh(ctx.device.type, (ctx.num_processes,))
        if device_mesh is None
        else device_mesh
    )
    policy = MixedPrecisionPolicy() if options.mp_policy is None else options.mp_policy
    classes = tuple(options.shard_modules)
    if classes:
        children = [m for m in model.modules() if m is not model]
        for child in reversed(children):
            if isinstance(child, classes) and not is_fsdp_module(child):
                fully_shard(
                    child,
                    mesh=mesh,
                    reshard_after_forward=options.reshard_after_forward,
                    mp_policy=policy,
                )
    fully_shard(
        model,
        mesh=mesh,
        reshard_after_forward=options.reshard_after_forward,
        mp_policy=policy,
    )
    install_gloo_reduce_scatter(model, ctx.device, mesh.get_all_groups())
    # Read by the no-sync context (funcaccel._no_sync) on every micro-step that
    # skips its sync: a property of the sharded model, like its hooks.
    setattr(model, ACCUMULATION_COMM_ATTRIBUTE, options.accumulation_comm)
    rebind_by_name_(optimizers, before, model)
    return model


def check_fsdp(caller: str, ctx: DistributedContext, fsdp: FSDPOptions) -> None:
    """Refuse, before anything changes, FSDP2 options that do not fit ``ctx``'s world.

    Raises:
        ValueError: see ``check_fsdp_options``.
        RuntimeError: several processes without a matching default group.
    """
    if ctx.num_processes > 1:
        check_fsdp_options(caller, ctx, fsdp)
        require_process_group(ctx, caller)


def fsdp_(
    ctx: DistributedContext,
    fsdp: FSDPOptions,
    optimizers: Sequence[torch.optim.Optimizer],
    model: nn.Module,
) -> nn.Module:
    """Shard ``model`` in place when there is something to shard (see ``wrap_fsdp``).

    ``model`` comes last, so that ``wrap_model`` can bind the rest beforehand.
    """
    if ctx.num_processes == 1 or not any(p.requires_grad for p in model.parameters()):
        return model
    return shard_model(ctx, model, fsdp, optimizers)


def wrap_fsdp(
    ctx: DistributedContext,
    model: nn.Module,
    fsdp: FSDPOptions | None = None,
    *,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
) -> nn.Module:
    """Move ``model`` to ``ctx.device`` and shard it in place with FSDP2; return it.

    With several processes and a parameter that requires grad, ``fully_shard``
    is applied to each submodule of a class in ``fsdp.shard_modules``
    (innermost first), then to ``model``, over a one-dimensional mesh of the
    whole world; ``model`` is then its own root (an ``FSDPModule``). Otherwise
    ``model`` is returned unsharded. FSDP2 replaces every parameter, so each of
    ``optimizers`` (built before, on the old parameters) is re-pointed in place
    at the new ones, its state sharded with them. A model built on the ``meta``
    device is sharded as it is: give this rank's shards storage afterwards with
    ``materialize_meta``. ``wrap_model(ctx, model, fsdp=...)`` does the same and
    materialises for you; use this for FSDP2 alone.

    With 2 processes and ``net = nn.Linear(4, 2)``, ``wrap_fsdp(ctx, net)`` keeps
    row 0 of the weight on rank 0 and row 1 on rank 1.

    Args:
        ctx: the distributed context.
        model: the user's module, not wrapped yet; changed in place.
        fsdp: the FSDP2 options; ``None`` for ``FSDPOptions()``.
        optimizers: optimizers already built on ``model``'s parameters.

    Returns:
        ``model`` itself, sharded when there are several processes.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``model`` already wrapped; ``reshard_after_forward`` that
            does not divide the world size.
        RuntimeError: several processes without a matching default group.

    >>> from funcaccel.context import DistributedContext
    >>> net = nn.Linear(4, 2)
    >>> wrap_fsdp(DistributedContext(), net) is net  # one process: nothing to shard
    True
    """
    caller = "wrap_fsdp"
    model = check_unwrapped(caller, ctx, model)
    fsdp = check_type(
        caller, "fsdp", fsdp, FSDPOptions, what=FSDP_OR_NONE, optional=True
    )
    opts = as_optimizers(caller, optimizers)
    fsdp = FSDPOptions() if fsdp is None else fsdp
    check_fsdp(caller, ctx, fsdp)
    place_(model, ctx.device)
    return fsdp_(ctx, fsdp, opts, model)
