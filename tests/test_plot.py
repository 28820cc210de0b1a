"""Tests for plot_metrics and ``python -m funcaccel plot``: a PNG from the tracker files.

The files are written by the real JSONLTracker and CSVTracker, so a change of their
format that the reader misses fails here. The picture is checked as a PNG (magic
bytes, size) and read back with matplotlib for its shape.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from funcaccel.__main__ import main
from funcaccel.context import DistributedContext
from funcaccel.plot import plot_metrics
from funcaccel.plot import read_metrics
from funcaccel.tracking import CSVTracker
from funcaccel.tracking import JSONLTracker
from funcaccel.tracking import Tracker
from funcaccel.tracking import finish_trackers
from funcaccel.tracking import log_metrics
from funcaccel.tracking import store_config

MAIN = DistributedContext()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _log_run(trackers: list[Tracker], steps: int = 12) -> None:
    store_config(MAIN, trackers, {"lr": 0.1, "note": "tiny"})
    for step in range(1, steps + 1):
        values = {"loss": 2.0 / step, "lr": 0.1 * math.cos(step / steps)}
        log_metrics(MAIN, trackers, values, step=step)
    finish_trackers(MAIN, trackers)


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 10_000  # axes, lines and labels, not an empty canvas
    image = pytest.importorskip("matplotlib.image").imread(path)
    height, width, channels = image.shape
    assert channels in (3, 4) and width > height > 200
    assert image[..., :3].min() < 0.5  # something dark was drawn on the white
    # The curves: pixels of matplotlib's first line colour, C0 (#1f77b4).
    c0 = [0x1F / 255, 0x77 / 255, 0xB4 / 255]
    near = abs(image[..., :3] - c0).max(axis=-1) < 0.05
    assert near.sum() > 100


def test_read_metrics_takes_the_numbers_jsonl_tracker_wrote(tmp_path: Path) -> None:
    tracker = JSONLTracker(tmp_path / "metrics.jsonl", clock=lambda: 5.0)
    store_config(MAIN, [tracker], {"lr": 0.1})
    log_metrics(MAIN, [tracker], {"loss": 0.5, "phase": "warmup"}, step=3)
    log_metrics(MAIN, [tracker], {"loss": float("nan"), "ok": True}, step=4)
    log_metrics(MAIN, [tracker], {"acc": 0.75})  # no step: placed at its index
    finish_trackers(MAIN, [tracker])
    # config, time, strings, bools and NaN are not points.
    assert read_metrics(tracker.path) == {"loss": [(3.0, 0.5)], "acc": [(2.0, 0.75)]}


def test_read_metrics_takes_the_numbers_csv_tracker_wrote(tmp_path: Path) -> None:
    tracker = CSVTracker(tmp_path / "metrics.csv", clock=lambda: 5.0)
    log_metrics(MAIN, [tracker], {"loss": 0.5, "acc": 0.25, "phase": "a"}, step=1)
    log_metrics(MAIN, [tracker], {"loss": 0.25}, step=2)  # acc and phase empty
    finish_trackers(MAIN, [tracker])
    assert read_metrics(tracker.path) == {
        "loss": [(1.0, 0.5), (2.0, 0.25)],
        "acc": [(1.0, 0.25)],
    }


def test_plot_metrics_writes_a_png_of_a_jsonl_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _log_run([JSONLTracker(tmp_path / "run" / "metrics.jsonl")])
    written = plot_metrics(tmp_path / "run")
    assert written == tmp_path / "run" / "metrics.png"
    _assert_png(written)


def test_plot_metrics_draws_csv_and_jsonl_files_side_by_side(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    _log_run([JSONLTracker(run / "metrics.jsonl"), CSVTracker(run / "metrics.csv")])
    out = tmp_path / "pictures" / "curves.png"
    assert plot_metrics(run, out=out, title="two files") == out
    _assert_png(out)
    assert not (run / "metrics.png").exists()


def test_plot_metrics_of_one_file_writes_beside_it(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _log_run([CSVTracker(tmp_path / "train.csv")])
    assert plot_metrics(str(tmp_path / "train.csv")) == tmp_path / "train.png"
    _assert_png(tmp_path / "train.png")


def test_plot_metrics_names_a_missing_run_directory(tmp_path: Path) -> None:
    with pytest.raises(
        FileNotFoundError,
        match=r"plot_metrics: '.*nowhere' does not exist; pass the run directory",
    ):
        plot_metrics(tmp_path / "nowhere")


def test_plot_metrics_lists_a_directory_without_metrics_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "metrics.config.json").write_text("{}")
    with pytest.raises(
        FileNotFoundError,
        match=r"holds no metrics file \(\*\.jsonl or \*\.csv\); it holds \['metrics\.config\.json', 'notes\.txt'\]",
    ):
        plot_metrics(tmp_path)


def test_plot_metrics_refuses_files_without_numbers(tmp_path: Path) -> None:
    tracker = JSONLTracker(tmp_path / "metrics.jsonl")
    store_config(MAIN, [tracker], {"lr": 0.1})  # a configuration, no metric
    finish_trackers(MAIN, [tracker])
    with pytest.raises(
        ValueError,
        match=r"plot_metrics: run_dir must be a run with a numeric metric to draw; "
        r"got '.*'\. Its files \['.*'\] hold none; log numbers with log_metrics",
    ):
        plot_metrics(tmp_path)


def test_plot_metrics_names_the_line_that_is_not_json(tmp_path: Path) -> None:
    lines = [json.dumps({"step": 1, "time": 0.0, "loss": 1.0}), "{broken", "[1, 2]"]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"line 2 of '.*metrics\.jsonl' is not JSON"):
        plot_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(lines[0] + "\n" + lines[2] + "\n")
    with pytest.raises(
        ValueError,
        match=r"line 2 of .* must be a JSON object; got \[1, 2\]\. Pass a file",
    ):
        plot_metrics(tmp_path)


def test_plot_metrics_refuses_a_csv_file_no_tracker_wrote(tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    with pytest.raises(
        ValueError,
        match=r"the header of .* must be a row starting with 'step', 'time'; got "
        r"\['a', 'b'\]\. Pass a file a CSVTracker wrote\.",
    ):
        plot_metrics(tmp_path)


def test_read_metrics_refuses_another_suffix(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"read_metrics: path must be a \.jsonl or \.csv file; got '.*log\.txt'",
    ):
        read_metrics(tmp_path / "log.txt")


def test_plot_metrics_checks_its_argument_types(tmp_path: Path) -> None:
    with pytest.raises(
        TypeError, match=r"plot_metrics: run_dir must be a path .*; got 3 \(int\)"
    ):
        plot_metrics(3)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"plot_metrics: title must be a str or None; got 1 \(int\)"
    ):
        plot_metrics(tmp_path, title=1)  # type: ignore[arg-type]


def test_plot_metrics_without_matplotlib_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _log_run([JSONLTracker(tmp_path / "metrics.jsonl")])
    # A None entry in sys.modules makes the import raise ImportError.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'funcaccel\[plot\]'"):
        plot_metrics(tmp_path)
    assert not (tmp_path / "metrics.png").exists()


def test_cli_plot_writes_the_png_and_prints_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    _log_run([JSONLTracker(tmp_path / "run" / "metrics.jsonl")])
    out = tmp_path / "loss.png"
    assert main(["plot", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"{out}\n"
    _assert_png(out)


def test_cli_plot_reports_a_missing_run_directory_with_status_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plot", str(tmp_path / "nowhere")]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("python -m funcaccel plot: plot_metrics: ")
    assert "does not exist" in captured.err


def test_cli_plot_without_matplotlib_names_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _log_run([JSONLTracker(tmp_path / "metrics.jsonl")])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["plot", str(tmp_path)]) == 1
    assert "pip install 'funcaccel[plot]'" in capsys.readouterr().err
