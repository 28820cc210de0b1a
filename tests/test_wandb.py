"""Tests for WandbTracker: offline runs read back from W&B's own run file, gating."""

from __future__ import annotations

import importlib
import json
import struct
import sys
import time
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from funcaccel.context import DistributedContext
from funcaccel.testing import run_ranks
from funcaccel.tracking import WandbTracker
from funcaccel.tracking import finish_trackers
from funcaccel.tracking import log_metrics
from funcaccel.tracking import store_config
from tests.fixtures import rank_ctx

SINGLE = DistributedContext()


def _any(value: object) -> Any:
    """Pass a value of the wrong type past mypy, as an untyped caller would."""
    return value


@pytest.fixture(autouse=True)
def _stop_wandb_service() -> Iterator[None]:
    """Stop W&B's service after each test: wandb records it in WANDB_SERVICE."""
    yield
    if sys.modules.get("wandb") is not None:
        import wandb

        wandb.teardown()


# ---------------------------------------------------------------- reading a run

# A ``.wandb`` file is a LevelDB-style log: a 7-byte header (":W&B", magic,
# version), then 32 KiB blocks of chunks, each with a 7-byte header (crc32c,
# length, type: 1 full, 2 first, 3 middle, 4 last) and a serialized ``Record``.
_BLOCK = 32 * 1024
_CHUNK_HEADER = struct.Struct("<IHB")


def _records(run_file: Path) -> list[Any]:
    """Return the protobuf records W&B wrote to ``run_file``, in order."""
    pb = importlib.import_module("wandb.proto.wandb_internal_pb2")
    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records: list[Any] = []
    pending = b""
    position = 7
    while position + _CHUNK_HEADER.size <= len(data):
        left = _BLOCK - position % _BLOCK
        if left < _CHUNK_HEADER.size:  # the rest of a block is padding
            position += left
            continue
        _, length, kind = _CHUNK_HEADER.unpack_from(data, position)
        start = position + _CHUNK_HEADER.size
        if start + length > len(data):  # a chunk still being written
            break
        chunk, position = data[start : start + length], start + length
        if kind in (1, 2):
            pending = chunk
        else:
            pending += chunk
        if kind in (1, 4):
            records.append(pb.Record.FromString(pending))
    return records


def _kind(record: Any) -> str | None:
    kind: str | None = record.WhichOneof("record_type")
    return kind


def _key(item: Any) -> str:
    """An item's key: W&B writes some keys as a path in ``nested_key``."""
    key: str = item.key or "/".join(item.nested_key)
    return key


def _read_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]], Any]:
    """Return the run's config, its history rows (W&B's own keys dropped), its run."""
    (run_file,) = run_dir.glob("run-*.wandb")
    # W&B's service process writes the file; its last record (exit) may land a
    # moment after run.finish() has returned.
    deadline = time.monotonic() + 30.0
    records = _records(run_file)
    while not records or _kind(records[-1]) != "exit":
        assert time.monotonic() < deadline, [_kind(r) for r in records]
        time.sleep(0.1)
        records = _records(run_file)
    config: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    run = None
    for record in records:
        kind = _kind(record)
        if kind == "run":
            run = record.run
        elif kind == "config":
            config.update(
                {_key(i): json.loads(i.value_json) for i in record.config.update}
            )
        elif kind == "history":
            row = {_key(i): json.loads(i.value_json) for i in record.history.item}
            history.append(
                {k: v for k, v in row.items() if not k.startswith("_")}
                | {"_step": row["_step"]}
            )
    assert run is not None, [_kind(r) for r in records]
    return config, history, run


# ---------------------------------------------------------------- tests


def test_wandb_tracker_names_the_extra_when_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(
        ImportError,
        match=r"WandbTracker: the wandb package is not installed; .*pip install "
        r"'funcaccel\[wandb\]'",
    ):
        WandbTracker(tmp_path)


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda d: WandbTracker(_any(3)), TypeError, r"dir must be a str or os.Path"),
        (lambda d: WandbTracker(""), ValueError, r"dir must be non-empty; got ''"),
        (
            lambda d: WandbTracker(d, project=""),
            ValueError,
            r"project must be non-empty",
        ),
        (
            lambda d: WandbTracker(d, run_name=_any(1)),
            TypeError,
            r"run_name must be a str; got 1 \(int\)",
        ),
        (
            lambda d: WandbTracker(d, mode=_any("offine")),
            ValueError,
            r"mode must be one of \['online', 'offline', 'disabled'\] .* got 'offine'",
        ),
        (lambda d: WandbTracker(d, mode=_any(0)), TypeError, r"mode must be a str"),
        (
            lambda d: WandbTracker(d, init_kwargs={"dir": "x"}),
            ValueError,
            r"every key of init_kwargs must be an argument the tracker does not set "
            r"itself; got 'dir'\. The tracker sets 'dir' from the tracker's dir\.",
        ),
        (
            lambda d: WandbTracker(d, init_kwargs=_any(["entity"])),
            TypeError,
            r"init_kwargs must be a mapping .* got \['entity'\] \(list\)",
        ),
        (
            lambda d: WandbTracker(d, main_process_only=_any(1)),
            TypeError,
            r"main_process_only must be a bool; got 1 \(int\)",
        ),
    ],
)
def test_wandb_tracker_rejects_bad_arguments(
    tmp_path: Path,
    build: Callable[[Path], object],
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=rf"WandbTracker: {match}"):
        build(tmp_path)


