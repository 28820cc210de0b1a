"""``compile_blocks``: ``torch.compile`` each block in place, recording what it compiles.

Each chosen block gets ``module.compile(...)``: ``torch.compile`` of the block's
own call, kept on the block. The block stays in the model (no
``OptimizedModule`` wrapper), so hooks added to it afterwards, FSDP2's in
particular, run around the compiled code instead of being bypassed by it.
Compilation happens at the first call. The backend is wrapped by a
``GraphLog``, shared by the blocks of one call and kept on each of them, which
records the compile id of every graph the backend receives; ``compile_report``
reads it.

>>> import torch
>>> from torch import nn
>>> class Block(nn.Module):
...     def __init__(self) -> None:
...         super().__init__()
...         self.linear = nn.Linear(2, 2)
...     def forward(self, x: torch.Tensor) -> torch.Tensor:
...         return torch.tanh(self.linear(x))
>>> net = nn.Sequential(Block(), Block())
>>> compile_blocks(net, CompileOptions(blocks=[Block], backend="eager"))
['0', '1']
>>> compile_blocks(nn.Sequential(nn.Linear(2, 2)), CompileOptions(blocks=[nn.Linear]))
Traceback (most recent call last):
...
ValueError: compile_blocks: block '0' (Linear) runs torch's own forward ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import Final

import torch
from torch import nn

from funcaccel._checks import check_type
from funcaccel.model._compile_options import CompileOptions
from funcaccel.model._fast_order import compiled_in_place
from funcaccel.model._fast_order import refuse_sharded
from funcaccel.model._fast_order import select_blocks

__all__ = ["GRAPH_LOG_ATTRIBUTE", "GraphLog", "compile_blocks"]

_CALLER: Final = "compile_blocks"
GRAPH_LOG_ATTRIBUTE: Final = "_funcaccel_graph_log"
"""The attribute under which a compiled block keeps its ``GraphLog``."""


class GraphLog:
    """A ``torch.compile`` backend that records each graph, then hands it on.

    ``compile_ids`` holds dynamo's id of every graph compiled through it, as
    ``"frame/compile"`` strings (``"3/1"``: the second compilation of frame 3, a
    recompile). It is the one mutable record of the fast step, owned by the
    compiled blocks (an attribute of each), like DDP's reducer is owned by DDP.
    """

    __slots__ = ("compile_ids", "compiler_name", "inner")

    def __init__(self, inner: Callable[..., Any], name: str) -> None:
        self.inner = inner
        self.compiler_name = name
        self.compile_ids: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._guards import CompileContext

        self.compile_ids.append(str(CompileContext.current_compile_id()))
        return self.inner(gm, example_inputs)

    def reset(self) -> None:
        """Forward ``torch._dynamo.reset()`` to the backend (the log is kept)."""
        reset = getattr(self.inner, "reset", None)
        if callable(reset):
            reset()


def _backend(options: CompileOptions) -> GraphLog:
    backend = options.backend
    if backend == "inductor":
        # What torch.compile itself builds for inductor, mode and dynamic included.
        wrapper: Callable[..., Callable[..., Any]] = torch._TorchCompileInductorWrapper
        inner = wrapper(options.mode, None, options.dynamic)
        return GraphLog(inner, "inductor")
    if isinstance(backend, str):
        from torch._dynamo import lookup_backend

        return GraphLog(lookup_backend(backend), backend)
    return GraphLog(backend, getattr(backend, "__name__", type(backend).__name__))


def compile_blocks(model: nn.Module, options: CompileOptions) -> list[str]:
    """Compile ``model``'s blocks chosen by ``options`` in place (``module.compile()``).

    Changes ``model``'s blocks in place: each gets its compiled call, traced at
    its first call. Apply it after tensor parallelism and activation
    checkpointing, before FSDP2 / DDP wrapping (``wrap_model(..., compile=...)``
    does it in that order); a block compiled in place keeps the hooks sharding
    adds later. ``compile_report(model)`` then says what was compiled.

    Args:
        model: the user's module, not yet sharded or wrapped.
        options: the blocks and ``torch.compile``'s settings.

    Returns:
        The names of the compiled blocks (``""`` for the model itself).

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``model`` already wrapped (DDP, a ``torch.compile``
            wrapper) or sharded (FSDP2), a block already compiled, or no block
            of ``options.blocks``.
    """
    hint = "Pass the model itself."
    model = check_type(_CALLER, "model", model, nn.Module, hint=hint)
    check_type(_CALLER, "options", options, CompileOptions, what="a CompileOptions")
    refuse_sharded(_CALLER, model, "compilation")
    already = compiled_in_place(model)
    if already:
        label = repr(already[0]) if already[0] else "the model itself"
        msg = (
            f"{_CALLER}: {label} is already compiled in place; compile once, to a "
            "fresh model."
        )
        raise ValueError(msg)
    chosen = list(select_blocks(_CALLER, model, options.blocks))
    for name, module in chosen:
        _refuse_torch_forward(name, module)
    log = _backend(options)
    for _, module in chosen:
        module.compile(
            backend=log, fullgraph=options.fullgraph, dynamic=options.dynamic
        )
        object.__setattr__(module, GRAPH_LOG_ATTRIBUTE, log)
    return [name for name, _ in chosen]


def _refuse_torch_forward(name: str, module: nn.Module) -> None:
    """Refuse a block whose ``forward`` is torch.nn's own (``nn.Sequential``'s).

    Compiled in place, such a block's frame is one dynamo skips (torch's own
    modules are on its skip list): ``fullgraph=True`` then fails at the first
    call with "found no compiled frames", and ``fullgraph=False`` runs it
    uncompiled, silently.
    """
    forward = module.forward
    where = str(getattr(getattr(forward, "__func__", forward), "__module__", ""))
    if where.split(".")[0] != "torch":
        return
    label = repr(name) if name else "the model itself"
    kind = type(module).__name__
    msg = (
        f"{_CALLER}: block {label} ({kind}) runs torch's own forward "
        f"({where}), which torch.compile skips when a module is compiled in "
        "place, so it would run uncompiled; choose blocks whose class defines "
        "its own forward (for example a subclass with a forward method), or "
        "checkpoint the block first (apply_activation_checkpointing), whose "
        "forward is compiled instead."
    )
    raise ValueError(msg)
