"""Collectives over nested tensors: gather, broadcast, reduce, pad, gather for metrics.

Every function takes ``ctx`` first. Data is a tensor or a nested list / tuple / named
tuple / dict of tensors; the structure is rebuilt (named tuples as their own type),
the caller's tensors and containers are never modified, and another leaf is a
``TypeError`` naming its path. With one process every function returns its input
(``reduce`` an equal copy) and needs no process group; arguments are checked alike.
With several, ranks first exchange each leaf's shape and dtype, so a disagreement is
a ``ValueError`` on every rank instead of a hang; with ``ctx.collective_timeout``
set, a call that some ranks never make is a ``RuntimeError`` naming it, on the ranks
that made it, within that bound (see ``guard_collective``).

>>> ctx = DistributedContext()
>>> gather(ctx, {"x": torch.tensor([1, 2])})
{'x': tensor([1, 2])}
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any
from typing import Final
from typing import Literal
from typing import Protocol
from typing import TypeAlias
from typing import TypeVar
from typing import overload

import torch
import torch.distributed as dist

from funcaccel._checks import check_choice
from funcaccel._checks import check_index
from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._checks import type_name
from funcaccel._guard import guard_collective
from funcaccel._tree import rebuild
from funcaccel.collectives._exchange import all_gather_objects
from funcaccel.collectives._exchange import check_agree
from funcaccel.collectives._exchange import exchange
from funcaccel.collectives._exchange import join_objects
from funcaccel.collectives._exchange import local_spec
from funcaccel.collectives._exchange import per_leaf
from funcaccel.collectives._leaves import is_tensor_tree
from funcaccel.collectives._leaves import tensor_leaves
from funcaccel.collectives._pad import check_pad_args
from funcaccel.collectives._pad import check_pad_dim
from funcaccel.collectives._pad import check_pad_fill
from funcaccel.collectives._pad import pad_tensor
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group
from funcaccel.mesh import ParallelMesh
from funcaccel.mesh import check_mesh

__all__ = [
    "BatchInfo",
    "Reduction",
    "broadcast",
    "broadcast_object",
    "gather",
    "gather_for_metrics",
    "gather_object",
    "pad_across_processes",
    "pad_tensor",
    "reduce",
]

T = TypeVar("T")
M = TypeVar("M", bound=Mapping[Any, Any])
Reduction = Literal["sum", "mean", "max", "none"]
_REDUCTIONS: Final = ("sum", "mean", "max", "none")


class BatchInfo(Protocol):
    """What ``gather_for_metrics`` reads of a batch record from ``iter_batches``."""

    @property
    def is_last(self) -> bool:
        """Whether this is the last batch this rank yields in the epoch."""
        ...

    @property
    def remainder(self) -> int:
        """Real samples in the epoch's last global batch; 0 if full, -1 if dropped."""
        ...


class _Missing(enum.Enum):
    """The type of ``gather_for_metrics``'s default ``batch``: not passed at all."""

    BATCH = "batch not passed"


_BatchArg: TypeAlias = BatchInfo | None | _Missing
"""What ``gather_for_metrics`` accepts as ``batch``: a record, or an explicit ``None``."""

_NOT_PASSED: Final = _Missing.BATCH
_MSG_NO_BATCH: Final = (
    "gather_for_metrics: batch= is missing; with num_processes={p} an evened-out "
    "loader repeats samples from the epoch's start in its last batch, and only the "
    "batch record says how many to drop. Iterate with `for batch in "
    "iter_batches(loader, state)` and pass batch=batch (the record, not "
    "batch.data); pass batch=None only when data holds no looped-back samples "
    "(drop_last, even_batches=False, or data not read from a sharded loader)."
)


def _check_from_process(
    ctx: DistributedContext, caller: str, from_process: int
) -> None:
    hint = "Pass the source rank as an int."
    check_type(caller, "from_process", from_process, int, hint=hint)
    p, hint = ctx.num_processes, "pass the rank to copy from."
    check_index(caller, "from_process", from_process, "num_processes", p, hint)


