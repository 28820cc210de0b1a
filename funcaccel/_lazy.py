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

__all__ = ["is_instance_if_loaded"]


def is_instance_if_loaded(obj: object, module_name: str, class_name: str) -> bool:
    """Return ``isinstance(obj, module.class_name)``, False when the module is unloaded."""
    module = sys.modules.get(module_name)
    if module is None:
        return False
    cls = getattr(module, class_name)
    assert isinstance(cls, type), (module_name, class_name)
    return isinstance(obj, cls)
