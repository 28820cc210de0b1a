"""The order of the fast step, checked: checkpoint, then compile, then shard or wrap.

``wrap_model`` composes: tensor parallelism, activation checkpointing per block,
in-place compilation per block, then FSDP2 / HSDP or DDP. Done by hand in another
order the model still computes the same numbers, only slower or with more memory
(a ``torch.compile(block)`` wrapper bypasses the hooks ``fully_shard`` adds, a
block compiled before its checkpoint keeps graphs traced without it), so nothing
would tell the user. ``apply_activation_checkpointing`` and ``compile_blocks``
refuse those orders here, before anything changes.

>>> from torch import nn
>>> net = nn.Sequential(nn.Linear(2, 2))
>>> net[0].compile(backend="eager")
>>> compiled_in_place(net)
['0']
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from collections.abc import Sequence

from torch import nn
from torch.nn.parallel import DataParallel
from torch.nn.parallel import DistributedDataParallel

from funcaccel._dist_types import is_deepspeed_engine
from funcaccel._dist_types import is_fsdp_module

__all__ = [
    "compiled_in_place",
    "compiled_wrappers",
    "refuse_compile_wrappers",
    "refuse_compiled",
    "refuse_sharded",
    "select_blocks",
]


def compiled_in_place(model: nn.Module) -> list[str]:
    """Return the names of ``model``'s modules compiled in place (``module.compile()``)."""
    return [
        name
        for name, module in model.named_modules()
        if getattr(module, "_compiled_call_impl", None) is not None
    ]


def compiled_wrappers(model: nn.Module) -> list[str]:
    """Return the names of ``torch.compile`` wrappers (``OptimizedModule``) in ``model``."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    kind = getattr(eval_frame, "OptimizedModule", None)
    if not isinstance(kind, type):  # dynamo never loaded: no wrapper can exist
        return []
    return [name for name, module in model.named_modules() if isinstance(module, kind)]


def _label(name: str) -> str:
    return repr(name) if name else "the model itself"


def refuse_sharded(caller: str, model: nn.Module, then: str) -> None:
    """Refuse a model already wrapped by DDP or a DeepSpeed engine, or sharded by FSDP2.

    ``then`` names what the caller must run before the wrapping.

    Raises:
        ValueError: naming the wrapper and the order to use.
    """
    wrapped = ""
    if isinstance(model, (DistributedDataParallel, DataParallel)):
        wrapped = type(model).__name__
    elif is_deepspeed_engine(model):
        wrapped = "a DeepSpeed engine"
    else:
        sharded = [name for name, m in model.named_modules() if is_fsdp_module(m)]
        if sharded:
            wrapped = f"FSDP2: fully_shard was applied to {_label(sharded[0])}"
    if wrapped:
        msg = (
            f"{caller}: model is already wrapped ({wrapped}); {then} must come "
            "before DDP / FSDP2 wrapping. Apply it to the unwrapped module first, "
            "or pass compile= / activation_checkpointing= to wrap_model, which "
            "composes them in the right order."
        )
        raise ValueError(msg)
    refuse_compile_wrappers(caller, model)


def refuse_compile_wrappers(caller: str, model: nn.Module) -> None:
    """Refuse a ``torch.compile`` wrapper (``OptimizedModule``) inside ``model``.

    FSDP2 shards the module inside the wrapper, whose compiled code then runs
    outside the hooks ``fully_shard`` adds (about 2x slower, same numbers).

    Raises:
        ValueError: naming the wrapper and the in-place way.
    """
    wrappers = compiled_wrappers(model)
    if wrappers:
        msg = (
            f"{caller}: {_label(wrappers[0])} is a torch.compile wrapper "
            "(OptimizedModule), whose compiled code runs outside the hooks that "
            "sharding adds to the module inside it. Compile in place instead: "
            "pass the plain module and use compile_blocks (module.compile())."
        )
        raise ValueError(msg)


def refuse_compiled(caller: str, model: nn.Module) -> None:
    """Refuse a model with a module already compiled in place.

    Raises:
        ValueError: activation checkpointing applied after compilation.
    """
    compiled = compiled_in_place(model)
    if compiled:
        msg = (
            f"{caller}: {_label(compiled[0])} is already compiled (module.compile()); "
            "activation checkpointing must come first, so that the compiled graph "
            "contains the recomputation. Apply apply_activation_checkpointing, then "
            "compile_blocks, to a fresh model."
        )
        raise ValueError(msg)


def select_blocks(
    caller: str, model: nn.Module, classes: Sequence[type[nn.Module]]
) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(name, module)`` for each block of ``classes`` in ``model`` (outermost only).

    A block nested inside another matching block is skipped: it runs inside its
    parent's (compiled or checkpointed) call already. No classes: the model
    itself.

    Raises:
        ValueError: classes given but no module of them in ``model``.
    """
    if not classes:
        yield "", model
        return
    found = False
    kinds = tuple(classes)
    inside: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, kinds):
            continue
        if any(not o or name.startswith(o + ".") for o in inside):
            continue
        inside.append(name)
        found = True
        yield name, module
    if not found:
        names = ", ".join(cls.__name__ for cls in classes)
        msg = (
            f"{caller}: no module of model ({type(model).__name__}) is a {names}, "
            "so nothing would change; pass the classes of the model's blocks, or "
            "blocks=() for the whole model."
        )
        raise ValueError(msg)
