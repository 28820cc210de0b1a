"""Move nested batches to a device without touching the input.

The rules: docs/loader.md#semantics-building-a-sharded-loader.

A batch is walked as a tree by the package's one walker (``funcaccel._tree``):
tensors and other leaves with a ``.to`` method are moved, lists, tuples, named
tuples, mappings and dataclass instances are rebuilt around their moved contents,
and any other leaf (strings, numbers, ``None``, numpy arrays) is kept as it is. The input is never modified: every container on the way is a new
object, so a caller holding the original batch still sees it unchanged.
"""

from __future__ import annotations

from typing import Any
from typing import Final
from typing import TypeVar
from typing import cast

import torch

from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._tree import tree_map

__all__ = ["send_to_device"]

_T = TypeVar("_T")

# Leaves that are never moved, recognised by exact type before anything slower.
_ATOMS: Final = frozenset({int, float, complex, bool, str, bytes, type(None)})


def send_to_device(
    data: _T, device: torch.device | str, *, non_blocking: bool = False
) -> _T:
    """Return ``data`` with every tensor (and every object with ``.to``) on ``device``.

    Tensors may be nested in lists, tuples, named tuples, dicts (or other mappings)
    and dataclass instances; the structure and container types are kept. Other
    leaves are returned as they are. ``data`` is left unchanged: containers are
    rebuilt and tensors are moved with ``Tensor.to``, which returns the same tensor
    when it is already on ``device``. An object with a ``.to`` method is moved by its
    own method (for an ``nn.Module`` that method works in place).

    Args:
        data: The batch to move.
        device: Where to move it.
        non_blocking: Passed to ``Tensor.to`` (and to an object's ``.to`` when it
            accepts it), for asynchronous host-to-GPU copies from pinned memory.

    Returns:
        A batch of the same structure with its tensors on ``device``.

    Raises:
        TypeError: If ``device`` is not a ``torch.device`` or a string, or
            ``non_blocking`` is not a bool.

    >>> batch = {"x": torch.zeros(2), "ids": [torch.ones(1)], "name": "a"}
    >>> moved = send_to_device(batch, "cpu")
    >>> moved["name"], moved["x"].device.type, moved is batch, moved["ids"] is batch["ids"]
    ('a', 'cpu', False, False)
    """
    if isinstance(device, str):
        target = torch.device(device)
    elif isinstance(device, torch.device):
        target = device
    else:
        hint = "Pass e.g. torch.device('cpu') or ctx.device."
        fail_type("send_to_device", "device", device, "a torch.device or a str", hint)
    hint = "Pass True or False."
    check_type("send_to_device", "non_blocking", non_blocking, bool, hint=hint)
    return cast(_T, send_tree(data, target, non_blocking))


def send_tree(data: Any, device: torch.device, non_blocking: bool) -> Any:
    """Return ``data`` moved to ``device`` (arguments already checked)."""

    def move(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            if non_blocking:
                return leaf.to(device, non_blocking=True)
            return leaf if leaf.device == device else leaf.to(device)
        if type(leaf) in _ATOMS:
            return leaf
        mover = getattr(leaf, "to", None)
        return _call_to(mover, device, non_blocking) if callable(mover) else leaf

    return tree_map(move, data)


def _call_to(mover: Any, device: torch.device, non_blocking: bool) -> Any:
    if not non_blocking:
        return mover(device)
    try:
        return mover(device, non_blocking=True)
    except TypeError:
        # Its .to takes no non_blocking keyword; a blocking move is still correct.
        return mover(device)
