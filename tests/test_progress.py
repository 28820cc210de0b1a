"""Tests for progress: tqdm or plain lines on the main process, silence elsewhere."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from funcaccel.context import DistributedContext
from funcaccel.progress import progress
from funcaccel.throughput import Throughput
from tests.fixtures import rank_ctx

MAIN = DistributedContext()


def _no_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes `import tqdm` raise ImportError.
    monkeypatch.setitem(sys.modules, "tqdm", None)


def _generate(n: int) -> Iterator[int]:
    yield from range(n)


def _terminal(monkeypatch: pytest.MonkeyPatch, is_terminal: bool) -> None:
    # capsys has replaced sys.stderr by then; its isatty() answers False.
    monkeypatch.setattr(sys.stderr, "isatty", lambda: is_terminal)


def test_progress_shows_a_tqdm_bar_on_the_main_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("tqdm")
    _terminal(monkeypatch, True)
    assert list(progress(MAIN, ["a", "b", "c"], desc="train")) == ["a", "b", "c"]
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.search(r"train: 100%.*3/3", captured.err)


def test_progress_prints_plain_lines_when_stderr_is_not_a_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # With tqdm importable or not: a log file or pipe gets lines, not redraws.
    assert list(progress(MAIN, range(4), desc="log", every=2)) == [0, 1, 2, 3]
    err = capsys.readouterr().err
    assert "\r" not in err
    counts = re.findall(r"^log: (\d+)/4 \(\d+%\) in \d+\.\ds$", err, re.M)
    assert counts == ["2", "4"]


def test_progress_prints_plain_lines_without_tqdm(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_tqdm(monkeypatch)
    assert list(progress(MAIN, range(5), desc="eval", every=2)) == [0, 1, 2, 3, 4]
    captured = capsys.readouterr()
    assert captured.out == ""
    counts = re.findall(r"^eval: (\d+)/5 \((\d+)%\) in \d+\.\ds$", captured.err, re.M)
    assert counts == [("2", "40"), ("4", "80"), ("5", "100")]


def test_progress_plain_default_prints_about_ten_lines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_tqdm(monkeypatch)
    assert sum(progress(MAIN, range(95))) == sum(range(95))
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in lines] == [
        f"{n}/95" for n in (*range(10, 95, 10), 95)
    ]
    assert all(line.startswith("progress: ") for line in lines)


def test_progress_plain_counts_unsized_iterables(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_tqdm(monkeypatch)
    assert list(progress(MAIN, _generate(250))) == list(range(250))
    counts = re.findall(r"^progress: (\d+) in", capsys.readouterr().err, re.M)
    assert counts == ["100", "200", "250"]


def test_progress_plain_reports_an_empty_iterable_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_tqdm(monkeypatch)
    assert list(progress(MAIN, [], desc="none")) == []
    assert re.fullmatch(r"none: 0 in \d+\.\ds\n", capsys.readouterr().err)


def test_progress_uses_given_total_for_unsized_iterables(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_tqdm(monkeypatch)
    list(progress(MAIN, _generate(4), total=4, every=4))
    assert capsys.readouterr().err.startswith("progress: 4/4 (100%)")


@pytest.mark.parametrize("tqdm_available", [True, False])
def test_progress_is_silent_on_other_ranks(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tqdm_available: bool,
) -> None:
    if not tqdm_available:
        _no_tqdm(monkeypatch)
    items = _generate(3)
    assert list(progress(rank_ctx(2, 1), items, desc="train", every=1)) == [0, 1, 2]
    assert capsys.readouterr() == ("", "")


def test_progress_prints_nothing_before_the_first_item(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_tqdm(monkeypatch)
    iterator = progress(MAIN, range(3), every=1)
    assert capsys.readouterr().err == ""
    assert next(iterator) == 0
    assert capsys.readouterr().err == ""  # counted once the consumer moves on
    assert next(iterator) == 1
    assert capsys.readouterr().err.startswith("progress: 1/3")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"ctx": 0}, TypeError, r"progress: ctx must be a DistributedContext; got 0"),
        ({"iterable": 5}, TypeError, r"progress: iterable must be iterable; got 5"),
        ({"total": -1}, ValueError, r"progress: total \(-1\) must be >= 0"),
        ({"total": 2.0}, TypeError, r"total must be an int; got 2\.0 \(float\)"),
        ({"every": 0}, ValueError, r"progress: every \(0\) must be >= 1"),
        ({"desc": 3}, TypeError, r"desc must be a str or None; got 3 \(int\)"),
        ({"throughput": 3}, TypeError, r"progress: throughput must be a function"),
    ],
)
def test_progress_rejects_bad_arguments(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    arguments: dict[str, Any] = {"ctx": MAIN, "iterable": [1], **kwargs}
    with pytest.raises(error, match=match):
        progress(arguments.pop("ctx"), arguments.pop("iterable"), **arguments)


def test_progress_plain_lines_show_the_latest_throughput(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_tqdm(monkeypatch)
    windows: list[Throughput] = []

    def latest() -> Throughput | None:
        return windows[-1] if windows else None

    for n in progress(MAIN, range(4), desc="train", every=2, throughput=latest):
        if n == 1:  # a window ends after the second item
            windows.append(
                Throughput(
                    seconds=2.0, tokens=5000, flops=8e14, peak_flops_per_device=1e15
                )
            )
    lines = capsys.readouterr().err.splitlines()
    assert re.fullmatch(
        r"train: 2/4 \(50%\) in \d+\.\ds, 2,500 tok/s, 400 TFLOP/s/device, MFU 40\.0%",
        lines[0],
    ), lines
    assert lines[1].endswith("MFU 40.0%") and lines[1].startswith("train: 4/4")


def test_progress_tqdm_bar_shows_the_throughput(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("tqdm")
    _terminal(monkeypatch, True)
    rate = Throughput(seconds=1.0, samples=12)
    list(progress(MAIN, range(3), desc="fit", throughput=lambda: rate))
    assert re.search(r"fit: 100%.*3/3.*12\.0 samples/s", capsys.readouterr().err)
    with pytest.raises(
        TypeError, match=r"progress: throughput\(\) must be a Throughput"
    ):
        list(progress(MAIN, range(1), throughput=lambda: 5))  # type: ignore[arg-type,return-value]