def gather(ctx: DistributedContext, data: T) -> T:
    """Concatenate every rank's tensors along dim 0, in rank order, on every rank.

    0-d tensors count as shape ``[1]``; dim-0 sizes may differ. ``data`` is not
    modified. With 2 ranks, rank 0 ``[1, 2]`` and rank 1 ``[3]`` give
    ``[1, 2, 3]`` on both.

    Raises:
        TypeError: a leaf is not a tensor.
        ValueError: on every rank, when the structure, a dtype or a dim but 0 differs.
        RuntimeError: no process group matches ``ctx``, or (with
            ``ctx.collective_timeout``) not every rank reached this call.
    """
    require_process_group(ctx, "gather")
    paths, flat = tensor_leaves(data, "gather", rows=True)
    if ctx.num_processes == 1:
        return data
    guard_collective(ctx, "gather")
    specs = exchange(ctx, "gather", paths, flat)
    return rebuild(data, _gather_rows(ctx, "gather", paths, flat, specs))


def _gather_rows(
    ctx: DistributedContext,
    caller: str,
    paths: list[str],
    flat: list[torch.Tensor],
    specs: list[list[tuple[tuple[int, ...], str]]],
    keep: range | None = None,
) -> list[torch.Tensor]:
    """All-gather each leaf's rows; keep the ranks in ``keep`` (default: all)."""
    out = []
    for path, tensor, per_rank in zip(paths, flat, specs, strict=True):
        check_agree(caller, path, per_rank, 1)
        # gloo's all_gather needs equal shapes: pad to the longest, trim after.
        sizes = [shape[0] for shape, _ in per_rank]
        send = pad_tensor(tensor, max(sizes)).contiguous()
        buffers = [torch.empty_like(send) for _ in sizes]
        dist.all_gather(buffers, send)
        parts = [b[:n] for b, n in zip(buffers, sizes, strict=True)]
        out.append(torch.cat(parts if keep is None else [parts[g] for g in keep]))
    return out


def gather_object(ctx: DistributedContext, obj: list[T] | tuple[T, ...]) -> list[T]:
    """Return a new list of rank 0's items, then rank 1's, ... on every rank.

    Items must pickle. With 2 ranks, rank 0 ``["a"]`` and rank 1 ``["b", "c"]``
    give ``["a", "b", "c"]`` on both. With one process ``obj`` itself is returned
    (a tuple as a list of its items).

    Raises:
        TypeError: ``obj`` is not a list or tuple (on every rank when any rank's is not).
        RuntimeError: no process group matches ``ctx``, or (with
            ``ctx.collective_timeout``) not every rank reached this call.
    """
    require_process_group(ctx, "gather_object")
    if ctx.num_processes == 1:
        join_objects("gather_object", "obj", [obj])
        return obj if isinstance(obj, list) else list(obj)
    guard_collective(ctx, "gather_object")
    # Exchange first, check after: every rank sees every rank's type alike.
    out: list[T] = join_objects("gather_object", "obj", all_gather_objects(ctx, obj))
    return out


def broadcast(ctx: DistributedContext, data: T, *, from_process: int = 0) -> T:
    """Return rank ``from_process``'s tensors on every rank; ``data`` is not modified.

    Every rank passes tensors of the same shapes and dtypes (their values are
    ignored, except on ``from_process``). With 2 ranks, rank 0 ``[1., 2.]`` and
    rank 1 ``[0., 0.]`` give ``[1., 2.]`` on both (``[0., 0.]`` with
    ``from_process=1``).

    Raises:
        TypeError: a leaf is not a tensor, or ``from_process`` not an int.
        ValueError: ``from_process`` out of range; on every rank, a structure,
            shape or dtype that differs across ranks.
        RuntimeError: no process group matches ``ctx``, or (with
            ``ctx.collective_timeout``) not every rank reached this call.
    """
    require_process_group(ctx, "broadcast")
    _check_from_process(ctx, "broadcast", from_process)
    paths, leaves = tensor_leaves(data, "broadcast")
    if ctx.num_processes == 1:
        return data
    guard_collective(ctx, "broadcast")
    for path, per_rank in zip(
        paths, exchange(ctx, "broadcast", paths, leaves), strict=True
    ):
        check_agree("broadcast", path, per_rank, 0)
    out = [t.detach().clone(memory_format=torch.contiguous_format) for t in leaves]
    for tensor in out:
        dist.broadcast(tensor, src=from_process)
    return rebuild(data, out)


