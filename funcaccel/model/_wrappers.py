"""Which modules are wrappers: ``check_unwrapped`` refuses one, ``unwrap_model`` walks out.

A wrapper is ``DistributedDataParallel`` / ``DataParallel`` (``.module``), a
DeepSpeed engine (``.module``) or ``torch.compile``'s ``OptimizedModule``
(``._orig_mod``). An FSDP2 module is its own root: ``fully_shard`` changes the
module's class in place, so it is returned as is but cannot be wrapped again.

>>> from funcaccel.context import DistributedContext
>>> check_unwrapped("f", DistributedContext(), nn.DataParallel(nn.Linear(2, 1)))
Traceback (most recent call last):
...
ValueError: f: model is already wrapped (DataParallel); pass unwrap_model(model), or use the wrapped model as it is.
"""

from __future__ import annotations

import sys
from typing import Final

from torch import nn
from torch.nn.parallel import DataParallel
from torch.nn.parallel import DistributedDataParallel

from funcaccel._checks import check_type
from funcaccel._compile import inside_compile
from funcaccel._ctx_checks import check_context
from funcaccel._dist_types import is_deepspeed_engine
from funcaccel._dist_types import is_fsdp_module

__all__ = ["check_unwrapped", "unwrap_model"]

_MODULE: Final = "a torch.nn.Module"
_PASS_MODULE: Final = "Pass the module itself, not its parameters or state_dict."
_UNWRAP: Final = "pass unwrap_model(model), or use the wrapped model as it is."


def check_unwrapped(caller: str, ctx: object, model: object) -> nn.Module:
    """Return ``model`` after checking ``ctx`` and that ``model`` is a module not yet wrapped.

    Raises:
        TypeError: ``ctx`` is not a ``DistributedContext``, ``model`` not a module.
        ValueError: ``model`` (inside ``torch.compile``'s wrapper, if any) is DDP,
            ``DataParallel``, FSDP2 or a DeepSpeed engine.
    """
    check_context(caller, ctx)
    model = check_type(
        caller, "model", model, nn.Module, what=_MODULE, hint=_PASS_MODULE
    )
    inner = inside_compile(model)
    wrappers = (DistributedDataParallel, DataParallel)
    if (
        isinstance(inner, wrappers)
        or is_fsdp_module(inner)
        or is_deepspeed_engine(inner)
    ):
        msg = f"{caller}: model is already wrapped ({type(inner).__name__}); {_UNWRAP}"
        raise ValueError(msg)
    return model


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

    >>> net = nn.Linear(2, 1)
    >>> unwrap_model(nn.DataParallel(net)) is net
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
