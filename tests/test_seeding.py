"""set_seed: the generators it seeds, the seed it uses, and what it refuses."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
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
    return DistributedContext(
        num_processes=world,
        process_index=rank,
        distributed_type=DistributedType.MULTI_CPU,
    )


@pytest.fixture(autouse=True)
def _keep_global_rng() -> Iterator[None]:
    """set_seed changes process-wide generators: put them back after each test."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    torch.use_deterministic_algorithms(deterministic)


def draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.random()), torch.rand(1).item()


def seeded_by_hand(
    python: int, numpy: int, torch_seed: int
) -> tuple[float, float, float]:
    random.seed(python)
    np.random.seed(numpy)
    torch.manual_seed(torch_seed)
    return draws()


@pytest.mark.parametrize("seed", [0, 42, 2**31, 2**32 - 1])
def test_set_seed_seeds_python_numpy_and_torch(seed: int) -> None:
    expected = seeded_by_hand(seed, seed, seed)
    assert fa.set_seed(ONE, seed) == seed
    assert draws() == expected


def test_device_specific_adds_the_rank() -> None:
    expected = seeded_by_hand(12, 12, 12)
    assert fa.set_seed(rank_ctx(2, 4), 10, device_specific=True) == 12
    assert draws() == expected
    assert fa.set_seed(rank_ctx(2, 4), 10) == 10  # no group needed, rank ignored


@pytest.mark.parametrize(
    ("seed", "numpy_seed"),
    [(2**32 + 3, 3), (-1, 2**32 - 1), (2**64 - 1, 2**32 - 1), (-(2**63), 0)],
)
def test_numpy_gets_the_seed_modulo_2_to_the_32(seed: int, numpy_seed: int) -> None:
    expected = seeded_by_hand(seed, numpy_seed, seed)
    assert fa.set_seed(ONE, seed) == seed
    assert draws() == expected


@given(seed=st.integers(-(2**63), 2**64 - 1))
def test_the_same_seed_gives_the_same_draws(seed: int) -> None:
    fa.set_seed(ONE, seed)
    first = draws()
    fa.set_seed(ONE, seed)
    assert draws() == first


def test_integral_non_int_seeds_are_accepted() -> None:
    assert fa.set_seed(ONE, np.int64(7)) == 7  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("seed", "match"),
    [
        (1.5, r"^set_seed: seed must be an int; got 1\.5 \(float\)"),
        (True, r"^set_seed: seed must be an int; got True \(bool\)"),
        ("3", r"^set_seed: seed must be an int; got '3' \(str\)"),
        (None, r"^set_seed: seed must be an int; got None"),
    ],
)
def test_set_seed_rejects_non_integers(seed: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        fa.set_seed(ONE, seed)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_set_seed_rejects_seeds_torch_refuses(seed: int) -> None:
    with pytest.raises(ValueError, match=rf"^set_seed: .*got {seed}\. Pass a smaller"):
        fa.set_seed(ONE, seed)


def test_device_specific_overflow_names_the_rank() -> None:
    with pytest.raises(
        ValueError,
        match=r"^set_seed: seed \+ process_index \(18446744073709551615 \+ 1\) must be in "
        r".*; got 18446744073709551616\. Pass a smaller seed\.$",
    ):
        fa.set_seed(rank_ctx(1, 2), 2**64 - 1, device_specific=True)


def test_set_seed_checks_flags_and_ctx() -> None:
    with pytest.raises(TypeError, match=r"^set_seed: device_specific must be a bool"):
        fa.set_seed(ONE, 1, device_specific=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^set_seed: deterministic must be a bool"):
        fa.set_seed(ONE, 1, deterministic="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^set_seed: ctx must be a DistributedContext"):
        fa.set_seed(1, 1)  # type: ignore[arg-type]


def test_deterministic_switches_torch_to_deterministic_algorithms() -> None:
    torch.use_deterministic_algorithms(False)
    fa.set_seed(ONE, 1)
    assert not torch.are_deterministic_algorithms_enabled()
    fa.set_seed(ONE, 1, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    fa.set_seed(ONE, 1)  # False leaves it on
    assert torch.are_deterministic_algorithms_enabled()


def test_cuda_generators_are_seeded_when_cuda_is_available(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", calls.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fa.set_seed(ONE, 5)
    without = list(calls)
    calls.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fa.set_seed(ONE, 5)
    # torch.manual_seed may seed CUDA itself; set_seed adds one explicit call.
    assert len(calls) == len(without) + 1 and set(calls) == {5}


def _seeded_draws(ctx: DistributedContext) -> dict[str, Any]:
    fa.set_seed(ctx, 10)
    same = draws()
    used = fa.set_seed(ctx, 10, device_specific=True)
    return {"same": same, "used": used, "own": draws()}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_set_seed_on_real_ranks(world: int) -> None:
    results = run_ranks(_seeded_draws, world, start_method="forkserver")
    shared = seeded_by_hand(10, 10, 10)
    assert [r["same"] for r in results] == [shared] * world
    assert [r["used"] for r in results] == [10 + r for r in range(world)]
    for rank, result in enumerate(results):
        assert result["own"] == seeded_by_hand(10 + rank, 10 + rank, 10 + rank)
    assert len({r["own"] for r in results}) == world
