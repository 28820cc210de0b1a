"""Type checks against torch classes whose modules are slow to import.

``torch.distributed.fsdp``, ``torch.distributed.tensor`` and
``torch.distributed.checkpoint`` take a second or more to import. No object can be
an instance of a class whose module was never imported, so funcaccel checks
``isinstance`` only against modules already loaded, and imports them itself only
on the paths that shard or checkpoint. ``import funcaccel`` thus stays cheap.

>>> import torch
>>> is_instance_if_loaded(torch.ones(1), "torch", "Tensor")
True
>>> is_instance_if_loaded(torch.ones(1), "not_imported_anywhere", "Thing")
False
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING
from typing import TypeGuard

from typing_extensions import TypeIs

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

__all__ = [
    "is_deepspeed_engine",
    "is_dtensor",
    "is_fsdp_module",
    "is_instance_if_loaded",
    "is_zero_parameter",
]


def is_instance_if_loaded(obj: object, module_name: str, class_name: str) -> bool:
    """Return ``isinstance(obj, module.class_name)``, False when the module is unloaded."""
    module = sys.modules.get(module_name)
    if module is None:
        return False
    cls = getattr(module, class_name)
    assert isinstance(cls, type), (module_name, class_name)
    return isinstance(obj, cls)


def is_fsdp_module(module: nn.Module) -> TypeGuard[FSDPModule]:
    """Return whether ``fully_shard`` (FSDP2) has been applied to ``module``.

    >>> from torch import nn
    >>> is_fsdp_module(nn.Linear(1, 1))
    False
    """
    return is_instance_if_loaded(module, "torch.distributed.fsdp", "FSDPModule")


def is_dtensor(value: object) -> TypeIs[DTensor]:
    """Return whether ``value`` is a ``DTensor`` (a sharded FSDP2 tensor)."""
    return is_instance_if_loaded(value, "torch.distributed.tensor", "DTensor")


def is_deepspeed_engine(module: object) -> bool:
    """Return whether ``module`` is a DeepSpeed engine (``wrap_model(deepspeed=...)``).

    >>> from torch import nn
    >>> is_deepspeed_engine(nn.Linear(1, 1))
    False
    """
    return is_instance_if_loaded(module, "deepspeed.runtime.engine", "DeepSpeedEngine")


def is_zero_parameter(tensor: object) -> bool:
    """Return whether ``tensor`` is a parameter that a DeepSpeed ZeRO optimizer manages.

    Its gradient then lives in ZeRO's partitions, not in ``.grad``. ZeRO-3 marks
    its parameters with ``ds_id``, ZeRO-1 and -2 with ``param_idx_in_group``.

    >>> import torch
    >>> is_zero_parameter(torch.nn.Parameter(torch.ones(1)))
    False
    """
    if "deepspeed" not in sys.modules:
        return False
    return hasattr(tensor, "ds_id") or hasattr(tensor, "param_idx_in_group")
