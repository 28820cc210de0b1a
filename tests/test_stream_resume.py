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
import warnings
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset
from torch.utils.data import get_worker_info

from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.checkpoint import latest_checkpoint
from funcaccel.checkpoint import load_checkpoint
from funcaccel.checkpoint import read_checkpoint_meta
from funcaccel.checkpoint import save_checkpoint
from funcaccel.collectives import broadcast_object
from funcaccel.context import DistributedContext
from funcaccel.loader import Batch
from funcaccel.loader import LoaderState
from funcaccel.loader import iter_batches
from funcaccel.loader import shard_loader
from funcaccel.model import unwrap_model
from funcaccel.model import wrap_model
from funcaccel.packing import pack_documents
from funcaccel.testing import rank_ctx
from funcaccel.testing import run_ranks
from tests._hf import FileReads
from tests._hf import hf_stream
from tests._hf import scipy_env
from tests._hf import write_jsonl

datasets = pytest.importorskip("datasets")
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


def test_a_buffer_shuffled_hf_stream_is_replayed_not_loaded(tmp_path: Path) -> None:
    # datasets saves no shuffle buffer: loading its state would silently lose the
    # samples the buffer held, so the loader reads such a stream as a plain one.
    files = write_jsonl(tmp_path / "data", SAMPLES, 3)

    def loader(p: int, rank: int) -> Any:
        stream = hf_stream(files, tmp_path / "cache").shuffle(seed=1, buffer_size=4)
        data = DataLoader(stream, batch_size=BATCH)
        return shard_loader(rank_ctx(p, rank), data, dispatch_batches=False)

    for p in (1, 2):
        unbroken = [list(iter_batches(loader(p, r))) for r in range(p)]
        flat = {i for run in unbroken for b in _ids(run) for i in b}
        assert flat == set(range(SAMPLES))  # shuffled, every sample once
        for rank in range(p):
            state = unbroken[rank][2].state
            assert state.stream_state is None
            resumed = list(iter_batches(loader(p, rank), state))
            assert _ids(resumed) == _ids(unbroken[rank][3:])
    raw = datasets.load_dataset(
        "json", data_files=files, split="train", streaming=True, cache_dir=str(tmp_path)
    )
    shuffled = raw.shuffle(seed=1, buffer_size=4)
    documents = shuffled.map(lambda e: {"tokens": [e["id"], 0]})
    packed = pack_documents(documents, seq_len=4, field="tokens")
    iterator = iter(packed)
    next(iterator)
    assert packed.state_dict()["source"] is None  # packing replays it too


def test_a_state_without_the_streams_position_replays_the_skipped_samples() -> None:
    reads: list[int] = []
    make: Make = lambda on_read: Numbers(SAMPLES, on_read)  # noqa: E731
    unbroken = list(iter_batches(_loader(make, 2, 0)))
    plain = LoaderState(epoch=0, global_batches=3, global_batch_size=4)
    resumed = list(iter_batches(_loader(make, 2, 0, reads), plain))
    assert _ids(resumed) == _ids(unbroken[3:])
    assert reads[:12] == list(range(12))  # read and dropped: exact, not O(1)


