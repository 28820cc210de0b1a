"""The main example, run as a user runs it: one process, torchrun, stop and resume."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests._scripts import REPO
from tests._scripts import run_script

pytest.importorskip("sklearn")

SCRIPT = REPO / "examples" / "train_digits.py"
TINY = ["--epochs", "2", "--train-samples", "320", "--batch-size", "16"]


def _run(args: list[str], *, processes: int = 1, timeout: float = 240) -> str:
    done = run_script(
        SCRIPT,
        *args,
        processes=processes,
        done_marker="param_sha256: ",
        timeout=timeout,
    )
    assert done.status == 0, done.stdout + done.stderr
    return done.stdout


def _value(out: str, key: str) -> str:
    found: list[str] = re.findall(rf"^{key}: (\S+)$", out, flags=re.MULTILINE)
    assert len(found) == 1, out
    return found[0]


def _last_line(out: str) -> str:
    return out.strip().splitlines()[-1]


def test_one_process_run_prints_accuracy_and_digest_last(tmp_path: Path) -> None:
    out = _run([*TINY, "--log-dir", str(tmp_path / "logs")])
    assert re.fullmatch(r"param_sha256: [0-9a-f]{64}", _last_line(out))
    assert 0.0 <= float(_value(out, "test_accuracy")) <= 1.0
    # 320 samples in batches of 16 = 20 micro-batches per epoch, windows of 2.
    assert int(_value(out, "optimizer_steps")) == 2 * 10
    records = [
        json.loads(line)
        for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    assert "config" in records[0]
    steps = [r["step"] for r in records[1:] if "loss" in r]
    assert steps == list(range(1, 21))
    assert records[-1]["test_accuracy"] == pytest.approx(
        float(_value(out, "test_accuracy")), abs=1e-4
    )


def test_a_stopped_and_resumed_run_ends_bit_for_bit_like_an_uninterrupted_one(
    tmp_path: Path,
) -> None:
    whole = _run([*TINY, "--checkpoint-dir", str(tmp_path / "whole")])
    stopped = _run(
        [*TINY, "--checkpoint-dir", str(tmp_path / "cut"), "--stop-after", "13"]
    )
    assert "stopped after 13 optimizer steps" in stopped
    resumed = _run([*TINY, "--checkpoint-dir", str(tmp_path / "cut")])
    assert "resumed from" in resumed
    assert _value(resumed, "param_sha256") == _value(whole, "param_sha256")
    assert _value(resumed, "optimizer_steps") == _value(whole, "optimizer_steps")


def test_the_same_seed_gives_the_same_parameters() -> None:
    first = _run(TINY)
    assert _value(_run(TINY), "param_sha256") == _value(first, "param_sha256")
    other = _run([*TINY, "--seed", "1"])
    assert _value(other, "param_sha256") != _value(first, "param_sha256")


@pytest.mark.distributed
def test_two_processes_under_torchrun_with_profiling_and_bf16(tmp_path: Path) -> None:
    out = _run(
        [
            *TINY,
            "--bf16",
            "--log-dir",
            str(tmp_path / "logs"),
            "--profile-dir",
            str(tmp_path / "traces"),
        ],
        processes=2,
    )
    assert re.fullmatch(r"param_sha256: [0-9a-f]{64}", _last_line(out))
    # Each rank reads 10 of the 20 batches per epoch: 5 windows of 2 per epoch.
    assert int(_value(out, "optimizer_steps")) == 2 * 5
    for rank in (0, 1):
        trace = json.loads((tmp_path / "traces" / f"profile_{rank}.json").read_text())
        assert trace["traceEvents"]
    metrics = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 1 + 10 + 1  # config, one line per step, test accuracy


@pytest.mark.slow
def test_the_default_run_reaches_95_percent_test_accuracy() -> None:
    out = _run([], timeout=300)
    assert float(_value(out, "test_accuracy")) >= 0.95
