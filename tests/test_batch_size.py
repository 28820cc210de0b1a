"""find_executable_batch_size and is_out_of_memory.

Out-of-memory errors are injected: ``fn`` raises ``torch.OutOfMemoryError`` when the
batch size is above a limit, which on real ranks differs by rank.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import funcaccel as fa
from funcaccel.context import DistributedContext
from funcaccel.context import DistributedType
from funcaccel.testing import run_ranks

ONE = DistributedContext()


@pytest.fixture(autouse=True)
def _no_full_collections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each retry runs gc.collect(), a second or more late in a suite that has
    loaded torch, hypothesis and hundreds of tests; the halving rules do not need
    it. test_memory_is_collected_after_each_out_of_memory_attempt checks the
    calls themselves."""
    monkeypatch.setattr(gc, "collect", lambda generation=2: 0)


def limited(limit: int, tried: list[int]) -> Callable[[int], str]:
    """An ``fn`` that runs out of memory above ``limit`` and records each try."""

    def train(batch_size: int) -> str:
        tried.append(batch_size)
        if batch_size > limit:
            msg = f"CUDA out of memory. Tried to allocate {batch_size} GiB"
            raise torch.OutOfMemoryError(msg)
        return f"ran {batch_size}"

    return train


# (starting batch size, memory limit) -> the batch sizes tried, written out:
# each is the previous times 0.9, rounded down (Accelerate's rule).
TRIES: dict[tuple[int, int], list[int]] = {
    (64, 10): [64, 57, 51, 45, 40, 36, 32, 28, 25, 22, 19, 17, 15, 13, 11, 9],
    (100, 80): [100, 90, 81, 72],
    (16, 10): [16, 14, 12, 10],
    (7, 7): [7],
    (7, 3): [7, 6, 5, 4, 3],
    (1, 1): [1],
    (9, 1): [9, 8, 7, 6, 5, 4, 3, 2, 1],
}


def accelerate_tries(start: int, limit: int) -> list[int]:
    """The batch sizes Accelerate 1.x's own decorator tries on the same fake OOM."""
    memory = pytest.importorskip("accelerate.utils.memory")
    tried: list[int] = []
    decorated = memory.find_executable_batch_size(
        limited(limit, tried), starting_batch_size=start
    )
    try:
        decorated()
    except RuntimeError as error:  # "No executable batch size found, reached zero."
        assert "reached zero" in str(error)
    return tried


@pytest.mark.parametrize(("start", "limit"), list(TRIES))
def test_shrinks_by_a_tenth_until_the_batch_fits(start: int, limit: int) -> None:
    tried: list[int] = []
    result, batch_size = fa.find_executable_batch_size(
        ONE, limited(limit, tried), start
    )
    assert tried == TRIES[(start, limit)]
    assert (result, batch_size) == (f"ran {tried[-1]}", tried[-1])


@pytest.mark.parametrize(
    ("start", "limit"),
    [*TRIES, (128, 0), (128, 1), (1000, 37), (2048, 100), (3, 0), (30, 29)],
)
def test_tries_the_batch_sizes_accelerate_tries(start: int, limit: int) -> None:
    expected = accelerate_tries(start, limit)
    tried: list[int] = []
    try:
        fa.find_executable_batch_size(ONE, limited(limit, tried), start)
    except RuntimeError as error:
        assert "ran out of memory at each of the" in str(error)
    assert tried == expected


@given(start=st.integers(1, 5000), limit=st.integers(1, 5000))
def test_ends_at_the_first_size_that_fits(start: int, limit: int) -> None:
    tried: list[int] = []
    _, batch_size = fa.find_executable_batch_size(ONE, limited(limit, tried), start)
    assert tried[0] == start
    assert all(b == int(a * 0.9) for a, b in zip(tried, tried[1:], strict=False))
    assert batch_size == tried[-1] <= limit < min(tried[:-1], default=limit + 1)


