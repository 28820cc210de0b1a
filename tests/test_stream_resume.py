"""A stateful stream resumes in O(1): no skipped sample is read again.

A ``datasets.IterableDataset`` (streaming local JSON Lines) and a stateful torch
stream written here (``state_dict``/``load_state_dict``) are resumed from every
``batch.state`` of an epoch on 1, 2 and 3 simulated ranks: the batches are the
rest of the unbroken epoch and the reads (counted by the stream itself) start at
the resume point. A state crosses world sizes where the new global batch divides
the samples consumed and is refused with a ``ValueError`` naming both world sizes
otherwise. On real gloo ranks a DDP run stopped mid-epoch, checkpointed and
resumed ends with the parameters of the unbroken run, bit for bit.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset

from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.checkpoint import latest_checkpoint
from funcaccel.checkpoint import load_checkpoint
from funcaccel.checkpoint import save_checkpoint
from funcaccel.context import DistributedContext
from funcaccel.loader import Batch
from funcaccel.loader import LoaderState
from funcaccel.loader import iter_batches
from funcaccel.loader import shard_loader
from funcaccel.model import unwrap_model
from funcaccel.model import wrap_model
from funcaccel.testing import rank_ctx
from funcaccel.testing import run_ranks
from tests._hf import hf_stream
from tests._hf import scipy_env
from tests._hf import write_jsonl

pytest.importorskip("datasets")
pytestmark = pytest.mark.usefixtures(scipy_env.__name__)

SAMPLES = 23
BATCH = 2


class Numbers(IterableDataset[dict[str, torch.Tensor]]):
    """Samples ``0..n-1`` with a position it can save and load; reports every read."""

    def __init__(self, n: int, on_read: Callable[[int], None] | None = None) -> None:
        self.n, self.on_read, self.start, self.at = n, on_read, 0, 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.at, self.start = self.start, 0
        while self.at < self.n:
            self.at += 1
            if self.on_read is not None:
                self.on_read(self.at - 1)
            yield {"id": torch.tensor(self.at - 1)}

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["at"]


Make = Callable[[Callable[[int], None] | None], Any]


def _kinds(tmp_path: Path) -> dict[str, Make]:
    files = write_jsonl(tmp_path / "data", SAMPLES, 3)
    return {
        "hf": lambda on_read: hf_stream(files, tmp_path / "cache", on_read),
        "own": lambda on_read: Numbers(SAMPLES, on_read),
    }


def _loader(
    make: Make, p: int, rank: int, reads: list[int] | None = None, **kw: Any
) -> Any:
    batch = kw.pop("batch_size", BATCH)
    # The same pipeline (a counting map) whether or not the reads are wanted.
    data = DataLoader(
        make((reads if reads is not None else []).append), batch_size=batch, **kw
    )
    return shard_loader(rank_ctx(p, rank), data, dispatch_batches=False)


def _ids(batches: list[Batch]) -> list[list[int]]:
    return [b.data["id"].tolist() for b in batches]


def _round_trip(state: LoaderState) -> LoaderState:
    """The state as a checkpoint's JSON manifest stores and reads it."""
    return LoaderState.from_dict(json.loads(json.dumps(state.to_dict())))


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("kind", ["hf", "own"])
def test_a_stream_resumed_from_any_batch_state_reads_no_skipped_sample(
    tmp_path: Path, p: int, kind: str
) -> None:
    make = _kinds(tmp_path)[kind]
    unbroken = [list(iter_batches(_loader(make, p, r))) for r in range(p)]
    size = BATCH * p  # G
    padded = SAMPLES % size != 0 and p > 1
    for k in range(1, len(unbroken[0])):
        for rank in range(p):
            state = unbroken[rank][k - 1].state
            assert state.stream_state is not None and state.stream_ranks == p
            reads: list[int] = []
            loader = _loader(make, p, rank, reads)
            resumed = list(iter_batches(loader, _round_trip(state)))
            assert _ids(resumed) == _ids(unbroken[rank][k:]), (k, rank)
            assert [b.is_last for b in resumed] == [
                b.is_last for b in unbroken[rank][k:]
            ]
            assert [b.remainder for b in resumed] == [
                b.remainder for b in unbroken[rank][k:]
            ]
            # Only samples after the k global batches are read, and the epoch's first
            # global batch once more when the last one needs padding from it.
            head = list(range(size)) if padded else []
            assert reads == list(range(k * size, SAMPLES)) + head, (k, rank)


