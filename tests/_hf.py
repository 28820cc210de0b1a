"""Local Hugging Face ``datasets`` for the data tests: JSON Lines files, no network.

``datasets`` is an optional extra: test modules call ``pytest.importorskip`` before
using these helpers, which import it only when called.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def write_jsonl(root: Path, samples: int, shards: int) -> list[str]:
    """Write samples ``0..samples-1`` as ``{"id": i, "x": [i / 10, -i]}`` in ``shards`` files.

    File ``s`` holds a contiguous part of the ids, so that reading the files in
    order reads the ids in order.
    """
    root.mkdir(parents=True, exist_ok=True)
    per = -(-samples // shards)
    files = []
    for shard in range(shards):
        ids = range(shard * per, min(samples, (shard + 1) * per))
        path = root / f"part{shard}.jsonl"
        lines = (json.dumps({"id": i, "x": [i / 10, -i]}) + "\n" for i in ids)
        path.write_text("".join(lines))
        files.append(str(path))
    return files


def hf_stream(
    files: list[str], cache: Path, on_read: Callable[[int], None] | None = None
) -> Any:
    """The files as a streaming ``datasets.IterableDataset``, formatted to torch.

    ``on_read(id)`` is called for every sample the stream reads (through ``map``).
    """
    import datasets

    ds = datasets.load_dataset(
        "json", data_files=files, split="train", streaming=True, cache_dir=str(cache)
    )
    if on_read is not None:
        ds = ds.map(_Reads(on_read))
    return ds.with_format("torch")


class _Reads:
    """A ``map`` function that reports each sample's id (picklable for workers)."""

    def __init__(self, on_read: Callable[[int], None]) -> None:
        self.on_read = on_read

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        self.on_read(int(example["id"]))
        return example


def hf_table(samples: int) -> Any:
    """Samples ``0..samples-1`` as a map-style ``datasets.Dataset``, formatted to torch."""
    import datasets

    ids = list(range(samples))
    table = {"id": ids, "x": [[i / 10, -i] for i in ids]}
    return datasets.Dataset.from_dict(table).with_format("torch")


@pytest.fixture
def scipy_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Let the first streaming ``load_dataset`` set KMP_DUPLICATE_LIB_OK.

    ``datasets`` imports ``scipy.io`` for streaming, and that imports threadpoolctl,
    which sets this variable at import (``os.environ.setdefault``); setting it here
    first means the suite's leak check sees no change.
    """
    monkeypatch.setenv("KMP_DUPLICATE_LIB_OK", "True")
    yield


class FileReads:
    """An ``on_read`` that appends each id to a file: counts reads in worker processes too."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, sample_id: int) -> None:
        with self.path.open("a") as out:
            out.write(f"{sample_id}\n")

    def ids(self) -> list[int]:
        """The ids read so far, in the order the processes wrote them."""
        if not self.path.exists():
            return []
        return [int(line) for line in self.path.read_text().split()]
