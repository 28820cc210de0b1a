"""Sharded data loading: ``shard_loader``, ``iter_batches``, ``LoaderState``.

``_loader.py`` holds the public functions; ``_setup.py`` the decision procedure run
once per loader; ``_state.py`` the values threaded and yielded; ``_indices.py`` where
each epoch's indices come from; ``_reading.py`` how batches are read;
``_stream.py`` one epoch as a stream of batches; ``_dispatch.py`` dispatch mode;
``_placement.py`` device placement. A stateful stream (``state_dict`` /
``load_state_dict``, as a ``datasets.IterableDataset``) is read through
``_stateful.py`` (global batches tagged with the stream's state),
``_stream_records.py`` (its records) and, with worker processes, ``_workers.py``
(one resumable order of their batches); ``_json.py`` checks a state is JSON. The
rules are in docs/loader.md and docs/data.md.
"""

from __future__ import annotations

from funcaccel._typing import RngType
from funcaccel.loader._loader import ShardedLoader
from funcaccel.loader._loader import iter_batches
from funcaccel.loader._loader import shard_loader
from funcaccel.loader._placement import send_to_device
from funcaccel.loader._state import Batch
from funcaccel.loader._state import LoaderState

__all__ = [
    "Batch",
    "iter_batches",
    "LoaderState",
    "send_to_device",
    "shard_loader",
    "RngType",
    "ShardedLoader",
]
