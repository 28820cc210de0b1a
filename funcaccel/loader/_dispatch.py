"""Dispatch mode: rank 0 reads, every rank receives its rows.

The rules: docs/loader.md#semantics-dispatch-mode.

Batches are walked by the package's one tree walker (``funcaccel._tree``), so a
batch is split into the same leaves here as when sharding or gathering.

Rank 0 groups the original loader's batches into global batches (one base batch in
split mode, ``p`` consecutive ones otherwise), checks that they can be concatenated,
and for each one broadcasts a header (structure, shapes, dtypes, ``is_last``), then
the tensors. Every rank then keeps rows ``[r*c, (r+1)*c)``. A failure on rank 0 is
sent in place of a header, so every rank raises instead of waiting forever.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any
from typing import Final
from typing import Literal

import torch
import torch.distributed as dist

from funcaccel._checks import summary
from funcaccel._checks import type_name
from funcaccel._primitives import comm_device
from funcaccel._tree import TreeSpec
from funcaccel._tree import flatten
from funcaccel._tree import spec_paths
from funcaccel._tree import unflatten
from funcaccel.collectives import broadcast_
from funcaccel.context import DistributedContext

__all__ = ["dispatch_epoch"]

SliceFn = Callable[[Any, slice], Any]
_FIX: Final = "use a collate_fn that pads to a fixed length, split_batches=True or dispatch_batches=False"
_FIX_0D: Final = (
    "return tensors with a batch dimension from collate_fn, or dispatch_batches=False"
)


def _rejected(
    kind: type[TypeError] | type[ValueError], problem: str, fix: str = ""
) -> _Rejected:
    """Return the error every rank raises for a global batch dispatch cannot send."""
    fix = fix or "use a collate_fn that returns only tensors, or dispatch_batches=False"
    return _Rejected(kind(f"shard_loader: dispatch_batches=True {problem}; {fix}"))


def _same(what: str) -> str:
    return f"use a collate_fn that returns the same {what} for every batch, or dispatch_batches=False"


class _Rejected(Exception):
    """A global batch that cannot be dispatched: wraps the error every rank raises.

    ``args[0]`` is that ``TypeError`` or ``ValueError``; wrapping it keeps it apart
    from an error the user's code raised while reading the batch.
    """


@dataclass(frozen=True, slots=True)
class _Flat:
    spec: TreeSpec
    paths: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]


def _flat_tensors(batch: Any, index: int) -> _Flat:
    spec, leaves = flatten(batch)
    paths = tuple(spec_paths(spec, "batch"))
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            problem = f"can only send tensors, but leaf {path} of global batch {index} is a {type_name(leaf)} ({summary(leaf, 40)})"
            raise _rejected(TypeError, problem)
        if leaf.dim() == 0:
            problem = f"cannot split leaf {path} of global batch {index}: it is a 0-d tensor with no rows"
            raise _rejected(ValueError, problem, _FIX_0D)
    return _Flat(spec, paths, tuple(leaves))


def _concat(parts: list[_Flat], what: str) -> _Flat:
    """Concatenate flattened batches along dim 0 after checking they match."""
    first = parts[0]
    for number, part in enumerate(parts[1:], start=1):
        specs = f"batch 0 is {first.spec.describe()} but batch {number} is"
        if part.spec != first.spec:
            problem = f"cannot {what}: the batches differ in structure: {specs}"
            raise _rejected(
                ValueError, f"{problem} {part.spec.describe()}", _same("structure")
            )
        for path, a, b in zip(first.paths, first.tensors, part.tensors, strict=True):
            if a.dtype != b.dtype:
                problem = (
                    f"cannot {what}: leaf {path} has dtypes {a.dtype} and {b.dtype}"
                )
                raise _rejected(ValueError, problem, _same("dtype"))
            if a.shape[1:] != b.shape[1:]:
                shapes = f"{tuple(a.shape)} and {tuple(b.shape)}"
                raise _rejected(
                    ValueError, f"cannot {what}: leaf {path} has shapes {shapes}", _FIX
                )
    if len(parts) == 1:
        return first
    columns = zip(*(part.tensors for part in parts), strict=True)
    tensors = tuple(torch.cat(column) for column in columns)
    return _Flat(first.spec, first.paths, tensors)


def _build(batches: list[Any], index: int) -> _Flat:
    parts = [_flat_tensors(batch, index) for batch in batches]
    return _concat(
        parts, f"concatenate the {len(batches)} batches of global batch {index}"
    )


@dataclass(frozen=True, slots=True)
class _Failure:
    error: Exception
    index: int


def _global_batches(
    base_batches: Iterator[Any], group: int, drop_last: bool, first_index: int
) -> Iterator[_Flat | _Failure]:
    """Rank 0: yield the epoch's global batches, then at most one failure."""
    index = first_index
    try:
        while True:
            chunk = list(itertools.islice(base_batches, group))
            if not chunk or (drop_last and len(chunk) < group):
                return
            yield _build(chunk, index)
            index += 1
    except Exception as error:  # sent to every rank, then raised (docs/loader.md#semantics-dispatch-mode)
        yield _Failure(error, index)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Header:
    kind: Literal["batch", "error", "stop"]
    spec: TreeSpec | None = None
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[torch.dtype, ...] = ()
    rows: int = 0
    per_rank: int = 0
    is_last: bool = False
    error: Literal["TypeError", "ValueError", "RuntimeError"] = "RuntimeError"
    message: str = ""


