"""Check that a model's ``forward`` is the chain of units a pipeline runs instead.

A pipeline stage runs its units one after the other and never calls the model's
own ``forward``. A model whose ``forward`` does anything else between its units
(a residual sum, a mask, a skipped or repeated unit) would train another function
than the one the user wrote, with no error. ``check_chain`` traces ``forward``
symbolically (torch.fx, each unit a leaf; nothing is computed, so a ``meta`` model
works) and accepts only the graph ``input -> unit 0 -> unit 1 -> ... -> output``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from torch import nn

__all__ = ["check_chain"]

_FIX: Final = "Write the model as a chain: an nn.Sequential of its units, or a forward that only calls its top-level children (or the items of an nn.ModuleList / nn.Sequential child) in order, each on the previous one's output; move anything else (masks, positions, residual sums) into a unit."
_LIMIT: Final = 160


def _short(text: str) -> str:
    return text if len(text) <= _LIMIT else text[: _LIMIT - 3] + "..."


def check_chain(
    caller: str, model: nn.Module, units: Sequence[tuple[str, nn.Module]]
) -> None:
    """Raise unless ``model.forward(x)`` is ``units`` applied to ``x`` in order.

    Args:
        caller: the public function named in errors.
        model: the model being cut; only traced, never run or changed.
        units: its units in order, as ``(qualified name, module)``.

    Raises:
        ValueError: ``forward`` could not be traced, or its graph is not the
            chain (names the first operation that is not a unit call).

    >>> import torch
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
    >>> check_chain("wrap_model", net, list(net.named_children()))
    >>> class Residual(nn.Sequential):
    ...     def forward(self, x: torch.Tensor) -> torch.Tensor:
    ...         return x + super().forward(x)
    >>> check_chain("wrap_model", Residual(nn.Tanh()), [("0", nn.Tanh())])
    Traceback (most recent call last):
    ...
    ValueError: wrap_model: pipeline= runs the model's units one after the other ...
    """
    import torch.fx

    leaves = {id(module) for _, module in units}

    class _UnitTracer(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
            return id(m) in leaves or super().is_leaf_module(m, module_qualified_name)

    kind = type(model).__qualname__
    head = f"{caller}: pipeline= runs the model's units one after the other in place of {kind}.forward"
    try:
        graph = _UnitTracer().trace(model)
    except Exception as error:  # any tracing failure means: not checkable
        reason = _short(f"{type(error).__name__}: {error}")
        msg = f"{head}, which could not be checked to be that chain (torch.fx could not trace it: {reason}). {_FIX}"
        raise ValueError(msg) from error
    expected = [name for name, _ in units]
    seen: list[str] = []
    previous: torch.fx.Node | None = None
    for node in graph.nodes:
        if node.op == "placeholder":
            if previous is None:
                previous = node
            elif node.users:
                what = f"a second input {node.target!r} used by the units"
                msg = f"{head}, but {kind}.forward takes {what}. {_FIX}"
                raise ValueError(msg)
            continue
        if node.op == "output":
            if node.args != (previous,):
                msg = f"{head}, but {kind}.forward returns {_short(str(node.args))} rather than the last unit's output. {_FIX}"
                raise ValueError(msg)
            continue
        chained = node.args == (previous,) and not node.kwargs
        if node.op != "call_module" or not chained:
            step = f"{node.op} {_short(str(node.target))} on {_short(str(node.args))}"
            msg = f"{head}, but {kind}.forward also does {step} after units {seen}. {_FIX}"
            raise ValueError(msg)
        seen.append(str(node.target))
        previous = node
    if seen != expected:
        msg = f"{head}, but {kind}.forward calls the units {_short(str(seen))}, not each of {_short(str(expected))} once in order. {_FIX}"
        raise ValueError(msg)