def broadcast_object(ctx: DistributedContext, obj: T, *, from_process: int = 0) -> T:
    """Return rank ``from_process``'s picklable ``obj`` on every rank.

    Other ranks' ``obj`` is ignored (pass ``None``). With 2 ranks, rank 0
    ``{"seed": 7}`` and rank 1 ``None`` give ``{"seed": 7}`` on both.

    Raises:
        TypeError: ``from_process`` is not an int.
        ValueError: ``from_process`` is out of range.
        RuntimeError: no process group matches ``ctx``, or (with
            ``ctx.collective_timeout``) not every rank reached this call.
    """
    require_process_group(ctx, "broadcast_object")
    _check_from_process(ctx, "broadcast_object", from_process)
    if ctx.num_processes == 1:
        return obj
    guard_collective(ctx, "broadcast_object")
    holder: list[T] = [obj]
    dist.broadcast_object_list(holder, src=from_process)
    return holder[0]


def reduce(ctx: DistributedContext, data: T, *, reduction: Reduction = "sum") -> T:
    """Return the element-wise sum, mean (sum / p) or max over ranks, on every rank.

    ``reduction`` defaults to ``"sum"``, as ``Accelerator.reduce`` does; ``"none"``
    also gives the sum, as it does in Accelerate. New tensors are returned (an equal copy with one process); ``data`` is not
    modified. With 2 ranks, rank 0 ``[1., 4.]`` and rank 1 ``[3., 2.]`` give sum
    ``[4., 6.]``, mean ``[2., 3.]``, max ``[3., 4.]``.

    Raises:
        ValueError: ``reduction`` is not "sum", "mean", "max" or "none"; on every rank, a
            structure, shape or dtype that differs across ranks.
        TypeError: a leaf is not a tensor, "mean" of an integer or bool tensor, or
            "max" of a complex one.
        RuntimeError: no process group matches ``ctx``, or (with
            ``ctx.collective_timeout``) not every rank reached this call.
    """
    require_process_group(ctx, "reduce")
    check_choice(
        "reduce", "reduction", reduction, _REDUCTIONS, hint="'none' is the sum."
    )
    paths, leaves = tensor_leaves(data, "reduce")
    if ctx.num_processes > 1:
        guard_collective(ctx, "reduce")
        specs = exchange(ctx, "reduce", paths, leaves)
        for path, per_rank in zip(paths, specs, strict=True):
            check_agree("reduce", path, per_rank, 0)
    # Checked after the exchange: dtypes now agree, so every rank raises alike.
    for path, tensor in zip(paths, leaves, strict=True):
        floating = tensor.is_floating_point() or tensor.is_complex()
        undefined = reduction == "max" and tensor.is_complex()
        if undefined or (reduction == "mean" and not floating):
            msg = f"reduce: reduction={reduction!r} is undefined for {path} of dtype {tensor.dtype}; cast it to a floating dtype or use 'sum'."
            raise TypeError(msg)
    out = [t.detach().clone(memory_format=torch.contiguous_format) for t in leaves]
    op = dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.SUM
    if ctx.num_processes > 1:
        for tensor in out:
            dist.all_reduce(tensor, op=op)
            if reduction == "mean":
                tensor.div_(ctx.num_processes)
    return rebuild(data, out)