class WorkerNumbers(Numbers):
    """``Numbers`` split between worker processes as ``datasets`` splits its shards.

    Worker ``w`` of ``W`` reads the runs of 4 ids ``4k..4k+3`` with ``k % W == w``.
    """

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        w, workers = (0, 1) if info is None else (info.id, info.num_workers)
        self.at, self.start = self.start, 0
        while self.at < self.n:
            self.at += 1
            if (self.at - 1) // 4 % workers != w:
                continue  # another worker's run: not read here
            if self.on_read is not None:
                self.on_read(self.at - 1)
            yield {"id": torch.tensor(self.at - 1)}


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("kind", ["hf", "own"])
def test_worker_processes_resume_from_any_batch_state_in_the_same_order(
    tmp_path: Path, p: int, kind: str
) -> None:
    files = write_jsonl(tmp_path / "data", SAMPLES, 3)
    reads = FileReads(tmp_path / "reads.txt")

    def make(on_read: Callable[[int], None] | None) -> Any:
        if kind == "hf":
            return hf_stream(files, tmp_path / "cache", on_read)
        return WorkerNumbers(SAMPLES, on_read)

    def loader(rank: int, on_read: FileReads) -> Any:
        data = DataLoader(make(on_read), batch_size=BATCH, num_workers=2)
        return shard_loader(rank_ctx(p, rank), data, dispatch_batches=False)

    # The same pipeline (a counting map) in every run.
    unbroken = [
        list(iter_batches(loader(r, FileReads(tmp_path / "all.txt")))) for r in range(p)
    ]
    # Every sample of the epoch is read (each worker pads its own last batch).
    assert {i for run in unbroken for b in _ids(run) for i in b} == set(range(SAMPLES))
    size = BATCH * p
    subs = [[i for i in range(SAMPLES) if i // 4 % 2 == w] for w in range(2)]
    heads = {i for sub in subs for i in sub[:size]}
    for rank in range(p):
        ids = _ids(unbroken[rank])
        for k in (1, len(ids) // 2, len(ids) - 1):
            reads.path.unlink(missing_ok=True)
            state = _round_trip(unbroken[rank][k - 1].state)
            assert len(state.stream_state["workers"]) == 2
            resumed = list(iter_batches(loader(rank, reads), state))
            assert _ids(resumed) == ids[k:], (k, rank)
            if kind == "hf":
                continue
            read = reads.ids()
            # Every rank reads all samples: the rest of the stream after the
            # workers' positions, and at most each worker's head again, to pad.
            rest = [i for run in unbroken for b in _ids(run)[k:] for i in b]
            assert set(read) <= set(rest) | heads, (k, rank)
            if p == 1:  # no padding: exactly the rest, each sample once
                assert sorted(read) == sorted(rest)


def test_with_workers_a_state_needs_the_global_batch_size_that_saved_it(
    tmp_path: Path,
) -> None:
    make = _kinds(tmp_path)["own"]
    two = list(iter_batches(_loader(make, 2, 0, num_workers=2)))  # G = 4
    state = _round_trip(two[1].state)
    with pytest.raises(
        ValueError,
        match=r"iter_batches: the state's global_batch_size must be this loader's total_batch_size \(2\) with num_workers=2; got 4\. The stream's state was saved by a loader on 2 data-parallel ranks and this loader runs on 1",
    ):
        iter_batches(_loader(make, 1, 0, num_workers=2), state)
    # One rank with a batch of 4 keeps G = 4: it continues both workers' parts.
    resumed = list(
        iter_batches(_loader(make, 1, 0, num_workers=2, batch_size=4), state)
    )
    ranks = [
        _ids(list(iter_batches(_loader(make, 2, r, num_workers=2)))) for r in (0, 1)
    ]
    joined = [ranks[0][s] + ranks[1][s] for s in range(2, len(ranks[0]))]
    # The same batches; one rank keeps a worker's last one short where two pad it.
    got = _ids(resumed)
    assert all(j[: len(g)] == g for g, j in zip(got, joined, strict=True))
    assert sum(map(len, got)) < sum(map(len, joined))


@pytest.mark.parametrize("workers", [0, 2])
def test_iterating_the_loader_directly_gives_the_batches_of_iter_batches(
    tmp_path: Path, workers: int
) -> None:
    make = _kinds(tmp_path)["hf"]
    for rank in range(2):
        loader = _loader(make, 2, rank, num_workers=workers)
        records = _ids(list(iter_batches(loader)))
        assert [batch["id"].tolist() for batch in loader] == records


def test_a_stream_state_needs_the_num_workers_that_saved_it(tmp_path: Path) -> None:
    make = _kinds(tmp_path)["own"]
    zero = list(iter_batches(_loader(make, 1, 0)))
    with pytest.raises(
        ValueError,
        match=r"iter_batches: state.stream_state must be the state of a loader with num_workers=2; got 'num_workers=0'\. .* Resume with num_workers=0, or start the next epoch with LoaderState\(epoch=1\)",
    ):
        iter_batches(_loader(make, 1, 0, num_workers=2), zero[2].state)
    # Persistent workers keep their first stream: those loaders replay, exactly.
    loader = _loader(make, 1, 0, num_workers=1, persistent_workers=True)
    assert list(iter_batches(loader))[0].stream_state is None
    plain = LoaderState(epoch=0, global_batches=3, global_batch_size=BATCH)
    assert _ids(list(iter_batches(loader, plain))) == _ids(zero[3:])


def test_a_torchdata_stateful_dataloader_is_read_like_a_dataloader() -> None:
    torchdata = pytest.importorskip("torchdata.stateful_dataloader")
    make: Make = lambda on_read: Numbers(SAMPLES, on_read)  # noqa: E731
    for p in (1, 2):
        reads: list[int] = []
        with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch API
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            data = torchdata.StatefulDataLoader(make(reads.append), batch_size=BATCH)
        loader = shard_loader(rank_ctx(p, 0), data, dispatch_batches=False)
        unbroken = list(iter_batches(loader))
        assert _ids(unbroken) == _ids(list(iter_batches(_loader(make, p, 0))))
        reads.clear()
        resumed = list(iter_batches(loader, unbroken[2].state))
        assert _ids(resumed) == _ids(unbroken[3:])
        start = 3 * BATCH * p  # nothing before the resume point, then the rest
        assert reads[: SAMPLES - start] == list(range(start, SAMPLES))


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
    assert len({state, _round_trip(state)}) == 1  # hashable, equal after JSON
    shared = {"at": [1]}
    copied = LoaderState(global_batches=1, stream_state=shared, stream_ranks=1)
    shared["at"].append(2)
    assert copied.stream_state == {"at": [1]}  # deep-copied


class Plain(IterableDataset[dict[str, torch.Tensor]]):
    """The samples of ``Numbers`` with no state: the reference of today's dispatch."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return ({"id": torch.tensor(i)} for i in range(SAMPLES))


def _dispatched(ctx: DistributedContext) -> dict[str, Any]:
    """Dispatch (the default for streams): every resume point of a stateful stream."""
    torch.set_num_threads(1)

    def loader(source: Any) -> Any:
        return shard_loader(ctx, DataLoader(source, batch_size=BATCH))

    unbroken = list(iter_batches(loader(Numbers(SAMPLES))))
    out: dict[str, Any] = {
        "dispatch": loader(Numbers(SAMPLES)).dispatch_batches,
        "same": _ids(unbroken) == _ids(list(iter_batches(loader(Plain())))),
        "resumes": [],
    }
    for k in range(1, len(unbroken)):
        # A checkpoint holds rank 0's state (the only rank that reads).
        state = broadcast_object(ctx, unbroken[k - 1].state)
        reads: list[int] = []
        resumed = list(iter_batches(loader(Numbers(SAMPLES, reads.append)), state))
        out["resumes"].append(
            (_ids(resumed) == _ids(unbroken[k:]), reads, state.stream_state)
        )
    return out


@pytest.mark.distributed
def test_a_dispatched_stream_resumes_reading_no_skipped_sample() -> None:
    ranks = run_ranks(_dispatched, 2, timeout_s=240, start_method="forkserver")
    size = BATCH * 2
    for rank, result in enumerate(ranks):
        assert result["dispatch"] and result["same"]  # today's dispatched batches
        for k, (same, reads, stream_state) in enumerate(result["resumes"], 1):
            assert same, (rank, k)
            assert stream_state == {"source": {"at": k * size}}
            # Rank 0 alone reads: the rest, then the first global batch to pad.
            head = list(range(size)) if rank == 0 else []
            assert reads == (list(range(k * size, SAMPLES)) if rank == 0 else []) + head


def _save_after(ctx: DistributedContext, files: list[str], root: Path) -> list[int]:
    """Read 1 global batch of 4 on 2 ranks, checkpoint the loader; return the epoch's ids."""
    reads: list[int] = []  # the same pipeline (a counting map) as the resume's
    stream = hf_stream(files, root / f"cache{ctx.process_index}", reads.append)
    loader = shard_loader(ctx, DataLoader(stream, batch_size=2), dispatch_batches=False)
    records = list(iter_batches(loader))
    save_checkpoint(ctx, root / "ws", loader=records[0].state)
    return [i for b in _ids(records) for i in b]


def _resume_on(
    ctx: DistributedContext, files: list[str], root: Path, path: Path
) -> Any:
    """Resume the saved loader state on this world: the ids and reads, or the error."""
    state = read_checkpoint_meta(path).loader
    assert state is not None and state.stream_state is not None
    reads: list[int] = []
    stream = hf_stream(files, root / f"cache{ctx.process_index}", reads.append)
    loader = shard_loader(ctx, DataLoader(stream, batch_size=2), dispatch_batches=False)
    try:
        ids = [i for b in _ids(list(iter_batches(loader, state))) for i in b]
    except ValueError as error:
        return str(error)
    return ids, reads


@pytest.mark.distributed
def test_a_checkpointed_stream_continues_on_one_rank_and_refuses_three(
    tmp_path: Path,
) -> None:
    files = write_jsonl(tmp_path / "data", SAMPLES, 3)
    run = functools.partial(run_ranks, timeout_s=240, start_method="forkserver")
    run(_save_after, 2, files, tmp_path)
    path = latest_checkpoint(tmp_path / "ws")
    assert path is not None
    # 2 ranks x 2 = 4 samples consumed: one rank of 2 continues from sample 4,
    # reading nothing before it; three ranks of 2 (G = 6) cannot, and say why.
    [(ids, reads)] = run(_resume_on, 1, files, tmp_path, path)
    assert ids == list(range(4, SAMPLES)) and reads == ids
    errors = run(_resume_on, 3, files, tmp_path, path)
    for error in errors:
        assert (
            "saved by a loader on 2 data-parallel ranks and this loader runs on 3"
            in error
        )
        assert "LoaderState(epoch=1)" in error


# --- real gloo ranks: stopped, checkpointed, resumed = unbroken, bit for bit -----

STOP = 3  # optimizer steps before the checkpoint (mid-epoch 0)


def _train(
    ctx: DistributedContext,
    files: list[str],
    root: Path,
    resume: Path | None,
    workers: int = 0,
) -> tuple[list[torch.Tensor], list[int]]:
    """Two epochs of a float64 DDP regression on the stream; returns params and reads."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = wrap_model(ctx, nn.Linear(2, 1).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rank = ctx.process_index
    reads: list[int] = []
    counter = FileReads(root / f"reads-{resume is not None}-{rank}.txt")
    on_read = counter if workers else reads.append
    stream = hf_stream(files, root / f"cache{rank}", on_read)
    # fork: quick to start (a forkserver rank would start each worker afresh)
    context = "fork" if workers else None
    data = DataLoader(
        stream, batch_size=BATCH, num_workers=workers, multiprocessing_context=context
    )
    loader = shard_loader(ctx, data, dispatch_batches=False)
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
    return params, counter.ids() if workers else reads


def _both(
    ctx: DistributedContext, files: list[str], root: Path, workers: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int], list[int]]:
    """The unbroken run (saving at STOP), then a fresh model and loader resumed from it."""
    theirs, their_reads = _train(ctx, files, root, None, workers)
    path = latest_checkpoint(root / "ckpt")
    assert path is not None
    ours, our_reads = _train(ctx, files, root, path, workers)
    return ours, theirs, our_reads, their_reads


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "workers"), [(1, 0), (2, 0), (3, 0), (2, 2)])
def test_a_streaming_run_stopped_and_resumed_ends_bit_for_bit_as_the_unbroken_run(
    tmp_path: Path, world: int, workers: int
) -> None:
    files = write_jsonl(tmp_path / "data", SAMPLES, 3)
    ranks = run_ranks(
        _both, world, files, tmp_path, workers, timeout_s=300, start_method="forkserver"
    )
    size = BATCH * world
    for ours, theirs, our_reads, their_reads in ranks:
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        # Each rank reads every sample once per epoch (with workers, a worker its
        # shards), the unbroken run and the resumed run alike.
        assert sorted(their_reads) == sorted(2 * list(range(SAMPLES)))
        if workers:
            # The resumed run skips the STOP global batches read before the stop
            # and reads at most each worker's first global batch again (to pad).
            assert len(our_reads) <= len(their_reads) - STOP * size + workers * size
            continue
        # Epoch 0 resumed after STOP global batches: the skipped samples are not
        # read (the head again only for the padding), then epoch 1 whole.
        head = list(range(size)) if SAMPLES % size and world > 1 else []
        epoch0 = list(range(STOP * size, SAMPLES)) + head
        assert our_reads[: len(epoch0)] == epoch0
        assert sorted(our_reads[len(epoch0) :]) == list(range(SAMPLES))


def test_a_datasets_stream_whose_chain_cannot_be_read_is_replayed(
    tmp_path: Path,
) -> None:
    # The buffer-shuffle check reads datasets' chain of example iterables; a
    # datasets release without it must fall back to the exact replay, not load.
    from funcaccel._stream_state import resumes_exactly

    files = write_jsonl(tmp_path / "data", SAMPLES, 3)
    plain = hf_stream(files, tmp_path / "cache")
    assert resumes_exactly(plain)
    assert not resumes_exactly(plain.shuffle(seed=1, buffer_size=4))
    hidden = hf_stream(files, tmp_path / "cache")
    del hidden._ex_iterable  # as if renamed
    assert not resumes_exactly(hidden)