def test_a_custom_reduction_chooses_the_next_size() -> None:
    tried: list[int] = []
    seen: list[int] = []

    def halve(size: int) -> int:
        seen.append(size)
        return size // 2

    result = fa.find_executable_batch_size(
        ONE, limited(10, tried), 100, reduce_batch_size_fn=halve
    )
    assert result == ("ran 6", 6)
    assert tried == [100, 50, 25, 12, 6]
    assert seen == [100, 50, 25, 12]  # called with each size that failed
    tried = []
    steps = fa.find_executable_batch_size(
        ONE, limited(90, tried), 128, reduce_batch_size_fn=lambda size: size - 16
    )
    assert steps == ("ran 80", 80) and tried == [128, 112, 96, 80]


def test_a_custom_reduction_returning_zero_gives_up() -> None:
    tried: list[int] = []
    with pytest.raises(
        RuntimeError,
        match=r"^find_executable_batch_size: .*train ran out of memory at each of the "
        r"2 batch sizes tried, from starting_batch_size=12 down to 3, where "
        r"reduce_batch_size_fn\(3\) returned 0 \(on rank\(s\) \[0\] at 3;",
    ):
        fa.find_executable_batch_size(
            ONE, limited(0, tried), 12, reduce_batch_size_fn=lambda size: size // 4
        )
    assert tried == [12, 3]
    tried = []
    with pytest.raises(RuntimeError, match=r"each of the 3 batch sizes tried, from "):
        fa.find_executable_batch_size(
            ONE, limited(0, tried), 16, reduce_batch_size_fn=lambda size: size // 4
        )
    assert tried == [16, 4, 1]  # not called for 1: nothing smaller to try


@pytest.mark.parametrize(
    ("reduce", "error", "message"),
    [
        (
            lambda size: size,
            ValueError,
            r"reduce_batch_size_fn's result for 64 must be an int from 0 to 63; "
            r"got 64\. Return a smaller batch size to try, or 0 to give up\.",
        ),
        (
            lambda size: size + 1,
            ValueError,
            r"reduce_batch_size_fn's result for 64 must be an int from 0 to 63; got 65",
        ),
        (
            lambda size: -1,
            ValueError,
            r"reduce_batch_size_fn's result for 64 must be an int from 0 to 63; got -1",
        ),
        (
            lambda size: size * 0.9,
            TypeError,
            r"reduce_batch_size_fn's result for 64 must be an int from 0 to 63; "
            r"got 57\.6 \(float\)",
        ),
        (
            lambda size: None,
            TypeError,
            r"reduce_batch_size_fn's result for 64 must be an int from 0 to 63; "
            r"got None \(NoneType\)",
        ),
        (
            lambda size: True,
            TypeError,
            r"reduce_batch_size_fn's result for 64 must be an int from 0 to 63; "
            r"got True \(bool\)",
        ),
    ],
)
def test_a_bad_reduction_result_is_refused(
    reduce: Callable[[int], Any], error: type[Exception], message: str
) -> None:
    tried: list[int] = []
    with pytest.raises(error, match=r"^find_executable_batch_size: " + message):
        fa.find_executable_batch_size(
            ONE, limited(10, tried), 64, reduce_batch_size_fn=reduce
        )
    assert tried == [64]  # refused before another attempt


def test_a_reduction_that_takes_no_argument_is_refused_before_fn_runs() -> None:
    tried: list[int] = []
    with pytest.raises(
        TypeError,
        match=r"^find_executable_batch_size: reduce_batch_size_fn must be callable as "
        r"reduce_batch_size_fn\(failed_batch_size\) -> int; got <function .*> "
        r"\(function\)\. It is given the batch size that ran out of memory and "
        r"returns the next one \(Accelerate's takes no argument\)",
    ):
        fa.find_executable_batch_size(
            ONE,
            limited(10, tried),
            64,
            reduce_batch_size_fn=lambda: 32,  # type: ignore[arg-type,misc]
        )
    with pytest.raises(TypeError, match=r"reduce_batch_size_fn must be callable"):
        fa.find_executable_batch_size(
            ONE,
            limited(10, tried),
            64,
            reduce_batch_size_fn=32,  # type: ignore[arg-type]
        )
    assert tried == []


def test_reduce_by_tenth_is_accelerates_product() -> None:
    for size in range(1, 3000):
        assert fa.batch_size.reduce_by_tenth(size) == int(size * 0.9)
    assert fa.batch_size.reduce_by_tenth(1) == 0