def pad_across_processes(
    ctx: DistributedContext,
    data: T,
    *,
    dim: int = 0,
    pad_index: float = 0,
    pad_first: bool = False,
) -> T:
    """Pad every leaf along ``dim`` to the largest size on any rank.

    Padding is ``pad_index``, after the data (before it with ``pad_first``); leaves
    with fewer than ``dim + 1`` dims are returned as they are, as is a leaf already
    of the largest size, but when no leaf on any rank has ``dim`` the call is a
    ``ValueError`` (the dim is wrong, not the data). ``data`` is not modified.
    With 2 ranks, rank 0 ``[1, 2, 3]`` and rank 1 ``[4]``: rank 0 keeps
    ``[1, 2, 3]``, rank 1 gets ``[4, 0, 0]`` (``[0, 0, 4]`` with ``pad_first``).

    Raises:
        TypeError: a leaf is not a tensor, ``dim`` not an int, ``pad_index`` not
            a number or ``pad_first`` not a bool.
        ValueError: ``dim`` is negative; on every rank, a structure that
            differs across ranks, no leaf on any rank with dimension ``dim``, or
            a fractional ``pad_index`` for an integer leaf that has ``dim`` (with
            one process too, though nothing is padded there).
        RuntimeError: no process group matches ``ctx``, or (with
            ``ctx.collective_timeout``) not every rank reached this call.
    """
    caller = "pad_across_processes"
    require_process_group(ctx, caller)
    check_pad_args(caller, dim, pad_index)
    paths, leaves = tensor_leaves(data, caller)
    if ctx.num_processes == 1:
        one = [[(tuple(t.shape), str(t.dtype))] for t in leaves]
        check_pad_fill(caller, one, dim=dim, pad_index=pad_index, pad_first=pad_first)
        check_pad_dim(caller, one, dim=dim)
        return data
    guard_collective(ctx, caller)
    specs = exchange(ctx, caller, paths, leaves)
    # On the gathered specs, so every rank raises alike before any tensor moves.
    # The dim check cannot run before the exchange: one rank's leaf may lack dim
    # while another rank's has it, and then only some ranks would raise, leaving
    # the others waiting in the exchange.
    check_pad_fill(caller, specs, dim=dim, pad_index=pad_index, pad_first=pad_first)
    check_pad_dim(caller, specs, dim=dim)
    longest = [
        max((s[dim] for s, _ in per_rank if len(s) > dim), default=0)
        for per_rank in specs
    ]
    out = [
        t
        if t.ndim <= dim
        else pad_tensor(t, n, dim=dim, pad_index=pad_index, pad_first=pad_first)
        for t, n in zip(leaves, longest, strict=True)
    ]
    return rebuild(data, out)


def _check_batch(batch: _BatchArg, data_ranks: int) -> BatchInfo | None:
    """Return ``batch`` as a record or ``None``; refuse a missing one at ``p > 1``."""
    if batch is _NOT_PASSED:
        # Every rank runs the same call, so every rank raises here, before any
        # collective: no rank is left waiting.
        if data_ranks > 1:
            raise TypeError(_MSG_NO_BATCH.format(p=data_ranks))
        return None  # one process: nothing is ever looped back
    if batch is None:
        return None
    is_last = getattr(batch, "is_last", None)
    remainder = getattr(batch, "remainder", None)
    if not isinstance(is_last, bool) or type(remainder) is not int:  # no bool
        msg = f"gather_for_metrics: batch must have is_last: bool and remainder: int (a record from iter_batches); got {type_name(batch)} with is_last={is_last!r}, remainder={remainder!r}."
        raise TypeError(msg)
    if remainder < -1:
        hint = "Pass the record iter_batches yields."
        fail_value("gather_for_metrics", "batch.remainder", remainder, ">= -1", hint)
    return batch


