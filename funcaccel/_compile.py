"""The module inside ``torch.compile``'s wrappers: a leaf that needs only torch.

>>> from torch import nn
>>> net = nn.Linear(1, 1)
>>> inside_compile(net) is net
True
"""

from __future__ import annotations

from torch import nn

__all__ = ["inside_compile"]


def inside_compile(model: nn.Module) -> nn.Module:
    """Return the module inside ``torch.compile``'s wrappers (``._orig_mod``), if any.

    Nothing is imported from ``torch._dynamo``: an ``OptimizedModule`` is
    recognised by its ``_orig_mod`` attribute, so this stays cheap when
    ``torch.compile`` was never used.
    """
    while isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):
        model = inner
    return model
