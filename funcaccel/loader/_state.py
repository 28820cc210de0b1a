"""The values ``iter_batches`` threads and yields: ``LoaderState`` and ``Batch``.

``LoaderState`` is what a checkpoint stores to resume a loader (docs/loader.md#semantics-resuming-from-a-loaderstate); a
``Batch`` is one record of ``iter_batches``, whose ``state`` is the ``LoaderState``
to resume from after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Final

from funcaccel._checks import check_int
from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel.loader._json import json_copy

__all__ = ["START", "Batch", "LoaderState", "make_batch"]

_FIX: Final = "Pass the dict LoaderState.to_dict() returned."
_FIX_START: Final = "Leave stream_state out at an epoch start: LoaderState(epoch=e)."


@dataclass(frozen=True, slots=True, kw_only=True)
class LoaderState:
    """Where a loader stands in its epochs; the value a checkpoint stores.

    Args:
        epoch: The epoch to iterate (>= 0).
        global_batches: Global batches of that epoch already consumed (>= 0).
        global_batch_size: The global batch size ``G`` they were counted in; 0
            means "the resuming loader's ``total_batch_size``".
        stream_state: A stateful stream's own ``state_dict()`` after those
            samples (JSON values, deep-copied), so that a resume loads it instead
            of reading the samples again; ``None`` for any other loader
            (docs/data.md#resuming-a-stream).
        stream_ranks: The data-parallel ranks of the loader that saved
            ``stream_state`` (>= 1 with it, 0 without).

    Raises:
        TypeError: A field of the wrong type.
        ValueError: A negative field, a ``stream_state`` without ``stream_ranks``
            or with ``global_batches=0``, or ``stream_ranks`` without it.

    >>> state = LoaderState(epoch=2, global_batches=5, global_batch_size=64)
    >>> LoaderState.from_dict(state.to_dict()) == state
    True
    >>> LoaderState(epoch=-1)
    Traceback (most recent call last):
    ...
    ValueError: LoaderState: epoch (-1) must be >= 0; pass a larger value.
    """

    epoch: int = 0
    global_batches: int = 0
    global_batch_size: int = 0
    # left out of the hash (a dict is not hashable); equality still compares it
    stream_state: Any = field(default=None, hash=False)
    stream_ranks: int = 0

    def __post_init__(self) -> None:
        for name in ("epoch", "global_batches", "global_batch_size", "stream_ranks"):
            check_int("LoaderState", name, getattr(self, name), 0)
        if self.stream_state is None:
            if self.stream_ranks:
                what = "0 when stream_state is None"
                fail_value("LoaderState", "stream_ranks", self.stream_ranks, what)
            return
        state = json_copy("LoaderState", "stream_state", self.stream_state)
        object.__setattr__(self, "stream_state", state)
        if self.stream_ranks < 1:
            what = ">= 1 (the data-parallel ranks that saved stream_state)"
            fail_value("LoaderState", "stream_ranks", self.stream_ranks, what)
        if self.global_batches == 0:
            what = ">= 1 when stream_state is set (it is the position after them)"
            fail_value("LoaderState", "global_batches", 0, what, _FIX_START)

    def __repr__(self) -> str:
        # The stream's fields only when set: the common state reads as before.
        text = (
            f"LoaderState(epoch={self.epoch}, global_batches={self.global_batches}, "
            f"global_batch_size={self.global_batch_size}"
        )
        if self.stream_state is None:
            return text + ")"
        return (
            f"{text}, stream_state={self.stream_state!r}, "
            f"stream_ranks={self.stream_ranks})"
        )

    def to_dict(self) -> dict[str, Any]:
        """Return the state as a plain JSON-able dict (the stream's keys only when set).

        >>> LoaderState(epoch=1).to_dict()
        {'epoch': 1, 'global_batches': 0, 'global_batch_size': 0}
        """
        data: dict[str, Any] = {
            "epoch": self.epoch,
            "global_batches": self.global_batches,
            "global_batch_size": self.global_batch_size,
        }
        if self.stream_state is not None:
            data["stream_state"] = json_copy(
                "LoaderState.to_dict", "stream_state", self.stream_state
            )
            data["stream_ranks"] = self.stream_ranks
        return data

    @classmethod
    def from_dict(cls, data: object) -> LoaderState:
        """Rebuild a state from ``to_dict()``'s output; ``data`` is not modified.

        Raises:
            TypeError: ``data`` is not a dict, or a value is not an int.
            ValueError: ``data`` lacks a key or has an unknown one, or a value is
                negative.
        """
        what = "a dict from LoaderState.to_dict()"
        data = check_type("LoaderState.from_dict", "data", data, dict, what=what)
        expected = {"epoch", "global_batches", "global_batch_size"}
        streamed = expected | {"stream_state", "stream_ranks"}
        keys = sorted(map(str, data))
        what = f"exactly {sorted(expected)} or {sorted(streamed)}"
        if set(data) != expected and set(data) != streamed:
            fail_value("LoaderState.from_dict", "the keys of data", keys, what, _FIX)
        return cls(
            epoch=data["epoch"],
            global_batches=data["global_batches"],
            global_batch_size=data["global_batch_size"],
            stream_state=data.get("stream_state"),
            stream_ranks=data.get("stream_ranks", 0),
        )


START: Final = LoaderState()


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    """One batch of ``iter_batches``, with where it stands in the epoch.

    Attributes:
        data: This rank's batch, on the device when ``put_on_device``.
        index: The global batch index within the epoch (skipped ones counted).
        is_last: Whether this is the last batch this rank yields in the epoch.
        remainder: Real samples in the epoch's last global batch: ``n % G`` (0 when
            complete), -1 with ``drop_last`` or when unknown (docs/loader.md#semantics-building-a-sharded-loader and docs/loader.md#semantics-dispatch-mode).
        epoch: The epoch this batch belongs to.
        total_batch_size: The loader's global batch size ``G`` (``None`` if dynamic).
        stream_state: A stateful stream's ``state_dict()`` after this global batch
            (``None`` for other loaders); ``state`` carries it.
        stream_ranks: The data-parallel ranks of the loader (0 without a stream state).
    """

    data: Any
    index: int
    is_last: bool
    remainder: int
    epoch: int
    total_batch_size: int | None
    stream_state: Any = None
    stream_ranks: int = 0

    @property
    def state(self) -> LoaderState:
        """The state to resume from after this batch (the next epoch after the last).

        >>> Batch(data=None, index=2, is_last=False, remainder=4, epoch=0, total_batch_size=6).state
        LoaderState(epoch=0, global_batches=3, global_batch_size=6)
        """
        if self.is_last:
            return LoaderState(epoch=self.epoch + 1)
        return LoaderState(
            epoch=self.epoch,
            global_batches=self.index + 1,
            global_batch_size=self.total_batch_size or 0,
            stream_state=self.stream_state,
            stream_ranks=self.stream_ranks if self.stream_state is not None else 0,
        )


# The slots of Batch, set directly: the dataclass's __init__ sets frozen fields one
# by one through object.__setattr__, which costs about 1 us per batch in the
# iter_batches hot path (measured); Batch has no __post_init__, so this builds the
# same value.
_SET_DATA, _SET_INDEX, _SET_IS_LAST, _SET_REMAINDER, _SET_EPOCH, _SET_TOTAL = (
    getattr(Batch, name).__set__
    for name in ("data", "index", "is_last", "remainder", "epoch", "total_batch_size")
)
_SET_STREAM, _SET_RANKS = (
    getattr(Batch, name).__set__ for name in ("stream_state", "stream_ranks")
)


def make_batch(
    data: Any,
    index: int,
    is_last: bool,
    remainder: int,
    epoch: int,
    total_batch_size: int | None,
    stream_state: Any = None,
    stream_ranks: int = 0,
) -> Batch:
    """Return ``Batch(data=data, index=index, ...)``, built faster.

    >>> make_batch([1], 0, True, -1, 2, 4) == Batch(
    ...     data=[1], index=0, is_last=True, remainder=-1, epoch=2, total_batch_size=4
    ... )
    True
    """
    batch = object.__new__(Batch)
    _SET_DATA(batch, data)
    _SET_INDEX(batch, index)
    _SET_IS_LAST(batch, is_last)
    _SET_REMAINDER(batch, remainder)
    _SET_EPOCH(batch, epoch)
    _SET_TOTAL(batch, total_batch_size)
    _SET_STREAM(batch, stream_state)
    _SET_RANKS(batch, stream_ranks)
    return batch
