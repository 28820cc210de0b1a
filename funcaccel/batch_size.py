"""Finding the largest batch size that fits in memory, with every rank agreeing.

``find_executable_batch_size(ctx, fn, starting_batch_size)`` calls
``fn(batch_size)``, multiplying the batch size by 0.9 (rounded down) after an
out-of-memory error until a call succeeds, as Accelerate's decorator of the same
name; ``reduce_batch_size_fn=`` replaces that rule. It returns
``(result, batch_size)``. After every attempt the ranks exchange whether they ran
out of memory, so they all retry, and all finish, with the same batch size.

>>> def train(batch_size):
...     if batch_size > 10:
...         raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
...     return f"trained with {batch_size}"
>>> find_executable_batch_size(DistributedContext(), train, 16)
('trained with 10', 10)
>>> find_executable_batch_size(
...     DistributedContext(), train, 64, reduce_batch_size_fn=lambda size: size // 2
... )
('trained with 8', 8)
"""

from __future__ import annotations

import gc
import inspect
from collections.abc import Callable
from typing import Final
from typing import TypeVar

import torch

from funcaccel._checks import check_type
from funcaccel._checks import fail_on_ranks
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._checks import is_int
from funcaccel._checks import type_name
from funcaccel._ctx_checks import check_context
from funcaccel._primitives import exchange_codes
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group

