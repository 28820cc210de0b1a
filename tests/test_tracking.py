"""Tests for tracker gating (docs/tracking.md#semantics-trackers-and-gating) and the built-in trackers."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from funcaccel.context import DistributedContext
from funcaccel.testing import run_ranks
from funcaccel.tracking import CSVTracker
from funcaccel.tracking import InMemoryTracker
from funcaccel.tracking import JSONLTracker
from funcaccel.tracking import MLflowTracker
from funcaccel.tracking import TensorBoardTracker
from funcaccel.tracking import Tracker
from funcaccel.tracking import TrackerBase
from funcaccel.tracking import WandbTracker
from funcaccel.tracking import finish_trackers
from funcaccel.tracking import log_metrics
from funcaccel.tracking import normalize_config
from funcaccel.tracking import normalize_metrics
from funcaccel.tracking import store_config
from funcaccel.tracking import trackers_from_names
from funcaccel.tracking._wandb_ready import wandb_can_start
from tests.fixtures import rank_ctx

SINGLE = DistributedContext()


class _Recorder:
    """A user tracker with no main_process_only attribute; records every call."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[str, object, object]] = []

    def log(
        self, values: Mapping[str, float | int | str], step: int | None = None
    ) -> None:
        self.calls.append(("log", values, step))

    def store_init_configuration(self, values: Mapping[str, object]) -> None:
        self.calls.append(("config", values, None))

    def finish(self) -> None:
        self.calls.append(("finish", None, None))


def _clock() -> float:
    return 1234.5


# ---------------------------------------------------------------- gating


def test_recorder_and_builtins_satisfy_the_protocol(tmp_path: Path) -> None:
    trackers = [_Recorder(), InMemoryTracker(), JSONLTracker(tmp_path / "m.jsonl")]
    assert all(isinstance(t, Tracker) for t in trackers)


def test_helpers_call_every_tracker_with_one_process() -> None:
    recorder, memory = _Recorder(), InMemoryTracker()
    values = {"loss": 0.5}
    config = {"lr": 0.1}
    log_metrics(SINGLE, [recorder, memory], values, step=3)
    store_config(SINGLE, [recorder, memory], config)
    finish_trackers(SINGLE, [recorder, memory])
    assert recorder.calls == [
        ("log", values, 3),
        ("config", config, None),
        ("finish", None, None),
    ]
    assert recorder.calls[0][1] is values and recorder.calls[1][1] is config
    assert [(r.step, r.values) for r in memory.logs] == [(3, {"loss": 0.5})]
    assert memory.config == {"lr": 0.1} and memory.finished


@pytest.mark.parametrize(("rank", "called"), [(0, True), (1, False), (2, False)])
def test_main_process_only_trackers_run_on_rank_zero_only(
    rank: int, called: bool
) -> None:
    recorder = _Recorder()
    ctx = rank_ctx(3, rank)
    log_metrics(ctx, [recorder], {"loss": 0.5}, step=3)
    store_config(ctx, [recorder], {"lr": 0.1})
    finish_trackers(ctx, [recorder])
    assert len(recorder.calls) == (3 if called else 0)


def test_every_rank_tracker_runs_on_other_ranks() -> None:
    everywhere = InMemoryTracker(main_process_only=False)
    main_only = InMemoryTracker()
    log_metrics(rank_ctx(2, 1), [everywhere, main_only], {"loss": 0.5})
    assert [(r.step, r.values) for r in everywhere.logs] == [(None, {"loss": 0.5})]
    assert main_only.logs == ()


def test_helpers_stop_at_the_tracker_that_raises_but_finish_reaches_all() -> None:
    class Broken(_Recorder):
        def finish(self) -> None:
            raise OSError("disk gone")

    first, last = Broken(), _Recorder()
    with pytest.raises(OSError, match="disk gone"):
        finish_trackers(SINGLE, [first, last])
    assert last.calls == [("finish", None, None)]


