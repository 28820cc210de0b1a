"""Process synchronisation: a barrier, agreed flags and splitting inputs between ranks.

``wait_for_everyone`` is a barrier; ``any_process`` / ``all_processes`` turn a
per-rank bool into one answer every rank shares (Accelerate's
``set_trigger`` / ``check_trigger``, as values); ``split_between_processes`` gives
each rank its contiguous part of a list, tuple, dict or tensor, and
``padded_count`` says how many items of that part are padding. With one process
nothing communicates and no process group is needed.

>>> from funcaccel.context import DistributedType
>>> rank1 = DistributedContext(
...     num_processes=2, process_index=1, distributed_type=DistributedType.MULTI_CPU
... )
>>> split_between_processes(rank1, [0, 1, 2, 3, 4])
[3, 4]
>>> split_between_processes(rank1, [0, 1, 2], apply_padding=True)
[2, 2]
>>> padded_count(rank1, 3)
1
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from typing import Final
from typing import TypeVar
from typing import overload

import torch
import torch.distributed as dist

from funcaccel._checks import check_bool
from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._ctx_checks import check_context
from funcaccel._guard import guard_collective
from funcaccel._primitives import exchange_codes
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group

__all__ = [
    "all_processes",
    "any_process",
    "padded_count",
    "split_between_processes",
    "wait_for_everyone",
]

_FIX_LENGTHS: Final = "Split a dict whose values hold one item per sample each."
_FIX_0D: Final = "Pass a tensor with at least one dim (t.reshape(1))."

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")


def _device_ids(ctx: DistributedContext) -> list[int] | None:
    # NCCL's barrier otherwise guesses the device from the rank, which is wrong
    # when LOCAL_RANK does not equal the CUDA index torch picked.
    if ctx.device.type == "cuda" and ctx.device.index is not None:
        return [ctx.device.index]
    return None


def wait_for_everyone(ctx: DistributedContext) -> None:
    """Block until every process of the run has reached this call (a barrier).

    With one process it returns at once and needs no process group. Every rank
    must call it, the same number of times: a rank that never arrives leaves the
    others waiting until the group's timeout.

    Args:
        ctx: the run's context.

    Raises:
        TypeError: ``ctx`` is not a ``DistributedContext``.
        RuntimeError: ``ctx.num_processes > 1`` and no matching process group.

    Example, with 2 ranks: rank 0 writes a file and calls ``wait_for_everyone``;
    rank 1 calls it at once and returns only after rank 0 arrived, so it can read
    the file.

    >>> wait_for_everyone(DistributedContext())  # one process: returns at once
    """
    check_context("wait_for_everyone", ctx)
    require_process_group(ctx, "wait_for_everyone")
    if ctx.num_processes == 1:
        return
    guard_collective(ctx, "wait_for_everyone")
    dist.barrier(device_ids=_device_ids(ctx))


def _agreed_flags(ctx: DistributedContext, caller: str, flag: object) -> list[int]:
    """Exchange ``flag`` (0 / 1, or 2 for a non-bool) and raise on every rank if bad."""
    check_context(caller, ctx)
    require_process_group(ctx, caller)
    good = type(flag) is bool
    # A rank that raised before the all-reduce would leave the others in it until
    # the timeout, so a bad flag travels as code 2 and every rank raises.
    codes = exchange_codes(ctx, (1 if flag else 0) if good else 2, caller=caller)
    bad = [rank for rank, code in enumerate(codes) if code == 2]
    if not good:
        fail_type(caller, "flag", flag, "a bool", "Pass bool(flag).")
    if bad:
        msg = (
            f"{caller}: rank(s) {bad} passed a flag that is not a bool; fix the call "
            "on those ranks (pass bool(flag))."
        )
        raise TypeError(msg)
    return codes


def any_process(ctx: DistributedContext, flag: bool) -> bool:
    """Return, on every rank, whether ``flag`` is true on at least one rank.

    Accelerate's ``set_trigger`` / ``check_trigger`` as one call: each rank says
    whether it saw the condition (say, a NaN loss or a stop file), and every rank
    gets the same answer, so all can break out of the loop together. Every rank
    must call it. One all-reduce; nothing with one process (returns ``flag``).

    Args:
        ctx: the run's context.
        flag: this rank's answer; exactly a ``bool``.

    Returns:
        True on every rank when any rank passed True.

    Raises:
        TypeError: ``flag`` is not a bool, on every rank (the message names the
            ranks that passed a non-bool), or ``ctx`` of the wrong type.
        RuntimeError: ``ctx.num_processes > 1`` and no matching process group.

    Example, with 3 ranks passing False, True, False: every rank gets True;
    with all False, every rank gets False.

    >>> any_process(DistributedContext(), False)
    False
    """
    codes = _agreed_flags(ctx, "any_process", flag)
    return any(code == 1 for code in codes)


def all_processes(ctx: DistributedContext, flag: bool) -> bool:
    """Return, on every rank, whether ``flag`` is true on every rank.

    The counterpart of ``any_process``, with the same contract: every rank calls
    it with exactly a ``bool``, one all-reduce (nothing with one process: it
    returns ``flag``), and the same errors on every rank.

    Example, with 2 ranks: rank 0 True, rank 1 False gives False on both; True
    and True gives True on both.

    >>> all_processes(DistributedContext(), True)
    True
    """
    codes = _agreed_flags(ctx, "all_processes", flag)
    return all(code == 1 for code in codes)


def _bounds(length: int, world: int, rank: int) -> tuple[int, int, int]:
    """Return ``(start, stop, padded_length)`` of ``rank``'s part of ``length`` items.

    The first ``length % world`` ranks get ``length // world + 1`` items, the
    others ``length // world``, in rank order (Accelerate's split). Padding makes
    every part as long as the longest, ``ceil(length / world)``.
    """
    base, extra = divmod(length, world)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return start, stop, base + (1 if extra else 0)


def padded_count(ctx: DistributedContext, total: int) -> int:
    """Return how many items of this rank's padded part of ``total`` are padding.

    ``split_between_processes(ctx, inputs, apply_padding=True)`` gives every rank
    ``ceil(total / num_processes)`` items; the padding is at the end of the part,
    so drop the last ``padded_count(ctx, total)`` results of each rank (before
    gathering) to keep every input exactly once. Pure: no communication.

    Args:
        ctx: the run's context (only ``num_processes`` and ``process_index``).
        total: the number of items split (``len(inputs)``; for a dict the length
            of its values; for a tensor ``inputs.shape[0]``).

    Returns:
        ``ceil(total / p) - (items this rank really got)``; 0 for ``total == 0``.

    Raises:
        TypeError: ``total`` is not an int.
        ValueError: ``total < 0``.

    Example, with 3 ranks and 7 items: the parts are ``[0, 1, 2]``,
    ``[3, 4, 4]`` and ``[5, 6, 6]``, so rank 0 gets 0, ranks 1 and 2 get 1.

    >>> from funcaccel.context import DistributedType
    >>> [padded_count(r, 7) for r in (
    ...     DistributedContext(num_processes=3, process_index=i,
    ...                        distributed_type=DistributedType.MULTI_CPU)
    ...     for i in range(3))]
    [0, 1, 1]
    """
    check_context("padded_count", ctx)
    check_type("padded_count", "total", total, int, hint="Pass len(inputs).")
    if total < 0:
        fail_value("padded_count", "total", total, ">= 0", "Pass len(inputs).")
    start, stop, padded = _bounds(total, ctx.num_processes, ctx.process_index)
    return padded - (stop - start)


def _length(caller: str, name: str, value: object) -> int:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            fail_value(caller, name, value, "a tensor with a dim 0 to split", _FIX_0D)
        return int(value.shape[0])
    if isinstance(value, (list, tuple)):
        return len(value)
    what = "a list, tuple, dict or torch.Tensor"
    fail_type(caller, name, value, what, "Convert it with list(...).")


def _dict_length(caller: str, inputs: dict[Any, Any]) -> int:
    lengths = {key: _length(caller, f"inputs[{key!r}]", v) for key, v in inputs.items()}
    if len(set(lengths.values())) > 1:
        fail_value(
            caller, "the lengths of inputs' values", lengths, "equal", _FIX_LENGTHS
        )
    return next(iter(lengths.values()), 0)


def _take(value: Any, start: int, stop: int, padded: int | None) -> Any:
    """Return ``value[start:stop]``, padded to ``padded`` items with its last one.

    An empty part is padded with the input's last item, so a rank with nothing
    still returns ``padded`` items when padding is asked for.
    """
    part = value[start:stop]
    if padded is None or len(part) == padded:
        return tuple(part) if isinstance(value, tuple) else part
    fill = value[stop - 1 : stop] if stop > start else value[-1:]
    missing = padded - (stop - start)
    if isinstance(value, torch.Tensor):
        repeat = fill.expand(missing, *fill.shape[1:])
        return torch.cat([part, repeat])
    items = list(part) + list(fill) * missing
    return tuple(items) if isinstance(value, tuple) else items


@overload
def split_between_processes(
    ctx: DistributedContext, inputs: torch.Tensor, *, apply_padding: bool = False
) -> torch.Tensor: ...


@overload
def split_between_processes(
    ctx: DistributedContext, inputs: list[T], *, apply_padding: bool = False
) -> list[T]: ...


@overload
def split_between_processes(
    ctx: DistributedContext, inputs: tuple[T, ...], *, apply_padding: bool = False
) -> tuple[T, ...]: ...


@overload
def split_between_processes(
    ctx: DistributedContext, inputs: dict[K, V], *, apply_padding: bool = False
) -> dict[K, V]: ...


def split_between_processes(
    ctx: DistributedContext,
    inputs: torch.Tensor | Sequence[Any] | dict[Any, Any],
    *,
    apply_padding: bool = False,
) -> Any:
    """Return this rank's contiguous part of ``inputs``; ``inputs`` is not modified.

    With ``n`` items and ``p`` ranks, the first ``n % p`` ranks get
    ``n // p + 1`` items and the others ``n // p``, in rank order, as
    Accelerate's ``split_between_processes``. A list gives a list, a tuple a
    tuple, a tensor the rows of its dim 0 (a view where no padding is added),
    and a dict a new dict with every value split alike (its values must be lists,
    tuples or tensors of one length). A rank with nothing (``n < p``, or
    ``n == 0``) gets an empty part.

    With ``apply_padding=True`` every part has ``ceil(n / p)`` items: a short part
    is completed by repeating its last item (the input's last item for a rank
    that got none). ``padded_count(ctx, n)`` is how many were added on this rank;
    drop that many results at the end before gathering. Pure: no communication,
    no process group needed.

    Args:
        ctx: the run's context (only ``num_processes`` and ``process_index``).
        inputs: a list, tuple, dict of equal-length values, or a tensor.
        apply_padding: give every rank the same number of items.

    Returns:
        This rank's part, of the type of ``inputs``.

    Raises:
        TypeError: ``inputs`` (or a dict value) of another type, or
            ``apply_padding`` not a bool.
        ValueError: a dict whose values differ in length (the message lists
            them), or a 0-d tensor.

    Example, with 3 ranks and ``[0, 1, 2, 3, 4, 5, 6]``: rank 0 gets
    ``[0, 1, 2]``, rank 1 ``[3, 4]``, rank 2 ``[5, 6]``; with padding, rank 1
    gets ``[3, 4, 4]`` and rank 2 ``[5, 6, 6]``.

    >>> split_between_processes(DistributedContext(), {"a": [1, 2], "b": (3, 4)})
    {'a': [1, 2], 'b': (3, 4)}
    """
    caller = "split_between_processes"
    check_context(caller, ctx)
    check_bool(caller, "apply_padding", apply_padding)
    if isinstance(inputs, dict):
        length = _dict_length(caller, inputs)
    else:
        length = _length(caller, "inputs", inputs)
    start, stop, padded = _bounds(length, ctx.num_processes, ctx.process_index)
    pad_to = padded if apply_padding else None
    if isinstance(inputs, dict):
        return {k: _take(v, start, stop, pad_to) for k, v in inputs.items()}
    return _take(inputs, start, stop, pad_to)
