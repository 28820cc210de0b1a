"""The model and optimizer state DCP stores, under the model's original names.

DCP names every tensor by its parameter's fully qualified name. A ``Pipeline``
holds its stages as ``stage_modules.<i>``, so its names carry that prefix; here
it is removed (``stage_modules.0.layers.2.weight`` -> ``layers.2.weight``), so a
checkpoint saved on one pipeline cut loads on another, on a plain FSDP2 model
or in one process, and the reverse. Optimizer state is flattened (one key per
parameter and field, param-group settings per parameter too), so that a rank
holding only some parameters saves and loads only theirs.

>>> original_name("state.stage_modules.1.layers.3.0.weight.momentum_buffer")
'state.layers.3.0.weight.momentum_buffer'
"""

from __future__ import annotations

import re
from typing import Any
from typing import Final

import torch
from torch import nn

from funcaccel.model import Pipeline
from funcaccel.model import unwrap_model

__all__ = [
    "load_model_state",
    "load_optimizer_state",
    "model_state",
    "optimizer_state",
    "original_name",
]

_STAGE: Final = re.compile(r"\bstage_modules\.\d+\.")


def original_name(key: str) -> str:
    """Return ``key`` without a ``Pipeline``'s ``stage_modules.<i>.`` part."""
    return _STAGE.sub("", key)


def _is_pipeline(model: nn.Module) -> bool:
    return isinstance(unwrap_model(model), Pipeline)


def _renamed(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    if not _is_pipeline(model):
        return state
    return {original_name(key): value for key, value in state.items()}


def _restored(
    model: nn.Module, saved: dict[str, Any], live: dict[str, Any]
) -> dict[str, Any]:
    """Return ``saved`` (original names) under the names of ``live``'s keys."""
    if not _is_pipeline(model):
        return saved
    return {key: saved[original_name(key)] for key in live}


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def model_state(model: nn.Module) -> dict[str, Any]:
    """Return ``model``'s state for DCP (this rank's tensors), under original names."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return _renamed(model, get_model_state_dict(model, options=_options()))


def optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Return ``optimizer``'s flattened state for DCP, under ``model``'s original names."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=_options())
    return _renamed(model, state)


def load_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    """Load ``state`` (from ``model_state``, filled by DCP) into ``model`` in place."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    live = (
        get_model_state_dict(model, options=_options()) if _is_pipeline(model) else {}
    )
    set_model_state_dict(model, _restored(model, state, live), options=_options())


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load ``state`` (from ``optimizer_state``, filled by DCP) into ``optimizer``."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    live: dict[str, Any] = {}
    if _is_pipeline(model):
        live = get_optimizer_state_dict(model, optimizer, options=_options())
    restored = _restored(model, state, live)
    set_optimizer_state_dict(model, optimizer, restored, options=_options())
