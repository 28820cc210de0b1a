"""Hugging Face ``datasets`` through ``shard_loader``: the batches of a torch dataset.

A map-style ``datasets.Dataset`` (formatted to torch) and a streaming
``datasets.IterableDataset`` read from local JSON Lines files are sharded exactly
as a torch dataset holding the same samples is: the same batches per rank, ``len``,
``total_batch_size``, ``is_last`` and ``remainder`` in every mode (one process,
sharded, split, ``drop_last``, uneven, shuffled), on simulated ranks; and on real
gloo ranks (1, 2 and 3) every sample is seen once per epoch through
``gather_for_metrics``, dispatched or sharded.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset

from funcaccel.collectives import gather_for_metrics
from funcaccel.context import DistributedContext
from funcaccel.loader import iter_batches
from funcaccel.loader import shard_loader
from funcaccel.testing import rank_ctx
from funcaccel.testing import run_ranks
from tests._hf import hf_stream
from tests._hf import hf_table
from tests._hf import scipy_env
from tests._hf import write_jsonl

datasets = pytest.importorskip("datasets")

SAMPLES = 29
SHARDS = 3
BATCH = 6
pytestmark = pytest.mark.usefixtures(scipy_env.__name__)
Row = tuple[list[list[int]], list[bool], list[int], int, int | None]


def _sample(i: int) -> dict[str, torch.Tensor]:
    return {"id": torch.tensor(i), "x": torch.tensor([i / 10, -i])}


class TorchStream(IterableDataset[dict[str, torch.Tensor]]):
    """The same samples as a plain unsized torch stream (the reference)."""

    def __init__(self, samples: int = SAMPLES) -> None:
        self.samples = samples

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return (_sample(i) for i in range(self.samples))


def _per_rank(
    p: int, make: Any, *, drop_last: bool, shuffle: bool, **options: Any
) -> list[Row]:
    """What each of ``p`` simulated ranks reads in epoch 0 (and its len/G)."""
    rows: list[Row] = []
    for rank in range(p):
        data = DataLoader(
            make(), batch_size=BATCH, drop_last=drop_last, shuffle=shuffle
        )
        loader = shard_loader(
            rank_ctx(p, rank), data, dispatch_batches=False, seed=3, **options
        )
        records = list(iter_batches(loader))
        try:
            length = len(loader)
        except TypeError:
            length = -1
        rows.append(
            (
                [b.data["id"].tolist() for b in records],
                [b.is_last for b in records],
                [b.remainder for b in records],
                length,
                loader.total_batch_size,
            )
        )
    return rows


MODES = [
    {},
    {"split_batches": True},
    {"drop_last": True},
    {"even_batches": False},
]


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES, ids=["plain", "split", "drop_last", "uneven"])
def test_a_map_style_hf_dataset_shards_as_the_torch_dataset_does(
    p: int, mode: dict[str, Any]
) -> None:
    options = dict(mode)
    drop_last = options.pop("drop_last", False)
    for shuffle in (False, True):
        reference = [_sample(i) for i in range(SAMPLES)]
        ours = _per_rank(
            p,
            lambda: hf_table(SAMPLES),
            drop_last=drop_last,
            shuffle=shuffle,
            **options,
        )
        theirs = _per_rank(
            p, lambda: reference, drop_last=drop_last, shuffle=shuffle, **options
        )
        assert ours == theirs
        seen = {i for row in ours for batch in row[0] for i in batch}
        if not drop_last:
            assert seen == set(range(SAMPLES))


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES, ids=["plain", "split", "drop_last", "uneven"])
def test_a_streaming_hf_dataset_shards_as_the_torch_stream_does(
    tmp_path: Path, p: int, mode: dict[str, Any]
) -> None:
    options = dict(mode)
    drop_last = options.pop("drop_last", False)
    files = write_jsonl(tmp_path / "data", SAMPLES, SHARDS)
    ours = _per_rank(
        p,
        lambda: hf_stream(files, tmp_path / "cache"),
        drop_last=drop_last,
        shuffle=False,
        **options,
    )
    theirs = _per_rank(p, TorchStream, drop_last=drop_last, shuffle=False, **options)
    assert ours == theirs
    # Every sample is read once per epoch; the even-out rule loops back to the start.
    flat = [i for row in ours for batch in row[0] for i in batch]
    if not drop_last:
        assert set(flat) == set(range(SAMPLES))


def test_a_stream_already_split_by_node_is_refused(tmp_path: Path) -> None:
    from datasets.distributed import split_dataset_by_node

    files = write_jsonl(tmp_path / "data", SAMPLES, SHARDS)
    split = split_dataset_by_node(
        hf_stream(files, tmp_path / "cache"), rank=1, world_size=2
    )
    for p in (1, 2):
        with pytest.raises(
            ValueError,
            match=r"shard_loader: the dataset is a datasets stream already split between 2 nodes \(split_dataset_by_node, rank 1\); .* Pass the stream as it was before split_dataset_by_node\.",
        ):
            shard_loader(rank_ctx(p, 0), DataLoader(split, batch_size=BATCH))


# --- real gloo ranks: each sample once per epoch through gather_for_metrics ------


def _gathered(ctx: DistributedContext, files: list[str], cache: Path) -> dict[str, Any]:
    """Epoch 0 of each loader kind on this rank: its batches and the gathered ids."""
    torch.set_num_threads(1)
    kinds: dict[str, tuple[Callable[[], Any], dict[str, Any]]] = {
        "stream-dispatched": (lambda: hf_stream(files, cache), {}),
        "stream-sharded": (
            lambda: hf_stream(files, cache),
            {"dispatch_batches": False},
        ),
        "table-shuffled": (lambda: hf_table(SAMPLES), {"shuffle": True}),
    }
    out: dict[str, Any] = {}
    for name, (make, options) in kinds.items():
        shuffle = bool(options.pop("shuffle", False))
        data = DataLoader(make(), batch_size=BATCH, shuffle=shuffle)
        loader = shard_loader(ctx, data, seed=5, **options)
        local: list[list[int]] = []
        gathered: list[int] = []
        for batch in iter_batches(loader):
            ids = batch.data["id"]
            local.append(ids.tolist())
            gathered += gather_for_metrics(ctx, ids, batch=batch).tolist()
        out[name] = (local, gathered)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 3])
def test_hf_datasets_give_every_sample_once_per_epoch_on_real_ranks(
    tmp_path: Path, world: int
) -> None:
    files = write_jsonl(tmp_path / "data", SAMPLES, SHARDS)
    ranks = run_ranks(
        _gathered,
        world,
        files,
        tmp_path / "cache",
        timeout_s=240,
        start_method="forkserver",
    )
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(5)).tolist()
    expected = {
        "stream-dispatched": list(range(SAMPLES)),
        "stream-sharded": list(range(SAMPLES)),
        "table-shuffled": order,
    }
    for name, want in expected.items():
        for _local, gathered in (rank[name] for rank in ranks):
            assert gathered == want, name  # in order, each sample once
        batches = [len(rank[name][0]) for rank in ranks]
        assert len(set(batches)) == 1, (name, batches)  # the even-out rule
    # Sharded streams and tables read what the torch reference reads on each rank.
    for rank, result in enumerate(ranks):
        reference = _per_rank(world, TorchStream, drop_last=False, shuffle=False)
        assert result["stream-sharded"][0] == reference[rank][0]