@pytest.mark.parametrize("kind", ["hf", "own"])
def test_the_epoch_after_a_resumed_one_starts_from_the_beginning(
    tmp_path: Path, kind: str
) -> None:
    make = _kinds(tmp_path)[kind]
    loader = _loader(make, 2, 1)
    unbroken = [_ids(list(iter_batches(loader, LoaderState(epoch=e)))) for e in (0, 1)]
    state = list(iter_batches(loader))[3].state
    assert _ids(list(iter_batches(loader, state))) == unbroken[0][4:]
    assert _ids(list(iter_batches(loader, LoaderState(epoch=1)))) == unbroken[1]
    # The loader's dataset itself was never moved: a fresh epoch 0 is whole again.
    assert _ids(list(iter_batches(loader))) == unbroken[0]


def _global(p: int, per_rank: list[list[list[int]]]) -> list[int]:
    """The global order: the ranks' batches of each step, rank 0 first."""
    steps = len(per_rank[0])
    return [i for s in range(steps) for r in range(p) for i in per_rank[r][s]]


@pytest.mark.parametrize("kind", ["hf", "own"])
def test_a_stream_state_continues_on_a_world_size_whose_batch_divides_it(
    tmp_path: Path, kind: str
) -> None:
    make = _kinds(tmp_path)[kind]
    two = [list(iter_batches(_loader(make, 2, r, batch_size=2))) for r in range(2)]
    state = _round_trip(two[0][1].state)  # 2 global batches of 4: 8 samples
    assert (state.global_batches, state.global_batch_size) == (2, 4)
    for p, bs in ((1, 2), (4, 1), (4, 2), (1, 8)):
        reads: list[int] = []
        resumed = []
        for rank in range(p):
            mine: list[int] = []
            resumed.append(
                _ids(
                    list(
                        iter_batches(_loader(make, p, rank, mine, batch_size=bs), state)
                    )
                )
            )
            reads += mine
        flat = _global(p, resumed)
        # The same global sequence from sample 8 on (then the even-out loop-back).
        assert flat[: SAMPLES - 8] == list(range(8, SAMPLES)), (p, bs)
        assert min(reads) >= 8 or p > 1  # padding may read the epoch's head again
        assert reads[: SAMPLES - 8] == list(range(8, SAMPLES))


@pytest.mark.parametrize("kind", ["hf", "own"])
def test_a_stream_state_inside_the_new_global_batch_is_refused_naming_both_world_sizes(
    tmp_path: Path, kind: str
) -> None:
    make = _kinds(tmp_path)[kind]
    two = list(iter_batches(_loader(make, 2, 0, batch_size=2)))
    state = _round_trip(two[1].state)  # 8 samples; 3 ranks of 2 make G = 6
    with pytest.raises(
        ValueError,
        match=r"saved by a loader on 2 data-parallel ranks and this loader runs on 3",
    ) as error:
        iter_batches(_loader(make, 3, 0, batch_size=2), state)
    assert "global batch divides 8" in str(error.value)
    assert "LoaderState(epoch=1)" in str(error.value)


def test_a_state_without_the_streams_position_replays_the_skipped_samples() -> None:
    reads: list[int] = []
    make: Make = lambda on_read: Numbers(SAMPLES, on_read)  # noqa: E731
    unbroken = list(iter_batches(_loader(make, 2, 0)))
    plain = LoaderState(epoch=0, global_batches=3, global_batch_size=4)
    resumed = list(iter_batches(_loader(make, 2, 0, reads), plain))
    assert _ids(resumed) == _ids(unbroken[3:])
    assert reads[:12] == list(range(12))  # read and dropped: exact, not O(1)


def test_worker_processes_replay_the_skipped_samples_exactly() -> None:
    make: Make = lambda on_read: Numbers(SAMPLES, on_read)  # noqa: E731
    unbroken = list(iter_batches(_loader(make, 1, 0)))
    state = unbroken[4].state
    loader = _loader(make, 1, 0, num_workers=1)
    workers = list(iter_batches(loader))
    assert _ids(workers) == _ids(unbroken)
    assert _ids(list(iter_batches(loader, state))) == _ids(unbroken[5:])


