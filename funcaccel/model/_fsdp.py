"""FSDP2 options and sharding for ``wrap_model`` (``torch.distributed.fsdp.fully_shard``).

Kept apart from ``model.py`` so that the DDP and FSDP paths each read at once. The
public names are re-exported by ``funcaccel.model``.

>>> import torch
>>> FSDPOptions(shard_modules=[torch.nn.Linear]).shard_modules
(<class 'torch.nn.modules.linear.Linear'>,)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from funcaccel._checks import summary
from funcaccel._dist_types import is_dtensor
from funcaccel._dist_types import is_fsdp_module
from funcaccel._dist_types import is_instance_if_loaded
from funcaccel.context import DistributedContext
from funcaccel.model._fsdp_gloo import install_gloo_reduce_scatter

if TYPE_CHECKING:
    # Imported for real only when sharding: the package takes seconds to import.
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "FSDPOptions",
    "check_fsdp_options",
    "check_optimizers_hold",
    "shard_model",
]


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

    Raises:
        TypeError: a field of the wrong type.
        ValueError: an integer ``reshard_after_forward`` below 1.
    """

    shard_modules: Sequence[type[nn.Module]] = ()
    reshard_after_forward: bool | int | None = True
    mp_policy: MixedPrecisionPolicy | None = None

    def __post_init__(self) -> None:
        owner = "FSDPOptions"
        classes = self.shard_modules
        if isinstance(classes, (str, bytes)) or not isinstance(classes, Sequence):
            msg = (
                f"{owner}: shard_modules must be a sequence of nn.Module classes; got "
                f"{summary(classes)}. Use e.g. shard_modules=(TransformerBlock,)."
            )
            raise TypeError(msg)
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                msg = (
                    f"{owner}: shard_modules must hold nn.Module subclasses; got "
                    f"{summary(cls)}. Pass the class (e.g. nn.Linear), not an instance."
                )
                raise TypeError(msg)
        object.__setattr__(self, "shard_modules", tuple(classes))
        reshard = self.reshard_after_forward
        if reshard is not None and not isinstance(reshard, (bool, int)):
            msg = (
                f"{owner}: reshard_after_forward must be a bool, an int or None; got "
                f"{summary(reshard)} ({type(reshard).__name__})."
            )
            raise TypeError(msg)
        if isinstance(reshard, int) and not isinstance(reshard, bool) and reshard < 1:
            msg = (
                f"{owner}: reshard_after_forward as an int is the number of ranks to "
                f"reshard to and must be >= 1; got {reshard}."
            )
            raise ValueError(msg)
        if self.mp_policy is not None and not is_instance_if_loaded(
            self.mp_policy, "torch.distributed.fsdp", "MixedPrecisionPolicy"
        ):
            msg = (
                f"{owner}: mp_policy must be a torch.distributed.fsdp."
                f"MixedPrecisionPolicy or None; got {summary(self.mp_policy)}. Use e.g. "
                "MixedPrecisionPolicy(param_dtype=torch.bfloat16)."
            )
            raise TypeError(msg)