def test_memory_is_collected_after_each_out_of_memory_attempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    collected: list[int] = []

    def collect(generation: int = 2) -> int:
        collected.append(generation)
        return 0

    monkeypatch.setattr(gc, "collect", collect)
    fa.find_executable_batch_size(ONE, limited(10, []), 16)
    assert len(collected) == 3  # after 16, 14 and 12; none after the success


def test_batch_size_reaching_zero_is_a_runtime_error() -> None:
    tried: list[int] = []
    with pytest.raises(
        RuntimeError,
        match=r"^find_executable_batch_size: .*train ran out of memory at each of the "
        r"11 batch sizes tried, from starting_batch_size=12 down to 1 \(on rank\(s\) "
        r"\[0\] at 1; last error here: CUDA out of memory\. Tried to allocate 1 GiB\)\. "
        r"Free memory or make one sample smaller\.$",
    ):
        fa.find_executable_batch_size(ONE, limited(0, tried), 12)
    assert tried == [12, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1]


@pytest.mark.parametrize(
    "message",
    [
        "CUDA out of memory. Tried to allocate 20.00 MiB",
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if ...",
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes",
        "XPU out of memory. Tried to allocate 2 GiB",
        "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",
    ],
)
def test_runtime_errors_that_mean_out_of_memory_are_retried(message: str) -> None:
    error = RuntimeError(message)
    assert fa.is_out_of_memory(error)
    tried: list[int] = []

    def fn(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 2:
            raise RuntimeError(message)
        return batch_size

    assert fa.find_executable_batch_size(ONE, fn, 8) == (2, 2)
    assert tried == [8, 7, 6, 5, 4, 3, 2]


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("shape mismatch"),
        ValueError("out of memory"),  # not a RuntimeError
        KeyError("x"),
    ],
)
def test_other_exceptions_propagate_at_once(error: Exception) -> None:
    assert not fa.is_out_of_memory(error)
    tried: list[int] = []

    def fn(batch_size: int) -> None:
        tried.append(batch_size)
        raise error

    with pytest.raises(type(error)) as info:
        fa.find_executable_batch_size(ONE, fn, 8)
    assert info.value is error and tried == [8]


def test_is_out_of_memory_knows_torchs_error_type() -> None:
    assert fa.is_out_of_memory(torch.OutOfMemoryError("anything"))


def test_arguments_are_checked() -> None:
    fn = limited(1, [])
    with pytest.raises(
        ValueError,
        match=r"^find_executable_batch_size: starting_batch_size must be >= 1; got 0",
    ):
        fa.find_executable_batch_size(ONE, fn, 0)
    with pytest.raises(
        TypeError, match=r"starting_batch_size must be an int; got 8\.0"
    ):
        fa.find_executable_batch_size(ONE, fn, 8.0)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"starting_batch_size must be an int; got True"
    ):
        fa.find_executable_batch_size(ONE, fn, True)
    with pytest.raises(
        TypeError, match=r"fn must be callable as fn\(batch_size\); got 3"
    ):
        fa.find_executable_batch_size(ONE, 3, 8)  # type: ignore[arg-type]
    rank1 = DistributedContext(
        num_processes=2, process_index=1, distributed_type=DistributedType.MULTI_CPU
    )
    with pytest.raises(RuntimeError, match=r"no default process group"):
        fa.find_executable_batch_size(rank1, fn, 8)


# ---- real processes --------------------------------------------------------


