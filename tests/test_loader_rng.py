"""What a ``ShardedLoader`` draws from torch's global generator.

The rules: docs/loader.md#draws-from-torchs-global-generator. The loader's own order
comes from ``seed + epoch``; these tests check that torch's global generator, which
builds models and dropout masks after the loader, ends each epoch where a plain
``DataLoader`` and Accelerate 1.15's prepared loader leave it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data import Dataset

from funcaccel.loader import LoaderState
from funcaccel.loader import iter_batches
from funcaccel.loader import shard_loader
from funcaccel.loader._draws import plan_draws
from funcaccel.testing import run_ranks
from tests.fixtures import Indexed
from tests.fixtures import SizedStream
from tests.fixtures import rank_ctx

MakeLoader = Callable[[], DataLoader[Any]]


def _shuffled() -> DataLoader[Any]:
    return DataLoader(Indexed(10), batch_size=3, shuffle=True)


def _sequential() -> DataLoader[Any]:
    return DataLoader(Indexed(10), batch_size=3)


def _stream() -> DataLoader[Any]:
    return DataLoader(SizedStream(10), batch_size=3)


def _unbatched_shuffled() -> DataLoader[Any]:
    data: Dataset[torch.Tensor] = Indexed(5)
    return DataLoader(data, batch_size=None, shuffle=True)


def _persistent() -> DataLoader[Any]:
    return DataLoader(
        Indexed(10), batch_size=3, shuffle=True, num_workers=1, persistent_workers=True
    )


def _states_after_epochs(
    make: Callable[[], Any], epochs: int = 2
) -> list[torch.Tensor]:
    """Seed, build with ``make``, iterate ``epochs`` epochs; the state after each."""
    torch.manual_seed(1234)
    loader = make()
    states = [torch.get_rng_state()]  # after building
    for _ in range(epochs):
        for _ in loader:
            pass
        states.append(torch.get_rng_state())
    return states


def _assert_same(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    assert len(ours) == len(theirs)
    for when, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(a, b), f"global RNG state differs after epoch {when - 1}"


@pytest.mark.parametrize(
    "make", [_shuffled, _sequential, _stream, _unbatched_shuffled, _persistent]
)
def test_one_process_leaves_the_global_generator_where_a_dataloader_does(
    make: MakeLoader,
) -> None:
    plain = _states_after_epochs(make)
    ours = _states_after_epochs(lambda: shard_loader(rank_ctx(), make()))
    _assert_same(ours, plain)


def test_the_global_generator_does_move_at_each_epoch_start() -> None:
    # Guards the comparisons above against a test that would pass with no draws.
    states = _states_after_epochs(lambda: shard_loader(rank_ctx(), _shuffled()))
    assert not torch.equal(states[0], states[1])
    assert not torch.equal(states[1], states[2])


def _accelerate(make: MakeLoader, p: int, rank: int) -> Any:
    oracle = pytest.importorskip("accelerate.data_loader")
    return oracle.prepare_data_loader(
        make(),
        device=torch.device("cpu"),
        num_processes=p,
        process_index=rank,
        put_on_device=False,
        dispatch_batches=False,
    )


# Not _unbatched_shuffled: Accelerate 1.15 drops the shuffle of a DataLoader with
# batch_size=None (its loader iterates 0, 1, 2, ... with a SequentialSampler), so
# it draws one number per epoch where torch's shuffling DataLoader draws two.
@pytest.mark.parametrize("make", [_shuffled, _sequential, _stream, _persistent])
def test_one_process_leaves_the_global_generator_where_accelerate_does(
    make: MakeLoader,
) -> None:
    theirs = _states_after_epochs(lambda: _accelerate(make, 1, 0))
    ours = _states_after_epochs(lambda: shard_loader(rank_ctx(), make()))
    _assert_same(ours, theirs)


@pytest.mark.parametrize("make", [_shuffled, _sequential, _stream])
@pytest.mark.parametrize("rank", [0, 1])
def test_each_of_two_ranks_leaves_the_global_generator_where_accelerate_does(
    make: MakeLoader, rank: int
) -> None:
    # Accelerate seeds the shuffling sampler's generator from one draw when it
    # prepares the loader; every epoch start then draws the worker base seed.
    theirs = _states_after_epochs(lambda: _accelerate(make, 2, rank))
    ours = _states_after_epochs(
        lambda: shard_loader(rank_ctx(2, rank), make(), dispatch_batches=False)
    )
    _assert_same(ours, theirs)


def test_iter_batches_draws_like_a_for_loop() -> None:
    by_loop = _states_after_epochs(lambda: shard_loader(rank_ctx(), _shuffled()))
    torch.manual_seed(1234)
    loader = shard_loader(rank_ctx(), _shuffled())
    by_records = [torch.get_rng_state()]
    for epoch in range(2):
        list(iter_batches(loader, LoaderState(epoch=epoch)))
        by_records.append(torch.get_rng_state())
    _assert_same(by_records, by_loop)


def test_a_resumed_epoch_draws_nothing_so_a_restored_generator_continues_exactly() -> (
    None
):
    # Uninterrupted: epochs 0 and 1, the state saved after epoch 0's first batch.
    torch.manual_seed(3)
    loader = shard_loader(rank_ctx(), _shuffled())
    records = iter_batches(loader)
    first = next(records)
    saved_rng, saved_position = torch.get_rng_state(), first.state
    list(records)
    after_epoch0 = torch.get_rng_state()
    list(iter_batches(loader, LoaderState(epoch=1)))
    after_epoch1 = torch.get_rng_state()
    # Resumed: a new loader, the checkpoint's generator state, then the rest of
    # epoch 0 (its start drew before the save) and a fresh epoch 1.
    resumed = shard_loader(rank_ctx(), _shuffled())
    torch.set_rng_state(saved_rng)
    rest = list(iter_batches(resumed, saved_position))
    assert len(rest) == len(loader) - 1
    assert torch.equal(torch.get_rng_state(), after_epoch0)
    list(iter_batches(resumed, LoaderState(epoch=1)))
    assert torch.equal(torch.get_rng_state(), after_epoch1)


@pytest.mark.parametrize(
    ("kind", "processes", "dispatch", "persistent", "expected"),
    [
        ("random", 1, False, False, (0, 2, 2)),
        ("random", 1, False, True, (0, 2, 1)),
        ("random", 2, False, False, (1, 1, 1)),
        ("random", 2, False, True, (1, 1, 0)),
        ("random", 2, True, False, (0, 2, 2)),  # rank 0's count, on every rank
        ("sequential", 2, False, False, (0, 1, 1)),
        ("given", 1, False, False, (0, 1, 1)),  # your sampler draws its own
        ("iterable", 2, True, False, (0, 1, 1)),
    ],
)
def test_draw_counts(
    kind: Any,
    processes: int,
    dispatch: bool,
    persistent: bool,
    expected: tuple[int, int, int],
) -> None:
    draws = plan_draws(
        kind=kind, processes=processes, dispatch=dispatch, persistent_workers=persistent
    )
    assert (draws.when_built, draws.first_epoch, draws.later_epochs) == expected


def _dispatch_worker(ctx: Any) -> list[list[int]]:
    torch.manual_seed(10 + ctx.process_index)  # different streams per rank
    loader = shard_loader(
        ctx,
        DataLoader(Indexed(8), batch_size=2, shuffle=True),
        dispatch_batches=True,
        rng_types=("torch",),
    )
    states = []
    for _ in range(2):
        for _ in loader:
            pass
        states.append(torch.get_rng_state().tolist())
    return states


@pytest.mark.distributed
def test_dispatching_ranks_draw_rank_0s_count_and_stay_in_step() -> None:
    rank0, rank1 = run_ranks(_dispatch_worker, 2, start_method="forkserver")
    assert rank0 == rank1
    # Rank 0's stream: synchronised to itself, then 2 draws per epoch start.
    torch.manual_seed(10)
    expected = []
    for _ in range(2):
        for _ in range(2):
            torch.empty((), dtype=torch.int64).random_()
        expected.append(torch.get_rng_state().tolist())
    assert rank0 == expected
