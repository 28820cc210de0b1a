"""wait_for_everyone, any_process / all_processes, split_between_processes, padded_count.

The split is checked against a reference written differently from the
implementation: items are dealt out one at a time to count each rank's share, then
cut off in rank order; plus a few hand-written rows. The distributed checks run in
one worker per world size (2 and 3).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
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


def rank_ctx(rank: int, world: int) -> DistributedContext:
    kind = DistributedType.NO if world == 1 else DistributedType.MULTI_CPU
    return DistributedContext(
        num_processes=world, process_index=rank, distributed_type=kind
    )


def reference_parts(items: list[int], world: int, padding: bool) -> list[list[int]]:
    """Each rank's part: deal the items round-robin to count, then cut in order."""
    shares = [0] * world
    for i in range(len(items)):
        shares[i % world] += 1
    parts, rest = [], list(items)
    for share in shares:
        parts.append(rest[:share])
        rest = rest[share:]
    assert not rest
    if padding and items:
        longest = max(shares)
        for part in parts:
            fill = part[-1] if part else items[-1]
            while len(part) < longest:
                part.append(fill)
    return parts


# Written out by hand: (n, world, padding) -> every rank's part.
TABLE: dict[tuple[int, int, bool], list[list[int]]] = {
    (7, 3, False): [[0, 1, 2], [3, 4], [5, 6]],
    (7, 3, True): [[0, 1, 2], [3, 4, 4], [5, 6, 6]],
    (2, 3, False): [[0], [1], []],
    (2, 3, True): [[0], [1], [1]],
    (0, 2, False): [[], []],
    (0, 2, True): [[], []],
    (5, 4, False): [[0, 1], [2], [3], [4]],
    (5, 4, True): [[0, 1], [2, 2], [3, 3], [4, 4]],
    (8, 4, True): [[0, 1], [2, 3], [4, 5], [6, 7]],
    (1, 4, True): [[0], [0], [0], [0]],
    (11, 4, False): [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10]],
}


@pytest.mark.parametrize(("n", "world", "padding"), list(TABLE))
def test_split_matches_the_hand_written_table(
    n: int, world: int, padding: bool
) -> None:
    got = [
        fa.split_between_processes(
            rank_ctx(r, world), list(range(n)), apply_padding=padding
        )
        for r in range(world)
    ]
    assert got == TABLE[(n, world, padding)]
    assert reference_parts(list(range(n)), world, padding) == TABLE[(n, world, padding)]


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_split_gives_each_rank_its_part_for_lengths_0_to_11(
    world: int, padding: bool
) -> None:
    for n in range(12):
        items = [10 * i for i in range(n)]
        expected = reference_parts(items, world, padding)
        for rank in range(world):
            ctx = rank_ctx(rank, world)
            want = expected[rank]
            assert fa.split_between_processes(ctx, items, apply_padding=padding) == want
            assert fa.split_between_processes(
                ctx, tuple(items), apply_padding=padding
            ) == tuple(want)
            tensor = torch.tensor(items, dtype=torch.int64).reshape(n, 1)
            part = fa.split_between_processes(ctx, tensor, apply_padding=padding)
            assert part.dtype == torch.int64 and part.shape == (len(want), 1)
            assert part.flatten().tolist() == want
            data: dict[str, Any] = {"x": items, "y": tensor}
            split = fa.split_between_processes(ctx, data, apply_padding=padding)
            assert list(split) == ["x", "y"]
            assert split["x"] == want and split["y"].flatten().tolist() == want
            real = reference_parts(items, world, False)[rank]
            padded = reference_parts(items, world, True)[rank]
            assert fa.padded_count(ctx, n) == len(padded) - len(real)