@overload
def gather_for_metrics(
    ctx: DistributedContext,
    data: torch.Tensor,
    *,
    batch: _BatchArg = ...,
    use_gather_object: bool = ...,
    mesh: ParallelMesh | None = ...,
) -> torch.Tensor: ...
@overload
def gather_for_metrics(
    ctx: DistributedContext,
    data: list[T],
    *,
    batch: _BatchArg = ...,
    use_gather_object: bool = ...,
    mesh: ParallelMesh | None = ...,
) -> list[T]: ...
@overload
def gather_for_metrics(
    ctx: DistributedContext,
    data: tuple[T, ...],
    *,
    batch: _BatchArg = ...,
    use_gather_object: bool = ...,
    mesh: ParallelMesh | None = ...,
) -> tuple[T, ...] | list[T]: ...
@overload
def gather_for_metrics(
    ctx: DistributedContext,
    data: M,
    *,
    batch: _BatchArg = ...,
    use_gather_object: bool = ...,
    mesh: ParallelMesh | None = ...,
) -> M: ...
def gather_for_metrics(
    ctx: DistributedContext,
    data: object,
    *,
    batch: _BatchArg = _NOT_PASSED,
    use_gather_object: bool = False,
    mesh: ParallelMesh | None = None,
) -> object:
    """Gather ``data`` from every rank, then drop the epoch's looped-back duplicates.

    Tensors are gathered as by ``gather``; objects as by ``gather_object`` (then
    ``data`` must be a list or tuple) when ``use_gather_object`` or any leaf on
    any rank is not a tensor. When ``batch.is_last`` and ``batch.remainder > 0``
    only the first ``remainder`` rows (or items) are kept, so an evaluation loop
    sees every sample of the epoch exactly once.

    With 2 ranks, ``n=10``, ``bs=3``, the last batch is ``[6, 7, 8]`` on rank 0 and
    ``[9, 0, 1]`` on rank 1 with ``remainder=4``: both get ``[6, 7, 8, 9]``. With
    one process ``data`` comes back as it is:

    >>> gather_for_metrics(DistributedContext(), torch.tensor([6, 7, 8]))
    tensor([6, 7, 8])

    ``batch`` (the ``Batch`` record ``iter_batches`` yielded for ``data``) has no
    silent default: with several processes leaving it out is a ``TypeError`` on
    every rank, before anything is sent; ``batch=None`` says ``data`` holds no
    duplicates. With a ``mesh`` one copy per tensor-parallel group is kept. The
    full semantics: docs/collectives.md#semantics-collectives-rank-by-rank (and
    docs/mesh.md for ``mesh``).

    Raises:
        TypeError: ``batch`` missing with several processes or not a record;
            the object path given data that is not a list or tuple.
        ValueError: ``batch.remainder < -1``, or as ``gather``.
        RuntimeError: no process group matches ``ctx``, or (with
            ``ctx.collective_timeout``) not every rank reached this call.
    """
    caller = "gather_for_metrics"
    require_process_group(ctx, caller)
    keep: range | None = None
    data_ranks = ctx.num_processes
    if mesh is not None:
        check_mesh(caller, ctx, mesh)
        data_ranks = mesh.dp_size
        if mesh.tp > 1 or mesh.pp > 1:
            # tp rank 0 of each group on the last pipeline stage (which holds
            # the outputs): ranks first, first + tp, first + 2 * tp, ...
            first = (mesh.pp - 1) * mesh.dp_size * mesh.tp
            keep = range(first, ctx.num_processes, mesh.tp)
    record = _check_batch(batch, data_ranks)
    limit = None
    if record is not None and record.is_last and record.remainder > 0:
        limit = record.remainder
    objects = use_gather_object or not is_tensor_tree(data)
    if data_ranks == 1:
        if objects:
            join_objects(caller, "data", [data])
        return data
    paths, flat = ([], []) if objects else tensor_leaves(data, caller, rows=True)
    guard_collective(ctx, caller)
    # One exchange settles the path: objects as soon as any rank needs them (an
    # empty list holds no non-tensor leaf, so ranks can disagree).
    every = all_gather_objects(
        ctx, (objects, data if objects else local_spec(paths, flat))
    )
    if any(wanted for wanted, _ in every):
        if not all(wanted for wanted, _ in every):
            late = all_gather_objects(ctx, None if objects else data)
            every = [
                (True, x if w else y) for (w, x), y in zip(every, late, strict=True)
            ]
        kept = [x for _, x in every]
        if keep is not None:
            kept = [kept[g] for g in keep]
        return join_objects(caller, "data", kept)[:limit]
    specs = per_leaf(caller, paths, [spec for _, spec in every])
    gathered = _gather_rows(ctx, caller, paths, flat, specs, keep)
    return rebuild(data, [t[:limit] for t in gathered])
