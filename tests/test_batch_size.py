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


# (starting batch size, memory limit) -> the batch sizes tried, written out.
TRIES: dict[tuple[int, int], list[int]] = {
    (64, 10): [64, 32, 16, 8],
    (100, 10): [100, 50, 25, 12, 6],
    (7, 7): [7],
    (7, 3): [7, 3],
    (1, 1): [1],
    (9, 1): [9, 4, 2, 1],
}


@pytest.mark.parametrize(("start", "limit"), list(TRIES))
def test_halves_until_the_batch_fits(start: int, limit: int) -> None:
    tried: list[int] = []
    result, batch_size = fa.find_executable_batch_size(
        ONE, limited(limit, tried), start
    )
    assert tried == TRIES[(start, limit)]
    assert (result, batch_size) == (f"ran {tried[-1]}", tried[-1])


@given(start=st.integers(1, 5000), limit=st.integers(1, 5000))
def test_ends_at_the_first_halving_that_fits(start: int, limit: int) -> None:
    tried: list[int] = []
    _, batch_size = fa.find_executable_batch_size(ONE, limited(limit, tried), start)
    halvings = [start // 2**i for i in range(start.bit_length())]
    assert tried == halvings[: len(tried)]
    assert batch_size == next(b for b in halvings if b <= limit)


def test_memory_is_collected_after_each_out_of_memory_attempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    collected: list[int] = []

    def collect(generation: int = 2) -> int:
        collected.append(generation)
        return 0

    monkeypatch.setattr(gc, "collect", collect)
    fa.find_executable_batch_size(ONE, limited(10, []), 64)
    assert len(collected) == 3  # after 64, 32 and 16; none after the success


def test_batch_size_reaching_zero_is_a_runtime_error() -> None:
    tried: list[int] = []
    with pytest.raises(
        RuntimeError,
        match=r"^find_executable_batch_size: .*train ran out of memory at every batch "
        r"size from starting_batch_size=12 down to 1",
    ):
        fa.find_executable_batch_size(ONE, limited(0, tried), 12)
    assert tried == [12, 6, 3, 1]


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
    assert tried == [8, 4, 2]


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
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_find_executable_batch_size_on_real_ranks(world: int) -> None:
    results = run_ranks(_scenarios, world, start_method="forkserver")
    for rank, result in enumerate(results):
        assert result["rank 1 oom"] == (("ran 8", 8), [64, 32, 16, 8])
        expected = {2: [64, 32, 16], 3: [64, 32, 16, 8]}[world]  # limits 40, 25, 10
        final = expected[-1]
        assert result["rank limits"] == ((f"ran {final}", final), expected)
        (kind, msg), tried = result["other error"]
        assert tried == [64, 32]
        if rank == 1:
            assert (kind, msg) == ("ValueError", "bad batch")
        else:
            assert kind == "RuntimeError"
            assert (
                "fails_on_rank_1(32) raised an error other than out of memory on rank(s) [1]"
                in msg
            )
        (kind, msg), tried = result["never fits"]
        assert kind == "RuntimeError" and tried == [4, 2, 1]
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