def _any(value: object) -> Any:
    """Pass a value of the wrong type past mypy, as an untyped caller would."""
    return value


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: log_metrics(_any("ctx"), [], {}),
            TypeError,
            r"log_metrics: ctx must be a DistributedContext; got 'ctx'",
        ),
        (
            lambda: log_metrics(SINGLE, _any(InMemoryTracker()), {}),
            TypeError,
            r"Wrap a single tracker in a list",
        ),
        (
            lambda: store_config(SINGLE, [_any(object())], {}),
            TypeError,
            r"store_config: trackers\[0\] must be a Tracker \(with name, log, "
            r"store_init_configuration and finish\); got <object .*",
        ),
        (
            lambda: log_metrics(SINGLE, [], _any([("loss", 1.0)])),
            TypeError,
            r"values must be a mapping .* got \[\('loss', 1.0\)\]",
        ),
        (
            lambda: log_metrics(SINGLE, [], {}, step=True),
            TypeError,
            r"step must be an int or None; got True",
        ),
        (
            lambda: log_metrics(SINGLE, [], {}, step=-1),
            ValueError,
            r"log_metrics: step \(-1\) must be >= 0",
        ),
        (
            lambda: finish_trackers(SINGLE, _any(3)),
            TypeError,
            r"finish_trackers: trackers must be a list .* got 3",
        ),
    ],
)
def test_helpers_reject_bad_arguments(
    call: Callable[[], None], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        call()


def test_helpers_reject_non_bool_main_process_only() -> None:
    odd = _Recorder()
    odd.main_process_only = "yes"  # type: ignore[attr-defined]
    with pytest.raises(
        TypeError,
        match=r"the main_process_only of trackers\[0\] \(recorder\) must be a bool; "
        r"got 'yes' \(str\)",
    ):
        log_metrics(SINGLE, [odd], {"loss": 1.0})
    assert odd.calls == []


def _log_on_each_rank(ctx: DistributedContext, out: Path) -> list[int | None]:
    everywhere = InMemoryTracker(main_process_only=False)
    trackers: list[Tracker] = [JSONLTracker(out / "metrics.jsonl"), everywhere]
    log_metrics(ctx, trackers, {"rank": ctx.process_index}, step=ctx.process_index)
    finish_trackers(ctx, trackers)
    return [record.step for record in everywhere.logs]


@pytest.mark.distributed
def test_log_metrics_on_two_processes_writes_from_rank_zero(tmp_path: Path) -> None:
    steps = run_ranks(_log_on_each_rank, 2, tmp_path, start_method="forkserver")
    assert steps == [[0], [1]]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["rank"] for line in lines] == [0]


# ---------------------------------------------------------------- values


def test_normalize_metrics_unwraps_scalars() -> None:
    values = {
        "t": torch.tensor([[2.5]]),
        "i": torch.tensor(7),
        "np_f": np.float32(0.25),
        "np_i": np.int64(4),
        "flag": True,
        "name": "x",
    }
    out = normalize_metrics(values)
    assert out == {"t": 2.5, "i": 7, "np_f": 0.25, "np_i": 4, "flag": True, "name": "x"}
    assert [type(v) for v in out.values()] == [float, int, float, int, bool, str]
    assert isinstance(values["t"], torch.Tensor)  # the input is unchanged


@given(
    st.dictionaries(
        st.text(), st.one_of(st.integers(), st.floats(allow_nan=False), st.text())
    )
)
def test_normalize_metrics_keeps_plain_values(
    values: dict[str, int | float | str],
) -> None:
    out = normalize_metrics(values)
    assert out == values and out is not values