__all__ = [
    "find_executable_batch_size",
    "is_out_of_memory",
    "reduce_by_tenth",
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


def reduce_by_tenth(batch_size: int) -> int:
    """Return the batch size to try after ``batch_size`` ran out of memory.

    Accelerate's rule: ``int(batch_size * 0.9)``, the same float product and
    truncation, so the sizes tried are Accelerate's (128, 115, 103, 92, ...).
    From 1 it gives 0: no batch size fits.

    >>> [reduce_by_tenth(size) for size in (128, 115, 10, 2, 1)]
    [115, 103, 9, 1, 0]
    """
    return int(batch_size * 0.9)


def find_executable_batch_size(
    ctx: DistributedContext,
    fn: Callable[[int], T],
    starting_batch_size: int,
    *,
    reduce_batch_size_fn: Callable[[int], int] = reduce_by_tenth,
) -> tuple[T, int]:
    """Call ``fn(batch_size)``, shrinking the batch size on out-of-memory errors.

    If ``fn`` raises an out-of-memory error (``is_out_of_memory``) on **any**
    rank, every rank calls it again with ``reduce_batch_size_fn(batch_size)``:
    by default the batch size times 0.9, rounded down, as in Accelerate 1.x
    (128, 115, 103, 92, 82, ...). ``fn`` must be able to start over: build the
    loader, model and optimizer inside it. Every rank passes the same
    ``starting_batch_size``; one small all-reduce per attempt tells every rank
    how the others fared (more: docs/toolkit.md#find_executable_batch_size).

    Accelerate's ``reduce_batch_size_fn`` takes no argument and keeps the batch
    size itself; this one is given the batch size that failed and returns the
    next, so it holds no state (``lambda size: size // 2`` halves).

    Args:
        ctx: the run's context.
        fn: called with the batch size to try; its result is returned.
        starting_batch_size: the first batch size tried (an int >= 1).
        reduce_batch_size_fn: from the batch size that ran out of memory to the
            next one to try: an int from 1 to one less than its argument, or 0
            to give up (Accelerate's "reached zero"). It is not called for 1.
            With several ranks it must return the same on every rank.

    Returns:
        ``(result, batch_size)``: ``fn``'s result from the first attempt that
        succeeded on every rank, and the batch size it used (the same on every
        rank).

    Raises:
        RuntimeError: still out of memory at batch size 1 or where the reduction
            gave 0 (on every rank), or ``fn`` raised on another rank.
        TypeError, ValueError: a bad argument or reduction result, or ranks that
            disagree (before ``fn`` runs, or on the next size), each named with
            its fix; the full list is in docs/toolkit.md.
        Exception: any other exception of ``fn``, on the rank that raised it
            (after the ranks exchanged it, so no rank waits forever).

    Example, with 2 ranks, ``starting_batch_size=64``, and rank 1 running out of
    memory above 40 (rank 0 above 50): attempt 64 fails on both, 57 and 51
    fail on both, 45 fails on rank 1 (rank 0's success is dropped), 40 succeeds
    on both; both return ``(result, 40)``.
    """
    caller = "find_executable_batch_size"
    check_context(caller, ctx)
    if not callable(fn):
        fail_type(caller, "fn", fn, "callable as fn(batch_size)")
    check_type(caller, "starting_batch_size", starting_batch_size, int)
    if starting_batch_size < 1:
        hint = "Pass the largest batch size to try, e.g. 128."
        fail_value(caller, "starting_batch_size", starting_batch_size, ">= 1", hint)
    _check_reduction(caller, reduce_batch_size_fn)
    require_process_group(ctx, caller)
    _check_same_start(ctx, caller, starting_batch_size)
    name = getattr(fn, "__qualname__", type_name(fn))
    batch_size = starting_batch_size
    attempts = 0
    while True:
        result, code, error, oom_text = _attempt(fn, batch_size)
        attempts += 1
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
        next_size = (
            0 if batch_size == 1 else _next_size(ctx, reduce_batch_size_fn, batch_size)
        )
        if next_size == 0:
            ranks = [rank for rank, c in enumerate(codes) if c == _OOM]
            why = ""
            if batch_size > 1:
                why = f", where reduce_batch_size_fn({batch_size}) returned 0"
            msg = (
                f"{caller}: {name} ran out of memory at each of the {attempts} "
                f"batch sizes tried, from starting_batch_size={starting_batch_size} "
                f"down to {batch_size}{why} (on rank(s) {ranks} at {batch_size}; "
                f"last error here: {oom_text or 'none'}). Free memory or make one "
                "sample smaller."
            )
            raise RuntimeError(msg)
        batch_size = next_size


def _check_reduction(caller: str, reduce: object) -> None:
    what = "callable as reduce_batch_size_fn(failed_batch_size) -> int"
    if not callable(reduce):
        fail_type(caller, "reduce_batch_size_fn", reduce, what)
    try:
        signature = inspect.signature(reduce)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    try:
        signature.bind(1)
    except TypeError:
        hint = (
            "It is given the batch size that ran out of memory and returns the "
            "next one (Accelerate's takes no argument), e.g. "
            "lambda size: size // 2."
        )
        fail_type(caller, "reduce_batch_size_fn", reduce, what, hint)


def _next_size(
    ctx: DistributedContext, reduce: Callable[[int], int], failed: int
) -> int:
    """Return ``reduce(failed)``, checked, and the same on every rank.

    With several ranks and a reduction of the user's, the ranks exchange their
    next sizes (shifted by one, 0 meaning "refused here") so that a reduction
    refused, or answering differently, on one rank stops every rank.
    """
    caller = "find_executable_batch_size"
    if ctx.num_processes == 1 or reduce is reduce_by_tenth:
        return _checked_size(caller, reduce, failed)
    try:
        size = _checked_size(caller, reduce, failed)
    except Exception:  # exchanged first, then re-raised
        exchange_codes(ctx, 0, caller=caller)
        raise
    slots = exchange_codes(ctx, size + 1, caller=caller)
    refused = [rank for rank, slot in enumerate(slots) if slot == 0]
    what = f"reduce_batch_size_fn({failed})"
    if refused:
        fail_on_ranks(caller, f"{what} was refused", refused)
    sizes = [slot - 1 for slot in slots]
    if len(set(sizes)) > 1:
        name = f"{what} (by rank)"
        hint = "Make reduce_batch_size_fn depend on the failed batch size only."
        fail_value(caller, name, sizes, "the same on every rank", hint)
    return size


def _checked_size(caller: str, reduce: Callable[[int], int], failed: int) -> int:
    size: object = reduce(failed)
    name = f"reduce_batch_size_fn's result for {failed}"
    what = f"an int from 0 to {failed - 1}"
    hint = "Return a smaller batch size to try, or 0 to give up."
    if not is_int(size):
        fail_type(caller, name, size, what, hint)
    assert isinstance(size, int)
    if not 0 <= size < failed:
        fail_value(caller, name, size, what, hint)
    return size


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
    # Ranks that started differently would shrink in lockstep and end with
    # different batch sizes; one small collective before the first attempt.
    starts = exchange_codes(ctx, start, caller=caller)
    if len(set(starts)) > 1:
        name = "starting_batch_size (by rank)"
        fail_value(caller, name, starts, "the same on every rank", _SAME_START)
