"""Finding the largest batch size that fits in memory, with every rank agreeing.

``find_executable_batch_size(ctx, fn, starting_batch_size)`` calls
``fn(batch_size)``, halving the batch size after an out-of-memory error until a
call succeeds, as Accelerate's decorator of the same name; it returns
``(result, batch_size)``. After every attempt the ranks exchange whether they ran
out of memory, so they all retry, and all finish, with the same batch size.

>>> def train(batch_size):
...     if batch_size > 10:
...         raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
...     return f"trained with {batch_size}"
>>> find_executable_batch_size(DistributedContext(), train, 64)
('trained with 8', 8)
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Final
from typing import TypeVar

import torch

from funcaccel._checks import check_type
from funcaccel._checks import fail_on_ranks
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._checks import type_name
from funcaccel._ctx_checks import check_context
from funcaccel._primitives import exchange_codes
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group

__all__ = [
    "find_executable_batch_size",
    "is_out_of_memory",
]

T = TypeVar("T")

# Substrings of the RuntimeError messages that mean "the batch does not fit":
# Accelerate's should_reduce_batch_size list, with XPU's and MPS's wording
# covered by "out of memory".
_OOM_MESSAGES: Final = (
    "out of memory",
    "CUDNN_STATUS_NOT_SUPPORTED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",
    "PT_DEVMEM Allocation failed",
)
_NOT_OOM: Final = "raised an error other than out of memory"
_SAME_START: Final = "Pass one value on every rank."
_OK: Final = 0
_OOM: Final = 1
_ERROR: Final = 2


def is_out_of_memory(error: BaseException) -> bool:
    """Return whether ``error`` means the batch did not fit in memory.

    True for ``torch.OutOfMemoryError`` and for a ``RuntimeError`` whose message
    says out of memory, or reports a CUDA / cuDNN / cuBLAS / CPU / HPU allocation
    failure (Accelerate's ``should_reduce_batch_size``).

    >>> is_out_of_memory(RuntimeError("XPU out of memory. Tried to allocate 1 GiB"))
    True
    >>> is_out_of_memory(ValueError("out of memory"))
    False
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    text = str(error)
    return any(statement in text for statement in _OOM_MESSAGES)


def _free_memory(ctx: DistributedContext) -> None:
    # The failed attempt's tensors are garbage once its frames are gone; give
    # their memory back before the smaller attempt.
    gc.collect()
    if ctx.device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def find_executable_batch_size(
    ctx: DistributedContext, fn: Callable[[int], T], starting_batch_size: int
) -> tuple[T, int]:
    """Call ``fn(batch_size)``, halving the batch size on out-of-memory errors.

    If ``fn`` raises an out-of-memory error (``is_out_of_memory``) on **any**
    rank, every rank calls it again with half the batch size (rounded down), so
    ``fn`` must be able to start over: build the loader, model and optimizer
    inside it. Every rank passes the same ``starting_batch_size``; one small
    all-reduce per attempt tells every rank how the others fared (more:
    docs/toolkit.md#find_executable_batch_size).

    Args:
        ctx: the run's context.
        fn: called with the batch size to try; its result is returned.
        starting_batch_size: the first batch size tried (an int >= 1).

    Returns:
        ``(result, batch_size)``: ``fn``'s result from the first attempt that
        succeeded on every rank, and the batch size it used (the same on every
        rank).

    Raises:
        RuntimeError: ``fn`` still ran out of memory at batch size 1 (the batch
            size would reach 0), on every rank; or ``fn`` raised another
            exception on another rank (this rank stops as well, naming it).
        TypeError: ``fn`` not callable or ``starting_batch_size`` not an int.
        ValueError: ``starting_batch_size < 1``, or ranks passed different
            starting batch sizes (on every rank, before ``fn`` runs).
        Exception: any other exception of ``fn``, on the rank that raised it
            (after the ranks exchanged it, so no rank waits forever).

    Example, with 2 ranks, ``starting_batch_size=64``, and rank 1 running out of
    memory above 16 (rank 0 above 32): attempt 64 fails on both, 32 fails on
    rank 1 (rank 0's success is dropped), 16 succeeds on both; both return
    ``(result, 16)``.
    """
    caller = "find_executable_batch_size"
    check_context(caller, ctx)
    if not callable(fn):
        fail_type(caller, "fn", fn, "callable as fn(batch_size)")
    check_type(caller, "starting_batch_size", starting_batch_size, int)
    if starting_batch_size < 1:
        hint = "Pass the largest batch size to try, e.g. 128."
        fail_value(caller, "starting_batch_size", starting_batch_size, ">= 1", hint)
    require_process_group(ctx, caller)
    _check_same_start(ctx, caller, starting_batch_size)
    name = getattr(fn, "__qualname__", type_name(fn))
    batch_size = starting_batch_size
    while True:
        result, code, error, oom_text = _attempt(fn, batch_size)
        codes = exchange_codes(ctx, code, caller=caller)
        errors = [rank for rank, c in enumerate(codes) if c == _ERROR]
        if error is not None:
            raise error
        if errors:
            fail_on_ranks(caller, f"{name}({batch_size}) {_NOT_OOM}", errors)
        if _OOM not in codes:
            assert result is not None
            return result[0], batch_size
        _free_memory(ctx)
        if batch_size == 1:
            ranks = [rank for rank, c in enumerate(codes) if c == _OOM]
            msg = (
                f"{caller}: {name} ran out of memory at every batch size from "
                f"starting_batch_size={starting_batch_size} down to 1 (on rank(s) "
                f"{ranks} at 1; last error here: {oom_text or 'none'}). Free memory "
                "or make one sample smaller."
            )
            raise RuntimeError(msg)
        batch_size //= 2


def _attempt(
    fn: Callable[[int], T], batch_size: int
) -> tuple[tuple[T] | None, int, BaseException | None, str]:
    """Run one attempt: ``(result, code, error to re-raise, OOM message)``.

    The out-of-memory exception itself is not kept: its traceback holds the
    failed attempt's frames, and so its tensors.
    """
    try:
        return (fn(batch_size),), _OK, None, ""
    except BaseException as error:  # exchanged first, then re-raised
        if is_out_of_memory(error):
            return None, _OOM, None, str(error)[:200]
        return None, _ERROR, error, ""


def _check_same_start(ctx: DistributedContext, caller: str, start: int) -> None:
    if ctx.num_processes == 1:
        return
    # Ranks that started differently would halve in lockstep and end with
    # different batch sizes; one small collective before the first attempt.
    starts = exchange_codes(ctx, start, caller=caller)
    if len(set(starts)) > 1:
        name = "starting_batch_size (by rank)"
        fail_value(caller, name, starts, "the same on every rank", _SAME_START)
