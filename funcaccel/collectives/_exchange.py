"""What ranks exchange before a collective moves tensors, and the checks on it.

Each rank all-gathers its leaf paths and each leaf's ``(shape, dtype name)``; the
checks here then run on the same gathered values on every rank, so a disagreement
raises the same ``ValueError`` everywhere instead of leaving some ranks waiting in a
collective the others never enter.

>>> per_leaf("f", ["data"], [(["data"], [((2,), "torch.int64")])] * 2)
[[((2,), 'torch.int64'), ((2,), 'torch.int64')]]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from funcaccel._checks import type_name
from funcaccel.context import DistributedContext

__all__ = [
    "LeafSpec",
    "Spec",
    "all_gather_objects",
    "check_agree",
    "exchange",
    "join_objects",
    "per_leaf",
    "local_spec",
]

LeafSpec = tuple[tuple[int, ...], str]
"""One leaf's ``(shape, dtype name)``."""
# Per rank: the leaf paths, then each leaf's (shape, dtype name).
Spec = tuple[list[str], list[LeafSpec]]


def local_spec(paths: list[str], leaves: list[torch.Tensor]) -> Spec:
    """Return what this rank sends: its leaf paths and each leaf's shape and dtype."""
    return paths, [(tuple(t.shape), str(t.dtype)) for t in leaves]


def all_gather_objects(ctx: DistributedContext, obj: object) -> list[Any]:
    """Return every rank's picklable ``obj``, in rank order."""
    every: list[Any] = [None] * ctx.num_processes
    dist.all_gather_object(every, obj)
    return every


def per_leaf(caller: str, paths: list[str], specs: list[Spec]) -> list[list[LeafSpec]]:
    """Check every rank has the same leaves; return each leaf's (shape, dtype)s."""
    if any(spec[0] != paths for spec in specs):
        listing = "; ".join(f"rank {r}: {s[0]}" for r, s in enumerate(specs))
        msg = f"{caller}: data has a different structure on different ranks ({listing}); pass the same nesting, keys and key order on every rank."
        raise ValueError(msg)
    return [[spec[1][i] for spec in specs] for i in range(len(paths))]


def exchange(
    ctx: DistributedContext, caller: str, paths: list[str], leaves: list[torch.Tensor]
) -> list[list[LeafSpec]]:
    """All-gather every rank's leaf shapes and dtypes before any tensor moves."""
    return per_leaf(caller, paths, all_gather_objects(ctx, local_spec(paths, leaves)))


def check_agree(caller: str, path: str, per_rank: list[LeafSpec], first: int) -> None:
    """Raise unless every rank's leaf agrees on dtype and on shape from dim ``first``."""
    keys = {(shape[first:], dtype) for shape, dtype in per_rank}
    if len(keys) > 1:
        listing = ", ".join(f"rank {r}: {s} {d}" for r, (s, d) in enumerate(per_rank))
        rule = "every dim but 0" if first else "the shape"
        msg = f"{caller}: {path} must have the same dtype and {rule} on every rank; got {listing}. Cast to one dtype and pad with pad_across_processes first."
        raise ValueError(msg)


def join_objects(caller: str, name: str, every: list[Any]) -> list[Any]:
    """Concatenate every rank's list or tuple, or raise naming the ranks that aren't."""
    bad = [
        f"rank {r}: {type_name(o)}"
        for r, o in enumerate(every)
        if not isinstance(o, (list, tuple))
    ]
    if bad:
        msg = f"{caller}: {name} must be a list or tuple on every rank; got {', '.join(bad)}; wrap a single object as [{name}]."
        raise TypeError(msg)
    return [item for part in every for item in part]
