"""The fast step inside ``wrap_model``: checked first, applied between TP and sharding.

``check_fast_step`` refuses, before anything changes, options ``wrap_model``
could not apply; ``fast_step_`` then checkpoints and compiles the blocks, in
that order. Both change only the blocks' ``forward`` / call (lazily traced), so
they commute with the hooks tensor parallelism adds, and FSDP2's hooks, added
after, run around the compiled blocks.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from funcaccel._checks import check_type
from funcaccel.model._checkpointing import apply_activation_checkpointing
from funcaccel.model._compile_blocks import compile_blocks
from funcaccel.model._compile_options import ActivationCheckpointOptions
from funcaccel.model._compile_options import CompileOptions
from funcaccel.model._fast_order import refuse_compiled
from funcaccel.model._fast_order import refuse_sharded
from funcaccel.model._fast_order import select_blocks

__all__ = ["check_fast_step", "fast_step_", "then_wrap"]


def check_fast_step(
    caller: str, model: nn.Module, checkpointing: object, compile: object
) -> None:
    """Refuse options of the wrong type, or that cannot apply to ``model``.

    Raises:
        TypeError: options of the wrong type.
        ValueError: see ``apply_activation_checkpointing`` and ``compile_blocks``.
    """
    kind, what = ActivationCheckpointOptions, "an ActivationCheckpointOptions or None"
    ac = check_type(
        caller,
        "activation_checkpointing",
        checkpointing,
        kind,
        what=what,
        optional=True,
    )
    what = "a CompileOptions or None"
    options = check_type(
        caller, "compile", compile, CompileOptions, what=what, optional=True
    )
    if ac is not None:
        refuse_sharded(caller, model, "activation checkpointing")
        refuse_compiled(caller, model)
        list(select_blocks(caller, model, ac.blocks))
    if options is not None:
        refuse_sharded(caller, model, "compilation")
        list(select_blocks(caller, model, options.blocks))


def fast_step_(
    model: nn.Module,
    checkpointing: ActivationCheckpointOptions | None,
    compile: CompileOptions | None,
) -> None:
    """Checkpoint, then compile, ``model``'s blocks in place (each when given)."""
    if checkpointing is not None:
        apply_activation_checkpointing(model, checkpointing)
    if compile is not None:
        compile_blocks(model, compile)


def then_wrap(
    checkpointing: ActivationCheckpointOptions | None,
    compile: CompileOptions | None,
    wrap: Callable[[nn.Module], nn.Module],
) -> Callable[[nn.Module], nn.Module]:
    """Return ``wrap`` preceded by ``fast_step_`` (``wrap`` itself when nothing to do)."""
    if checkpointing is None and compile is None:
        return wrap

    def prepared(model: nn.Module) -> nn.Module:
        fast_step_(model, checkpointing, compile)
        return wrap(model)

    return prepared