_ERRORS: Final[Mapping[str, type[Exception]]] = MappingProxyType(
    {
        "TypeError": TypeError,
        "ValueError": ValueError,
        "RuntimeError": RuntimeError,
    }
)


def _share_header(ctx: DistributedContext, header: _Header | None) -> _Header:
    box: list[Any] = [header]
    if ctx.num_processes > 1:
        device = ctx.device if comm_device(ctx).type != "cpu" else None
        dist.broadcast_object_list(box, src=0, device=device)
    shared = box[0]
    assert isinstance(shared, _Header)
    return shared


def _fail(ctx: DistributedContext, failure: _Failure) -> Exception:
    """Rank 0: tell the others about ``failure``; return what rank 0 raises."""
    error = failure.error
    if isinstance(error, _Rejected):
        rejected: TypeError | ValueError = error.args[0]
        kind: Literal["TypeError", "ValueError"] = (
            "TypeError" if isinstance(rejected, TypeError) else "ValueError"
        )
        _share_header(ctx, _Header(kind="error", error=kind, message=str(rejected)))
        return rejected
    message = (
        f"shard_loader: rank 0 failed while reading global batch {failure.index} for "
        f"dispatch_batches=True: {type_name(error)}: {error}; see rank 0's "
        "traceback for the cause"
    )
    _share_header(ctx, _Header(kind="error", message=message))
    return error


def _part(
    spec: TreeSpec,
    tensors: tuple[torch.Tensor, ...],
    rank: int,
    per_rank: int,
    slice_fn: SliceFn | None,
) -> Any:
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    if slice_fn is None:
        return unflatten(spec, [tensor[rows] for tensor in tensors])
    return slice_fn(unflatten(spec, list(tensors)), rows)


