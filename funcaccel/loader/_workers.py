"""A stateful stream read by worker processes: one resumable order of their batches.

With ``num_workers = W > 0`` every worker process holds its own copy of the
stream and reads what the stream gives a worker (a ``datasets.IterableDataset``
gives worker ``w`` its shards ``w, w + W, ...``; a plain one repeats itself). A
``DataLoader`` interleaves the workers' batches in an order it cannot resume, so
the loader fixes the order itself: worker ``0, 1, ..., W - 1, 0, ...``, a worker
whose stream has ended left out of the cycle. The state after each batch holds
every worker's position (its own stream's ``state_dict()`` after its last
batch handed out, or that it has ended) and the worker next in the cycle, so a
resume gives each worker its position back and starts the cycle there, reading
no batch twice. The rules: docs/data.md#worker-processes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any
from typing import Final

from funcaccel._checks import fail_value
from funcaccel.loader._stateful import DONE
from funcaccel.loader._stateful import Resume
from funcaccel.loader._stateful import StreamTag
from funcaccel.loader._stateful import WorkerResumes

__all__ = ["check_worker_state", "in_cycle", "worker_resumes"]

Entry = Any  # None (not started), DONE, or {"seen": int, "source": state}
_FIX_WORKERS: Final = (
    "Each worker process reads its own part of the stream, so its state holds one "
    "position per worker. Resume with num_workers={0}, or start the next epoch "
    "with LoaderState(epoch={1})."
)


def _entry(tag: StreamTag) -> Entry:
    """A worker's position after a batch with ``tag``: ended after its last one."""
    return DONE if tag.state is None else {"seen": tag.seen, "source": tag.state}


def in_cycle(
    batches: Iterator[tuple[Any, StreamTag, bool]],
    entries: list[Entry],
    first: int,
) -> Iterator[tuple[Any, dict[str, Any]]]:
    """Yield the workers' batches in cycle order from worker ``first``, with the state after each.

    ``batches`` are a ``DataLoader``'s ``StreamCollate`` outputs, in whatever order
    it yields them; ``entries`` are the workers' positions at the start (``DONE``
    leaves a worker out).

    >>> t = lambda w, n, end=False: StreamTag(n, None if end else {"n": n}, w)
    >>> loader = iter([("a", t(0, 2), False), ("b", t(1, 2), False), (None, t(0, 2, True), True),
    ...                ("c", t(1, 4, True), True)])
    >>> [(d, s["next"]) for d, s in in_cycle(loader, [None, None], 0)]
    [('a', 1), ('b', 0), ('c', 0)]
    """
    workers = len(entries)
    queues: list[deque[tuple[Any, StreamTag, bool]]] = [deque() for _ in entries]
    latest = list(entries)
    done = [entry == DONE for entry in entries]
    current = first
    while not all(done):
        if done[current]:
            current = (current + 1) % workers
            continue
        while not queues[current]:
            item = next(batches, None)
            if item is None:  # the loader ended: every worker has finished
                return
            queues[item[1].worker].append(item)
        data, tag, ended = queues[current].popleft()
        if data is not None:
            latest[current] = DONE if ended else _entry(tag)
        done[current] = ended
        following = (current + 1) % workers
        if data is not None:
            yield data, {"workers": list(latest), "next": following}
        current = following


def worker_resumes(entries: list[Entry]) -> WorkerResumes:
    """Return what each worker process resumes from, given the saved positions."""
    return tuple(
        entry
        if entry is None or entry == DONE
        else Resume(entry["seen"], entry["source"])
        for entry in entries
    )


def check_worker_state(
    state: object,
    workers: int,
    total: int,
    epoch: int,
    world_fix: str,
    saved_total: int = 0,
) -> tuple[list[Entry], int]:
    """Return the saved positions and the next worker; ``ValueError`` if they do not fit.

    ``workers`` is this loader's ``num_workers`` (0: read in the training process),
    ``total`` its global batch size and ``saved_total`` the one of the state (0:
    the same); ``world_fix`` ends the error of a state this world cannot continue.
    With workers the global batch size must not change: it sets how the workers'
    batches interleave, so another one would continue in another order.
    """
    saved = 0
    if isinstance(state, dict) and set(state) == {"workers", "next"}:
        saved = len(state["workers"])
    elif not (isinstance(state, dict) and set(state) == {"source"}):
        what = "a stream state saved by iter_batches (batch.state)"
        fail_value("iter_batches", "state.stream_state", state, what)
    if saved != workers:
        what = f"the state of a loader with num_workers={workers}"
        fix = _FIX_WORKERS.format(saved, epoch + 1)
        fail_value(
            "iter_batches", "state.stream_state", f"num_workers={saved}", what, fix
        )
    if not workers:
        return [], 0
    assert isinstance(state, dict)
    if saved_total not in (0, total):
        what = f"this loader's total_batch_size ({total}) with num_workers={workers}"
        fail_value(
            "iter_batches",
            "the state's global_batch_size",
            saved_total,
            what,
            world_fix,
        )
    entries: list[Entry] = state["workers"]
    for entry in entries:
        if isinstance(entry, dict) and entry["seen"] % total:
            what = f"a multiple of this loader's total_batch_size ({total})"
            seen = entry["seen"]
            fail_value("iter_batches", "a worker's samples read", seen, what, world_fix)
    return entries, int(state["next"])