@pytest.mark.parametrize(
    ("values", "error", "match"),
    [
        (
            {"loss": torch.ones(3)},
            ValueError,
            r"value 'loss' must be one number; got tensor\(shape=\(3,\), "
            r"dtype=torch\.float32\)\. Log a single number",
        ),
        (
            {"loss": torch.ones(0)},
            ValueError,
            r"must be one number; got tensor\(shape=\(0,\)",
        ),
        (
            {"loss": [1.0]},
            TypeError,
            r"value 'loss' must be an int, .*; got \[1.0\] \(list\)",
        ),
        ({"loss": None}, TypeError, r"value 'loss' must be .*; got None \(NoneType\)"),
        ({"loss": 1j}, TypeError, r"\(complex\)"),
        ({1: 1.0}, TypeError, r"every key must be a str; got 1 \(int\)"),
    ],
)
def test_normalize_metrics_rejects_bad_values(
    values: dict[Any, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        normalize_metrics(values, caller="X.log")


def test_normalize_config_accepts_none_and_rejects_containers() -> None:
    assert normalize_config({"a": None, "b": torch.tensor(1.5)}) == {
        "a": None,
        "b": 1.5,
    }
    with pytest.raises(
        TypeError, match=r"configuration value 'betas' is \(0.9, 0.99\) .*str\(betas\)"
    ):
        normalize_config({"betas": (0.9, 0.99)})


# ---------------------------------------------------------------- file trackers


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_in_memory_tracker_refuses_records_after_finish() -> None:
    tracker = InMemoryTracker(name="mem")
    tracker.finish()
    with pytest.raises(
        ValueError, match=r"InMemoryTracker.log: the tracker was finished"
    ):
        tracker.log({"loss": 1.0})
    with pytest.raises(ValueError, match="name must be non-empty; got ''"):
        InMemoryTracker(name="")


FileTracker = Callable[[Path], JSONLTracker | CSVTracker]
FILE_TRACKERS: dict[str, FileTracker] = {
    "jsonl": lambda d: JSONLTracker(d / "sub" / "m.jsonl"),
    "csv": lambda d: CSVTracker(d / "sub" / "m.csv"),
}


@pytest.mark.parametrize("kind", sorted(FILE_TRACKERS))
def test_file_trackers_touch_nothing_before_first_gated_call(
    tmp_path: Path, kind: str
) -> None:
    tracker = FILE_TRACKERS[kind](tmp_path)
    log_metrics(rank_ctx(2, 1), [tracker], {"loss": 1.0})
    finish_trackers(rank_ctx(2, 1), [tracker])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", sorted(FILE_TRACKERS))
@pytest.mark.parametrize(
    ("bad", "error"), [(torch.ones(2), ValueError), (object(), TypeError)]
)
def test_file_trackers_reject_bad_values_before_writing(
    tmp_path: Path, kind: str, bad: object, error: type[Exception]
) -> None:
    tracker = FILE_TRACKERS[kind](tmp_path)
    with pytest.raises(error, match=r"Tracker.log: value 'loss'"):
        tracker.log({"loss": bad})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", sorted(FILE_TRACKERS))
def test_file_trackers_name_an_unwritable_path(tmp_path: Path, kind: str) -> None:
    (tmp_path / "sub").write_text("a file where a directory should be")
    tracker = FILE_TRACKERS[kind](tmp_path)
    with pytest.raises(OSError, match=r"Tracker: cannot open '.*sub/m\.\w+'"):
        tracker.log({"loss": 1.0})


@pytest.mark.parametrize("kind", sorted(FILE_TRACKERS))
def test_file_trackers_reject_bad_steps(tmp_path: Path, kind: str) -> None:
    tracker = FILE_TRACKERS[kind](tmp_path)
    with pytest.raises(ValueError, match=r"Tracker.log: step \(-2\) must be >= 0"):
        tracker.log({"loss": 1.0}, step=-2)
    with pytest.raises(TypeError, match=r"Tracker.log: step must be an int .* 1.5"):
        tracker.log({"loss": 1.0}, step=_any(1.5))
    assert list(tmp_path.iterdir()) == []


def test_importing_the_trackers_loads_no_optional_backend() -> None:
    code = (
        "import sys, funcaccel, funcaccel.tracking\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('tensorboard', 'mlflow', 'wandb') "
        "or m.startswith('torch.utils.tensorboard')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr


def test_jsonl_tracker_writes_one_object_per_log(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    tracker = JSONLTracker(path, clock=_clock)
    store_config(SINGLE, [tracker], {"lr": 0.1, "sched": None})
    tracker.log({"loss": torch.tensor(0.5), "tag": "a"}, step=1)
    log_metrics(SINGLE, [tracker], {"loss": float("nan")})
    # Each record is flushed at once: readable before finish().
    records = _jsonl(path)
    assert records[:2] == [
        {"config": {"lr": 0.1, "sched": None}, "time": 1234.5},
        {"step": 1, "time": 1234.5, "loss": 0.5, "tag": "a"},
    ]
    assert records[2]["step"] is None and math.isnan(records[2]["loss"])
    finish_trackers(SINGLE, [tracker])
    finish_trackers(SINGLE, [tracker])  # twice is harmless
    with pytest.raises(ValueError, match=r"JSONLTracker.log: the tracker was finished"):
        tracker.log({"loss": 1.0})


def test_jsonl_tracker_appends_to_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    for step in (0, 1):
        tracker = JSONLTracker(path, clock=_clock)
        tracker.log({"loss": float(step)}, step=step)
        tracker.finish()
    assert [r["step"] for r in _jsonl(path)] == [0, 1]


@pytest.mark.parametrize("key", ["step", "time", "config"])
def test_jsonl_tracker_rejects_reserved_keys(tmp_path: Path, key: str) -> None:
    with pytest.raises(
        ValueError,
        match=rf"every metric name must be other than .*; got '{key}'\. Rename",
    ):
        JSONLTracker(tmp_path / "m.jsonl").log({key: 1})
    assert list(tmp_path.iterdir()) == []


def _csv(path: Path) -> list[list[str]]:
    with path.open(newline="") as handle:
        return list(csv.reader(handle))


def test_csv_tracker_fixes_columns_at_first_log(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    tracker = CSVTracker(path, clock=_clock)
    tracker.log({"loss": 0.5, "acc": torch.tensor([0.75])}, step=0)
    tracker.log({"acc": 1.0})
    with pytest.raises(
        ValueError,
        match=r"every metric must be a column of its own \(the columns are "
        r"\['step', 'time', 'loss', 'acc'\]\); got 'lr'\. Log every metric",
    ):
        tracker.log({"loss": 0.1, "lr": 0.01}, step=2)
    tracker.finish()
    assert tracker.columns == ("step", "time", "loss", "acc")
    assert _csv(path) == [
        ["step", "time", "loss", "acc"],
        ["0", "1234.5", "0.5", "0.75"],
        ["", "1234.5", "", "1.0"],
    ]


def test_csv_tracker_resumes_with_the_existing_header(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    first = CSVTracker(path, clock=_clock)
    first.log({"loss": 1.0, "note": "a, b"}, step=0)
    first.finish()
    second = CSVTracker(path, clock=_clock)
    second.log({"note": "c"}, step=1)
    second.finish()
    assert _csv(path) == [
        ["step", "time", "loss", "note"],
        ["0", "1234.5", "1.0", "a, b"],
        ["1", "1234.5", "", "c"],
    ]


def test_csv_tracker_refuses_a_foreign_csv(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    path.write_text("epoch,loss\n0,1.0\n")
    with pytest.raises(
        ValueError,
        match=r"the header of '.*m\.csv' must be a row starting with 'step', 'time'; "
        r"got \['epoch', 'loss'\]\. Pass a new path",
    ):
        CSVTracker(path).log({"loss": 1.0})
    assert path.read_text() == "epoch,loss\n0,1.0\n"


def test_csv_tracker_merges_configuration_into_a_json_file(tmp_path: Path) -> None:
    tracker = CSVTracker(tmp_path / "m.csv")
    assert tracker.config_path == tmp_path / "m.config.json"
    tracker.store_init_configuration({"lr": 0.1, "opt": "adam"})
    tracker.store_init_configuration({"lr": 0.2, "sched": None})
    stored = json.loads(tracker.config_path.read_text())
    assert stored == {"lr": 0.2, "opt": "adam", "sched": None}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.config.json"]
    tracker.config_path.write_text("[1, 2]")
    with pytest.raises(
        ValueError,
        match=r"m\.config\.json' must be a JSON object; got .*\. Move it away",
    ):
        tracker.store_init_configuration({"lr": 0.3})


def test_file_trackers_reject_path_of_wrong_type() -> None:
    with pytest.raises(
        TypeError, match=r"JSONLTracker: path must be a str or os.PathLike; got 3"
    ):
        JSONLTracker(3)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"CSVTracker: main_process_only must be a bool"
    ):
        CSVTracker("m.csv", main_process_only=1)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"JSONLTracker: clock must be a callable .* 0.0"
    ):
        JSONLTracker("m.jsonl", clock=_any(0.0))


# ---------------------------------------------------------------- TensorBoard


def test_tensorboard_tracker_names_the_extra_when_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'funcaccel\[tensorboard\]'"):
        TensorBoardTracker(tmp_path)


def test_tensorboard_tracker_writes_events_read_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # type: ignore[import-untyped]
    from tensorboard.plugins.hparams import plugin_data_pb2  # type: ignore[import-untyped]

    logdir = tmp_path / "run"
    tracker = TensorBoardTracker(logdir)
    log_metrics(rank_ctx(2, 1), [tracker], {"loss": 1.0})
    assert not logdir.exists()  # nothing before the first gated call
    store_config(SINGLE, [tracker], {"lr": 0.1, "opt": "adam", "sched": None})
    log_metrics(
        SINGLE, [tracker], {"loss": _any(torch.tensor(0.5)), "note": "hi"}, step=3
    )
    log_metrics(SINGLE, [tracker], {"loss": 0.25}, step=4)
    with pytest.raises(
        ValueError, match=r"TensorBoardTracker.log: value 'loss' must be one number"
    ):
        tracker.log({"loss": torch.ones(2)})
    finish_trackers(SINGLE, [tracker])
    events = EventAccumulator(str(logdir))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(3, 0.5), (4, 0.25)]
    (text,) = events.Tensors("note/text_summary")
    assert (text.step, text.tensor_proto.string_val) == (3, [b"hi"])
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    assert start.hparams["lr"].number_value == 0.1
    assert start.hparams["opt"].string_value == "adam"
    assert start.hparams["sched"].string_value == "None"
    with pytest.raises(
        ValueError, match="TensorBoardTracker.log: the tracker was finished"
    ):
        tracker.log({"loss": 1.0})


def test_tensorboard_tracker_names_an_unwritable_logdir(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    (tmp_path / "file").write_text("x")
    tracker = TensorBoardTracker(tmp_path / "file" / "run")
    with pytest.raises(
        OSError,
        match=r"TensorBoardTracker: cannot create the event file in '.*file/run'",
    ):
        tracker.log({"loss": 1.0})


# ---------------------------------------------------------------- TrackerBase


class _ListTracker(TrackerBase):
    """A tracker of one's own: only the writing, the base does the checks."""

    def __init__(self, *, main_process_only: bool = True) -> None:
        super().__init__(name="list", main_process_only=main_process_only)
        self.rows: list[tuple[str, object, object]] = []

    def _write_metrics(
        self, values: dict[str, bool | int | float | str], step: int | None
    ) -> None:
        self.rows.append(("log", values, step))

    def _write_config(self, values: dict[str, Any]) -> None:
        self.rows.append(("config", values, None))

    def _close(self) -> None:
        self.rows.append(("close", None, None))


def test_tracker_base_checks_before_the_backend_writes() -> None:
    tracker = _ListTracker(main_process_only=False)
    assert isinstance(tracker, Tracker)
    assert (tracker.name, tracker.main_process_only, tracker.finished) == (
        "list",
        False,
        False,
    )
    log_metrics(rank_ctx(2, 1), [tracker], {"loss": _any(torch.tensor(0.5))}, step=2)
    store_config(SINGLE, [tracker], {"lr": np.float64(0.1), "sched": None})
    with pytest.raises(ValueError, match=r"_ListTracker.log: step \(-1\) must be >= 0"):
        tracker.log({"loss": 1.0}, step=-1)
    with pytest.raises(
        TypeError, match=r"_ListTracker.log: value 'loss' must be .*; got \[1\]"
    ):
        tracker.log({"loss": [1]})
    with pytest.raises(
        TypeError,
        match=r"_ListTracker.store_init_configuration: configuration value 'b'",
    ):
        tracker.store_init_configuration({"b": (1, 2)})
    finish_trackers(SINGLE, [tracker])
    tracker.finish()  # closed once
    with pytest.raises(ValueError, match=r"_ListTracker.log: the tracker was finished"):
        tracker.log({"loss": 1.0})
    with pytest.raises(
        ValueError,
        match=r"_ListTracker.store_init_configuration: the tracker was finished",
    ):
        tracker.store_init_configuration({"lr": 0.1})
    assert tracker.finished
    assert tracker.rows == [
        ("log", {"loss": 0.5}, 2),
        ("config", {"lr": 0.1, "sched": None}, None),
        ("close", None, None),
    ]


def test_tracker_base_rejects_a_bad_name_or_flag() -> None:
    with pytest.raises(TypeError, match=r"_ListTracker: main_process_only must be"):
        _ListTracker(main_process_only=_any("yes"))
    with pytest.raises(TypeError, match=r"InMemoryTracker: name must be a str; got 3"):
        InMemoryTracker(name=_any(3))
    with pytest.raises(
        ValueError, match=r"JSONLTracker: path must be non-empty; got ''"
    ):
        JSONLTracker("")


# ---------------------------------------------------------------- by name


def _installed(*packages: str) -> None:
    for package in packages:
        pytest.importorskip(package)


def test_trackers_from_names_builds_each_under_project_dir(tmp_path: Path) -> None:
    _installed("tensorboard", "mlflow", "wandb")
    names = ["wandb", "jsonl", "csv", "tensorboard", "mlflow"]
    trackers = trackers_from_names(SINGLE, names, tmp_path / "exp", project_name="e1")
    assert [t.name for t in trackers] == names
    wandb, jsonl, csv_, tensorboard, mlflow = trackers
    assert isinstance(wandb, WandbTracker)
    assert (wandb.dir, wandb.project) == (tmp_path / "exp", "e1")
    assert isinstance(jsonl, JSONLTracker)
    assert jsonl.path == tmp_path / "exp" / "metrics.jsonl"
    assert isinstance(csv_, CSVTracker)
    assert csv_.path == tmp_path / "exp" / "metrics.csv"
    assert isinstance(tensorboard, TensorBoardTracker)
    assert tensorboard.logdir == tmp_path / "exp" / "tensorboard"
    assert isinstance(mlflow, MLflowTracker)
    assert mlflow.tracking_uri == f"sqlite:///{tmp_path}/exp/mlflow.db"
    assert mlflow.experiment_name == "e1"
    assert all(t.main_process_only for t in trackers)
    assert list(tmp_path.iterdir()) == []  # nothing before the first gated call


def test_trackers_from_names_writes_what_it_built(tmp_path: Path) -> None:
    trackers = trackers_from_names(SINGLE, "jsonl", tmp_path)
    log_metrics(SINGLE, trackers, {"loss": 0.5}, step=1)
    finish_trackers(SINGLE, trackers)
    assert [(r["step"], r["loss"]) for r in _jsonl(tmp_path / "metrics.jsonl")] == [
        (1, 0.5)
    ]


def test_trackers_from_names_all_is_every_installed_tracker(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _installed("tensorboard", "mlflow", "wandb")
    everything = ["jsonl", "csv", "tensorboard", "mlflow", "wandb"]
    offline = {"WANDB_MODE": "offline"}
    built = trackers_from_names(SINGLE, "all", tmp_path, environ=offline)
    assert [t.name for t in built] == everything
    assert [
        t.name
        for t in trackers_from_names(SINGLE, ["csv", "all"], tmp_path, environ=offline)
    ] == everything
    for package in ("tensorboard", "wandb"):
        monkeypatch.setitem(sys.modules, package, None)
    built = trackers_from_names(rank_ctx(2, 1), ("all",), tmp_path)
    assert [t.name for t in built] == ["jsonl", "csv", "mlflow"]


_NO_WANDB_KEY = (
    r"^trackers_from_names: 'all' leaves W&B out: wandb is installed but finds no "
    r"API key and no offline mode here, so its first call would fail \('No API key "
    r"configured'\)\. To include it, run `wandb login` or set WANDB_API_KEY "
    r"\(online\), or set WANDB_MODE=offline \(runs kept under project_dir/wandb/ "
    r"for `wandb sync`\)\.$"
)


def test_all_leaves_wandb_out_with_a_warning_when_it_has_no_key(
    tmp_path: Path,
) -> None:
    _installed("tensorboard", "mlflow", "wandb")
    home = {"HOME": str(tmp_path), "WANDB_MODE": "online"}  # no key, no netrc
    with pytest.warns(UserWarning, match=_NO_WANDB_KEY) as caught:
        built = trackers_from_names(SINGLE, "all", tmp_path / "runs", environ=home)
    assert [t.name for t in built] == ["jsonl", "csv", "tensorboard", "mlflow"]
    assert len(caught) == 1 and caught[0].filename == __file__  # the caller's line
    # Rank 1 gets the same list without a warning (an error under filterwarnings).
    other = trackers_from_names(rank_ctx(2, 1), "all", tmp_path / "runs", environ=home)
    assert [t.name for t in other] == [t.name for t in built]
    # Named explicitly, W&B is built: wandb itself then asks for the key.
    named = trackers_from_names(SINGLE, ["jsonl", "wandb"], tmp_path, environ=home)
    assert [t.name for t in named] == ["jsonl", "wandb"]
    assert not (tmp_path / "runs").exists()


def test_all_reads_wandbs_key_from_the_process_environment_by_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _installed("wandb")
    for name in [n for n in os.environ if n.startswith("WANDB_")] + ["NETRC"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.warns(UserWarning, match=_NO_WANDB_KEY):
        built = trackers_from_names(SINGLE, "all", tmp_path)
    assert "wandb" not in [t.name for t in built]
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert trackers_from_names(SINGLE, "all", tmp_path)[-1].name == "wandb"
    assert not list(tmp_path.iterdir())  # nothing written, no wandb run started


def _netrc(path: Path, host: str) -> str:
    path.write_text(f"machine {host}\n  login user\n  password {'k' * 40}\n")
    return str(path)


@pytest.mark.parametrize(
    ("environ", "files", "ready"),
    [
        ({}, {}, False),
        ({"WANDB_MODE": "online"}, {}, False),
        ({"WANDB_MODE": "offline"}, {}, True),
        ({"WANDB_MODE": "dryrun"}, {}, True),
        ({"WANDB_MODE": "disabled"}, {}, True),
        ({"WANDB_API_KEY": "k" * 40}, {}, True),
        ({"WANDB_IDENTITY_TOKEN_FILE": "/var/token"}, {}, True),
        ({}, {".netrc": "api.wandb.ai"}, True),
        ({}, {"_netrc": "api.wandb.ai"}, True),
        ({}, {".netrc": "example.com"}, False),
        (
            {"WANDB_BASE_URL": "https://wandb.corp:8080"},
            {".netrc": "api.wandb.ai"},
            False,
        ),
        (
            {"WANDB_BASE_URL": "https://wandb.corp:8080"},
            {".netrc": "wandb.corp:8080"},
            True,
        ),
        ({}, {".netrc": "machine"}, False),  # malformed: wandb ignores it too
        ({}, {"settings": "[default]\nmode = offline\n"}, True),
        ({}, {"settings": "[default]\napi_key = abc\n"}, True),
        ({}, {"settings": "[default]\nentity = team\n"}, False),
        ({}, {"settings": "not an ini file"}, False),
        ({"WANDB_MODE": "online"}, {"settings": "[default]\nmode = offline\n"}, False),
        (
            {},
            {"settings": "[default]\nbase_url = https://w.corp\n", ".netrc": "w.corp"},
            True,
        ),
    ],
)
def test_wandb_can_start_reads_where_wandb_reads(
    tmp_path: Path, environ: dict[str, str], files: dict[str, str], ready: bool
) -> None:
    home = tmp_path / "home"
    (home / ".config" / "wandb").mkdir(parents=True)
    for name, content in files.items():
        if name == "settings":
            (home / ".config" / "wandb" / "settings").write_text(content)
        elif content == "machine":
            (home / name).write_text("machine\n")
        else:
            _netrc(home / name, content)
    assert wandb_can_start({"HOME": str(home), **environ}) is ready


def test_wandb_can_start_follows_netrc_and_config_dir_variables(tmp_path: Path) -> None:
    netrc_file = _netrc(tmp_path / "creds", "api.wandb.ai")
    assert wandb_can_start({"NETRC": netrc_file})
    assert not wandb_can_start({"NETRC": str(tmp_path / "missing")})
    (tmp_path / "settings").write_text("[default]\nmode = offline\n")
    assert wandb_can_start({"WANDB_CONFIG_DIR": str(tmp_path)})
    system = {"WANDB_SETTINGS_SYSTEM": str(tmp_path / "settings")}
    assert wandb_can_start(system)
    assert not wandb_can_start({})  # no HOME: only the variables count


def test_trackers_from_names_checks_environ(tmp_path: Path) -> None:
    with pytest.raises(
        TypeError,
        match=r"^trackers_from_names: environ must be a mapping such as os\.environ, "
        r"or None; got \['WANDB_MODE'\] \(list\)\.$",
    ):
        trackers_from_names(SINGLE, "all", tmp_path, environ=_any(["WANDB_MODE"]))


@pytest.mark.parametrize("name", ["tensorboard", "mlflow", "wandb"])
def test_trackers_from_names_names_the_extra_of_a_missing_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str
) -> None:
    monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(
        ImportError,
        match=rf"trackers_from_names: tracker '{name}' needs the {name} package, "
        rf"which is not installed; install it with `pip install 'funcaccel\[{name}\]'`",
    ):
        trackers_from_names(SINGLE, ["jsonl", name], tmp_path)


@pytest.mark.parametrize(
    ("names", "error", "match"),
    [
        (
            "neptune",
            ValueError,
            r"names_or_all\[0\] must be one of 'jsonl', 'csv', "
            r"'tensorboard', 'mlflow', 'wandb', 'all'; got 'neptune'\. 'all' is every "
            r"one whose package is installed\.",
        ),
        (
            ["jsonl", "jsonl"],
            ValueError,
            r"names_or_all must be a list naming each tracker once; got \['jsonl', "
            r"'jsonl'\]\. 'jsonl' is named twice\.",
        ),
        (["jsonl", 3], TypeError, r"names_or_all\[1\] must be a str; got 3 \(int\)"),
        (3, TypeError, r"names_or_all must be a tracker name or a list .* got 3"),
        (b"jsonl", TypeError, r"names_or_all must be .* got b'jsonl' \(bytes\)"),
    ],
)
def test_trackers_from_names_rejects_bad_names(
    tmp_path: Path, names: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=rf"trackers_from_names: {match}"):
        trackers_from_names(SINGLE, _any(names), tmp_path)


def test_trackers_from_names_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"ctx must be a DistributedContext; got 0"):
        trackers_from_names(_any(0), "jsonl", tmp_path)
    with pytest.raises(TypeError, match=r"project_dir must be a str or os.PathLike"):
        trackers_from_names(SINGLE, "jsonl", _any(None))
    with pytest.raises(ValueError, match=r"project_name must be non-empty; got ''"):
        trackers_from_names(SINGLE, "jsonl", tmp_path, project_name="")
    assert trackers_from_names(SINGLE, [], tmp_path) == []