def dispatch_epoch(
    ctx: DistributedContext,
    *,
    base_batches: Iterator[Any] | None,
    pad_source: Callable[[], list[Any]] | None,
    group: int,
    drop_last: bool,
    first_index: int,
    slice_fn: SliceFn | None,
    shares: int | None = None,
    share: int | None = None,
) -> Iterator[tuple[Any, bool, int]]:
    """Yield ``(this rank's rows, is_last, rows of the global batch)`` per global batch.

    On rank 0 ``base_batches`` are the original loader's batches from global batch
    ``first_index`` on, and ``pad_source`` returns the base batches of the epoch's
    first global batch when those were skipped (``None`` when ``first_index`` is 0:
    they are read first). Other ranks pass ``None`` for both and only receive.

    With 2 ranks, 9 samples and batches of 2, the global batches are [0..3], [4..7]
    and [8]; the last is padded with the first 2 rows of the first, so rank 0
    receives [0,1] [4,5] [8] and rank 1 [2,3] [6,7] [0], each with 1 real row last.

    Every rank receives every global batch and keeps its part: part ``share`` of
    ``shares`` (by default ``ctx.process_index`` of ``ctx.num_processes``; on a
    mesh its data-parallel rank of ``dp_size``, so a tensor-parallel group keeps
    the same rows). Rank 0 keeps part 0.
    """
    parts = ctx.num_processes if shares is None else shares
    part = ctx.process_index if share is None else share
    if ctx.process_index == 0:
        assert base_batches is not None and part == 0
        return _lead(
            ctx,
            base_batches,
            pad_source,
            group,
            drop_last,
            first_index,
            slice_fn,
            parts,
        )
    return _follow(ctx, slice_fn, part)


def _lead(
    ctx: DistributedContext,
    base_batches: Iterator[Any],
    pad_source: Callable[[], list[Any]] | None,
    group: int,
    drop_last: bool,
    first_index: int,
    slice_fn: SliceFn | None,
    parts: int,
) -> Iterator[tuple[Any, bool, int]]:
    p, device = parts, comm_device(ctx)
    items = _global_batches(base_batches, group, drop_last, first_index)
    pad: _Flat | None = None  # the first p rows of the epoch's first global batch
    current = next(items, None)
    if current is None:
        _share_header(ctx, _Header(kind="stop"))
        return
    while current is not None:
        if isinstance(current, _Failure):
            raise _fail(ctx, current)
        if pad is None and pad_source is None:
            pad = _Flat(
                current.spec, current.paths, tuple(t[:p] for t in current.tensors)
            )
        following = next(items, None)
        is_last, rows = following is None, _rows(current)
        per_rank, batch = rows // p, current
        if is_last and not drop_last and rows % p:
            try:
                if pad is None:
                    assert pad_source is not None
                    head = _build(pad_source(), 0)
                    pad = _Flat(
                        head.spec, head.paths, tuple(t[:p] for t in head.tensors)
                    )
                what = "pad the last global batch with the first rows of global batch 0"
                batch = _concat([current, pad], what)
            except Exception as error:
                raise _fail(ctx, _Failure(error, 0)) from None
            per_rank += 1
        tensors = tuple(t.to(device).contiguous() for t in batch.tensors)
        header = _Header(
            kind="batch",
            spec=batch.spec,
            shapes=tuple(tuple(t.shape) for t in tensors),
            dtypes=tuple(t.dtype for t in tensors),
            rows=rows,
            per_rank=per_rank,
            is_last=is_last,
        )
        _share_header(ctx, header)
        for tensor in tensors:
            broadcast_(ctx, tensor)
        yield _part(batch.spec, tensors, 0, per_rank, slice_fn), is_last, rows
        current = following


def _rows(flat: _Flat) -> int:
    return int(flat.tensors[0].shape[0]) if flat.tensors else 0


def _follow(
    ctx: DistributedContext, slice_fn: SliceFn | None, part: int
) -> Iterator[tuple[Any, bool, int]]:
    device = comm_device(ctx)
    while True:
        header = _share_header(ctx, None)
        if header.kind == "stop":
            return
        if header.kind == "error":
            raise _ERRORS[header.error](header.message)
        assert header.spec is not None
        tensors = tuple(
            broadcast_(ctx, torch.empty(shape, dtype=dtype, device=device))
            for shape, dtype in zip(header.shapes, header.dtypes, strict=True)
        )
        rows = _part(header.spec, tensors, part, header.per_rank, slice_fn)
        yield rows, header.is_last, header.rows
        if header.is_last:
            return
