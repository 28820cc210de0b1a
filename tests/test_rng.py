"""Tests for ``funcaccel.rng``: syncing generators across ranks, capture and restore."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import funcaccel as fa
from funcaccel.context import DistributedContext
from funcaccel.rng import capture_rng_state
from funcaccel.rng import restore_rng_state
from funcaccel.rng import sync_rng_states
from funcaccel.testing import run_ranks
from tests.fixtures import rank_ctx


def test_sync_rng_states_is_exported_and_a_no_op_on_one_process() -> None:
    assert fa.sync_rng_states is sync_rng_states
    torch.manual_seed(7)
    before = torch.get_rng_state()
    generator = torch.Generator().manual_seed(3)
    sync_rng_states(DistributedContext(), ["torch", "generator"], generator)
    assert torch.equal(torch.get_rng_state(), before)
    assert generator.initial_seed() == 3


@pytest.mark.parametrize(
    ("rng_types", "generator", "error", "pattern"),
    [
        (
            "torch",
            None,
            TypeError,
            r"sync_rng_states: rng_types must be a list of names",
        ),
        (
            ["numpy"],
            None,
            ValueError,
            r"each name in rng_types must be one of 'torch', 'cuda', 'generator'; "
            r"got 'numpy'\. Remove it",
        ),
        (
            ["cuda"],
            None,
            ValueError,
            r"rng_types must be free of 'cuda' when ctx.device is cpu; got \['cuda'\]",
        ),
        (["generator"], 3, TypeError, r"generator must be a torch.Generator or None"),
    ],
)
def test_sync_rng_states_refuses_bad_arguments(
    rng_types: Any, generator: Any, error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        sync_rng_states(DistributedContext(), rng_types, generator)


def test_sync_rng_states_needs_a_group_with_several_processes() -> None:
    with pytest.raises(RuntimeError, match=r"sync_rng_states: ctx has num_processes=2"):
        sync_rng_states(rank_ctx(2, 1), ["torch"])


def _synced(ctx: DistributedContext) -> dict[str, Any]:
    rank = ctx.process_index
    torch.manual_seed(100 + rank)
    generator = torch.Generator().manual_seed(200 + rank)
    untouched = torch.Generator().manual_seed(300 + rank)
    sync_rng_states(ctx, ["torch", "generator"], generator)
    return {
        "torch": torch.rand(3).tolist(),
        "generator": torch.rand(3, generator=generator).tolist(),
        "untouched": torch.rand(1, generator=untouched).tolist(),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_sync_rng_states_gives_every_rank_rank_zeros_streams(world: int) -> None:
    results = run_ranks(_synced, world, start_method="forkserver")
    torch.manual_seed(100)
    expected_torch = torch.rand(3).tolist()
    expected_generator = torch.rand(3, generator=torch.Generator().manual_seed(200))
    for rank, result in enumerate(results):
        assert result["torch"] == expected_torch
        assert result["generator"] == expected_generator.tolist()
        own = torch.rand(1, generator=torch.Generator().manual_seed(300 + rank))
        assert result["untouched"] == own.tolist()  # not named, not synced


def test_capture_and_restore_round_trip_the_generators() -> None:
    torch.manual_seed(5)
    state = capture_rng_state()
    first = torch.rand(2)
    restore_rng_state(state, caller="test")
    assert torch.equal(torch.rand(2), first)