def test_loader_state_carries_a_stream_state_through_json() -> None:
    state = LoaderState(
        epoch=1,
        global_batches=3,
        global_batch_size=4,
        stream_state={"at": [12, None]},
        stream_ranks=2,
    )
    assert _round_trip(state) == state
    assert LoaderState.from_dict(
        {"epoch": 1, "global_batches": 0, "global_batch_size": 0}
    ) == LoaderState(epoch=1)
    assert "stream_state" not in LoaderState(epoch=1).to_dict()
    with pytest.raises(
        TypeError,
        match=r"LoaderState: stream_state\['at'\] must be JSON values .* got \(1, 2\) \(tuple\)",
    ):
        LoaderState(global_batches=1, stream_state={"at": (1, 2)}, stream_ranks=1)
    with pytest.raises(
        ValueError,
        match=r"LoaderState: stream_ranks must be 0 when stream_state is None; got 2",
    ):
        LoaderState(global_batches=1, stream_ranks=2)
    with pytest.raises(
        ValueError, match=r"LoaderState: stream_ranks must be >= 1 .*; got 0"
    ):
        LoaderState(global_batches=1, stream_state={})
    with pytest.raises(
        ValueError,
        match=r"LoaderState: global_batches must be >= 1 when stream_state is set .*; got 0",
    ):
        LoaderState(stream_state={"at": 0}, stream_ranks=1)
    shared = {"at": [1]}
    copied = LoaderState(global_batches=1, stream_state=shared, stream_ranks=1)
    shared["at"].append(2)
    assert copied.stream_state == {"at": [1]}  # deep-copied


# --- real gloo ranks: stopped, checkpointed, resumed = unbroken, bit for bit -----

STOP = 3  # optimizer steps before the checkpoint (mid-epoch 0)


def _train(
    ctx: DistributedContext, files: list[str], root: Path, resume: Path | None
) -> tuple[list[torch.Tensor], list[int]]:
    """Two epochs of a float64 DDP regression on the stream; returns params and reads."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = wrap_model(ctx, nn.Linear(2, 1).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    reads: list[int] = []
    stream = hf_stream(files, root / f"cache{ctx.process_index}", reads.append)
    loader = shard_loader(
        ctx, DataLoader(stream, batch_size=BATCH), dispatch_batches=False
    )
    grad, state = GradState(accumulation_steps=1), LoaderState()
    if resume is not None:
        loaded = load_checkpoint(ctx, resume, models=model, optimizers=opt)
        assert loaded.grad is not None and loaded.loader is not None
        grad, state = loaded.grad, loaded.loader
        assert state.stream_state is not None

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(x)
        return ((out.squeeze(1) - y) ** 2).mean()

    while state.epoch < 2:
        for batch in iter_batches(loader, state):
            x = batch.data["x"].double()
            y = batch.data["id"].double() / 10
            _, grad = accumulate_step(
                ctx,
                grad,
                model,
                opt,
                functools.partial(loss, x, y),
                end_of_dataloader=batch.is_last,
            )
            state = batch.state
            if resume is None and grad.optimizer_steps == STOP and not batch.is_last:
                save_checkpoint(
                    ctx,
                    root / "ckpt",
                    models=model,
                    optimizers=opt,
                    grad=grad,
                    loader=state,
                )
    params = [p.detach().clone() for p in unwrap_model(model).parameters()]
    return params, reads


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_streaming_run_stopped_and_resumed_ends_bit_for_bit_as_the_unbroken_run(
    tmp_path: Path, world: int
) -> None:
    files = write_jsonl(tmp_path / "data", SAMPLES, 3)
    run = functools.partial(run_ranks, timeout_s=240, start_method="forkserver")
    unbroken = run(_train, world, files, tmp_path, None)
    path = latest_checkpoint(tmp_path / "ckpt")
    assert path is not None
    resumed = run(_train, world, files, tmp_path, path)
    size = BATCH * world
    consumed = STOP * size
    for (ours, our_reads), (theirs, _) in zip(resumed, unbroken, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        # Epoch 0 resumed after STOP global batches: the skipped samples are not read
        # (the head again only for the padding), then epoch 1 whole.
        head = list(range(size)) if SAMPLES % size and world > 1 else []
        epoch0 = list(range(consumed, SAMPLES)) + head
        assert our_reads[: len(epoch0)] == epoch0
        assert sorted(set(our_reads[len(epoch0) :])) == list(range(SAMPLES))
