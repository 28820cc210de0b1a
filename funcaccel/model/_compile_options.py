"""The fast step's two option records: ``CompileOptions`` and ``ActivationCheckpointOptions``.

Both name the *blocks* they act on by class (for example a transformer block);
no classes means the whole model is one block. ``compile_blocks`` and
``apply_activation_checkpointing`` (and ``wrap_model(..., compile=...,
activation_checkpointing=...)``) read them.

>>> from torch import nn
>>> CompileOptions(blocks=[nn.Linear], backend="eager").blocks
(<class 'torch.nn.modules.linear.Linear'>,)
>>> ActivationCheckpointOptions(blocks=(nn.Linear,), every_n=2).mode
'full'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import Final
from typing import Literal

import torch
from torch import nn

from funcaccel._checks import check_bool
from funcaccel._checks import check_choice
from funcaccel._checks import check_int
from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value

__all__ = ["ActivationCheckpointOptions", "CompileOptions", "block_classes"]

CompileMode = Literal[
    "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"
]
CheckpointMode = Literal["full", "selective"]

_MODES: Final = (
    "default",
    "reduce-overhead",
    "max-autotune",
    "max-autotune-no-cudagraphs",
)
_CLASSES: Final = "a sequence of nn.Module classes"
_EXAMPLE: Final = "Use e.g. blocks=(TransformerBlock,), or () for the whole model."


def block_classes(owner: str, value: object) -> tuple[type[nn.Module], ...]:
    """Return ``value`` as a tuple of ``nn.Module`` subclasses; raise ``TypeError`` if not.

    >>> block_classes("f", [nn.Linear])
    (<class 'torch.nn.modules.linear.Linear'>,)
    """
    if isinstance(value, (str, bytes, type)) or not isinstance(value, Sequence):
        fail_type(owner, "blocks", value, _CLASSES, _EXAMPLE)
    for cls in value:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            hint = "Pass the class (e.g. nn.Linear), not an instance."
            fail_type(owner, "every item of blocks", cls, "an nn.Module subclass", hint)
    return tuple(value)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CompileOptions:
    """How ``compile_blocks`` compiles a model: in place, one block at a time.

    Each module of a class in ``blocks`` gets ``torch.compile`` applied to its own
    call, in place (``module.compile()``): the module object stays where it is,
    so hooks added to it later (FSDP2's, tensor parallelism's) run around the
    compiled code instead of being bypassed, and identical blocks share their
    graphs. No ``blocks``: the whole model is compiled in place.

    Args:
        blocks: the block classes; any sequence, stored as a tuple.
        backend: a ``torch.compile`` backend name (``"inductor"``, or the cheap
            ``"aot_eager"`` / ``"eager"`` for tests) or a backend callable.
        mode: inductor's mode (``"default"``, ``"reduce-overhead"``,
            ``"max-autotune"``, ``"max-autotune-no-cudagraphs"``) or ``None``;
            only with ``backend="inductor"``.
        fullgraph: ``True`` (the default) makes a graph break inside a block an
            error with dynamo's reason, so a block is never silently split into
            pieces; ``False`` lets dynamo break and resume (``compile_report``
            then lists the breaks).
        dynamic: torch's ``dynamic`` (``None``: static first, dynamic after a
            shape changes; ``False``: recompile per shape; ``True``: dynamic).

    Raises:
        TypeError: a field of the wrong type.
        ValueError: an unknown mode, or a mode with another backend.
    """

    blocks: Sequence[type[nn.Module]] = ()
    backend: str | Callable[..., Any] = "inductor"
    mode: CompileMode | None = None
    fullgraph: bool = True
    dynamic: bool | None = None

    def __post_init__(self) -> None:
        owner = "CompileOptions"
        object.__setattr__(self, "blocks", block_classes(owner, self.blocks))
        if not (isinstance(self.backend, str) or callable(self.backend)):
            what = "a backend name or a backend callable"
            fail_type(owner, "backend", self.backend, what, "Use e.g. 'inductor'.")
        if self.mode is not None:
            check_type(owner, "mode", self.mode, str, optional=True)
            check_choice(owner, "mode", self.mode, _MODES)
            if self.backend != "inductor":
                what = "None with a backend other than 'inductor'"
                hint = "Modes are inductor's; pass mode=None or backend='inductor'."
                fail_value(owner, "mode", self.mode, what, hint)
        check_bool(owner, "fullgraph", self.fullgraph)
        check_type(owner, "dynamic", self.dynamic, bool, optional=True)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ActivationCheckpointOptions:
    """How ``apply_activation_checkpointing`` recomputes activations, block by block.

    A checkpointed block keeps only its inputs from the forward pass and runs its
    forward again in backward (``torch.utils.checkpoint``, non-reentrant), with
    the RNG state of the first run restored, so dropout draws the same numbers
    and the gradients are bit for bit those without checkpointing (eager).

    Args:
        blocks: the block classes; any sequence, stored as a tuple; none: the
            whole model is the one block.
        mode: ``"full"`` recomputes everything inside the block; ``"selective"``
            saves the outputs of ``save_ops`` and recomputes the rest (torch's
            selective checkpointing).
        every_n: checkpoint every ``n``-th matching block (1-based: with
            ``every_n=2`` the 2nd, 4th, ...); 1 checkpoints them all.
        save_ops: with ``"selective"``, the ``torch.ops.aten`` overloads whose
            outputs are kept; empty: the matrix products and attention
            (``mm``, ``addmm``, ``bmm``, the ``scaled_dot_product`` kernels).
        preserve_rng_state: restore the RNG state for the recomputation (keep
            ``True`` with dropout, or the gradients are wrong).

    Raises:
        TypeError: a field of the wrong type.
        ValueError: ``every_n`` below 1, an unknown mode, or ``save_ops`` with
            ``mode="full"``.
    """

    blocks: Sequence[type[nn.Module]] = ()
    mode: CheckpointMode = "full"
    every_n: int = 1
    save_ops: Sequence[torch._ops.OpOverload] = ()
    preserve_rng_state: bool = True

    def __post_init__(self) -> None:
        owner = "ActivationCheckpointOptions"
        object.__setattr__(self, "blocks", block_classes(owner, self.blocks))
        check_type(owner, "mode", self.mode, str)
        check_choice(owner, "mode", self.mode, ("full", "selective"))
        check_int(owner, "every_n", self.every_n, 1)
        ops = self.save_ops
        what = "a sequence of torch.ops.aten overloads"
        hint = "Use e.g. save_ops=(torch.ops.aten.mm.default,)."
        if isinstance(ops, (str, bytes)) or not isinstance(ops, Sequence):
            fail_type(owner, "save_ops", ops, what, hint)
        for op in ops:
            if not isinstance(op, torch._ops.OpOverload):
                fail_type(owner, "every item of save_ops", op, "an OpOverload", hint)
        if ops and self.mode == "full":
            what = "empty with mode='full' (it saves nothing)"
            fail_value(owner, "save_ops", tuple(ops), what, "Pass mode='selective'.")
        object.__setattr__(self, "save_ops", tuple(ops))
        check_bool(owner, "preserve_rng_state", self.preserve_rng_state)
