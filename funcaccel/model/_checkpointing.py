"""``apply_activation_checkpointing``: recompute each block's activations in backward.

Each chosen block keeps its place, class and parameter names: its ``forward`` is
replaced, on the instance, by a ``CheckpointedForward`` that runs the class's
forward under ``torch.utils.checkpoint.checkpoint`` (non-reentrant). Hooks on the
block (FSDP2's unshard / reshard, tensor parallelism's redistribution) stay
outside the checkpointed region, and an in-place compile of the block
(``compile_blocks``, later) traces the checkpoint into its graph.

>>> import torch
>>> from torch import nn
>>> net = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
>>> apply_activation_checkpointing(net, ActivationCheckpointOptions(blocks=[nn.Linear]))
['0', '2']
>>> net(torch.ones(1, 2, requires_grad=True)).shape
torch.Size([1, 2])
"""

from __future__ import annotations

import functools
from typing import Any
from typing import Final

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from funcaccel._checks import check_type
from funcaccel.model._compile_options import ActivationCheckpointOptions
from funcaccel.model._fast_order import refuse_compiled
from funcaccel.model._fast_order import refuse_sharded
from funcaccel.model._fast_order import select_blocks

__all__ = [
    "CheckpointedForward",
    "apply_activation_checkpointing",
    "checkpointed_blocks",
]

_CALLER: Final = "apply_activation_checkpointing"


def _default_save_ops() -> frozenset[torch._ops.OpOverload]:
    aten = torch.ops.aten
    return frozenset(
        {
            aten.mm.default,
            aten.addmm.default,
            aten.bmm.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
        }
    )


def _policy(
    save: frozenset[torch._ops.OpOverload],
    ctx: Any,
    op: Any,
    *args: Any,
    **kwargs: Any,
) -> torch_checkpoint.CheckpointPolicy:
    del ctx, args, kwargs  # the decision depends on the op alone
    if op in save:
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


class CheckpointedForward:
    """A block's ``forward`` run under ``torch.utils.checkpoint`` (set on the instance).

    It holds the block itself (not a bound method), so ``copy.deepcopy`` of a
    model gives a copy whose blocks recompute their own forward, not the
    original's; ``options`` says how.
    """

    __slots__ = ("module", "options")

    def __init__(self, module: nn.Module, options: ActivationCheckpointOptions) -> None:
        self.module = module
        self.options = options

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, options = self.module, self.options
        # The class's forward (FSDP2 swaps the class for a subclass that keeps it).
        forward = functools.partial(type(module).forward, module)
        if options.mode == "selective":
            save = frozenset(options.save_ops) or _default_save_ops()
            context_fn = functools.partial(
                torch_checkpoint.create_selective_checkpoint_contexts,
                functools.partial(_policy, save),
            )
            return torch_checkpoint.checkpoint(
                forward,
                *args,
                use_reentrant=False,
                preserve_rng_state=options.preserve_rng_state,
                context_fn=context_fn,
                **kwargs,
            )
        return torch_checkpoint.checkpoint(
            forward,
            *args,
            use_reentrant=False,
            preserve_rng_state=options.preserve_rng_state,
            **kwargs,
        )


def checkpointed_blocks(model: nn.Module) -> list[str]:
    """Return the names of ``model``'s modules with activation checkpointing applied.

    >>> checkpointed_blocks(nn.Linear(1, 1))
    []
    """
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module.__dict__.get("forward"), CheckpointedForward)
    ]


def apply_activation_checkpointing(
    model: nn.Module, options: ActivationCheckpointOptions
) -> list[str]:
    """Make the blocks of ``model`` chosen by ``options`` recompute their activations.

    Changes ``model``'s blocks in place (their ``forward``); nothing else moves:
    names, classes, parameters and ``state_dict`` keys stay the same. With
    ``every_n=n`` the ``n``-th, ``2n``-th, ... block (in ``model.modules()``
    order) is checkpointed. Apply it after tensor parallelism and before
    ``compile_blocks`` and FSDP2 / DDP wrapping (``wrap_model(...,
    activation_checkpointing=...)`` does it in that order).

    With 4 blocks and ``every_n=2``: blocks 1 and 3 (0-based) are checkpointed;
    in backward they run their forward again, the RNG state of their first run
    restored, so the gradients are those of the model without checkpointing.

    Args:
        model: the user's module, not yet compiled, sharded or wrapped.
        options: the blocks and the kind of checkpointing.

    Returns:
        The names of the checkpointed blocks (``""`` for the model itself).

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``model`` already compiled, wrapped (DDP) or sharded (FSDP2),
            a block already checkpointed, or no block of ``options.blocks``.
    """
    hint = "Pass the model itself."
    model = check_type(_CALLER, "model", model, nn.Module, hint=hint)
    kind, what = ActivationCheckpointOptions, "an ActivationCheckpointOptions"
    check_type(_CALLER, "options", options, kind, what=what)
    refuse_sharded(_CALLER, model, "activation checkpointing")
    refuse_compiled(_CALLER, model)
    already = checkpointed_blocks(model)
    if already:
        label = repr(already[0]) if already[0] else "the model itself"
        msg = (
            f"{_CALLER}: {label} is already checkpointed; apply activation "
            "checkpointing once, to a fresh model."
        )
        raise ValueError(msg)
    chosen = [
        (name, module)
        for count, (name, module) in enumerate(
            select_blocks(_CALLER, model, options.blocks), start=1
        )
        if count % options.every_n == 0
    ]
    for name, module in chosen:
        if "forward" in module.__dict__:
            label = repr(name) if name else "the model itself"
            msg = (
                f"{_CALLER}: {label} has a forward set on the instance "
                f"({type(module.__dict__['forward']).__name__}), which checkpointing "
                "would bypass; remove it (or checkpoint the module it calls)."
            )
            raise ValueError(msg)
    for _, module in chosen:
        # An instance attribute shadows the class's forward, which nn.Module's
        # __call__ then runs inside its hooks.
        module.forward = CheckpointedForward(module, options)
    return [name for name, _ in chosen]
