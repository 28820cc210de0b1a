"""Pad a tensor along one dimension: the pure arithmetic under ``pad_across_processes``.

``funcaccel.collectives`` re-exports ``pad_tensor``; ``gather`` uses it to give gloo's
``all_gather`` equal shapes, ``pad_across_processes`` to reach the longest rank.
"""

from __future__ import annotations

from typing import Final

import torch

from funcaccel._checks import check_bool
from funcaccel._checks import check_index
from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._checks import summary

__all__ = ["check_pad_args", "check_pad_dim", "check_pad_fill", "pad_tensor"]

_SHOWN_SHAPES: Final = 3
"""The most leaf shapes a ``check_pad_dim`` message lists before "..."."""


def pad_tensor(
    tensor: torch.Tensor,
    size: int,
    *,
    dim: int = 0,
    pad_index: float = 0,
    pad_first: bool = False,
) -> torch.Tensor:
    """Return ``tensor`` padded along ``dim`` to ``size`` with ``pad_index``.

    Pure; ``tensor`` is not modified, and is returned itself when already ``size`` long.

    Raises:
        TypeError: ``tensor`` is not a tensor, ``dim`` not an int or ``pad_index``
            not a number.
        ValueError: ``dim`` not in ``[0, tensor.ndim)``, ``size`` below the current
            size, or a fractional ``pad_index`` for an integer tensor.

    >>> pad_tensor(torch.tensor([4]), 3)
    tensor([4, 0, 0])
    >>> pad_tensor(torch.tensor([[1, 2]]), 3, dim=1, pad_index=-1, pad_first=True)
    tensor([[-1,  1,  2]])
    """
    check_type("pad_tensor", "tensor", tensor, torch.Tensor, what="a torch.Tensor")
    check_pad_args("pad_tensor", dim, pad_index)
    shape = tuple(tensor.shape)
    hint = f"pass a dim the tensor's shape {shape} has."
    check_index("pad_tensor", "dim", dim, "tensor.ndim", tensor.ndim, hint)
    spec = [[(shape, str(tensor.dtype))]]  # one leaf, as check_pad_fill reads it
    check_pad_fill(
        "pad_tensor", spec, dim=dim, pad_index=pad_index, pad_first=pad_first
    )
    current = tensor.shape[dim]
    if size < current:
        fail_value("pad_tensor", "size", size, f">= {current} (dim {dim}'s size)")
    if size == current:
        return tensor
    sizes = list(shape)
    sizes[dim] = size
    out = tensor.new_full(sizes, pad_index)
    out.narrow(dim, size - current if pad_first else 0, current).copy_(tensor)
    return out


def check_pad_args(caller: str, dim: int, pad_index: float) -> None:
    check_type(caller, "dim", dim, int)
    if dim < 0:
        fail_value(caller, "dim", dim, ">= 0", "Count dims from 0 (no negatives).")
    # bool in the kinds: a bool pad_index has always passed (it fills 0 or 1).
    number = (int, float, bool)
    hint = "Pass an int or a float."
    check_type(caller, "pad_index", pad_index, number, what="a number", hint=hint)


def check_pad_fill(
    caller: str,
    specs: list[list[tuple[tuple[int, ...], str]]],
    *,
    dim: int,
    pad_index: float,
    pad_first: object,
) -> None:
    """Check ``pad_first`` and that ``pad_index`` fits every leaf that has ``dim``.

    ``specs`` holds, per leaf, every rank's ``(shape, dtype name)`` (one entry with
    one process), so each rank reaches the same verdict, whichever rank's leaf
    would need the padding.

    >>> check_pad_fill("f", [[((2,), "torch.int64")]], dim=0, pad_index=0.5, pad_first=False)
    Traceback (most recent call last):
    ...
    ValueError: f: pad_index 0.5 cannot be stored in a torch.int64 leaf (leaf 0, shape (2,)); ...
    """
    check_bool(caller, "pad_first", pad_first)
    if not isinstance(pad_index, float) or pad_index.is_integer():
        return
    for index, per_rank in enumerate(specs):
        for shape, dtype in per_rank:
            kind = getattr(torch, dtype.removeprefix("torch."), None)
            exact = isinstance(kind, torch.dtype) and not (
                kind.is_floating_point or kind.is_complex
            )
            if len(shape) > dim and exact:
                msg = f"{caller}: pad_index {pad_index} cannot be stored in a {dtype} leaf (leaf {index}, shape {shape}); pass an integer pad_index, or cast the leaf to a floating dtype."
                raise ValueError(msg)


def check_pad_dim(
    caller: str, specs: list[list[tuple[tuple[int, ...], str]]], *, dim: int
) -> None:
    """Raise unless some leaf, on some rank, has dimension ``dim``.

    ``specs`` is as for ``check_pad_fill``, every rank's shapes, so each rank
    reaches the same verdict even where the ranks' leaves differ in ndim (a leaf
    that lacks ``dim`` while another has it is left as it is, not an error). A
    structure without leaves has nothing to pad and passes.

    >>> check_pad_dim("f", [[((2, 3), "torch.int64")]], dim=1)
    >>> check_pad_dim("f", [[((2, 3), "torch.int64")]], dim=5)
    Traceback (most recent call last):
    ...
    ValueError: f: dim (5) is not a dimension of any leaf; got leaf shapes (2, 3); ...
    """
    # The distinct shapes over leaves and ranks, in order: ranks see the same list.
    shapes = list(dict.fromkeys(shape for per_rank in specs for shape, _ in per_rank))
    if not shapes or any(len(shape) > dim for shape in shapes):
        return
    listing = ", ".join(summary(shape) for shape in shapes[:_SHOWN_SHAPES])
    if len(shapes) > _SHOWN_SHAPES:
        listing += ", ..."
    most = max(len(shape) for shape in shapes)
    fix = (
        f"pass a dim below {most} (the most dims any leaf has)"
        if most
        else "0-d leaves have no dim to pad: reshape them to 1-d first (t.reshape(1))"
    )
    msg = f"{caller}: dim ({dim}) is not a dimension of any leaf; got leaf shapes {listing}; {fix}."
    raise ValueError(msg)