@given(
    n=st.integers(0, 60),
    world=st.integers(1, 9),
    width=st.integers(0, 3),
)
def test_split_properties(n: int, world: int, width: int) -> None:
    items = list(range(100, 100 + n))
    plain = [
        fa.split_between_processes(rank_ctx(r, world), items) for r in range(world)
    ]
    padded = [
        fa.split_between_processes(rank_ctx(r, world), items, apply_padding=True)
        for r in range(world)
    ]
    # The plain parts are the input in order, sizes non-increasing and within 1.
    assert [x for part in plain for x in part] == items
    sizes = [len(p) for p in plain]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
    # Padded parts are equally long; dropping padded_count items gives the plain part.
    assert {len(p) for p in padded} == {-(-n // world)}
    for rank in range(world):
        pad = fa.padded_count(rank_ctx(rank, world), n)
        assert padded[rank][: len(padded[rank]) - pad] == plain[rank]
        assert all(x in items for x in padded[rank])
    # A tensor with trailing dims splits alike.
    tensor = torch.arange(n * 2 * width, dtype=torch.float64).reshape(n, 2, width)
    for rank in range(world):
        part = fa.split_between_processes(
            rank_ctx(rank, world), tensor, apply_padding=True
        )
        assert part.shape == (len(padded[rank]), 2, width)
        rows = [i - 100 for i in padded[rank]]
        assert torch.equal(part, tensor[rows]) if rows else part.numel() == 0


def test_split_leaves_inputs_unchanged_and_returns_new_containers() -> None:
    data = {"a": [1, 2, 3], "b": (4, 5, 6)}
    ctx = rank_ctx(1, 2)
    part = fa.split_between_processes(ctx, data, apply_padding=True)
    assert part == {"a": [3, 3], "b": (6, 6)}
    assert data == {"a": [1, 2, 3], "b": (4, 5, 6)}
    items = [1, 2]
    one = fa.split_between_processes(ONE, items)
    assert one == items and one is not items


def test_split_of_a_dict_with_unequal_lengths_names_them() -> None:
    with pytest.raises(
        ValueError,
        match=r"split_between_processes: the lengths of inputs' values must be equal; "
        r"got \{'a': 3, 'b': 2\}\. Split",
    ):
        fa.split_between_processes(ONE, {"a": [1, 2, 3], "b": torch.zeros(2)})


def test_split_rejects_other_inputs() -> None:
    with pytest.raises(
        TypeError, match=r"split_between_processes: inputs must be .*got 'abc' \(str\)"
    ):
        fa.split_between_processes(ONE, "abc")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"inputs\['k'\] must be .*got 3 \(int\)"):
        fa.split_between_processes(ONE, {"k": 3})
    with pytest.raises(
        ValueError,
        match=r"inputs must be a tensor with a dim 0 to split; got "
        r"tensor\(shape=\(\), dtype=torch.float32\)\. Pass a tensor with",
    ):
        fa.split_between_processes(ONE, torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"apply_padding must be a bool; got 1 \(int\)"):
        fa.split_between_processes(ONE, [1], apply_padding=1)  # type: ignore[call-overload]
    with pytest.raises(
        TypeError, match=r"ctx must be a DistributedContext; got \d+ \(int\)"
    ):
        fa.split_between_processes(0, [1])  # type: ignore[call-overload]
    long_list = "x" * 500
    with pytest.raises(TypeError) as info:
        fa.split_between_processes(ONE, long_list)  # type: ignore[call-overload]
    assert len(str(info.value)) < 250  # the value shown is bounded


def test_padded_count_checks_total() -> None:
    with pytest.raises(
        TypeError, match=r"padded_count: total must be an int; got 2\.0"
    ):
        fa.padded_count(ONE, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"padded_count: total must be >= 0; got -1"):
        fa.padded_count(ONE, -1)
    assert fa.padded_count(rank_ctx(2, 3), 0) == 0


def test_one_process_needs_no_group() -> None:
    fa.wait_for_everyone(ONE)
    assert fa.any_process(ONE, True) is True and fa.any_process(ONE, False) is False
    assert fa.all_processes(ONE, True) is True and fa.all_processes(ONE, False) is False


@pytest.mark.parametrize("fn", [fa.any_process, fa.all_processes])
def test_flags_must_be_bools(fn: Any) -> None:
    name = fn.__name__
    for bad in (1, None, torch.tensor(True), "yes"):
        with pytest.raises(TypeError, match=rf"^{name}: flag must be a bool; got "):
            fn(ONE, bad)


def test_hand_built_multi_process_context_without_group_is_a_runtime_error() -> None:
    ctx = rank_ctx(0, 2)
    for call in (
        lambda: fa.wait_for_everyone(ctx),
        lambda: fa.any_process(ctx, True),
        lambda: fa.all_processes(ctx, False),
    ):
        with pytest.raises(RuntimeError, match=r"no default process group"):
            call()


def _caught(fn: Any) -> Any:
    try:
        return fn()
    except Exception as error:
        return type(error).__name__, str(error)


def _scenarios(ctx: DistributedContext, log_dir: Path) -> dict[str, Any]:
    rank, world = ctx.process_index, ctx.num_processes
    out: dict[str, Any] = {}
    out["split"] = {
        (n, pad): fa.split_between_processes(ctx, list(range(n)), apply_padding=pad)
        for n in range(12)
        for pad in (False, True)
    }
    out["padded_count"] = [fa.padded_count(ctx, n) for n in range(12)]
    patterns = {
        "none": [False] * world,
        "one": [r == 1 for r in range(world)],
        "all": [True] * world,
    }
    out["any"] = {k: fa.any_process(ctx, v[rank]) for k, v in patterns.items()}
    out["all"] = {k: fa.all_processes(ctx, v[rank]) for k, v in patterns.items()}
    bad: object = 1 if rank == 1 else True
    out["bad any"] = _caught(lambda: fa.any_process(ctx, bad))  # type: ignore[arg-type]
    out["bad all"] = _caught(lambda: fa.all_processes(ctx, bad))  # type: ignore[arg-type]
    # Barrier: rank 0 arrives late; nobody leaves before it arrived.
    if rank == 0:
        time.sleep(0.3)
        (log_dir / "arrived").write_text(repr(time.time()))
    fa.wait_for_everyone(ctx)
    out["left barrier"] = time.time()
    out["arrived seen"] = (log_dir / "arrived").exists()
    fa.wait_for_everyone(ctx)  # after the check, so the file is not read too late
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def dist_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]], Path]:
    world: int = request.param
    base = tmp_path_factory.mktemp(f"sync{world}")
    log_dir = base / "log"
    log_dir.mkdir()
    return (
        world,
        run_ranks(_scenarios, world, log_dir, start_method="forkserver"),
        log_dir,
    )