def _caught(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as error:
        return type(error).__name__, str(error)


def _scenarios(ctx: DistributedContext) -> dict[str, Any]:
    rank, world = ctx.process_index, ctx.num_processes
    out: dict[str, Any] = {}
    # Only rank 1 runs out of memory (above 10); the others fit anything.
    tried: list[int] = []
    out["rank 1 oom"] = (
        fa.find_executable_batch_size(
            ctx, limited(10 if rank == 1 else 1000, tried), 64
        ),
        tried,
    )
    # Each rank has its own limit: the smallest decides.
    tried = []
    out["rank limits"] = (
        fa.find_executable_batch_size(ctx, limited(40 - 15 * rank, tried), 64),
        tried,
    )
    # Another error on rank 1 at batch size 32 stops every rank.
    tried = []

    def fails_on_rank_1(batch_size: int) -> str:
        tried.append(batch_size)
        if batch_size > 32:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        if rank == 1:
            raise ValueError("bad batch")
        return "ok"

    out["other error"] = (
        _caught(lambda: fa.find_executable_batch_size(ctx, fails_on_rank_1, 64)),
        tried,
    )
    # The last rank never fits: every rank reaches 0.
    tried = []
    out["never fits"] = (
        _caught(
            lambda: fa.find_executable_batch_size(
                ctx, limited(0 if rank == world - 1 else 1000, tried), 4
            )
        ),
        tried,
    )
    # Ranks that start differently are told before fn runs.
    tried = []
    out["different starts"] = (
        _caught(
            lambda: fa.find_executable_batch_size(ctx, limited(9, tried), 8 + rank)
        ),
        tried,
    )
    # A reduction of the user's, the same on every rank.
    tried = []
    out["halving"] = (
        fa.find_executable_batch_size(
            ctx, limited(10, tried), 64, reduce_batch_size_fn=lambda size: size // 2
        ),
        tried,
    )
    # A reduction that answers differently by rank stops every rank.
    tried = []
    divisor = 2 if rank == 0 else 3
    out["reduction differs"] = (
        _caught(
            lambda: fa.find_executable_batch_size(
                ctx,
                limited(10, tried),
                64,
                reduce_batch_size_fn=lambda size: size // divisor,
            )
        ),
        tried,
    )
    # A reduction refused on rank 1 only stops every rank.
    tried = []
    out["reduction refused"] = (
        _caught(
            lambda: fa.find_executable_batch_size(
                ctx,
                limited(10, tried),
                64,
                reduce_batch_size_fn=lambda size: size if rank == 1 else size // 2,
            )
        ),
        tried,
    )
    return out


def shrinks(start: int, limit: int) -> list[int]:
    """The sizes tried by the default rule from ``start`` until one is <= limit."""
    sizes = [start]
    while sizes[-1] > max(limit, 0) and sizes[-1] > 1:
        sizes.append(int(sizes[-1] * 0.9))
    return sizes


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_find_executable_batch_size_on_real_ranks(world: int) -> None:
    results = run_ranks(_scenarios, world, start_method="forkserver")
    for rank, result in enumerate(results):
        assert result["rank 1 oom"] == (("ran 9", 9), TRIES[(64, 10)])
        expected = shrinks(64, {2: 25, 3: 10}[world])  # limits 40, 25, 10
        final = expected[-1]
        assert result["rank limits"] == ((f"ran {final}", final), expected)
        (kind, msg), tried = result["other error"]
        assert tried == [64, 57, 51, 45, 40, 36, 32]
        if rank == 1:
            assert (kind, msg) == ("ValueError", "bad batch")
        else:
            assert kind == "RuntimeError"
            assert (
                "fails_on_rank_1(32) raised an error other than out of memory on rank(s) [1]"
                in msg
            )
        (kind, msg), tried = result["never fits"]
        assert kind == "RuntimeError" and tried == [4, 3, 2, 1]
        assert f"on rank(s) [{world - 1}] at 1" in msg
        assert "starting_batch_size=4 down to 1" in msg
        (kind, msg), tried = result["different starts"]
        assert tried == []
        assert (kind, msg) == (
            "ValueError",
            "find_executable_batch_size: starting_batch_size (by rank) must be the "
            f"same on every rank; got {[8 + r for r in range(world)]}. Pass one value "
            "on every rank.",
        )
        assert result["halving"] == (("ran 8", 8), [64, 32, 16, 8])
        (kind, msg), tried = result["reduction differs"]
        assert tried == [64]
        assert (kind, msg) == (
            "ValueError",
            "find_executable_batch_size: reduce_batch_size_fn(64) (by rank) "
            f"must be the same on every rank; got {[32] + [21] * (world - 1)}. Make "
            "reduce_batch_size_fn depend on the failed batch size only.",
        )
        (kind, msg), tried = result["reduction refused"]
        assert tried == [64]
        if rank == 1:
            assert kind == "ValueError"
            assert "reduce_batch_size_fn's result for 64 must be an int" in msg
        else:
            assert (kind, msg) == (
                "RuntimeError",
                "find_executable_batch_size: reduce_batch_size_fn(64) was "
                "refused on rank(s) [1]; this rank stops too. See those ranks' "
                "tracebacks for the cause.",
            )