def test_wandb_tracker_on_a_non_main_rank_writes_nothing(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    tracker = WandbTracker(tmp_path / "runs", mode="offline")
    store_config(rank_ctx(2, 1), [tracker], {"lr": 0.1})
    log_metrics(rank_ctx(2, 1), [tracker], {"loss": 0.5}, step=3)
    finish_trackers(rank_ctx(2, 1), [tracker])
    assert (tracker.run_id, tracker.run_dir, list(tmp_path.iterdir())) == (
        None,
        None,
        [],
    )


@pytest.mark.slow
def test_wandb_tracker_offline_run_read_back(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    tracker = WandbTracker(
        tmp_path / "runs",
        project="read-back",
        run_name="first",
        mode="offline",
        init_kwargs={"tags": ["smoke"]},
    )
    store_config(SINGLE, [tracker], {"lr": 0.1, "opt": "adam", "sched": None})
    log_metrics(
        SINGLE, [tracker], {"loss": _any(torch.tensor(0.5)), "note": "hi"}, step=3
    )
    log_metrics(SINGLE, [tracker], {"acc": 0.75}, step=3)  # merged into step 3
    log_metrics(SINGLE, [tracker], {"loss": 0.25, "flag": True}, step=4)
    with pytest.raises(
        ValueError,
        match=r"WandbTracker.log: step must be >= the run's current step 4; got 2\. "
        r"W&B drops such records",
    ):
        tracker.log({"loss": 9.0}, step=2)
    with pytest.raises(
        ValueError, match=r"WandbTracker.log: value 'loss' must be one number"
    ):
        tracker.log({"loss": torch.ones(2)})
    store_config(SINGLE, [tracker], {"lr": 0.2})  # later values win
    finish_trackers(SINGLE, [tracker])
    finish_trackers(SINGLE, [tracker])  # twice is harmless
    with pytest.raises(ValueError, match="WandbTracker.log: the tracker was finished"):
        tracker.log({"loss": 1.0})

    run_dir = tracker.run_dir
    assert run_dir is not None and tracker.run_id is not None
    assert run_dir.parent == tmp_path / "runs" / "wandb"
    assert run_dir.name.startswith("offline-run-") and run_dir.name.endswith(
        tracker.run_id
    )
    config, history, run = _read_run(run_dir)
    assert (run.run_id, run.project, run.display_name, list(run.tags)) == (
        tracker.run_id,
        "read-back",
        "first",
        ["smoke"],
    )
    assert {k: v for k, v in config.items() if k != "_wandb"} == {
        "lr": 0.2,
        "opt": "adam",
        "sched": None,
    }
    assert history == [
        {"loss": 0.5, "note": "hi", "acc": 0.75, "_step": 3},
        {"loss": 0.25, "flag": True, "_step": 4},
    ]


def _log_with_wandb(ctx: DistributedContext, out: Path) -> str | None:
    tracker = WandbTracker(out, run_name="gated", mode="offline")
    store_config(ctx, [tracker], {"world": ctx.num_processes})
    log_metrics(ctx, [tracker], {"rank": ctx.process_index}, step=1)
    finish_trackers(ctx, [tracker])
    return tracker.run_id


@pytest.mark.distributed
@pytest.mark.slow
def test_wandb_tracker_on_two_processes_writes_from_rank_zero(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    out = tmp_path / "runs"
    run_ids = run_ranks(_log_with_wandb, 2, out, start_method="forkserver")
    assert run_ids[0] is not None and run_ids[1] is None
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    config, history, run = _read_run(run_dir)
    assert run.run_id == run_ids[0]
    assert config["world"] == 2
    assert history == [{"rank": 0, "_step": 1}]