@pytest.mark.distributed
def test_split_on_real_ranks(
    dist_results: tuple[int, list[dict[str, Any]], Path],
) -> None:
    world, per_rank, _ = dist_results
    for n in range(12):
        for pad in (False, True):
            expected = reference_parts(list(range(n)), world, pad)
            assert [r["split"][(n, pad)] for r in per_rank] == expected
    for rank, result in enumerate(per_rank):
        for n in range(12):
            plain = reference_parts(list(range(n)), world, False)
            assert result["padded_count"][n] == max(
                (len(p) for p in plain), default=0
            ) - len(plain[rank])


@pytest.mark.distributed
def test_flags_agree_on_every_rank(
    dist_results: tuple[int, list[dict[str, Any]], Path],
) -> None:
    _, per_rank, _ = dist_results
    for result in per_rank:
        assert result["any"] == {"none": False, "one": True, "all": True}
        assert result["all"] == {"none": False, "one": False, "all": True}


@pytest.mark.distributed
def test_a_bad_flag_on_one_rank_raises_on_every_rank(
    dist_results: tuple[int, list[dict[str, Any]], Path],
) -> None:
    _, per_rank, _ = dist_results
    for key, name in (("bad any", "any_process"), ("bad all", "all_processes")):
        for rank, result in enumerate(per_rank):
            kind, msg = result[key]
            assert kind == "TypeError"
            if rank == 1:
                assert msg.startswith(f"{name}: flag must be a bool; got 1 (int)")
            else:
                assert re.match(rf"{name}: rank\(s\) \[1\] passed a flag", msg)


@pytest.mark.distributed
def test_wait_for_everyone_waits_for_the_last_rank(
    dist_results: tuple[int, list[dict[str, Any]], Path],
) -> None:
    _, per_rank, log_dir = dist_results
    arrived = float((log_dir / "arrived").read_text())
    for result in per_rank:
        assert result["arrived seen"]
        assert result["left barrier"] >= arrived