def check_fsdp_options(
    ctx: DistributedContext,
    options: FSDPOptions,
    caller: str,
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
    >>> check_fsdp_options(ctx, FSDPOptions(reshard_after_forward=2), "wrap_model")
    >>> check_fsdp_options(ctx, FSDPOptions(reshard_after_forward=3), "wrap_model")
    Traceback (most recent call last):
    ...
    ValueError: wrap_model: FSDPOptions.reshard_after_forward=3 must divide ...
    """
    reshard = options.reshard_after_forward
    if isinstance(reshard, bool) or reshard is None:
        return
    world = ctx.num_processes if shard_size is None else shard_size
    what = "the world size" if shard_size is None else "the mesh's dp_shard"
    if reshard > world or world % reshard != 0:
        msg = (
            f"{caller}: FSDPOptions.reshard_after_forward={reshard} must divide "
            f"{what} ({world}); use a divisor of {world}, or True/False."
        )
        raise ValueError(msg)


def shard_model(
    ctx: DistributedContext,
    model: nn.Module,
    options: FSDPOptions,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    device_mesh: DeviceMesh | None = None,
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
    """
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
    rebind_by_name_(optimizers, before, model)
    return model


def rebind_by_name_(
    optimizers: Sequence[torch.optim.Optimizer],
    before: Mapping[str, nn.Parameter],
    model: nn.Module,
) -> int:
    """Point ``optimizers`` at ``model``'s parameters that replaced, under the same
    names, those in ``before`` (``dict(model.named_parameters(remove_duplicate=False))``
    taken before sharding or materialising); see ``rebind_optimizers_``."""
    after = dict(model.named_parameters(remove_duplicate=False))
    replaced = {
        id(old): after[name]
        for name, old in before.items()
        if name in after and after[name] is not old
    }
    return rebind_optimizers_(optimizers, replaced)


def rebind_optimizers_(
    optimizers: Sequence[torch.optim.Optimizer],
    replaced: Mapping[int, nn.Parameter],
) -> int:
    """Point ``optimizers`` in place at the parameters that replaced their own.

    ``replaced`` maps ``id(old parameter)`` to the parameter that took its place.
    Each param group keeps its order and hyperparameters; a replaced parameter's
    optimizer state moves to the new one, and a state tensor of the old
    parameter's shape (a momentum, Adam's moments) is sharded as the new
    parameter is (each rank keeps its own rows, as ``fully_shard`` does with the
    parameter itself); other state (``step``) is kept as it is.

    Returns:
        How many parameter entries were replaced.
    """
    count = 0
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            params: list[torch.Tensor] = []
            for old in group["params"]:
                new = replaced.get(id(old))
                if new is None:
                    params.append(old)
                    continue
                state = optimizer.state.pop(old, None)
                if state:
                    optimizer.state[new] = {
                        key: _sharded_like(value, old, new)
                        for key, value in state.items()
                    }
                params.append(new)
                count += 1
            group["params"] = params
    return count


def _sharded_like(value: object, old: torch.Tensor, new: torch.Tensor) -> object:
    if not (
        isinstance(value, torch.Tensor)
        and not is_dtensor(value)
        and is_dtensor(new)
        and value.dim() > 0
        and value.shape == old.shape
    ):
        return value
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank slices its own copy, as fully_shard does with
    # the parameter, so no rank's state is overwritten by another's.
    return distribute_tensor(
        value.to(new.device_mesh.device_type),
        new.device_mesh,
        new.placements,
        src_data_rank=None,
    )


def check_optimizers_hold(
    models: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    caller: str,
) -> None:
    """Raise unless every optimizer holds a parameter of one of ``models``.

    Only FSDP2 and tensor parallelism replace parameters (with ``DTensor`` ones),
    so nothing is checked when no model is FSDP2 and none holds a ``DTensor``. In the usual case the first parameter of each optimizer
    is among the first parameters of the model, and the check stops there.

    Raises:
        ValueError: an optimizer that holds none of the models' parameters (it was
            built before ``wrap_model`` sharded them).
    """
    if not any(
        is_fsdp_module(model) or any(is_dtensor(p) for p in model.parameters())
        for model in models
    ):
        return
    for index, optimizer in enumerate(optimizers):
        groups = optimizer.param_groups
        first = next((g["params"][0] for g in groups if g["params"]), None)
        if first is None or _holds(models, first):
            continue
        owned = {id(p) for model in models for p in model.parameters()}
        if any(id(p) in owned for group in groups for p in group["params"]):
            continue
        name = "optimizer" if len(optimizers) == 1 else f"optimizer[{index}]"
        msg = (
            f"{caller}: {name} holds none of the model's parameters: "
            "wrap_model(..., fsdp=FSDPOptions(...)) or a tp_plan replaced them with "
            "sharded "
            "parameters, so an optimizer built before it would never change the "
            "model. Pass it to wrap_model(ctx, model, fsdp=..., optimizers="
            "optimizer), which re-points it at the new parameters, or build the "
            "optimizer after wrap_model from model.parameters()."
        )
        raise ValueError(msg)


def _holds(models: Sequence[nn.Module], param: torch.Tensor) -> bool:
    return any(p is param for model in models for p in model.parameters())
