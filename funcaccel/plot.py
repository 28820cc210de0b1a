"""A PNG of the metrics a run logged, for people without a TensorBoard server.

``plot_metrics(run_dir)`` reads the files ``JSONLTracker`` (``*.jsonl``) and
``CSVTracker`` (``*.csv``) wrote in ``run_dir`` and draws one panel per numeric
metric against its step, one line per file; ``python -m funcaccel plot RUN_DIR``
does the same from the command line. Configuration records, the ``time`` column,
strings and empty cells are not drawn; a record without a step is placed at its
position in the file. matplotlib is imported on the first call (``pip install
'funcaccel[plot]'``), and only its object-oriented API is used: the figure is
drawn by the Agg renderer, no display is needed and pyplot's global state is
left alone.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._checks import make_dirs
from funcaccel._checks import summary

__all__ = ["plot_metrics", "read_metrics"]

Series = dict[str, list[tuple[float, float]]]
"""Metric name -> ``(step, value)`` points, in file order."""

_SUFFIXES: Final = (".jsonl", ".csv")
_NOT_METRICS: Final = frozenset({"step", "time", "config"})
_COLUMNS: Final = 3
_FEW: Final = 20
_INSTALL: Final = "pip install 'funcaccel[plot]'"
_JSONL_FIX: Final = "Pass a file a JSONLTracker wrote."
_CSV_HEADER: Final = "a row starting with 'step', 'time'"
_CSV_FIX: Final = "Pass a file a CSVTracker wrote."
_SUFFIX: Final = "a .jsonl or .csv file"
_FILE_FIX: Final = "Pass a file a JSONLTracker or CSVTracker wrote."
_NUMERIC: Final = "a run with a numeric metric to draw"
_LOG_FIX: Final = "log numbers with log_metrics first."


def _number(value: object) -> float | None:
    """Return ``value`` as a float when it is a real number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _cell(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        return None  # a string metric


def _jsonl_records(path: Path) -> Iterator[dict[str, object]]:
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                msg = (
                    f"plot_metrics: line {number} of {str(path)!r} is not JSON "
                    f"({error}); pass a file a JSONLTracker wrote."
                )
                raise ValueError(msg) from error
            if not isinstance(record, dict):
                line = f"line {number} of {str(path)!r}"
                fail_value("plot_metrics", line, record, "a JSON object", _JSONL_FIX)
            if "config" not in record:
                yield record


def _csv_records(path: Path) -> Iterator[dict[str, object]]:
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames or []
        if tuple(header[:2]) != ("step", "time"):
            name = f"the header of {str(path)!r}"
            fail_value("plot_metrics", name, header, _CSV_HEADER, _CSV_FIX)
        for row in reader:
            yield {key: _cell(value) for key, value in row.items() if key is not None}


def read_metrics(path: str | os.PathLike[str]) -> Series:
    """Return the numeric metrics of one JSONL or CSV file a file tracker wrote.

    Args:
        path: a ``.jsonl`` file (``JSONLTracker``) or ``.csv`` file (``CSVTracker``).

    Returns:
        Each metric's ``(step, value)`` points in file order; a record without a
        step is placed at its index among the file's metric records (from 0).

    Raises:
        ValueError: a line that is not a JSON object, a CSV file whose header does
            not start with ``step``, ``time``, or another suffix.
        OSError: the file cannot be read.
    """
    path = Path(path)
    if path.suffix == ".jsonl":
        records = _jsonl_records(path)
    elif path.suffix == ".csv":
        records = _csv_records(path)
    else:
        fail_value("read_metrics", "path", str(path), _SUFFIX, _FILE_FIX)
    series: Series = {}
    for index, record in enumerate(records):
        step = _number(record.get("step"))
        at = float(index) if step is None else step
        for name, raw in record.items():
            value = _number(raw)
            if name in _NOT_METRICS or value is None or math.isnan(value):
                continue
            series.setdefault(name, []).append((at, value))
    return series


def _metric_files(caller: str, run: Path) -> list[Path]:
    if run.is_file():
        return [run]
    if not run.is_dir():
        msg = (
            f"{caller}: {str(run)!r} does not exist; pass the run directory the "
            "JSONLTracker or CSVTracker wrote into (or one of their files)."
        )
        raise FileNotFoundError(msg)
    files = sorted(p for p in run.iterdir() if p.suffix in _SUFFIXES and p.is_file())
    if not files:
        listed = sorted(p.name for p in run.iterdir())
        msg = (
            f"{caller}: {str(run)!r} holds no metrics file (*.jsonl or *.csv); it "
            f"holds {summary(listed)}. Log with JSONLTracker or CSVTracker into "
            "that directory, or pass the directory they wrote into."
        )
        raise FileNotFoundError(msg)
    return files


def _default_out(run: Path) -> Path:
    return run.with_suffix(".png") if run.is_file() else run / "metrics.png"


def plot_metrics(
    run_dir: str | os.PathLike[str],
    *,
    out: str | os.PathLike[str] | None = None,
    title: str | None = None,
) -> Path:
    """Write a PNG of every numeric metric logged in ``run_dir``; return its path.

    One panel per metric (``loss``, ``lr``, ``test_accuracy``...), the step on
    the x axis, one line per metrics file holding that metric (with a legend when
    there are several); a metric with 20 points or fewer is drawn with dots.

    Args:
        run_dir: the directory a ``JSONLTracker`` / ``CSVTracker`` wrote its
            ``*.jsonl`` / ``*.csv`` files into, or one such file.
        out: where to write the PNG; ``run_dir/metrics.png`` by default (for a
            file, the same name with ``.png``). Parent directories are created.
        title: the figure's title; ``run_dir`` by default.

    Returns:
        The path of the PNG written.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'funcaccel[plot]'``).
        FileNotFoundError: ``run_dir`` does not exist or holds no metrics file.
        ValueError: the files hold no numeric metric, or one is not a tracker's file.
        TypeError: an argument of the wrong type.
    """
    kinds = (str, os.PathLike)
    what = "a path (str or os.PathLike)"
    for name, value in (("run_dir", run_dir), ("out", out)):
        check_type("plot_metrics", name, value, kinds, what=what, optional=True)
    check_type("plot_metrics", "title", title, str, optional=True)
    run = Path(run_dir)
    files = _metric_files("plot_metrics", run)
    per_file = {path: read_metrics(path) for path in files}
    names = list(dict.fromkeys(name for s in per_file.values() for name in s))
    if not names:
        hint = f"Its files {summary([p.name for p in files])} hold none; {_LOG_FIX}"
        fail_value("plot_metrics", "run_dir", str(run), _NUMERIC, hint)
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        msg = f"plot_metrics: drawing needs matplotlib, which is not installed; run {_INSTALL}."
        raise ImportError(msg) from error

    columns = min(_COLUMNS, len(names))
    rows = math.ceil(len(names) / columns)
    figure = Figure(figsize=(4.5 * columns, 3.2 * rows), layout="constrained")
    figure.suptitle(str(run) if title is None else title)
    axes = figure.subplots(rows, columns, squeeze=False)
    for slot, ax in enumerate(axes.flat):
        if slot >= len(names):
            ax.set_visible(False)
            continue
        name = names[slot]
        for path, series in per_file.items():
            points = series.get(name)
            if not points:
                continue
            steps, values = zip(*points, strict=True)
            # A few points (one per epoch, a final score) are drawn as dots too.
            marker = "o" if len(points) <= _FEW else None
            ax.plot(steps, values, marker=marker, markersize=4, label=path.name)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(per_file) > 1:
            ax.legend(fontsize="small")
    target = _default_out(run) if out is None else Path(out)
    make_dirs("plot_metrics", "the directory of out", target.parent)
    figure.savefig(target, format="png", dpi=100)
    return target
